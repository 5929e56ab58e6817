"""The landing sink: records in (``add``), exactly-once blocks out (``flush``).

It owns everything between a fetched batch and a durable row: the cursor
that re-cuts a replayed block on its old boundaries, the recent event ids
that drop producer retries, the open block of each source partition (rows
gather until ``sink_block_rows``, ``sink_block_bytes`` or ``sink_block_age_s``: ClickHouse wants
thousands of rows a second per insert, not one insert per fetch), landing in
offset order, hold-and-retry while the store is unavailable (``ClickHouseSink``),
the split that lands a refused block in halves, dead-lettering the rows the store refuses,
and the rollup of what landed into ``pool_minute`` (``rollup``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Iterable

from .. import metrics
from ..events import AdmissionSignal
from ..ingest import Record, RecentIds, TimeBounds, by_partition
from ..settings import Settings
from . import positions, rollup
from .blocks import (DEAD_LETTER_TABLE, STORE_REJECTED, TABLE_OF, BlockOutcome, PartitionCursor, cut_blocks,
                     refused_by_store)
from .clickhouse import ClickHouseSink
from .store import Store, StoreRejected, StoreUnavailable

log = logging.getLogger(__name__)
Where = tuple[str, int]  # (topic, partition)
ROW_BY_ROW_ROWS = 8   # a refused piece this small lands row by row: halving it further costs more inserts
SendDeadLetter = Callable[[bytes, bytes], Awaitable[None]]


class BlockSink:
    def __init__(self, settings: Settings, store: Store, send_dead_letter: SendDeadLetter,
                 sink: ClickHouseSink | None = None, rollup_sink: ClickHouseSink | None = None) -> None:
        self.settings = settings
        self.store = store
        self.sink = sink or ClickHouseSink(store)
        # the rollup's own client (``ClickHouseStore.second_writer``), so its statements run beside the inserts
        # and its holds are not landing's; the landing client when none is given
        self.rollup_sink = rollup_sink or self.sink
        self.rollup_store = rollup_sink.store if rollup_sink else store
        self.send_dead_letter = send_dead_letter
        self.bounds = TimeBounds.of(settings)
        self.cursors: dict[Where, PartitionCursor] = {}
        self.recent_ids: dict[Where, RecentIds] = {}
        self.open_blocks: dict[Where, BlockOutcome] = {}
        self._due: list[BlockOutcome] = []
        self._landing: asyncio.Task | None = None
        self.landed_through: dict[Where, int] = {}   # request partitions: every offset up to here is in the store
        self.rolled: dict[Where, int] = {}           # ... and up to here in a rollup (-1: none)
        self.rollups: list[tuple[list[rollup.Range], str]] = []   # recorded or about to be: run as they are
        self._rolled_at = time.monotonic()
        self._rollup_failures = 0
        self._rolling = asyncio.Lock()   # one rollup at a time: two over the same offsets would both count
        self._roller: asyncio.Task | None = None   # the rollup running beside landing, if any

    @property
    def held(self) -> bool:
        return self.sink.held

    def stop_holding(self) -> None:
        """The worker is stopping: store calls give up instead of holding."""
        self.sink.closing = self.rollup_sink.closing = True

    def add(self, cls: type, records: list[Record], now_ms: int) -> list[BlockOutcome]:
        """Cut, decode and gather one fetched batch of one topic; the blocks it made (for accounting)."""
        s = self.settings
        made = []
        for partition, recs in by_partition(records).items():
            where = (recs[0].topic, partition)
            cursor = self.cursors.setdefault(where, PartitionCursor())
            seen = self.recent_ids.setdefault(where, RecentIds(s.dedup_recent_ids)) if s.dedup_recent_ids else None
            skipped = cursor.skipped
            made += cut_blocks(cls, recs, cursor, s.max_event_bytes, now_ms, seen, self.bounds)
            if cursor.skipped > skipped:
                metrics.EVENTS_ALREADY_LANDED.labels(where[0]).inc(cursor.skipped - skipped)
        self._gather(made)
        return made

    def _gather(self, blocks: list[BlockOutcome]) -> None:
        now = time.monotonic()
        for block in blocks:
            where = (block.topic, block.partition)
            block.opened_at = now
            open_block = self.open_blocks.get(where)
            if open_block is not None and block.follows(open_block):
                open_block.absorb(block)
            else:
                if open_block is not None:
                    self._due.append(self.open_blocks.pop(where))
                if block.sealed:
                    self._due.append(block)
                    continue
                self.open_blocks[where] = open_block = block
            if open_block.size >= self.settings.sink_block_rows or \
                    open_block.source_bytes >= self.settings.sink_block_bytes:
                self._due.append(self.open_blocks.pop(where))

    def flush(self, partitions: Iterable[Where] | None = None) -> asyncio.Task:
        """Land what is due — full blocks, aged ones, and every open block of ``partitions`` — after
        every earlier landing; the task resolves to each landed partition's next offset to commit."""
        now = time.monotonic()
        wanted = set(partitions) if partitions is not None else None
        for where, block in list(self.open_blocks.items()):
            if (wanted is not None and where in wanted) or now - block.opened_at >= self.settings.sink_block_age_s:
                self._due.append(self.open_blocks.pop(where))
        blocks, self._due = self._due, []
        previous = self._landing

        async def land() -> dict[Where, int]:
            if previous is not None and not previous.done():
                await asyncio.wait([previous])
            for block in blocks:
                await self._land_block(block)
                if block.table == rollup.SOURCE_TABLE:   # landed in offset order: all before it is in the store
                    where = (block.topic, block.partition)
                    self.landed_through[where] = max(self.landed_through.get(where, -1), block.next_offset - 1)
            if partitions is not None:   # a revocation hands its partitions over rolled up
                await self.roll_up(force=True)
            else:
                self._roll_up_beside()
            return {(b.topic, b.partition): b.next_offset for b in blocks}

        self._landing = task = asyncio.ensure_future(land())
        return task

    async def _land_block(self, block: BlockOutcome) -> None:
        started = time.perf_counter()
        await self._land_dead_letters(block.landed_dead_letters(), block.token(DEAD_LETTER_TABLE))
        if block.redecided_rows and not block.rows_held:   # held: each of its records is a row or a letter already
            await self._land_dead_letters(block.landed_redecided(), f"{block.token(DEAD_LETTER_TABLE)}#redecided")
        rows, token = block.landed_rows(), block.token(block.table)
        try:
            await self.sink.land(block.table, rows, token)
        except StoreRejected as exc:
            await self._land_in_halves(block, rows, token, exc)
        metrics.SINK_BATCH_SECONDS.labels(block.table).observe(time.perf_counter() - started)
        if block.oldest_event_ms:
            metrics.LANDING_LAG_SECONDS.labels(block.table).observe(max(0.0, time.time() - block.oldest_event_ms / 1000))
        if block.table != TABLE_OF[AdmissionSignal]:  # signals are our own output, counted as sink rows
            metrics.EVENTS_ACCEPTED.labels(block.topic).inc(len(block.rows))
        metrics.count_dead_letters(block.topic, block.reasons)
        if block.duplicates:
            metrics.EVENTS_DUPLICATE.labels(block.topic).inc(block.duplicates)

    def _rollup_wait(self) -> float:
        return self.settings.sink_rollup_interval_s * 2 ** min(self._rollup_failures, 6)

    def _roll_up_beside(self) -> None:
        """Start the rollup that is due, as a task of its own: landing never waits for ``pool_minute`` (a
        slow or refusing rollup held each landing behind it, and the offsets' commits with it)."""
        if self.rollup_sink.closing:   # stopping: the closing rollup is the last
            return
        if (self._roller is None or self._roller.done()) and time.monotonic() - self._rolled_at >= self._rollup_wait():
            self._roller = asyncio.ensure_future(self.roll_up(force=False))
            self._roller.add_done_callback(self._report_rollup)

    def _report_rollup(self, task: asyncio.Task) -> None:
        """A rollup run beside landing ends in an error nothing awaits: logged, counted and backed off like a
        refusal, its rollup left queued to run again as it was (``roll_up`` handles the store's refusals
        itself; this is for the rest). One cut short by the worker stopping is no failure."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        if self.rollup_sink.closing and isinstance(exc, StoreUnavailable):
            log.warning("a rollup into pool_minute was cut short by the stop: %s", exc)
            return
        self._rollup_failed("a rollup into pool_minute failed", exc)

    def _rollup_failed(self, what: str, exc: BaseException) -> None:
        """Logged and counted; the next rollup waits twice as long (``_rollup_wait``)."""
        self._rollup_failures += 1
        log.error("%s (%d in a row): %s", what, self._rollup_failures, exc,
                  exc_info=None if isinstance(exc, StoreRejected) else exc)
        metrics.ROLLUPS.labels("failed").inc()

    async def rolled_up(self) -> None:
        """Wait for the rollup running beside landing, if one is."""
        if self._roller is not None:
            await asyncio.wait([self._roller])

    async def roll_up(self, force: bool) -> None:
        """Roll what landed since the last rollup up into ``pool_minute``, every ``sink_rollup_interval_s``
        (at once with ``force``: a revocation hands the partitions over rolled up, a stop leaves nothing
        behind). A rollup the store keeps refusing is logged and counted, and tried again as it was after
        twice the wait each time (up to 64 intervals); landing goes on meanwhile."""
        async with self._rolling:
            if force or time.monotonic() - self._rolled_at >= self._rollup_wait():
                self._rolled_at = time.monotonic()
                try:
                    await self._roll_up()
                except StoreRejected as exc:
                    self._rollup_failed("store refused a rollup into pool_minute", exc)
                except rollup.Fenced as exc:   # planned again from the store's record at the next rollup
                    log.warning("a rollup into pool_minute was fenced off: %s", exc)
                    metrics.ROLLUPS.labels("fenced").inc()

    async def _roll_up(self) -> None:
        """Rollups left from before (run as they were), then one of what landed since."""
        fresh = False
        while not fresh:
            if not self.rollups:
                fresh = await self._plan()
            await self._run_queued()

    async def _run_queued(self) -> None:
        while self.rollups:
            queued = self.rollups[0]
            ranges, dedup_token = queued
            try:   # refused or cut short: left queued, to run again as it is
                await self._call(rollup.roll_up, ranges, dedup_token)
            except rollup.Fenced:
                self._unqueue(queued)
                raise
            self._unqueue(queued)
            self._rollup_failures = 0
            metrics.ROLLUPS.labels("ok").inc()
            for topic, partition, _, last in ranges:
                if (topic, partition) in self.landed_through:
                    self.rolled[(topic, partition)] = max(self.rolled.get((topic, partition), -1), last)

    def _unqueue(self, queued: tuple[list[rollup.Range], str]) -> None:
        """By identity: a revocation may have dropped rollups from the queue meanwhile (``forget``)."""
        self.rollups = [r for r in self.rollups if r is not queued]

    async def _call(self, fn, *args):
        """One of the rollup's store calls, through its own client."""
        return await self.rollup_sink.call("rollup", fn, self.rollup_store, *args, rows_at_fault=True)

    async def _plan(self) -> bool:
        """The next rollup: first any rollup of these partitions found recorded and not landed (a crash, a
        cancellation, or a refusal by their last owner), as it was (False); else what landed since each
        partition's last rollup (True). The store's record is read every time, so an owner that got further
        (a worker that lost a partition without knowing it yet is behind it) fences this one off."""
        wheres = sorted(self.landed_through)
        stored = await self._call(rollup.last_rollups, wheres)
        for where in wheres:
            last = stored.get(where)
            if last is None:
                if where not in self.rolled:   # nothing rolled up: from the first offset the store holds
                    first = await self._call(rollup.first_landed, *where)
                    self.rolled[where] = -1 if first is None else first - 1
                continue
            if not last.landed:
                ranges = await self._call(rollup.recorded, last.token)
                if ranges:
                    self.rollups.append((ranges, last.token))
            self.rolled[where] = max(self.rolled.get(where, -1), last.last_offset)
        if self.rollups:
            return False
        ranges = rollup.plan(self.rolled, self.landed_through)
        if ranges:
            self.rollups.append((ranges, rollup.token(ranges)))
        return True

    async def _land_dead_letters(self, rows: list[bytes], token: str) -> None:
        """Dead-letter rows; one the store refuses (it should not: they are built to land) is counted and
        left on the dead-letter topic, where its original bytes already are."""
        try:
            await self.sink.land(DEAD_LETTER_TABLE, rows, token)
        except StoreRejected:
            for i, row_bytes in enumerate(rows):
                try:
                    await self.sink.land(DEAD_LETTER_TABLE, [row_bytes], f"{token}#{i}")
                except StoreRejected as exc:
                    log.error("store refused a dead-letter row of %s: %s", token, exc)
                    metrics.DEAD_LETTERS_UNLANDABLE.inc()

    async def _land_in_halves(self, block: BlockOutcome, rows: list[bytes], token: str,
                              refused: StoreRejected) -> None:
        """The store refused a block for its data: land it in halves, the refused halves in halves again,
        and a refused piece of at most ``ROW_BY_ROW_ROWS`` rows row by row; a refused row is dead-lettered.

        One bad row among n costs about 2·log2(n) inserts where landing row by row cost n (a 5,000-row
        block held every partition's landing for 79 s on chdb), a block refused for its spread (more
        partitions than one insert may touch) lands in a few pieces, and a block of bad rows costs about
        1.25 n, not the 2 n halving alone would. Each piece's token extends the block's with its first and
        last source offsets (a row's, with its own): a replay after a crash halves the block as before
        and drops whatever landed already, as long as the store refuses the same rows again.
        """
        log.warning("store refused block %s (%s); landing it in halves", token, refused)
        offsets = [source.offset for source in block.sources]
        refused_rows: dict[int, str] = {}
        pieces = [(0, len(rows), refused)]   # a stack: the first piece is landed first
        while pieces:
            lo, hi, exc = pieces.pop()
            if exc is None:
                piece = f"{offsets[lo]}" if hi - lo == 1 else f"{offsets[lo]}-{offsets[hi - 1]}"
                try:
                    await self.sink.land(block.table, rows[lo:hi], f"{token}#{piece}")
                    continue
                except StoreRejected as now_refused:
                    exc = now_refused
            if hi - lo == 1:
                refused_rows[lo] = str(exc)
            elif hi - lo <= ROW_BY_ROW_ROWS:
                pieces += [(i, i + 1, None) for i in reversed(range(lo, hi))]
            else:
                mid = (lo + hi) // 2
                pieces += [(mid, hi, None), (lo, mid, None)]
        if refused_rows:
            now_ms = int(time.time() * 1000)
            letters = [refused_by_store(block, i, detail, now_ms) for i, detail in refused_rows.items()]
            for key, letter, _ in letters:
                await self.send_dead_letter(key, letter)
            await self._land_dead_letters([row for _, _, row in letters], f"{DEAD_LETTER_TABLE}:{token}#refused")
            metrics.count_dead_letters(block.topic, {STORE_REJECTED: len(letters)})
        block.rows = [r for i, r in enumerate(block.rows) if i not in refused_rows]

    async def resume(self, cls: type, topic: str, partition: int, committed: int) -> None:
        """Prepare a newly assigned partition, read from ``committed`` on: the offsets the store holds
        already are skipped (a worker dies between an insert and its commit; a committed offset can be
        older than the log), and the partition's recent event ids are reloaded so re-sent events stay
        dropped."""
        s = self.settings
        table = TABLE_OF[cls]
        where = (topic, partition)
        last = await self.sink.call("resume", positions.last_block, self.store, table, topic, partition, committed)
        landed = await self.sink.call("resume", positions.landed_ranges, self.store, table, topic, partition,
                                      committed)
        others = await self.sink.call("resume", positions.landed_ranges, self.store, table, topic, partition,
                                      last[0], last[0]) if last else []
        if s.dedup_recent_ids:  # the ids before the replayed block: its own rows must decode as they did
            ids = await self.sink.call("resume", positions.recent_ids, self.store, table, topic, partition,
                                       s.dedup_recent_ids, last[0] if last else None)
            self.recent_ids[where] = RecentIds(s.dedup_recent_ids, ids)
        verdicts, refused, rows_held = await self.sink.call(
            "resume", positions.replay_verdicts, self.store, table, topic, partition, last) if last else ({}, {}, False)
        self.cursors[where] = PartitionCursor(landed, last, others, verdicts, refused, rows_held)
        if table == rollup.SOURCE_TABLE:   # what is in the store already; its rollups go on from the store's record
            self.rolled.pop(where, None)
            through = committed - 1
            if landed and landed[0][0] <= committed:
                through = max(through, landed[0][1])
            self.landed_through[where] = through
        if landed:
            log.info("landing resumes %s/%d at %d; the store holds %d offset run(s) after it, up to %d",
                     topic, partition, committed, len(landed), landed[-1][1])

    def forget(self, topic: str, partition: int) -> None:
        """A revoked partition's state goes; its next owner rebuilds it from the store."""
        where = (topic, partition)
        for state in (self.cursors, self.recent_ids, self.open_blocks, self.landed_through, self.rolled):
            state.pop(where, None)
        # a queued rollup over it: recorded, its next owner runs it (and this worker's next plan finds it
        # again for its other partitions); not yet recorded, nothing of it landed
        self.rollups = [queued for queued in self.rollups if all((r[0], r[1]) != where for r in queued[0])]
        self._due = [b for b in self._due if (b.topic, b.partition) != where]
