"""The client library routers embed: follow admission signals, decide per request, emit events.

Usage (asyncio)::

    client = RouterClient(settings, bootstrap, keys={"k1": b"..."}, seed=7)
    await client.start()          # reads sluice.admission.v1 from the beginning: every pool at once
    verdict = client.decide(Request(pool="chat-70b", priority="standard", continuing=False,
                                    retry=False, slo_ttft_s=1.0))
    if isinstance(verdict, Admit): ...
    client.record(accepted=True)  # the backend took the request (feeds the fallback throttle)
    await client.stop()

Every signal is verified (HMAC over the documented bytes, a known key id,
a schema-valid body, a ``seq`` above the last one accepted for its pool);
refusals are counted by reason. Without a valid signal a router is
**fail-static** for ``fallback_static_s`` after the last one expired, then
throttles adaptively: reject with probability
``max(0, (requests − K·accepts) / (requests + 1))`` over a sliding window (K = 2).

Everything but ``kafka_client`` is pure (no Kafka, no event loop), so a router
with its own transport can feed a ``SignalBook`` and ask a ``Decider``. The
names below are the public API, pinned by ``tests/unit/test_router_api.py``.
"""

from .decider import Decider
from .kafka_client import EventEmitter, RouterClient
from .signal_book import SignalBook
from .sliding_counts import SlidingCounts
from .verdicts import ADMIT, Admit, Defer, Redirect, Reject, Request, Verdict

__all__ = [
    "ADMIT",
    "Admit",
    "Decider",
    "Defer",
    "EventEmitter",
    "Redirect",
    "Reject",
    "Request",
    "RouterClient",
    "SignalBook",
    "SlidingCounts",
    "Verdict",
]
