"""Stage 2 of the control path: partials → the control loop → pictures and signed signals on Kafka.

Partials are co-partitioned by pool, so each pool's picture is computed by
exactly one worker (Faust's group ``app_id``); scaling out moves pools
between workers. Each merged partial is kept in a changelog table until it
leaves the cost window, so after a restart or rebalance the states are
rebuilt from the table, and partial ids make a redelivered partial count once.
A rebuild also re-reads the window's partials from the partials topic: Faust's
stream can skip records across a rebalance, and a skipped partial is in the
topic but never in the table (seen in a scale-out run: 292 partials, so the
300 s goodput differed from the offline picture).

A forgotten pool's partials leave the table too, or a rebuild would bring the
pool back. Faust writes a table change to the changelog partition of the event
being handled, so they are queued per partials partition and deleted while the
next partial of that partition is merged; and each table value keeps when it
was merged, so a rebuild leaves out a pool idle past ``pool_idle_s`` whose
partials are still there (no partial of its partition came since).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from faust.streams import current_event

from .. import metrics, topics
from ..admission.keyring import active_key
from ..admission.policy import STATES, config_from
from ..control_loop import ControlLoop, Signal
from ..events import PRIORITIES
from ..kafka_clients import client_options
from ..load.config import PictureConfigs
from ..load.partial import Partial
from ..load.picture import AXES
from ..settings import Settings, SettingsError
from ..pools_view import absorb
from ..topic_reader import open_from_beginning, read_since, read_to_end
from .stall_watch import send_all

log = logging.getLogger(__name__)
KEY_SEP = b"\x1f"  # pool ␟ partial id: table keys of stage 2
REREAD_MARGIN_S = 60.0   # a rebuild re-reads partials published this much before the cost window's horizon
REREAD_TIMEOUT_S = 30.0  # and gives up on the re-read after this long (streams wait for the rebuild)
Reread = tuple[Partial, bytes, int]  # a partial the table lacks, as published, and its broker time (ms)


def control_loop(settings: Settings) -> ControlLoop:
    try:
        policy = config_from(settings.admission_policy)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    key_id, secret = active_key(settings)
    return ControlLoop(PictureConfigs(settings), policy, key_id, secret, int(settings.heartbeat_s * 1000),
                       max_pools=settings.max_pools, pool_idle_ms=int(settings.pool_idle_s * 1000))


class Stage2:
    def __init__(self, settings: Settings, table: Any, load_topic: Any, admission_topic: Any) -> None:
        self.settings = settings
        self.loop = control_loop(settings)
        self.table = table
        self.load_topic = load_topic
        self.admission_topic = admission_topic
        self.fleet: dict[str, dict] = {}  # every pool's newest picture, from sluice.load.v1 (for siblings)
        self.fleet_heard: dict[str, float] = {}  # pool → when its newest picture arrived (this worker's clock)
        self.fleet_fresh_s = settings.replica_stale_after_s
        self.max_ahead_ms = int(settings.max_clock_skew_s * 1000)
        self.partitions = topics.PARTIALS.partitions(settings)
        self.unwanted: dict[int, list[bytes]] = {}  # partials partition → table keys to delete there
        self.unwritten: dict[int, dict[bytes, bytes]] = {}  # partials partition → table key: value to write there
        self.clock = time.time
        self.failing: dict[str, str] = {}  # pool → the error its last step raised

    def _ahead_ms(self, partial: Partial) -> int:
        """How far the partial's newest event or replica sample time is ahead of this worker's clock."""
        newest = max((r.latest.event_time for r in partial.replicas.values() if r.latest is not None),
                     default=partial.newest_ms)
        return max(newest, partial.newest_ms) - int(self.clock() * 1000)

    def _ahead(self, partial: Partial) -> bool:
        """A partial newer than the clock allows (an older worker's, or a changelog poisoned before event
        times were bounded) would move the pool's watermark and make every real event late; a replica's
        latest sample from the future would keep a ghost replica fresh for ever."""
        return self._ahead_ms(partial) > self.max_ahead_ms

    def _from_the_future(self, partial: Partial) -> bool:
        """``_ahead``, logged and counted."""
        if not self._ahead(partial):
            return False
        log.warning("ignored partial %s of pool %s: an event or replica sample time is ahead of the clock "
                    "(newest_ms %d)", partial.id, partial.pool, partial.newest_ms)
        metrics.PARTIALS_REFUSED.inc()
        return True

    @property
    def snapshots(self) -> dict[str, dict]:
        return self.loop.pictures

    def merge(self, partial: Partial, raw: bytes) -> None:
        """Called inside stream iteration, so table writes go to the partial's own partition.
        ``raw`` is the partial as received: it is what the changelog keeps, with when it was merged."""
        self._apply_queued(partial)
        if self._from_the_future(partial):
            return
        if self._ahead_ms(partial) > 1000:   # a second: not the jitter between one machine's clock reads
            metrics.PARTIALS_AHEAD.inc()
        refused = self.loop.refused_pools
        evicted = self.loop.merge(partial, int(self.clock() * 1000))
        if evicted is None:
            if self.loop.refused_pools > refused:
                metrics.POOLS_REFUSED.inc()
            else:
                metrics.PARTIALS_DUPLICATE.inc()
            return
        metrics.PARTIALS_MERGED.inc()
        self.table[table_key(partial.pool, partial.id)] = stored(raw, int(self.clock() * 1000))
        for partial_id in evicted:
            self.table.pop(table_key(partial.pool, partial_id), None)

    def _apply_queued(self, partial: Partial) -> None:
        """Apply the table changes queued for the partition this merge writes to (the current event's;
        outside a stream, where tests call this, the partial's pool's): deletions, and partials a rebuild
        merged from the topic that are still in their pool's window."""
        event = current_event()
        partition = event.message.partition if event is not None else partition_of(partial.pool.encode(),
                                                                                    self.partitions)
        for key in self.unwanted.pop(partition, ()):
            self.table.pop(key, None)
        for key, value in self.unwritten.pop(partition, {}).items():
            pool, partial_id = key.decode().split(KEY_SEP.decode(), 1)
            state = self.loop.states.get(pool)
            if state is not None and partial_id in state.seen:
                self.table[key] = value

    def _unwanted(self, pool_key: bytes, key: bytes) -> None:
        self.unwanted.setdefault(partition_of(pool_key, self.partitions), []).append(key)

    def rebuild(self, active_partitions: set[int], partitions: int, reread: list[Reread] = ()) -> None:
        """States of the pools whose partials partitions this worker owns, from the (recovered) table and
        ``reread``: partials of those partitions on the partials topic that the table lacks.

        The table also holds standby copies of other workers' partitions:
        those pools are left out, or two workers would publish for one pool.
        A pool idle past ``pool_idle_s`` is not rebuilt, and its partials are queued for deletion.
        A reread partial still in its pool's window after the rebuild is queued for the table, so the
        next rebuild finds it there.
        """
        self.unwanted, self.unwritten = {}, {}  # queued for partitions this worker may no longer own
        kept, active_ms, keys = [], {}, set()
        for key, value in list(self.table.items()):
            pool = key.split(KEY_SEP, 1)[0]
            if partition_of(pool, partitions) in active_partitions:
                try:
                    partial, merged_ms = unstored(value)
                    if partial.pool.encode() != pool:
                        raise ValueError(f"it holds a partial of pool {partial.pool[:100]!r}")
                except Exception as exc:  # one bad value costs that value, never the worker (a crash loop)
                    log.warning("left out table value %r that does not parse: %s: %.200s", key[:200],
                                type(exc).__name__, exc)
                    self._unwanted(pool, key)
                    continue
                keys.add(key)
                if not self._from_the_future(partial):
                    kept.append((key, partial))
                    if merged_ms is not None:
                        active_ms[partial.pool] = max(merged_ms, active_ms.get(partial.pool, 0))
        found = []
        for partial, raw, broker_ms in reread:
            key = table_key(partial.pool, partial.id)
            if key in keys or partition_of(partial.pool.encode(), partitions) not in active_partitions \
                    or self._ahead(partial):  # the stream logged and counted it when it met it
                continue
            keys.add(key)
            kept.append((None, partial))
            active_ms[partial.pool] = max(broker_ms, active_ms.get(partial.pool, 0))
            found.append((key, partial, stored(raw, broker_ms)))
        idle = set(self.loop.rebuild([p for _, p in kept], int(self.clock() * 1000), active_ms))
        for key, partial in kept:  # idle pools' partials, and any whose merge raised, leave the table
            if key is not None and (partial.pool in idle or partial.id in self.loop.unmergeable):
                self._unwanted(partial.pool.encode(), key)
        missing = 0
        for key, partial, value in found:
            state = self.loop.states.get(partial.pool)
            if state is not None and partial.id in state.seen and partial.id not in self.loop.unmergeable:
                missing += 1
                queued = self.unwritten.setdefault(partition_of(partial.pool.encode(), partitions), {})
                queued[key] = value
        metrics.PARTIALS_REREAD.inc(missing)
        if self.loop.unmergeable:
            log.warning("rebuild left out %d partial(s) whose merge raised: %.200s", len(self.loop.unmergeable),
                        sorted(self.loop.unmergeable))
        log.info("stage 2 rebuilt %d pool picture(s) from %d partial(s) of partitions %s (%d in the window found "
                 "only on the partials topic); %d idle pool(s) left out", len(self.loop.states), len(kept),
                 sorted(active_partitions), missing, len(idle))

    async def reread(self, bootstrap: str, active_partitions: set[int]) -> list[Reread]:
        """The partials topic's partials of ``active_partitions`` from about the cost window back that the
        table lacks, for a rebuild.

        The changelog table holds what the stream merged, and Faust's stream can skip records across a
        rebalance (its committed offset passes partials it never handed to the agent): the topic itself is
        what was published. Call it while the streams are paused (the rebalance handler), so the table
        stands still; a failure or timeout leaves the rebuild to the table and whatever was read, loudly."""
        s = self.settings
        horizon_s = s.cost_window_s + s.allowed_lateness_s + s.max_clock_skew_s + REREAD_MARGIN_S
        since_ms = int((self.clock() - horizon_s) * 1000)
        known = set(self.table.keys())

        def lacking(record: Any) -> Reread | None:
            try:
                data = orjson.loads(record.value)
                if table_key(data["pool"], data["id"]) in known:
                    return None   # most are: their identity alone, without the checked parse (7× the cost)
                return Partial.from_dict(data), record.value, record.timestamp
            except Exception:  # the stream logs and skips it when it meets it
                return None

        found: list[Reread] = []
        try:
            complete = await read_since(bootstrap, topics.PARTIALS.name(s), active_partitions, since_ms,
                                        REREAD_TIMEOUT_S, lacking, found, **client_options(s))
        except Exception as exc:
            complete = False
            log.warning("rebuild could not re-read the partials topic: %s: %.200s", type(exc).__name__, exc)
        if not complete:
            metrics.REREAD_INCOMPLETE.inc()
            log.warning("rebuild's re-read of partitions %s gave up with %d partial(s) the table lacks: one the "
                        "stream skipped may be missing from the pictures", sorted(active_partitions), len(found))
        return found

    async def publish(self) -> int:
        """One step of the control loop; its pictures and signals go out, and into the metrics."""
        now = self.clock()
        step = self.loop.step(int(now * 1000), self.heard_fleet(now))
        for pool, error in step.failed:
            if self.failing.get(pool) != error:   # once per pool and error, not every tick
                log.error("pool %s: its picture or decision raised, so it gets no signal: %s", pool, error)
            metrics.POOL_STEP_FAILURES.inc()
        self.failing = dict(step.failed)
        for pool, partial_id in step.released:  # outside stream iteration: deleted at the next merge there
            self._unwanted(pool.encode(), table_key(pool, partial_id))
        messages = [(self.load_topic, p["pool"].encode(), orjson.dumps(p)) for p in step.pictures]
        messages += [(self.admission_topic, s.pool.encode(), s.value) for s in step.signals]
        # tombstones: compaction removes a forgotten pool from both topics
        messages += [(topic, pool.encode(), None) for pool in step.forgotten
                     for topic in (self.load_topic, self.admission_topic)]
        await send_all("signals", messages)
        metrics.POOLS_FORGOTTEN.inc(len(step.forgotten))
        for picture in step.pictures:
            metrics.PICTURE_LAG.observe(max(0.0, now - picture["watermark_ms"] / 1000))
            export_picture(picture)
        for signal in step.signals:
            export_signal(signal, now)
        return len(step.pictures)

    def heard_fleet(self, now: float) -> dict[str, dict]:
        """Other workers' pictures that may name redirect targets: those that arrived within
        ``replica_stale_after_s`` by this worker's clock. A pool's picture is republished whenever a partial
        of it merges, so one not heard from for that long had no replica sampled for that long (its worker
        stopped, or it did): its last picture, perhaps with headroom, must not draw moved work. This worker's
        own clock on both sides, so no other controller's clock is compared with it."""
        return {pool: picture for pool, picture in self.fleet.items()
                if now - self.fleet_heard.get(pool, float("-inf")) <= self.fleet_fresh_s}

    async def follow_fleet(self, bootstrap: str, topic: str) -> None:
        """Keep every pool's newest picture, whichever worker computes it, for redirect decisions. What the
        topic held when this worker started is read as not heard from: a pool whose worker is gone stays in
        the compacted topic until another forgets it."""
        consumer, ends = await open_from_beginning(bootstrap, topic, **client_options(self.settings))
        try:
            await read_to_end(consumer, ends, lambda batch: absorb(self.fleet, batch))
            while True:
                batch = await consumer.getmany(timeout_ms=500)
                heard = self.clock()
                for pool in absorb(self.fleet, batch):
                    self.fleet_heard[pool] = heard
                if len(self.fleet_heard) > len(self.fleet):   # pools forgotten (tombstoned) since
                    self.fleet_heard = {p: t for p, t in self.fleet_heard.items() if p in self.fleet}
        finally:
            await consumer.stop()


def stored(raw: bytes, merged_ms: int) -> bytes:
    """A table value: the partial as received, and when it was merged (the worker's clock)."""
    return orjson.dumps({"merged_ms": merged_ms, "partial": orjson.Fragment(raw)})


def unstored(value: bytes) -> tuple[Partial, int | None]:
    """A table value's partial and merge time; None for a value kept before merge times were."""
    data = orjson.loads(value)
    if isinstance(data.get("merged_ms"), int) and "partial" in data:
        return Partial.from_dict(data["partial"]), data["merged_ms"]
    return Partial.from_dict(data), None


def table_key(pool: str, partial_id: str) -> bytes:
    return pool.encode() + KEY_SEP + partial_id.encode()


def partition_of(pool_key: bytes, partitions: int) -> int:
    """The partials partition a pool's key lands in (Kafka's default partitioner, as the producer uses)."""
    from aiokafka.partitioner import murmur2

    return (murmur2(pool_key) & 0x7FFFFFFF) % partitions


def export_signal(signal: Signal, now_s: float) -> None:
    label = metrics.pool_label(signal.pool)
    decision = signal.decision
    metrics.SIGNALS_PUBLISHED.labels(label).inc()
    metrics.DECISION_LATENCY.labels(label).observe(max(0.0, now_s - signal.picture["watermark_ms"] / 1000))
    for state in STATES + ("stale",):
        metrics.ADMISSION_STATE.labels(label, state).set(1 if state == decision.state else 0)
    for cls in PRIORITIES:
        metrics.ADMIT_FRACTION.labels(label, cls).set(decision.signal["admit_fraction"][cls])
    metrics.TENANTS_LISTED.labels(label).set(len(decision.signal.get("tenant_admit_fraction", ())))
    limit = signal.picture["axes"]["demand"]["limit"]
    metrics.SERVING_CAPACITY.labels(label).set(decision.capacity_rps or _number(limit))


def export_picture(snapshot: dict) -> None:
    label = metrics.pool_label(snapshot["pool"])
    axes = snapshot["axes"]
    metrics.POOL_PRESSURE.labels(label).set(snapshot["pressure"])
    metrics.POOL_LATE_EVENTS.labels(label).set(snapshot["late_events"])
    for axis in AXES:
        metrics.POOL_AXIS_PRESSURE.labels(label, axis).set(axes[axis]["pressure"])
        metrics.POOL_AXIS_VALUE.labels(label, axis).set(_number(axes[axis]["value"]))
    metrics.POOL_COST_PER_TASK.labels(label).set(_number(axes["cost"]["value"]))
    metrics.POOL_GOODPUT.labels(label).set(snapshot["rates"]["goodput_tasks_per_s"])
    metrics.POOL_RETRY_AMPLIFICATION.labels(label).set(_number(axes["errors"]["detail"]["retry_amplification"]))
    metrics.POOL_PREEMPTIONS.labels(label).set(axes["kv_cache"]["detail"]["preemptions_per_s_per_replica"])
    metrics.POOL_STALE_REPLICAS.labels(label).set(snapshot["replicas"]["stale"])
    cache = snapshot.get("cache") or {}
    metrics.POOL_PREFIX_HIT_RATE.labels(label).set(_number(cache.get("prefix_hit_rate")))
    metrics.POOL_CACHED_INPUT_SHARE.labels(label).set(_number(cache.get("cached_input_share")))


def _number(value: float | None) -> float:
    return float("nan") if value is None else value
