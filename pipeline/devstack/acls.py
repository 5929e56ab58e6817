"""Who may do what on a secure cluster: the one ACL table, applied by the devstack and read by operators.

Everything not granted here is refused (``allow.everyone.if.no.acl.found=false``); ``admin`` is a super
user and needs no entry. Topic names follow ``topic_namespace`` (``pipeline/topics.py``), so the table is
a function of the settings and is applied per namespace and ``app_id``
(``sluice kafka start --secure`` applies it for the current settings; applying again is a no-op).

| principal | resource | operations | why |
|---|---|---|---|
| ``sluice`` | raw topics (requests, replicas) | READ, DESCRIBE, DESCRIBE_CONFIGS, CREATE | both paths consume them; the worker creates missing topics |
| ``sluice`` | partials, load, admission, dead-letter topics | READ, WRITE, DESCRIBE, DESCRIBE_CONFIGS, CREATE | the control path writes them, stage 2 and landing read them |
| ``sluice`` | topics prefixed ``<app_id>-`` | ALL | Faust's changelog, leader and repartition topics |
| ``sluice`` | groups prefixed ``<app_id>`` | READ, DESCRIBE | ``<app_id>``, ``-control``, ``-landing``, ``-landing-web``, ``-otel`` |
| ``sluice`` | cluster | IDEMPOTENT_WRITE, DESCRIBE | idempotent producers; Faust describes the cluster |
| ``router`` | admission topic | READ, DESCRIBE | follows signals (no consumer group: it reads every partition) |
| ``router`` | requests topic | WRITE, DESCRIBE | publishes RequestEvents (idempotent: WRITE implies IDEMPOTENT_WRITE since Kafka 3.0) |
| ``sluice`` | OTLP spans topic; requests topic (when ``otel_topic`` is set) | READ, DESCRIBE, DESCRIBE_CONFIGS, CREATE; WRITE | ``sluice otel-bridge`` runs as ``sluice``: reads spans, writes the request events they become |
| ``gpu-agent`` | replicas topic | WRITE, DESCRIBE | publishes ReplicaSamples, nothing else |
| ``otel-collector`` | OTLP spans topic (``otel_topic``, when set) | WRITE, DESCRIBE | an OpenTelemetry Collector's Kafka exporter, nothing else (its spans become request events only through the bridge, which validates them) |

Nobody but ``sluice`` (and ``admin``) may write the admission topic; routers verify signatures besides.
``router`` may not read the raw topics, write replica samples or spans, or create topics; ``gpu-agent`` may
not touch the admission or requests topics; ``otel-collector`` may only write spans.

The principals other than ``admin`` are SCRAM users created with the Admin API (``scram_lines``, given to
``ApplyAcls.java`` by ``KafkaDevstack.ensure_users``; passwords on its stdin, never on a command line).
Applying the table only adds: a grant an older table made (``router`` writing the spans topic) stays on
an existing cluster until its state directory is made anew.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from .. import topics
from ..settings import Settings
from .credentials import GPU_AGENT, MECHANISM, OTEL_COLLECTOR, ROUTER, WORKER

HERE = Path(__file__).resolve().parent
READ_SIDE = ("READ", "DESCRIBE", "DESCRIBE_CONFIGS", "CREATE")
READ_WRITE = ("READ", "WRITE", "DESCRIBE", "DESCRIBE_CONFIGS", "CREATE")


class AclError(RuntimeError):
    """The ACLs could not be applied."""


@dataclass(frozen=True)
class Acl:
    principal: str        # the SCRAM user name, without ``User:``
    resource_type: str    # TOPIC, GROUP or CLUSTER
    pattern: str          # LITERAL or PREFIXED
    name: str
    operations: tuple[str, ...]

    def bindings(self) -> list[str]:
        return [f"User:{self.principal}|{self.resource_type}|{self.pattern}|{self.name}|{op}"
                for op in self.operations]


def acl_table(settings: Settings) -> list[Acl]:
    raw = [topics.REQUESTS, topics.REPLICAS]
    written = [spec for spec in topics.ALL if spec not in raw]
    table = [Acl(WORKER, "TOPIC", "LITERAL", spec.name(settings), READ_SIDE) for spec in raw]
    table += [Acl(WORKER, "TOPIC", "LITERAL", spec.name(settings), READ_WRITE) for spec in written]
    table += [
        Acl(WORKER, "TOPIC", "PREFIXED", f"{settings.app_id}-", ("ALL",)),
        Acl(WORKER, "GROUP", "PREFIXED", settings.app_id, ("READ", "DESCRIBE")),
        Acl(WORKER, "CLUSTER", "LITERAL", "kafka-cluster", ("IDEMPOTENT_WRITE", "DESCRIBE")),
        Acl(ROUTER, "TOPIC", "LITERAL", topics.ADMISSION.name(settings), ("READ", "DESCRIBE")),
        Acl(ROUTER, "TOPIC", "LITERAL", topics.REQUESTS.name(settings), ("WRITE", "DESCRIBE")),
        Acl(GPU_AGENT, "TOPIC", "LITERAL", topics.REPLICAS.name(settings), ("WRITE", "DESCRIBE")),
    ]
    if settings.otel_topic:
        table.append(Acl(WORKER, "TOPIC", "LITERAL", settings.otel_topic, READ_SIDE))
        table.append(Acl(WORKER, "TOPIC", "LITERAL", topics.REQUESTS.name(settings), ("WRITE",)))  # the bridge
        table.append(Acl(OTEL_COLLECTOR, "TOPIC", "LITERAL", settings.otel_topic, ("WRITE", "DESCRIBE")))
    return table


def scram_lines(users: dict[str, str]) -> list[str]:
    """``ApplyAcls.java`` input that creates (or resets) the SCRAM user ``name`` with ``password``."""
    return [f"{MECHANISM}|{name}|{password}" for name, password in users.items()]


def apply_acls(java_command: list[str], bootstrap: str, client_properties: Path, table: list[Acl],
               users: dict[str, str] | None = None, timeout_s: float = 120.0) -> None:
    """Create the SCRAM ``users`` (name → password) and every binding of ``table`` with Kafka's Admin
    client (``ApplyAcls.java``, one JVM; everything on its stdin, so no password is on its command line)."""
    lines = [*scram_lines(users or {}), *(binding for acl in table for binding in acl.bindings())]
    cmd = [*java_command, str(HERE / "ApplyAcls.java"), bootstrap, str(client_properties)]
    try:
        proc = subprocess.run(cmd, input="\n".join(lines) + "\n", capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AclError(f"applying ACLs and users took longer than {timeout_s:.0f}s") from None
    if proc.returncode != 0:
        raise AclError(f"applying ACLs and users failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
