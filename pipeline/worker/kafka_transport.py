"""Faust's aiokafka transport with an idempotent producer, registered as the ``sluice://`` broker scheme.

faust-streaming turns on ``enable_idempotence`` only inside exactly-once
transactions, which Sluice does not use; without it a send retried after a
broker loss (the leader wrote the batch, the acknowledgement was lost) is
written twice. Every other Sluice producer is idempotent through
``kafka_clients.producer_options``; this gives the worker's own producer
(partials, pictures, signals, dead letters) the same guarantee.
"""

from __future__ import annotations

from typing import Any, Mapping

from faust.transport import drivers
from faust.transport.drivers import aiokafka as driver

SCHEME = "sluice"


class IdempotentProducer(driver.Producer):
    def _settings_extra(self) -> Mapping[str, Any]:
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}


class Transport(driver.Transport):
    Producer = IdempotentProducer


drivers.TRANSPORTS.aliases.setdefault(SCHEME, f"{__name__}:Transport")
