"""The Faust application: thin glue between Kafka and the pure cores.

``faust -A pipeline.agents worker`` and ``sluice worker`` both run it.

Stage 1 (raw topics and the admission topic, consumer group
``<app_id>-stage1``) fetches batches, folds accepted events at once into
per-pool partials (one builder per source partition, published to
``sluice.partials.v1``, key: pool, every tick), and gathers rows per source
partition into blocks that land exactly once in ClickHouse (see
``ingest.py`` and docs/storage.md); offsets are committed only after their
dead letters are delivered and their blocks are durable.

Stage 2 (partials, co-partitioned by pool) keeps each partial in a changelog
table until it leaves the cost window and merges it into an in-memory
``PoolState``; after a restart or rebalance the states are rebuilt from the
table, and partial ids make a redelivered partial count once. Every tick it
publishes each changed pool's picture to the compacted ``sluice.load.v1``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from typing import Any

import faust
import orjson
from aiohttp import web as aio_web

from . import metrics, topics
from .devstack.kafka import bootstrap_servers
from .admission.keyring import active_key
from .admission.policy import STATES, Decision, changed, config_from, decide
from .admission.signing import sign
from .events import PRIORITIES, AdmissionSignal, Event, ReplicaSample, RequestEvent
from .ingest import (DEAD_LETTER_TABLE, TABLE_OF, BlockOutcome, PartitionCursor, RecentIds, Record, process_block,
                     refused_by_store)
from .load.config import PictureConfigs
from .load.partial import Partial, PartialBuilder
from .load.picture import AXES, PoolState
from .settings import Settings, SettingsError, load_settings
from .sinks.clickhouse import ClickHouseSink
from .sinks import positions
from .sinks.migrations import prepare_store
from .sinks.readonly import QueryRefused, checked
from .sinks.store import Store, StoreQueryError, StoreRejected, StoreUnavailable, open_store
from .topic_reader import open_from_beginning

log = logging.getLogger(__name__)
KEY_SEP = b"\x1f"  # pool ␟ partial id: table keys of stage 2


class Stage1:
    """Per-batch work of the ingest agents; collaborators are injected so agent tests can swap them."""

    def __init__(self, settings: Settings, dead_letter_topic: Any, partials_topic: Any) -> None:
        self.settings = settings
        self.dead_letter_topic = dead_letter_topic
        self.partials_topic = partials_topic
        self.store: Store | None = None
        self.sink: ClickHouseSink | None = None
        self.builders: dict[tuple[str, int], PartialBuilder] = {}
        self.cursors: dict[tuple[str, int], PartitionCursor] = {}
        self.recent_ids: dict[tuple[str, int], RecentIds] = {}
        self.open_blocks: dict[tuple[str, int], BlockOutcome] = {}   # gathering rows, not yet landing
        self._landing: asyncio.Task | None = None
        self.consumer: Any = None
        self.store_ok = False
        self._last_tick = 0
        self._ready_lock = asyncio.Lock()

    async def ready(self) -> None:
        """Open and migrate the store once, before the first batch lands."""
        async with self._ready_lock:
            if self.sink is not None:
                return
            await topics.ensure_topics(self.settings, bootstrap_servers(self.settings))
            self.store = await asyncio.to_thread(open_store, self.settings)
            await asyncio.to_thread(prepare_store, self.store, self.settings)
            self.sink = ClickHouseSink(self.store)
            self.store_ok = True

    async def check_store(self) -> bool:
        """A cheap query, so /healthz notices an unreachable store even while no batch is landing."""
        if self.store is None:
            return False
        try:
            await asyncio.to_thread(self.store.query, "SELECT 1 AS ok")
            self.store_ok = True
        except StoreUnavailable as exc:
            if self.store_ok:
                log.warning("store unreachable: %s", exc)
            self.store_ok = False
        return self.store_ok

    def _builder(self, topic: str, partition: int) -> PartialBuilder:
        builder = self.builders.get((topic, partition))
        if builder is None:
            builder = self.builders[(topic, partition)] = PartialBuilder(
                f"{topic}/{partition}", self.settings.replica_stale_after_s)
        return builder

    async def handle(self, cls: type[Event], records: list[Record]) -> asyncio.Task:
        """Decode, dead-letter and fold one fetched batch of one topic; land what is due.

        Folding into the picture happens now. Rows gather per source partition
        into one block until it holds ``sink_block_rows`` rows or is
        ``sink_block_age_s`` old (ClickHouse wants thousands of rows, about a
        second, per insert); the returned task lands the blocks that are due
        and resolves to each partition's next offset to commit.
        """
        started = time.perf_counter()
        if self.sink is None:
            await self.ready()
        s = self.settings
        now_ms = int(time.time() * 1000)
        by_partition: dict[int, list[Record]] = {}
        for rec in records:
            by_partition.setdefault(rec.partition, []).append(rec)
        blocks: list[BlockOutcome] = []
        for partition, recs in by_partition.items():
            where = (recs[0].topic, partition)
            cursor = self.cursors.setdefault(where, PartitionCursor())
            seen = self.recent_ids.setdefault(where, RecentIds(s.dedup_recent_ids)) if s.dedup_recent_ids else None
            blocks += [process_block(cls, block, s.max_event_bytes, now_ms, seen, sealed)
                       for block, sealed in cursor.cut(recs)]
        pending = [await self.dead_letter_topic.send(key=key, value=value)
                   for block in blocks for key, value in block.dead_letters]
        if pending:
            await asyncio.gather(*pending)
        self._fold(cls, records[0].topic, blocks)
        for block in blocks:
            block.events = []  # folded: only the rows (and their sources, for refusals) wait to land
        metrics.INGEST_BATCH_SECONDS.labels(records[0].topic).observe(time.perf_counter() - started)
        return self._land(self._gather(blocks))

    def _gather(self, blocks: list[BlockOutcome]) -> list[BlockOutcome]:
        """Add blocks to their partition's open block; return the blocks due to land now."""
        due, now = [], time.monotonic()
        for block in blocks:
            where = (block.topic, block.partition)
            block.opened_at = now
            open_block = self.open_blocks.get(where)
            if open_block is not None and block.follows(open_block):
                open_block.absorb(block)
            else:
                if open_block is not None:
                    due.append(self.open_blocks.pop(where))
                if block.sealed:
                    due.append(block)
                    continue
                self.open_blocks[where] = open_block = block
            if open_block.size >= self.settings.sink_block_rows:
                due.append(self.open_blocks.pop(where))
        return due + self.aged_blocks(now)

    def aged_blocks(self, now: float | None = None, partitions: Any = None) -> list[BlockOutcome]:
        """Open blocks older than ``sink_block_age_s`` (or all of ``partitions``' blocks), taken out to land."""
        now = time.monotonic() if now is None else now
        out = []
        for where, block in list(self.open_blocks.items()):
            if (partitions is not None and where in partitions) or (
                    partitions is None and now - block.opened_at >= self.settings.sink_block_age_s):
                out.append(self.open_blocks.pop(where))
        return out

    def _land(self, blocks: list[BlockOutcome]) -> asyncio.Task:
        """Land ``blocks`` after every earlier landing (a partition's blocks land in offset order)."""
        previous = self._landing

        async def land() -> dict[tuple[str, int], int]:
            if previous is not None and not previous.done():
                await asyncio.wait([previous])
            for block in blocks:
                landing = time.perf_counter()
                await self.sink.land(DEAD_LETTER_TABLE, block.landed_dead_letters(), block.token(DEAD_LETTER_TABLE))
                try:
                    await self.sink.land(block.table, block.landed_rows(), block.token(block.table))
                except StoreRejected as exc:
                    await self._land_row_by_row(block, exc)
                metrics.SINK_BATCH_SECONDS.labels(block.table).observe(time.perf_counter() - landing)
                if block.oldest_event_ms:
                    metrics.LANDING_LAG_SECONDS.labels(block.table).observe(
                        max(0.0, time.time() - block.oldest_event_ms / 1000))
                if block.table != TABLE_OF[AdmissionSignal]:  # signals are our own output, counted as sink rows
                    metrics.EVENTS_ACCEPTED.labels(block.topic).inc(len(block.rows))
            return {(block.topic, block.partition): block.next_offset for block in blocks}

        self._landing = task = asyncio.ensure_future(land())
        return task

    async def _land_row_by_row(self, block: BlockOutcome, refused: StoreRejected) -> None:
        """The store refused a block for its data: land its rows one by one, dead-letter the refused ones.

        Deterministic like the block (each row's token extends the block's), so
        a replay after a crash drops whatever landed already.
        """
        log.warning("store refused block %s (%s); landing its rows one by one", block.token(block.table), refused)
        token = block.token(block.table)
        for i, row_bytes in enumerate(block.landed_rows()):
            offset = block.sources[i].offset
            try:
                await self.sink.land(block.table, [row_bytes], f"{token}#{offset}")
            except StoreRejected as exc:
                key, letter, letter_row = refused_by_store(block, i, str(exc), int(time.time() * 1000))
                await (await self.dead_letter_topic.send(key=key, value=letter))
                await self.sink.land(DEAD_LETTER_TABLE, [letter_row], f"{DEAD_LETTER_TABLE}:{token}#{offset}")
                metrics.count_dead_letters(block.topic, {"store_rejected": 1})
                block.rows[i] = b""
        block.rows = [r for r in block.rows if r]

    def _fold(self, cls: type[Event], topic: str, blocks: list[BlockOutcome]) -> None:
        """Accepted events into the partition's partial builder, and the per-batch counters."""
        completed: dict[str, list[int]] = {}
        for block in blocks:
            metrics.count_dead_letters(topic, block.reasons)
            if block.duplicates:
                metrics.EVENTS_DUPLICATE.labels(topic).inc(block.duplicates)
            if block.newest_event_ms:
                metrics.NEWEST_EVENT_TIME.labels(topic).set(block.newest_event_ms / 1000)
            if cls is AdmissionSignal:
                continue
            builder = self._builder(topic, block.partition)
            for event in block.events:
                if cls is RequestEvent:
                    builder.fold_request(event)
                    if event.phase == "completed":
                        counts = completed.setdefault(event.pool, [0, 0])
                        counts[0] += 1
                        if (event.ttft_s is not None and event.slo_ttft_s is not None
                                and event.ttft_s > event.slo_ttft_s):
                            counts[1] += 1
                else:
                    builder.fold_sample(event)
        for pool, (done, missed) in completed.items():
            label = metrics.pool_label(pool)
            metrics.REQUESTS_COMPLETED.labels(label).inc(done)
            metrics.TTFT_SLO_MISSES.labels(label).inc(missed)

    async def resume(self, consumer: Any, tp: Any, cls: type[Event]) -> None:
        """Start a newly assigned partition after what the store holds of it.

        Blocks between the committed offset and the last landed block landed
        already and are skipped; the last one is replayed on its old
        boundaries (it may have landed in one table only), and the partition's
        recent event ids are reloaded so re-sent events stay dropped.
        """
        s = self.settings
        committed = await consumer.committed(tp) or 0
        table = TABLE_OF[cls]
        last = await self.sink.call("resume", positions.last_block, self.store, table, tp.topic, tp.partition,
                                    committed)
        where = (tp.topic, tp.partition)
        start = last[0] if last else committed
        if s.dedup_recent_ids:
            ids = await self.sink.call("resume", positions.recent_ids, self.store, table, tp.topic, tp.partition,
                                       start, s.dedup_recent_ids)
            self.recent_ids[where] = RecentIds(s.dedup_recent_ids, ids)
        self.cursors[where] = PartitionCursor(last)
        consumer.seek(tp, start)
        if last is not None:
            log.info("stage 1 resumes %s/%d at its last landed block %d-%d (committed %d)",
                     tp.topic, tp.partition, last[0], last[1], committed)

    def forget(self, topic: str, partition: int) -> None:
        """A revoked partition's per-partition state goes; its next owner rebuilds it from the store."""
        for state in (self.builders, self.cursors, self.recent_ids, self.open_blocks):
            state.pop((topic, partition), None)

    async def consume(self, bootstrap: str) -> None:
        """Stage 1's loop: fetch a batch per poll, handle it per topic, commit what has landed.

        A batch is read with aiokafka's ``getmany`` rather than through a Faust
        stream: stage 1 sees every raw event, and per-message stream machinery
        cost more than all of stage 1's own work (see docs/load-picture.md).
        Up to ``ingest_landing_depth`` batches land while the next is decoded
        (so folding into the picture does not wait for ClickHouse); they land
        in order, and offsets are committed only after their blocks are durable.
        """
        from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
        from aiokafka.errors import CommitFailedError, IllegalStateError

        stage1 = self
        inflight: list[list[asyncio.Task]] = []   # landing tasks per fetched batch, oldest first
        lag: dict[Any, int] = {}

        async def settle(keep: int = 0) -> None:
            """Wait until at most ``keep`` batches are still landing, then commit what the others landed."""
            offsets: dict[tuple[str, int], int] = {}
            while len(inflight) > keep or (inflight and all(t.done() for t in inflight[0])):
                for task in inflight.pop(0):
                    offsets.update(await task)
            if not offsets:
                return
            try:
                await consumer.commit({TopicPartition(t, p): o for (t, p), o in offsets.items()})
            except (CommitFailedError, IllegalStateError) as exc:
                # a rebalance moved the partitions: the new owner resumes after what landed
                log.warning("stage 1 commit after rebalance failed: %s", exc)

        class Rebalance(ConsumerRebalanceListener):
            async def on_partitions_revoked(self, revoked: Any) -> None:
                inflight.append([stage1._land(stage1.aged_blocks(partitions={(tp.topic, tp.partition)
                                                                              for tp in revoked}))])
                await settle()
                await stage1.publish_partials()  # what was folded from them goes out before they move
                for tp in revoked:
                    stage1.forget(tp.topic, tp.partition)
                    lag.pop(tp, None)

            async def on_partitions_assigned(self, assigned: Any) -> None:
                # paused until resumed: nothing may be handled from a position the store has not confirmed
                consumer.pause(*assigned)
                for tp in assigned:
                    await stage1.resume(consumer, tp, classes[tp.topic])
                consumer.resume(*assigned)

        s = self.settings
        await self.ready()
        classes = {topics.REQUESTS.name(s): RequestEvent, topics.REPLICAS.name(s): ReplicaSample,
                   topics.ADMISSION.name(s): AdmissionSignal}
        consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, group_id=topics.stage1_group(s), enable_auto_commit=False,
            auto_offset_reset="earliest", max_partition_fetch_bytes=topics.raw_topic_max_bytes(s),
            fetch_max_bytes=max(52428800, topics.raw_topic_max_bytes(s)), max_poll_records=s.ingest_batch_max)
        consumer.subscribe(list(classes), listener=Rebalance())
        await consumer.start()
        self.consumer = consumer
        try:
            while True:
                fetched = await consumer.getmany(timeout_ms=int(s.ingest_batch_within_s * 1000),
                                                 max_records=s.ingest_batch_max)
                if not fetched:
                    aged = self.aged_blocks()
                    if aged:
                        inflight.append([self._land(aged)])
                    await settle()
                    continue
                by_topic: dict[str, list[Record]] = {}
                for tp, messages in fetched.items():
                    by_topic.setdefault(tp.topic, []).extend(
                        Record(m.topic, m.partition, m.offset, m.timestamp, m.key, m.value) for m in messages)
                landing = [await self.handle(classes[topic], records) for topic, records in by_topic.items()]
                for tp, messages in fetched.items():
                    highwater = consumer.highwater(tp)
                    if highwater is not None:
                        lag[tp] = max(0, highwater - messages[-1].offset - 1)
                for topic in classes:
                    metrics.CONSUMER_LAG.labels(topic).set(sum(v for tp, v in lag.items() if tp.topic == topic))
                await settle(keep=s.ingest_landing_depth - 1)
                inflight.append(landing)
        finally:
            self.consumer = None
            for tasks in inflight:
                for task in tasks:
                    task.cancel()
            await consumer.stop()

    async def publish_partials(self) -> int:
        """Drain every builder; a partial's tick is a wall-clock millisecond, unique per drain."""
        tick = max(self._last_tick + 1, int(time.time() * 1000))
        self._last_tick = tick
        drained = [partial for builder in list(self.builders.values()) for partial in builder.drain(tick)]
        sent = [await self.partials_topic.send(key=partial.pool.encode(), value=partial.to_bytes())
                for partial in drained]
        if sent:
            await asyncio.gather(*sent)
            metrics.PARTIALS_PUBLISHED.inc(len(sent))
        return len(sent)


class Admission:
    """Each tick, every local pool's latest picture → the policy → a signed signal when it changed
    or the heartbeat is due."""

    def __init__(self, settings: Settings, admission_topic: Any) -> None:
        try:
            self.config = config_from(settings.admission_policy)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        self.key_id, self.secret = active_key(settings)
        self.heartbeat_ms = int(settings.heartbeat_s * 1000)
        self.topic = admission_topic
        self.decisions: dict[str, Decision] = {}
        self.published: dict[str, tuple[Decision, int]] = {}

    async def evaluate(self, pictures: dict[str, dict], fleet: dict[str, dict], now_ms: int) -> int:
        """Decide for ``pictures`` (this worker's pools); ``fleet`` (every pool known) supplies siblings."""
        sent = []
        for pool, picture in pictures.items():
            models = set(picture.get("models", ()))
            siblings = [p for other, p in fleet.items() if other != pool and models & set(p.get("models", ()))]
            decision = decide(picture, self.decisions.get(pool, Decision(pool)), self.config, now_ms, siblings)
            self.decisions[pool] = decision
            last = self.published.get(pool)
            if last is not None and not changed(last[0], decision) and now_ms - last[1] < self.heartbeat_ms:
                continue
            signal = {"event_id": str(uuid.uuid4()), "event_time": now_ms, **decision.signal}
            sent.append(await self.topic.send(key=pool.encode(), value=sign(signal, self.key_id, self.secret)))
            self.published[pool] = (decision, now_ms)
            label = metrics.pool_label(pool)
            metrics.SIGNALS_PUBLISHED.labels(label).inc()
            metrics.DECISION_LATENCY.labels(label).observe(max(0.0, (now_ms - picture["watermark_ms"]) / 1000))
            for state in STATES + ("stale",):
                metrics.ADMISSION_STATE.labels(label, state).set(1 if state == decision.state else 0)
            for cls in PRIORITIES:
                metrics.ADMIT_FRACTION.labels(label, cls).set(decision.signal["admit_fraction"][cls])
        if sent:
            await asyncio.gather(*sent)
        return len(sent)


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


def _number(value: float | None) -> float:
    return float("nan") if value is None else value


class Stage2:
    """Per-pool pictures from partials; the changelog table makes them survive restarts."""

    def __init__(self, settings: Settings, table: Any, load_topic: Any, admission: Admission) -> None:
        self.configs = PictureConfigs(settings)
        self.table = table
        self.load_topic = load_topic
        self.admission = admission
        self.states: dict[str, PoolState] = {}
        self.changed: set[str] = set()
        self.snapshots: dict[str, dict] = {}
        self.fleet: dict[str, dict] = {}  # every pool's newest picture, from sluice.load.v1 (for siblings)

    def merge(self, partial: Partial, raw: bytes) -> None:
        """Called inside stream iteration, so table writes go to the partial's own partition.
        ``raw`` is the partial as received: it is what the changelog keeps."""
        config = self.configs.for_pool(partial.pool)
        state = self.states.get(partial.pool)
        if state is None:
            state = self.states[partial.pool] = PoolState(partial.pool)
        if not state.merge(partial, config):
            metrics.PARTIALS_DUPLICATE.inc()
            return
        metrics.PARTIALS_MERGED.inc()
        pool_key = partial.pool.encode() + KEY_SEP
        self.table[pool_key + partial.id.encode()] = raw
        for evicted in state.evicted:
            self.table.pop(pool_key + evicted.encode(), None)
        self.changed.add(partial.pool)

    def rebuild(self) -> None:
        """States of the pools whose partitions this worker owns, from the (recovered) table."""
        partials: dict[str, list[Partial]] = {}
        for key, value in list(self.table.items()):
            pool = key.split(KEY_SEP, 1)[0].decode()
            partials.setdefault(pool, []).append(Partial.from_bytes(value))
        self.states = {}
        for pool, items in partials.items():
            state = self.states[pool] = PoolState(pool)
            config = self.configs.for_pool(pool)
            for partial in sorted(items, key=lambda p: p.newest_ms):
                state.merge(partial, config)
        self.changed = set(self.states)
        self.snapshots = {p: s for p, s in self.snapshots.items() if p in self.states}
        log.info("stage 2 rebuilt %d pool picture(s) from %d partial(s)", len(self.states),
                 sum(len(v) for v in partials.values()))

    async def publish(self) -> int:
        sent = []
        now = time.time()
        for pool in sorted(self.changed):
            snapshot = self.states[pool].snapshot(self.configs.for_pool(pool))
            snapshot["published_at_ms"] = int(now * 1000)
            self.snapshots[pool] = snapshot
            sent.append(await self.load_topic.send(key=pool.encode(), value=orjson.dumps(snapshot)))
            metrics.PICTURE_LAG.observe(max(0.0, now - snapshot["watermark_ms"] / 1000))
            export_picture(snapshot)
        self.changed.clear()
        if sent:
            await asyncio.gather(*sent)
        await self.admission.evaluate(self.snapshots, {**self.fleet, **self.snapshots}, int(now * 1000))
        return len(sent)

    async def follow_fleet(self, bootstrap: str, topic: str) -> None:
        """Keep every pool's newest picture, whichever worker computes it, for redirect decisions."""
        consumer, _ = await open_from_beginning(bootstrap, topic)
        try:
            while True:
                for messages in (await consumer.getmany(timeout_ms=500)).values():
                    for message in messages:
                        if message.value is not None:
                            self.fleet[message.key.decode()] = orjson.loads(message.value)
        finally:
            await consumer.stop()


def _bytes_topic(app: faust.App, settings: Settings, spec: topics.TopicSpec) -> Any:
    partitions, config = topics.topic_configs(settings)[spec.name(settings)]
    return app.topic(spec.name(settings), key_type=bytes, value_type=bytes, key_serializer="raw",
                     value_serializer="raw", partitions=partitions, config=config,
                     replicas=settings.topic_replication_factor)


def create_app(settings: Settings) -> faust.App:
    datadir = settings.state_dir / "faust" / settings.app_id
    datadir.parent.mkdir(parents=True, exist_ok=True)
    app = faust.App(
        settings.app_id,
        broker=f"kafka://{bootstrap_servers(settings)}",
        key_serializer="raw",
        value_serializer="raw",
        store="memory://",
        datadir=str(datadir),
        web_host=settings.web_host,
        web_bind=settings.web_host,
        web_port=settings.web_port,
        web_in_thread=False,
        topic_partitions=topics.PARTIALS.partitions(settings),
        topic_replication_factor=settings.topic_replication_factor,
        consumer_max_fetch_size=topics.raw_topic_max_bytes(settings),
        producer_max_request_size=topics.dead_letter_max_bytes(settings) + 65536,
        broker_commit_interval=1.0,
        consumer_auto_offset_reset="earliest",
        loghandlers=[],
    )
    dead_letters = _bytes_topic(app, settings, topics.DEADLETTER)
    partials = _bytes_topic(app, settings, topics.PARTIALS)
    load = _bytes_topic(app, settings, topics.LOAD)
    admission = _bytes_topic(app, settings, topics.ADMISSION)
    table = app.Table("pool_partials", partitions=topics.PARTIALS.partitions(settings), key_type=bytes,
                      value_type=bytes)
    stage1 = Stage1(settings, dead_letters, partials)
    stage2 = Stage2(settings, table, load, Admission(settings, admission))
    app.stage1, app.stage2 = stage1, stage2

    @app.agent(partials, name=f"{settings.app_id}.pictures")
    async def pictures(stream: Any) -> None:
        async for value in stream:
            stage2.merge(Partial.from_bytes(value), value)

    @app.timer(interval=settings.tick_s)
    async def tick() -> None:
        await stage1.publish_partials()
        await stage2.publish()

    @app.on_before_shutdown.connect
    async def close_store(sender: Any, **kwargs: Any) -> None:
        if stage1.store is not None:
            await asyncio.to_thread(stage1.store.close)

    @app.on_rebalance_complete.connect
    async def after_recovery(sender: Any, **kwargs: Any) -> None:
        stage2.rebuild()  # the table has just been recovered from its changelog

    @app.page("/healthz")
    async def healthz(web: Any, request: Any) -> Any:
        consuming = bool(stage1.consumer and stage1.consumer.assignment())
        store_ok = stage1.store_ok and not (stage1.sink and stage1.sink.held)
        ok = consuming and store_ok
        body = {"ok": ok, "consuming": consuming, "store": stage1.store.backend if stage1.store else None,
                "store_reachable": store_ok, "sink_held": bool(stage1.sink and stage1.sink.held)}
        return web.json(body, status=200 if ok else 503)

    metrics.attach_faust_sensors(app)

    @app.page("/metrics")
    async def prometheus(web: Any, request: Any) -> Any:
        return aio_web.Response(body=metrics.exposition(), content_type="text/plain", charset="utf-8")

    @app.page("/query")
    class Query(faust.web.View):
        """Read-only SQL against this worker's store (the embedded one is locked to this process)."""

        async def post(self, request: Any) -> Any:
            if settings.query_token:
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {settings.query_token}".encode()):
                    return self.json({"error": "missing or wrong bearer token"}, status=401)
            if stage1.store is None:
                return self.json({"error": "the store is not open yet"}, status=503)
            sql = (await request.read()).decode("utf-8", errors="replace")
            try:
                statement = checked(sql, settings.query_max_rows)
                rows = await asyncio.to_thread(stage1.store.read_only, statement)
            except (QueryRefused, StoreQueryError) as exc:
                return self.json({"error": str(exc)}, status=400)
            truncated = len(rows) > settings.query_max_rows
            return self.json({"rows": rows[: settings.query_max_rows], "truncated": truncated})

    @app.page("/pools")
    async def pools(web: Any, request: Any) -> Any:
        """Pictures of the pools whose partitions this worker owns (``sluice pools`` shows all)."""
        return web.json({"pools": [stage2.snapshots[p] for p in sorted(stage2.snapshots)]})

    @app.task
    async def stage1_loop() -> None:
        await stage1.consume(bootstrap_servers(settings))

    @app.timer(interval=5.0)
    async def store_health() -> None:
        await stage1.check_store()

    @app.task
    async def fleet_pictures() -> None:
        await stage2.follow_fleet(bootstrap_servers(settings), topics.LOAD.name(settings))

    return app


_default_app: faust.App | None = None


def __getattr__(name: str) -> Any:
    """``pipeline.agents.app`` (what ``faust -A pipeline.agents`` loads), built on first use
    so that importing this module needs no broker."""
    global _default_app
    if name != "app":
        raise AttributeError(name)
    if _default_app is None:
        _default_app = create_app(load_settings())
    return _default_app
