"""The secure devstack's principals and their SCRAM passwords.

Passwords are random, made once and kept in ``<state_dir>/kafka/credentials.json`` (mode 0600); a
principal added to ``PRINCIPALS`` later is added to an existing file (the others keep theirs). Only
``admin`` is written into the storage when it is formatted (the brokers authenticate to each other as
``admin`` before anything else can run); the other principals are created as SCRAM users through the
Admin API once the cluster answers (``ApplyAcls.java``, passwords on its stdin), so no password but
``admin``'s ever appears on a command line, and a principal can be added to a running cluster. Which
principal may do what is ``acls.py``.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

MECHANISM = "SCRAM-SHA-512"
ADMIN = "admin"          # super user: the brokers between themselves, the controller listener, ACL changes
WORKER = "sluice"        # a Sluice worker (control and landing) and `sluice otel-bridge`
ROUTER = "router"        # a router: reads admission signals, writes request events
GPU_AGENT = "gpu-agent"  # a GPU agent or collector: writes replica samples
OTEL_COLLECTOR = "otel-collector"  # an OpenTelemetry Collector: writes OTLP spans to `otel_topic`
PRINCIPALS = (ADMIN, WORKER, ROUTER, GPU_AGENT, OTEL_COLLECTOR)


def credentials_path(kafka_dir: Path) -> Path:
    return kafka_dir / "credentials.json"


def ensure_credentials(kafka_dir: Path) -> dict[str, str]:
    """principal → password for every principal of ``PRINCIPALS``: the stored ones, plus a new random one
    (hex, so no character needs quoting anywhere) for each principal the file lacks, written back
    (0600, replaced atomically). Names in the file that are not principals any more are kept there."""
    path = credentials_path(kafka_dir)
    stored: dict[str, str] = {}
    if path.exists():
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict) or not all(isinstance(v, str) and v for v in stored.values()):
            raise ValueError(f"{path} is not a JSON object of principal → password")
    missing = [name for name in PRINCIPALS if name not in stored]
    if missing:
        stored = {**stored, **{name: secrets.token_hex(24) for name in missing}}
        kafka_dir.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".partial-{os.getpid()}")
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(stored, fh, indent=1)
        staging.rename(path)
    return {name: stored[name] for name in PRINCIPALS}


def client_env(principal: str, ca_file: Path) -> list[str]:
    """The non-secret environment a Sluice process needs to connect as ``principal``: no password (it is
    in ``credentials.json``) and no bootstrap list (the devstack's changes on every start; Sluice reads it
    from ``broker.json`` while ``SLUICE_KAFKA_BOOTSTRAP_SERVERS`` is unset). The CA file is the devstack's
    own and stays where it is across restarts."""
    return ["SLUICE_KAFKA_SECURITY_PROTOCOL=SASL_SSL",
            f"SLUICE_KAFKA_SASL_MECHANISM={MECHANISM}",
            f"SLUICE_KAFKA_SASL_USERNAME={principal}",
            f"SLUICE_KAFKA_SSL_CA_FILE={ca_file}"]
