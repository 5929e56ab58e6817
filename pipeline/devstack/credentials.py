"""The secure devstack's principals and their SCRAM passwords.

Passwords are random, made once and kept in ``<state_dir>/kafka/credentials.json`` (mode 0600); the
broker learns them when its storage is formatted (``--add-scram``), so they exist before any broker
authenticates to another. Which principal may do what is ``acls.py``.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

MECHANISM = "SCRAM-SHA-512"
ADMIN = "admin"          # super user: the brokers between themselves, the controller listener, ACL changes
WORKER = "sluice"        # a Sluice worker (control and landing)
ROUTER = "router"        # a router: reads admission signals, writes request events
GPU_AGENT = "gpu-agent"  # a GPU agent or collector: writes replica samples
PRINCIPALS = (ADMIN, WORKER, ROUTER, GPU_AGENT)


def credentials_path(kafka_dir: Path) -> Path:
    return kafka_dir / "credentials.json"


def ensure_credentials(kafka_dir: Path) -> dict[str, str]:
    """principal → password, made (hex, so no character needs quoting anywhere) unless already stored."""
    path = credentials_path(kafka_dir)
    if path.exists():
        stored = json.loads(path.read_text())
        if set(stored) != set(PRINCIPALS):
            raise ValueError(f"{path} names {sorted(stored)}, expected {sorted(PRINCIPALS)}")
        return stored
    kafka_dir.mkdir(parents=True, exist_ok=True)
    made = {name: secrets.token_hex(24) for name in PRINCIPALS}
    staging = path.with_suffix(".partial")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(made, fh, indent=1)
    staging.rename(path)
    return made


def client_env(principal: str, password: str, ca_file: Path, bootstrap: str) -> list[str]:
    """The environment a Sluice process needs to connect as ``principal``."""
    return [f"SLUICE_KAFKA_BOOTSTRAP_SERVERS={bootstrap}",
            "SLUICE_KAFKA_SECURITY_PROTOCOL=SASL_SSL",
            f"SLUICE_KAFKA_SASL_MECHANISM={MECHANISM}",
            f"SLUICE_KAFKA_SASL_USERNAME={principal}",
            f"SLUICE_KAFKA_SASL_PASSWORD={password}",
            f"SLUICE_KAFKA_SSL_CA_FILE={ca_file}"]
