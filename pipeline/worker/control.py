"""Stage 1 of the control path: raw events → validation → per-pool partials, never waiting for a store.

Consumer group ``<app_id>-control`` reads the raw topics; every accepted
event is folded at once into its source partition's ``PartialBuilder``, bad
records go to the dead-letter topic, and every ``cut_interval_s`` the builders are cut into
per-pool partials on ``sluice.partials.v1``.

**Each event is counted once in the picture, across crashes and
rebalances**, without transactions, by a write-ahead cut: before a cut
publishes the partials of offsets ``[start, end]`` of a partition it commits
offset ``start`` with metadata ``cut:<end>``. A partial's id is
``<topic>/<partition>/<start>-<end>``. If the worker dies after publishing,
the next owner reads the committed ``(start, cut:end)``, folds exactly
``[start, end]`` again and publishes it under the same id, which stage 2
drops as a duplicate (or merges, if the first one never got out). The next
cut's commit of ``end + 1`` confirms the cut. A pool's partial too large for
one message (a sparse backlog: one entry per event-second) goes out in parts
under ``topics.partial_budget_bytes()``, ``<id>``, ``<id>#1``, …, split by its
content alone, so the repeat yields the same parts under the same ids.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .. import metrics, topics
from ..events import Event, ReplicaSample, RequestEvent
from ..ingest import Record, RecentIdGenerations, TimeBounds, by_partition, decode_records
from ..load.partial import PartialBuilder
from ..settings import Settings
from .consumer import BatchLoop, commit, committed_with_metadata
from .stall_watch import PRODUCER_WAITS, StallWatch, send_all

log = logging.getLogger(__name__)
Where = tuple[str, int]
CUT_PREFIX = "cut:"


class ControlConsumer(BatchLoop):
    lag_gauge = metrics.CONSUMER_LAG

    def __init__(self, settings: Settings, dead_letter_topic: Any, partials_topic: Any) -> None:
        super().__init__(settings)
        self.dead_letter_topic = dead_letter_topic
        self.bounds = TimeBounds.of(settings)
        self.partials_topic = partials_topic
        self.builders: dict[Where, PartialBuilder] = {}
        self.recent_ids: dict[Where, RecentIdGenerations] = {}
        self.cut_start: dict[Where, int] = {}   # first offset not yet in a published partial
        self.folded_to: dict[Where, int] = {}   # last offset folded
        self.replays: dict[Where, int] = {}     # a cut to repeat exactly, after assignment: its end
        self.unconfirmed: set[Where] = set()    # published cuts whose end the group has not committed
        self.owned: set[Where] = set()          # partitions assigned to this worker now
        # each cut's waits, by phase (lock, commit, send): a cut that never ends keeps its partitions' events out
        # of the pictures while the path still consumes, so /healthz names one older than producer_stall_s
        # (http.health). Its ``spoiled`` is never read: the sends are the producer's, watched by PRODUCER_WAITS
        self.cut_waits = StallWatch()
        # what a fold holding the lock waits on at the broker (its dead letters): with the cut's own commit and
        # send, every broker wait a holder makes is timed, so a cut queued behind a holder in none is wedged
        self.holder_waits = StallWatch()
        self._lock = asyncio.Lock()

    def _builder(self, where: Where) -> PartialBuilder:
        builder = self.builders.get(where)
        if builder is None:
            builder = self.builders[where] = PartialBuilder(f"{where[0]}/{where[1]}",
                                                            self.settings.replica_stale_after_s)
        return builder

    async def handle(self, cls: type[Event], records: list[Record]) -> None:
        """Validate, dead-letter and fold one fetched batch of one topic.

        Under the same lock as a cut: a fold that slipped in while a cut awaits its commit would put
        events past the cut's end into its partial, and a successor repeating that cut would fold them
        again; a revoke that slipped into a fold would leave a builder for a partition no longer ours.
        """
        started = time.perf_counter()
        async with self._lock:
            for partition, recs in by_partition(records).items():
                where = (recs[0].topic, partition)
                if self.consumer is not None and where not in self.owned:
                    continue  # revoked while this batch waited for the lock: its next owner reads it
                end = self.replays.get(where)
                if end is not None and recs[-1].offset >= end:
                    # the repeated cut is complete: fold it, publish it under its old id, then go on
                    await self._fold(cls, where, [r for r in recs if r.offset <= end])
                    del self.replays[where]
                    await self._cut([where])
                    recs = [r for r in recs if r.offset > end]
                if recs:
                    await self._fold(cls, where, recs)
        metrics.INGEST_BATCH_SECONDS.labels(records[0].topic).observe(time.perf_counter() - started)

    async def _fold(self, cls: type[Event], where: Where, records: list[Record]) -> None:
        s = self.settings
        if not records:
            return
        seen = self.recent_ids.get(where)
        if seen is None and s.dedup_recent_ids:
            seen = self.recent_ids[where] = RecentIdGenerations(s.dedup_recent_ids)
        now_ms = int(time.time() * 1000)
        decoded = decode_records(cls, records, s.max_event_bytes, now_ms, seen, self.bounds)
        if decoded.dead_letters:
            with self.holder_waits.waiting("dead letters"):
                await send_all("dead letters", ((self.dead_letter_topic, key, letter)
                                                for _, key, letter in decoded.dead_letters))
        self.cut_start.setdefault(where, records[0].offset)
        self.folded_to[where] = records[-1].offset
        builder = self._builder(where)
        topic = where[0]
        metrics.CONTROL_EVENTS.labels(topic, "folded").inc(len(decoded.events))
        metrics.CONTROL_EVENTS.labels(topic, "dead_lettered").inc(len(decoded.dead_letters))
        metrics.CONTROL_EVENTS.labels(topic, "duplicate").inc(decoded.duplicates)
        if decoded.newest_event_ms:
            metrics.NEWEST_EVENT_TIME.labels(topic).set(decoded.newest_event_ms / 1000)
        ahead = 0   # events stamped ahead of this clock, folded as of it (PartialBuilder.fold_request)
        if cls is ReplicaSample:
            for event in decoded.events:
                ahead += builder.fold_sample(event, now_ms)
            metrics.CONTROL_EVENTS_AHEAD.labels(topic).inc(ahead)
            return
        completed: dict[str, list[int]] = {}
        for event in decoded.events:
            ahead += builder.fold_request(event, now_ms)
            if event.phase == "completed":
                counts = completed.setdefault(event.pool, [0, 0])
                counts[0] += 1
                if event.ttft_s is not None and event.slo_ttft_s is not None and event.ttft_s > event.slo_ttft_s:
                    counts[1] += 1
        metrics.CONTROL_EVENTS_AHEAD.labels(topic).inc(ahead)
        for pool, (done, missed) in completed.items():
            label = metrics.pool_label(pool)
            metrics.REQUESTS_COMPLETED.labels(label).inc(done)
            metrics.TTFT_SLO_MISSES.labels(label).inc(missed)

    def wedged(self, stall_s: float, producer_waits: StallWatch = PRODUCER_WAITS) -> float | None:
        """How long a cut has queued on the lock, when over ``stall_s`` while the lock's holder waits on
        nothing at the broker — no commit or send of a cut, no fold's dead letters (None: not wedged). Every
        broker wait a holder makes is one of those, so this is the path stuck inside the worker, which only a
        restart cures; a holder sending one batch of dead letters after another to a slow broker is never read
        as it. Two guards, since reading a broker outage as wedged would end every worker at once: a lock just
        handed to the queued cut (not yet run) is not held, and no wait on the producer may be half as old as
        the bound (the broker is away: a restart would meet it)."""
        if (not self._lock.locked() or self.cut_waits.kinds() != {"lock"} or self.holder_waits.kinds()
                or producer_waits.stuck(stall_s / 2)):
            return None
        return self.cut_waits.stuck(stall_s).get("lock")

    async def publish_partials(self, only: list[Where] | None = None) -> int:
        """Cut the builders (write-ahead commit first, see the module doc) and publish their partials."""
        with self.cut_waits.waiting("lock"):
            await self._lock.acquire()
        try:
            return await self._cut(only)
        finally:
            self._lock.release()

    async def _cut(self, only: list[Where] | None = None) -> int:
        """Under the lock: the cut, its write-ahead commit, then its partials."""
        from aiokafka import TopicPartition
        from aiokafka.structs import OffsetAndMetadata

        consumer = self.consumer
        if self.ended:
            # a cut queued ahead of on_stop: with no consumer it cannot commit first, and what it would
            # publish is read again by the partitions' next owner
            return 0
        cuts: dict[Where, tuple[int, int]] = {}
        for where in list(self.builders):
            if (only is not None and where not in only) or where in self.replays:
                continue
            start, end = self.cut_start.get(where), self.folded_to.get(where)
            if start is not None and end is not None and end >= start:
                cuts[where] = (start, end)
        confirm = {w: self.cut_start[w] for w in self.unconfirmed
                   if w not in cuts and (only is None or w in only) and w in self.cut_start}
        offsets = {TopicPartition(*w): OffsetAndMetadata(start, f"{CUT_PREFIX}{end}")
                   for w, (start, end) in cuts.items()}
        offsets.update({TopicPartition(*w): OffsetAndMetadata(start, "") for w, start in confirm.items()})
        if not offsets:
            return 0
        with self.cut_waits.waiting("commit"):
            committed = consumer is None or await commit(consumer, offsets)
        if not committed:
            # not ours any more, or the broker is busy: the next cut (or the next owner) covers it
            assigned = {(tp.topic, tp.partition) for tp in consumer.assignment()}
            for where in [w for w in cuts if w not in assigned]:
                self.forget(*where)
            return 0
        self.unconfirmed -= set(confirm)
        drained = []
        for where, (start, end) in cuts.items():
            drained += self.builders[where].drain(f"{start}-{end}", topics.partial_budget_bytes())
            self.cut_start[where] = end + 1
            self.unconfirmed.add(where)
        with self.cut_waits.waiting("send"):
            sent = await send_all("partials", ((self.partials_topic, p.pool.encode(), p.to_bytes()) for p in drained))
        metrics.PARTIALS_PUBLISHED.inc(sent)
        return sent

    async def assigned(self, consumer: Any, tp: Any) -> None:
        """Start a partition where the group left it, repeating a cut that may have been published."""
        where = (tp.topic, tp.partition)
        offset, meta = await committed_with_metadata(consumer, tp)
        self.forget(*where)
        self.owned.add(where)
        if offset is None:
            return
        self.cut_start[where] = offset
        if meta.startswith(CUT_PREFIX):
            end = int(meta[len(CUT_PREFIX):])
            if end >= offset:
                self.replays[where] = end
                log.info("control path repeats cut %s/%d %d-%d", tp.topic, tp.partition, offset, end)
        consumer.seek(tp, offset)

    def forget(self, topic: str, partition: int) -> None:
        where = (topic, partition)
        for state in (self.builders, self.recent_ids, self.cut_start, self.folded_to, self.replays):
            state.pop(where, None)
        self.unconfirmed.discard(where)
        self.owned.discard(where)

    async def on_stop(self) -> None:
        """The loop ended (a crash, or shutdown): nothing folded may go out now, since with no consumer a
        cut could not commit first and whoever reads these partitions next would count it again."""
        async with self._lock:
            for where in {*self.builders, *self.cut_start, *self.owned, *self.replays}:
                self.forget(*where)

    def group(self) -> str:
        return topics.control_group(self.settings)

    def classes(self) -> dict[str, type]:
        s = self.settings
        return {topics.REQUESTS.name(s): RequestEvent, topics.REPLICAS.name(s): ReplicaSample}

    async def on_fetched(self, by_topic: dict[str, list[Record]]) -> None:
        """Fold at once; partials go out every cut interval (``publish_partials``), not per fetch."""
        classes = self.classes()
        for topic, records in by_topic.items():
            await self.handle(classes[topic], records)

    async def on_assigned(self, tp: Any) -> None:
        await self.assigned(self.consumer, tp)

    async def on_revoked(self, revoked: list[Where]) -> None:
        async with self._lock:
            await self._cut(revoked)
            for where in revoked:
                self.forget(*where)
