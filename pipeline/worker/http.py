"""The worker's HTTP endpoints: /healthz, /metrics, /pools and the read-only /query."""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

import faust
from aiohttp import web as aio_web

from .. import metrics
from ..settings import Settings
from ..sinks.readonly import QueryRefused, ReadLimits
from ..sinks.store import StoreQueryError
from .stall_watch import PRODUCER_WAITS, StallWatch, aiokafka_producer, spent


QUERY_MAX_BYTES = 256 * 1024


def health(control: Any, landing: Any, stall_s: float, waits: StallWatch = PRODUCER_WAITS,
           producer: Any = None) -> tuple[bool, dict]:
    """Healthy when each path this worker runs consumes, the landing path's store answers, and the Kafka
    producer can still deliver (its sender runs, no refusal spoiled it: only a restart brings a new one).

    Waits on the producer older than ``stall_s`` are named in the body but do not fail the check: the
    broker is slow or away, and a restart would meet the same broker (stall_watch). So is a control-path cut
    waiting that long (``control.cut_stuck_s``, by phase: lock, commit, send): its partitions' events stop
    reaching the pools' pictures while the path still consumes (docs/runbook.md, cut stuck). Except a cut
    queued on the lock that long while the lock's holder waits on nothing at the broker (``ControlConsumer.
    wedged``): the path is wedged inside the worker, which a restart cures, so that fails the check
    (``control.wedged``), and the worker exits (``RestartExit``). In ``all`` the store's state is
    reported but does not fail the check either: a restart would cost the fleet its admission control and
    bring no store back.
    """
    body: dict[str, Any] = {"producer_stuck_s": waits.stuck(stall_s)}
    reason = spent(producer, waits)
    if reason:
        body["producer_spent"] = reason
    ok = not reason
    if control is not None:
        consuming = bool(control.consumer and control.consumer.assignment())
        wedged = control.wedged(stall_s, waits) is not None
        cut_stuck = control.cut_waits.stuck(stall_s)
        body["control"] = {"consuming": consuming, "cut_stuck_s": cut_stuck, "wedged": wedged}
        ok = ok and consuming and not wedged
    if landing is not None:
        consuming = bool(landing.consumer and landing.consumer.assignment())
        reachable = landing.store_ok and not landing.held
        body["landing"] = {"consuming": consuming, "store": landing.store.backend if landing.store else None,
                           "store_reachable": reachable, "sink_held": landing.held}
        ok = ok and consuming and (reachable or control is not None)
    body["ok"] = ok
    return ok, body


def add_pages(app: faust.App, settings: Settings, control: Any, landing: Any, stage2: Any) -> None:
    @app.page("/healthz")
    async def healthz(web: Any, request: Any) -> Any:
        ok, body = health(control, landing, settings.producer_stall_s,
                          producer=aiokafka_producer(app))
        return web.json(body, status=200 if ok else 503)

    @app.page("/metrics")
    async def prometheus(web: Any, request: Any) -> Any:
        return aio_web.Response(body=metrics.exposition(), content_type="text/plain", charset="utf-8")

    @app.page("/pools")
    async def pools(web: Any, request: Any) -> Any:
        """Pictures of the pools whose partitions this worker owns (``sluice pools`` shows all)."""
        snapshots = stage2.snapshots if stage2 is not None else {}
        return web.json({"pools": [snapshots[p] for p in sorted(snapshots)]})

    @app.page("/query")
    class Query(faust.web.View):
        """Read-only SQL against this worker's store (the embedded one is locked to this process)."""

        async def post(self, request: Any) -> Any:
            if settings.query_token:
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {settings.query_token}".encode()):
                    return self.json({"error": "missing or wrong bearer token"}, status=401)
            if landing is None:
                return self.json({"error": "this worker runs the control role and has no store"}, status=404)
            if landing.store is None:
                return self.json({"error": "the store is not open yet"}, status=503)
            body = await request.read()
            if len(body) > QUERY_MAX_BYTES:
                return self.json({"error": f"a query is at most {QUERY_MAX_BYTES} bytes"}, status=413)
            sql = body.decode("utf-8", errors="replace")
            try:
                rows = await asyncio.to_thread(landing.store.read_only, sql, ReadLimits.of(settings))
            except (QueryRefused, StoreQueryError) as exc:
                return self.json({"error": str(exc)}, status=400)
            truncated = len(rows) > settings.query_max_rows
            return self.json({"rows": rows[: settings.query_max_rows], "truncated": truncated})
