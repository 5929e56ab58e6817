"""Where the Kafka broker is: the configured bootstrap servers, else the one the devstack recorded.

Kept apart from ``devstack`` so production code (the worker, routers) never
imports the development broker's tooling; ``sluice kafka start`` writes the
address file this reads.
"""

from __future__ import annotations

import json

from .settings import Settings


class NoBroker(RuntimeError):
    """Neither configured nor started by the devstack."""


def address_file(settings: Settings):
    return settings.kafka_dir / "broker.json"


def bootstrap_servers(settings: Settings) -> str:
    if settings.kafka_bootstrap_servers:
        return settings.kafka_bootstrap_servers
    try:
        return json.loads(address_file(settings).read_text())["bootstrap"]
    except (OSError, ValueError, TypeError, KeyError):
        raise NoBroker("no Kafka broker: run `sluice kafka start` or set KAFKA_BOOTSTRAP_SERVERS") from None
