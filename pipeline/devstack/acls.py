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
| ``sluice`` | OTLP spans topic; requests topic (when ``otel_topic`` is set) | READ…; WRITE | ``sluice otel-bridge`` runs as ``sluice``: reads spans, writes the request events they become |
| ``router`` | OTLP spans topic (``otel_topic``, when set) | WRITE, DESCRIBE | an OpenTelemetry Collector exporting router spans runs as ``router``: spans become request events |
| ``gpu-agent`` | replicas topic | WRITE, DESCRIBE | publishes ReplicaSamples, nothing else |

Nobody but ``sluice`` (and ``admin``) may write the admission topic; routers verify signatures besides.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from .. import topics
from ..settings import Settings
from .credentials import GPU_AGENT, ROUTER, WORKER

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
        # spans become request events in the bridge: whoever may write those may write these
        table.append(Acl(ROUTER, "TOPIC", "LITERAL", settings.otel_topic, ("WRITE", "DESCRIBE")))
    return table


def apply_acls(java_command: list[str], bootstrap: str, client_properties: Path, table: list[Acl],
               timeout_s: float = 120.0) -> None:
    """Create every binding of ``table`` with Kafka's Admin client (``ApplyAcls.java``, one JVM)."""
    lines = "\n".join(binding for acl in table for binding in acl.bindings()) + "\n"
    cmd = [*java_command, str(HERE / "ApplyAcls.java"), bootstrap, str(client_properties)]
    try:
        proc = subprocess.run(cmd, input=lines, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AclError(f"applying ACLs took longer than {timeout_s:.0f}s") from None
    if proc.returncode != 0:
        raise AclError(f"applying ACLs failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
