"""Faust glue without a broker: both paths' batch handling with in-memory collaborators, and the
stage-2 ``pictures`` agent in Faust's ``test_context()``."""

import asyncio

import orjson
import pytest

from pipeline.agents import create_app
from pipeline.events import ReplicaSample, RequestEvent
from pipeline.ingest import Record
from pipeline.load.partial import Partial, PartialBuilder
from pipeline.settings import Settings, load_settings
from pipeline.sim.specimens import bad_inputs, replica_sample, request_event
from pipeline.sinks.block_sink import BlockSink
from pipeline.sinks.store import StoreRejected


class MemorySink:
    """Stands in for the retrying ClickHouseSink under the BlockSink."""

    def __init__(self):
        self.rows: dict[str, list[bytes]] = {}
        self.held = False
        self.closing = False

    async def land(self, table, rows, dedup_token):
        self.rows.setdefault(table, []).extend(rows)

    async def call(self, label, fn, *args, rows_at_fault=False):
        """The store's other calls: the rollups into pool_minute (none recorded, so none found)."""
        self.rows.setdefault(label, []).append(fn.__name__.encode())
        return {} if fn.__name__ == "last_rollups" else None


class PickySink(MemorySink):
    """Refuses as data (``StoreRejected``) every request-event insert holding a row ``refuses`` picks, and
    records each request-event insert as (token, rows)."""

    def __init__(self, refuses=lambda row: b'"tenant":"poison"' in row):
        super().__init__()
        self.refuses = refuses
        self.inserts: list[tuple[str, int]] = []

    async def land(self, table, rows, dedup_token):
        if table == "request_events":
            self.inserts.append((dedup_token, len(rows)))
            if any(self.refuses(r) for r in rows):
                raise StoreRejected("Code: 27. CANNOT_PARSE_INPUT_ASSERTION_FAILED")
        await super().land(table, rows, dedup_token)


class MemoryTopic:
    def __init__(self):
        self.sent: list[tuple[bytes, bytes]] = []

    async def send(self, key, value):
        self.sent.append((key, value))
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


def use_sink(app, sink):
    """The landing path's BlockSink over ``sink`` (in place of ClickHouse)."""
    landing = app.landing
    landing.sink = BlockSink(landing.settings, None, landing._send_dead_letter, sink=sink)
    return sink


@pytest.fixture
def app(tmp_path):
    settings = load_settings(env={}, kafka_bootstrap_servers="127.0.0.1:9", state_dir=str(tmp_path),
                             app_id="sluice-agent-test", sink_block_age_s=0, dev_signing_key=True,
                             max_event_age_s=0)  # specimens carry 2023 event times  # land every batch at once
    app = create_app(settings)
    app.finalize()
    app.conf.store = "memory://"
    app.flow_control.resume()
    app.landing.dead_letter_topic = MemoryTopic()
    use_sink(app, MemorySink())
    app.control.dead_letter_topic = MemoryTopic()
    app.control.partials_topic = MemoryTopic()
    app.stage2.load_topic = MemoryTopic()
    app.stage2.admission_topic = MemoryTopic()
    return app


def records(topic, items):
    return [Record(topic, 0, offset, None, key, value) for offset, (key, value) in enumerate(items)]


def test_control_path_dead_letters_bad_and_folds_partials_and_landing_lands_good(app):
    good = [request_event(task_id=f"task-{i}", request_id=f"task-{i}-r1") for i in range(5)]
    bad = bad_inputs(app.control.settings.max_event_bytes)
    batch = records("raw", [(e["task_id"].encode(), orjson.dumps(e)) for e in good] + [(k, v) for _, v, k in bad])

    async def scenario():
        await app.control.handle(RequestEvent, batch)
        published = await app.control.publish_partials()
        await app.landing.handle(RequestEvent, batch)
        return published

    assert asyncio.run(scenario()) == 1
    sink = app.landing.sink.sink
    assert [orjson.loads(r)["event_id"] for r in sink.rows["request_events"]] == [e["event_id"] for e in good]
    assert [orjson.loads(r)["reason"] for r in sink.rows["dead_letters"]] == [r for r, _, _ in bad]
    assert [orjson.loads(v)["reason"] for _, v in app.control.dead_letter_topic.sent] == [r for r, _, _ in bad]
    assert app.landing.dead_letter_topic.sent == [], "each bad record reaches the dead-letter topic once"
    (key, value), = app.control.partials_topic.sent
    partial = orjson.loads(value)
    assert key == b"llama-70b-a" and partial["id"] == f"raw/0/0-{len(batch) - 1}"
    assert sum(b.get("completed", 0) for b in partial["requests"].values()) == 5


def test_samples_land_in_their_table(app):
    sample = replica_sample()

    async def scenario():
        await (await app.landing.handle(ReplicaSample, records("raw", [(b"r1", orjson.dumps(sample))])))

    asyncio.run(scenario())
    rows = app.landing.sink.sink.rows["replica_samples"]
    assert [orjson.loads(r)["event_id"] for r in rows] == [sample["event_id"]]


class StuckSink(MemorySink):
    """A store that never answers: every insert hangs."""

    held = True

    async def land(self, table, rows, dedup_token):
        await asyncio.Event().wait()


def test_a_stuck_store_never_delays_the_control_path(app):
    use_sink(app, StuckSink())
    events = [request_event(task_id=f"task-{i}", request_id=f"task-{i}-r1", event_time=1_700_000_000_000 + i)
              for i in range(20)]

    async def scenario():
        landing = await app.landing.handle(RequestEvent, records("raw", [(e["task_id"].encode(), orjson.dumps(e)) for e in events]))
        for i in range(0, 20, 5):  # the control path reads the same records in its own group
            batch = [Record("raw", 0, i + j, None, events[i + j]["task_id"].encode(), orjson.dumps(events[i + j]))
                     for j in range(5)]
            await asyncio.wait_for(app.control.handle(RequestEvent, batch), 1)
            await asyncio.wait_for(app.control.publish_partials(), 1)
            await asyncio.wait_for(app.stage2.publish(), 1)
        done = landing.done()
        landing.cancel()
        return done

    pictures = next(a for a in app.agents.values() if a.name.endswith("pictures"))

    async def with_agent():
        async with pictures.test_context() as agent:
            result = await scenario()
            for _, value in app.control.partials_topic.sent:
                await agent.put(value, key=b"llama-70b-a")
            await app.stage2.publish()
            return result

    assert asyncio.run(with_agent()) is False, "the landing is still stuck"
    assert len(app.control.partials_topic.sent) == 4
    assert app.stage2.admission_topic.sent, "signals go out while the store hangs"


class RecordingConsumer:
    """Commits and seeks of the control path, in order with the partials it publishes."""

    def __init__(self, log, committed=None):
        self.log = log
        self.committed = committed or {}
        self._coordinator = self

    async def commit(self, offsets):
        self.log.append(("commit", {(tp.topic, tp.partition): (o.offset, o.metadata) for tp, o in offsets.items()}))
        self.committed.update({(tp.topic, tp.partition): o for tp, o in offsets.items()})

    async def fetch_committed_offsets(self, tps):
        return {tp: self.committed[(tp.topic, tp.partition)] for tp in tps if (tp.topic, tp.partition) in self.committed}

    def seek(self, tp, offset):
        self.log.append(("seek", offset))


class LoggingTopic(MemoryTopic):
    def __init__(self, log):
        super().__init__()
        self.log = log

    async def send(self, key, value):
        self.log.append(("partial", orjson.loads(value)["id"]))
        return await super().send(key, value)


def recorded_control(app, n):
    """The app's control path over a recording consumer and partials topic, raw/0 owned, and ``n`` request
    records at offsets 100 on; returns (control, records, log)."""
    events = [request_event(task_id=f"t{i}", request_id=f"t{i}-r1", event_time=1_700_000_000_000 + i)
              for i in range(n)]
    recs = [Record("raw", 0, 100 + i, None, e["task_id"].encode(), orjson.dumps(e)) for i, e in enumerate(events)]
    log = []
    control = app.control
    control.consumer, control.partials_topic = RecordingConsumer(log), LoggingTopic(log)
    control.owned.add(("raw", 0))
    return control, recs, log


def test_a_cut_is_committed_before_it_is_published_and_repeated_exactly_after_a_crash(app):
    """The write-ahead cut: a worker dying after publishing makes its successor publish the same partial id."""
    from aiokafka import TopicPartition

    from pipeline.worker.control import ControlConsumer

    first, recs, log = recorded_control(app, 10)

    async def crash_after_publishing():
        await first.handle(RequestEvent, recs[:6])
        await first.publish_partials()

    asyncio.run(crash_after_publishing())
    assert log == [("commit", {("raw", 0): (100, "cut:105")}), ("partial", "raw/0/100-105")]

    log.clear()
    successor = ControlConsumer(first.settings, MemoryTopic(), LoggingTopic(log))
    successor.consumer = RecordingConsumer(log, committed=dict(first.consumer.committed))

    async def take_over():
        await successor.assigned(successor.consumer, TopicPartition("raw", 0))
        await successor.handle(RequestEvent, recs[:3])          # the cut is not complete yet: held
        await successor.publish_partials()
        await successor.handle(RequestEvent, recs[3:])          # completes it, then folds the rest
        await successor.publish_partials()

    asyncio.run(take_over())
    assert log == [("seek", 100),
                   ("commit", {("raw", 0): (100, "cut:105")}), ("partial", "raw/0/100-105"),
                   ("commit", {("raw", 0): (106, "cut:109")}), ("partial", "raw/0/106-109")]


def test_a_cut_queued_when_the_loop_ends_publishes_nothing(app):
    """The loop ends (its fetch failed) while a fold holds the lock and a cut waits behind it: the cut gets the
    lock before on_stop, but with no consumer it cannot commit first, so it publishes nothing (the next owner
    reads those events again), and on_stop drops what was folded."""
    control, recs, log = recorded_control(app, 6)

    async def scenario():
        await control.handle(RequestEvent, recs)
        await control._lock.acquire()                 # a fold under way
        cut = asyncio.ensure_future(control.publish_partials())
        await asyncio.sleep(0)
        control.ended, control.consumer = True, None  # as BatchLoop.consume's finally does
        stop = asyncio.ensure_future(control.on_stop())
        control._lock.release()
        return await cut, await stop

    assert asyncio.run(scenario()) == (0, None)
    assert log == [] and control.builders == {} and control.cut_start == {}


def partial_bytes(source, tick, n):
    builder = PartialBuilder(source, 15)
    for i in range(n):
        builder.fold_request(RequestEvent(**request_event(task_id=f"t{i}", event_time=1_700_000_000_000 + i)))
    (partial,) = builder.drain(tick)
    return partial.to_bytes()


def test_pictures_agent_merges_once_per_partial_id_and_publishes(app):
    pictures = next(a for a in app.agents.values() if a.name.endswith("pictures"))
    first, again, other = partial_bytes("raw/0", 1, 3), partial_bytes("raw/0", 1, 3), partial_bytes("raw/1", 1, 2)

    async def scenario():
        async with pictures.test_context() as agent:
            for value in (first, again, other):
                await agent.put(value, key=b"llama-70b-a")
        return await app.stage2.publish()

    assert asyncio.run(scenario()) == 1
    state = app.stage2.loop.states["llama-70b-a"]
    assert state.partials_merged == 2 and state.duplicate_partials == 1
    (key, value), = app.stage2.load_topic.sent
    assert key == b"llama-70b-a" and orjson.loads(value)["partials_merged"] == 2
    (key, signal), = app.stage2.admission_topic.sent
    from pipeline.admission.keyring import keyring
    from pipeline.admission.signing import verify

    assert key == b"llama-70b-a" and verify(signal, keyring(app.control.settings))["pool"] == "llama-70b-a"


def test_redirects_can_name_pools_computed_by_other_workers(app):
    from tests.unit.test_admission_policy import picture

    hot = picture("hot", watermark=1_000, demand=1.5) | {"models": ["m"]}
    elsewhere = picture("cool", demand=0.1) | {"models": ["m"]}
    other_model = picture("other", demand=0.1) | {"models": ["x"]}
    app.stage2.loop.pictures["hot"] = hot
    step = app.stage2.loop.step(1_000, {"cool": elsewhere, "other": other_model, "hot": hot})
    (signal,) = step.signals
    message = signal.value
    assert [r["pool"] for r in orjson.loads(message)["redirect"]] == ["cool"]


def series_count() -> int:
    from pipeline import metrics

    return sum(1 for line in metrics.exposition().decode().splitlines() if line and not line.startswith("#"))


def test_series_do_not_grow_with_task_ids(app):
    def batch(start):
        events = [request_event(task_id=f"task-{start + i}", request_id=f"task-{start + i}-r1",
                                phase="completed" if i % 2 else "received") for i in range(10_000)]
        return records("raw", [(e["task_id"].encode(), orjson.dumps(e)) for e in events])

    async def scenario(start):
        await app.control.handle(RequestEvent, batch(start))
        await app.control.publish_partials()
        await (await app.landing.handle(RequestEvent, batch(start)))

    asyncio.run(scenario(0))
    before = series_count()
    asyncio.run(scenario(10_000))
    assert series_count() == before, "10,000 new task ids added series"


def test_pool_labels_are_capped(monkeypatch):
    from pipeline import metrics

    monkeypatch.setattr(metrics, "MAX_POOL_LABELS", len(metrics._pools_seen) + 3)
    labels = {metrics.pool_label(f"pool-{i}") for i in range(1000)}
    assert len(labels) == 4 and "other" in labels


def test_store_health_follows_the_store(app):
    class DeadStore:
        backend = "chdb"

        def query(self, sql):
            from pipeline.sinks.store import StoreUnavailable

            raise StoreUnavailable("gone")

    class LiveStore(DeadStore):
        def query(self, sql):
            return [{"ok": 1}]

    app.landing.store = LiveStore()
    assert asyncio.run(app.landing.check_store()) is True
    app.landing.store = DeadStore()
    assert asyncio.run(app.landing.check_store()) is False and app.landing.store_ok is False


def test_rows_the_store_refuses_are_dead_lettered_and_the_rest_land(app):
    sink = use_sink(app, PickySink())
    events = [request_event(task_id=f"task-{i}", request_id=f"task-{i}-r1", tenant="poison" if i == 2 else "acme")
              for i in range(4)]
    batch = records("raw", [(e["task_id"].encode(), orjson.dumps(e)) for e in events])

    async def scenario():
        return await (await app.landing.handle(RequestEvent, batch))

    assert asyncio.run(scenario()) == {("raw", 0): 4}, "the whole block is accounted for and committable"
    landed = [orjson.loads(r)["event_id"] for r in sink.rows["request_events"]]
    assert landed == [e["event_id"] for i, e in enumerate(events) if i != 2]
    (key, value), = app.landing.dead_letter_topic.sent
    letter = orjson.loads(value)
    assert letter["reason"] == "store_rejected" and key == b"raw/0/2"
    assert orjson.loads(sink.rows["dead_letters"][0])["source_offset"] == 2


def test_a_refused_block_lands_in_halves_so_two_bad_rows_among_thousands_cost_dozens_of_inserts(app):
    """Row by row, one refused row among 5,000 cost 5,000 inserts (79 s of every partition's landing
    on chdb); halving the refused pieces costs about 2·log2(n) per bad row. Every other row lands, in
    offset order, each piece under a token of its own offsets."""
    from dataclasses import replace

    n, poisoned = 5000, {1234, 4321}
    app.landing.settings = replace(app.landing.settings, sink_block_rows=n)
    sink = use_sink(app, PickySink())
    events = [request_event(task_id=f"task-{i}", request_id=f"task-{i}-r1",
                            tenant="poison" if i in poisoned else "acme") for i in range(n)]
    batch = records("raw", [(e["task_id"].encode(), orjson.dumps(e)) for e in events])

    async def scenario():
        return await (await app.landing.handle(RequestEvent, batch))

    assert asyncio.run(scenario()) == {("raw", 0): n}
    landed = [orjson.loads(r)["event_id"] for r in sink.rows["request_events"]]
    assert landed == [e["event_id"] for i, e in enumerate(events) if i not in poisoned]
    assert sorted(orjson.loads(r)["source_offset"] for r in sink.rows["dead_letters"]) == sorted(poisoned)
    assert sorted(key for key, _ in app.landing.dead_letter_topic.sent) == [b"raw/0/1234", b"raw/0/4321"]
    assert len(sink.inserts) <= 1 + 2 * 2 * 13, sink.inserts   # 13 = ceil(log2(5000))
    tokens = [token for token, _ in sink.inserts]
    assert len(set(tokens)) == len(tokens), "every piece has a token of its own"
    block_token = tokens[0]
    assert f"{block_token}#1234" in tokens and f"{block_token}#0-2499" in tokens


def test_a_block_of_refused_rows_costs_about_its_rows_in_inserts_not_twice_them(app):
    """Halving a block whose every row is refused would cost 2n − 1 inserts; small refused pieces go row
    by row, so it costs about 1.25 n (row by row alone: n + 1), and every row is dead-lettered once."""
    from dataclasses import replace

    n = 1000
    app.landing.settings = replace(app.landing.settings, sink_block_rows=n)
    sink = use_sink(app, PickySink(refuses=lambda row: True))
    events = [request_event(task_id=f"task-{i}", request_id=f"task-{i}-r1") for i in range(n)]
    batch = records("raw", [(e["task_id"].encode(), orjson.dumps(e)) for e in events])

    async def scenario():
        return await (await app.landing.handle(RequestEvent, batch))

    assert asyncio.run(scenario()) == {("raw", 0): n}
    assert "request_events" not in sink.rows and len(sink.rows["dead_letters"]) == n
    assert sorted(orjson.loads(r)["source_offset"] for r in sink.rows["dead_letters"]) == list(range(n))
    assert n < len(sink.inserts) <= 1.3 * n, len(sink.inserts)


def test_rows_gather_per_partition_into_one_insert_of_thousands_not_one_per_fetch(app):
    from dataclasses import replace

    class CountingSink(MemorySink):
        def __init__(self):
            super().__init__()
            self.inserts = []

        async def land(self, table, rows, dedup_token):
            if rows:
                self.inserts.append((table, dedup_token, len(rows)))
            await super().land(table, rows, dedup_token)

    app.landing.settings = replace(app.landing.settings, sink_block_rows=6, sink_block_age_s=60)
    sink = use_sink(app, CountingSink())
    events = [request_event(task_id=f"task-{i}", request_id=f"task-{i}-r1") for i in range(8)]
    recs = [Record("raw", 0, i, None, e["task_id"].encode(), orjson.dumps(e)) for i, e in enumerate(events)]

    async def scenario():
        first = await (await app.landing.handle(RequestEvent, recs[:3]))
        second = await (await app.landing.handle(RequestEvent, recs[3:6]))
        third = await (await app.landing.handle(RequestEvent, recs[6:]))
        return first, second, third

    first, second, third = asyncio.run(scenario())
    assert first == {} and third == {}, "nothing is committed before it lands"
    assert second == {("raw", 0): 6}
    assert sink.inserts == [("request_events", "request_events:raw/0/0-5", 6)]
    open_blocks = app.landing.sink.open_blocks
    assert ("raw", 0) in open_blocks and open_blocks[("raw", 0)].start == 6


def test_a_block_of_huge_records_lands_at_its_byte_bound_not_its_row_count(app):
    """Review (session 22): blocks closed only at 5,000 rows or their age, and records up to the raw topics'
    limit (4 MiB) are dead-lettered with their original bytes: 5,000 of them in one block would hold
    gigabytes. A block now also lands once its source records reach ``sink_block_bytes``."""
    from dataclasses import replace

    app.landing.settings = replace(app.landing.settings, sink_block_rows=5000, sink_block_age_s=60,
                                   sink_block_bytes=1 << 20, max_event_bytes=65536)
    sink = use_sink(app, MemorySink())
    huge = [Record("raw", 0, i, None, b"task-1", b"x" * 700_000) for i in range(3)]

    async def scenario():
        first = await (await app.landing.handle(RequestEvent, huge[:1]))
        second = await (await app.landing.handle(RequestEvent, huge[1:]))
        return first, second

    first, second = asyncio.run(scenario())
    assert first == {}, "under the bound the block gathers, as always"
    assert second == {("raw", 0): 3}, "past it the block lands without waiting for rows or age"
    assert [orjson.loads(r)["reason"] for r in sink.rows["dead_letters"]] == ["oversize"] * 3
    assert ("raw", 0) not in app.landing.sink.open_blocks


def test_an_event_from_2100_is_dead_lettered_by_both_paths_and_never_moves_a_watermark(app):
    import time as clock

    now = int(clock.time() * 1000)
    real = request_event(task_id="t-real", request_id="t-real-r1", event_time=now)
    forged = request_event(task_id="t-forged", request_id="t-forged-r1", event_time=4_102_000_000_000)
    batch = records("raw", [(e["task_id"].encode(), orjson.dumps(e)) for e in (forged, real)])

    async def scenario():
        await app.control.handle(RequestEvent, batch)
        await app.control.publish_partials()
        await (await app.landing.handle(RequestEvent, batch))

    asyncio.run(scenario())
    assert [orjson.loads(v)["reason"] for _, v in app.control.dead_letter_topic.sent] == ["event_time_ahead"]
    assert [orjson.loads(r)["reason"] for r in app.landing.sink.sink.rows["dead_letters"]] == ["event_time_ahead"]
    (_, value), = app.control.partials_topic.sent
    assert orjson.loads(value)["newest_ms"] == now


def test_a_changelog_poisoned_by_a_partial_from_the_future_heals_on_rebuild(app):
    """Partials kept before event times were bounded: the rebuilt picture ignores them."""
    from pipeline.worker.pictures import KEY_SEP, partition_of

    import time as clock

    now = int(clock.time() * 1000)
    good = PartialBuilder("raw/0", 15)
    good.fold_request(RequestEvent(**request_event(event_time=now)))
    poisoned = PartialBuilder("raw/1", 15)
    poisoned.fold_request(RequestEvent(**request_event(event_time=4_102_000_000_000)))
    table = {}
    for builder, cut in ((good, "0-0"), (poisoned, "0-0")):
        (partial,) = builder.drain(cut)
        table[partial.pool.encode() + KEY_SEP + partial.id.encode()] = partial.to_bytes()
    app.stage2.table = table
    app.stage2.rebuild({partition_of(b"llama-70b-a", 2)}, 2)
    assert app.stage2.loop.states["llama-70b-a"].watermark_ms == now
    again = PartialBuilder("raw/2", 15)
    again.fold_request(RequestEvent(**request_event(event_time=4_102_000_000_000)))
    (late_poison,) = again.drain("5-5")
    app.stage2.merge(late_poison, late_poison.to_bytes())
    assert app.stage2.loop.states["llama-70b-a"].watermark_ms == now, "a live partial from the future is refused"
    assert not any(b"raw/2" in key for key in table)


def test_a_live_partial_whose_replica_sample_is_from_the_future_is_refused(app):
    """Its newest_ms current, one replica's latest sample in 2100: merged, that replica would stay fresh for
    ever (never stale, never evicted), holding a place among the pool's replicas."""
    import time as clock

    now = int(clock.time() * 1000)
    builder = PartialBuilder("raw/0", 15)
    builder.fold_request(RequestEvent(**request_event(event_time=now)))
    builder.fold_sample(ReplicaSample(**replica_sample(pool="llama-70b-a", replica_id="ghost", event_time=now)))
    (partial,) = builder.drain("0-0")
    doc = orjson.loads(partial.to_bytes())
    doc["replicas"]["ghost"]["latest"]["event_time"] = 4_102_000_000_000
    forged = Partial.from_dict(doc)
    app.stage2.merge(forged, orjson.dumps(doc))
    assert "llama-70b-a" not in app.stage2.loop.states, "refused whole, as a partial from the future"


def test_a_partial_from_a_worker_whose_clock_runs_fast_cannot_move_the_watermark_past_this_workers_clock(app):
    """Stage 1 holds events to its own worker's clock, so a worker whose clock runs 44.5 s fast (inside
    max_clock_skew_s) writes partials 44.5 s ahead. Merged as stamped (review, session 22), one moved the
    pool's watermark ahead: at once every replica read gone and the pool idle (pressure 0.03 from 10, an
    overloaded pool admitting everything), and every real event for 45 s was dropped as late. Now stage 2
    holds the watermark at its own clock: the replicas stay fresh and the real events after it are not late;
    the fast worker's own seconds are kept, and count once the watermark reaches them (the same at a
    rebuild, which merges with the rebuilding worker's clock)."""
    from pipeline import metrics

    now = int(app.stage2.clock() * 1000)
    real = PartialBuilder("raw/0", 15)
    for second in range(10):
        real.fold_sample(ReplicaSample(**replica_sample(pool="llama-70b-a", replica_id="r1",
                                                        event_time=now - 10_000 + second * 1000,
                                                        requests_waiting=500)))
    real.fold_request(RequestEvent(**request_event(task_id="real-1", request_id="real-1-r1", event_time=now)))
    (first,) = real.drain("0-10")
    fast = PartialBuilder("raw/1", 15)
    for i in range(5):
        event = RequestEvent(**request_event(task_id=f"fast-{i}", request_id=f"fast-{i}-r1",
                                             event_time=now + 44_500))
        fast.fold_request(event, not_after_ms=now + 44_500)
    (ahead,) = fast.drain("0-4")
    real.fold_request(RequestEvent(**request_event(task_id="real-2", request_id="real-2-r1",
                                                   event_time=now + 200)))
    (after,) = real.drain("11-11")
    ahead_before = metrics.PARTIALS_AHEAD._value.get()
    app.stage2.table = {}
    for partial in (first, ahead, after):
        app.stage2.merge(partial, partial.to_bytes())
    state = app.stage2.loop.states["llama-70b-a"]
    assert now <= state.watermark_ms <= now + 1_000, "the watermark stays on this worker's clock"
    assert state.late_events == 0, "the real events after the fast worker's are not late"
    assert state.partials_merged == 3
    assert sum(agg.counts["events"] for agg in state.requests.values()) == 7, "the fast worker's events are kept"
    snapshot = state.snapshot(app.stage2.loop.configs.for_pool("llama-70b-a"))
    assert snapshot["replicas"]["fresh"] == 1, "the replica is not read gone"
    assert metrics.PARTIALS_AHEAD._value.get() == ahead_before + 1


def test_a_table_value_that_does_not_parse_costs_that_value_not_the_rebuild(app):
    """A changelog value that is garbage is left out (and queued for deletion) and the rest rebuilds:
    raising there would crash the worker at every rebalance, on every worker that took the partition."""
    from pipeline.worker.pictures import KEY_SEP, partition_of, stored

    pool = b"llama-70b-a"
    now = int(app.stage2.clock() * 1000)   # merged just now: a pool idle past pool_idle_s is not rebuilt
    garbage = {b"bytes": b"\x78\x9c garbage", b"json": b"{not json", b"list": b"[]", b"null": b"null",
               b"wrapped": b'{"merged_ms": 1, "partial": {"id": 7}}', b"none": None,
               b"types": orjson.dumps({**orjson.loads(partial_bytes("raw/1", 1, 1)), "newest_ms": "9"}),
               b"int-id": orjson.dumps({**orjson.loads(partial_bytes("raw/2", 1, 1)), "id": 7}),
               b"other-pool": orjson.dumps({**orjson.loads(partial_bytes("raw/3", 1, 1)), "pool": "elsewhere"})}
    app.stage2.table = {pool + KEY_SEP + b"raw/0/1-3": stored(partial_bytes("raw/0", 1, 3), now),
                        **{pool + KEY_SEP + name: value for name, value in garbage.items()}}
    app.stage2.rebuild({partition_of(pool, 2)}, 2)
    assert app.stage2.loop.states["llama-70b-a"].partials_merged == 1
    queued = {key for keys in app.stage2.unwanted.values() for key in keys}
    assert queued == {pool + KEY_SEP + name for name in garbage}


def test_garbage_on_the_partials_topic_costs_one_record_not_the_agent(app):
    pictures = next(a for a in app.agents.values() if a.name.endswith("pictures"))
    garbage = [b"not json", b"[]", b"null", b'{"id": 1}', b'{"id": "x", "pool": "p", "requests": {"a": 1}}',
               b"\xff\xfe", b"{" * 10_000,
               orjson.dumps({**orjson.loads(partial_bytes("raw/9", 1, 1)), "models": [7]}),
               orjson.dumps({**orjson.loads(partial_bytes("raw/9", 2, 1)), "models": None})]

    async def scenario():
        async with pictures.test_context() as agent:
            for value in garbage:
                await agent.put(value, key=b"p")
            await agent.put(partial_bytes("raw/0", 1, 3), key=b"llama-70b-a")
        return await app.stage2.publish()

    assert asyncio.run(scenario()) == 1
    assert app.stage2.loop.states["llama-70b-a"].partials_merged == 1


def test_a_fold_waiting_on_a_cuts_commit_never_leaks_into_that_cut(app):
    """Found by the scale-out test: events folded while a cut awaited its commit went out inside that cut's
    partial, so a successor repeating the cut's declared range counted them twice."""
    events = [request_event(task_id=f"t{i}", request_id=f"t{i}-r1", phase="completed",
                            event_time=1_700_000_000_000 + i) for i in range(10)]
    recs = [Record("raw", 0, i, None, e["task_id"].encode(), orjson.dumps(e)) for i, e in enumerate(events)]
    log, release = [], None

    class SlowCommit(RecordingConsumer):
        async def commit(self, offsets):
            await release.wait()
            await super().commit(offsets)

    control = app.control
    control.consumer, control.partials_topic = SlowCommit(log), MemoryTopic()
    control.owned.add(("raw", 0))

    async def scenario():
        nonlocal release
        release = asyncio.Event()
        await control.handle(RequestEvent, recs[:4])
        cut = asyncio.ensure_future(control.publish_partials())
        await asyncio.sleep(0)                                   # the cut is waiting for its commit
        fold = asyncio.ensure_future(control.handle(RequestEvent, recs[4:]))
        await asyncio.sleep(0)
        release.set()
        await cut
        await fold
        await control.publish_partials()

    asyncio.run(scenario())
    first, second = (orjson.loads(v) for _, v in control.partials_topic.sent)
    assert (first["id"], second["id"]) == ("raw/0/0-3", "raw/0/4-9")
    assert [sum(b["completed"] for b in p["requests"].values()) for p in (first, second)] == [4, 6]


def test_a_cut_that_waits_is_named_in_health_by_what_it_waits_on(app):
    """A cut that never ends stops its pools' pictures while the path still consumes and the signals still
    go out (test_litellm_proxy failed so once, unexplained): past producer_stall_s /healthz names the wait —
    the commit, the lock a second cut queues on — without failing the check, and forgets it once it ends."""
    from pipeline.worker.http import health
    from pipeline.worker.stall_watch import StallWatch

    events = [request_event(task_id=f"t{i}", request_id=f"t{i}-r1", event_time=1_700_000_000_000 + i)
              for i in range(4)]
    recs = [Record("raw", 0, i, None, e["task_id"].encode(), orjson.dumps(e)) for i, e in enumerate(events)]
    now, release = [0.0], None

    class StuckCommit(RecordingConsumer):
        async def commit(self, offsets):
            await release.wait()
            await super().commit(offsets)

        def assignment(self):
            return {("raw", 0)}

    control = app.control
    control.consumer, control.partials_topic = StuckCommit([]), MemoryTopic()
    control.cut_waits = StallWatch(lambda: now[0])
    control.owned.add(("raw", 0))

    def stuck():
        ok, body = health(control, None, 60, StallWatch(lambda: now[0]))
        assert ok and body["control"]["consuming"], body
        return body["control"]["cut_stuck_s"]

    async def scenario():
        nonlocal release
        release = asyncio.Event()
        await control.handle(RequestEvent, recs)
        cut = asyncio.ensure_future(control.publish_partials())
        await asyncio.sleep(0)                                   # the cut waits for its commit
        now[0] += 30
        queued = asyncio.ensure_future(control.publish_partials())
        await asyncio.sleep(0)                                   # the next cut waits for the lock
        assert stuck() == {}
        now[0] += 31
        assert stuck() == {"commit": 61.0}
        now[0] += 30
        assert stuck() == {"commit": 91.0, "lock": 61.0}
        assert control.partials_topic.sent == []
        release.set()
        await cut
        await queued
        assert stuck() == {} and control.cut_waits.longest() == 0.0

    asyncio.run(scenario())
    assert len(control.partials_topic.sent) == 1


def test_a_cut_queued_on_a_lock_nothing_explains_fails_health(app):
    """A cut waiting on the lock past the bound while its holder waits on nothing at the broker (no commit or
    send of a cut, no fold's dead letters) is the path wedged inside the worker: only that fails /healthz, since
    a restart cures it. The same lock held by a fold sending one batch of dead letters after another to a slow
    broker stays reported only, however young its current send."""
    from pipeline.worker.http import health
    from pipeline.worker.stall_watch import StallWatch

    now = [0.0]
    producer_waits = StallWatch(lambda: now[0])

    class Assigned(RecordingConsumer):
        def assignment(self):
            return {("raw", 0)}

    control = app.control
    control.consumer = Assigned([])
    control.cut_waits = StallWatch(lambda: now[0])
    control.holder_waits = StallWatch(lambda: now[0])

    async def scenario():
        await control._lock.acquire()                         # a fold that never lets go
        cut = asyncio.ensure_future(control.publish_partials())
        await asyncio.sleep(0)
        now[0] += 59
        assert health(control, None, 60, producer_waits)[0] and control.wedged(60) is None
        now[0] += 2
        ok, body = health(control, None, 60, producer_waits)
        assert not ok and body["control"] == {"consuming": True, "cut_stuck_s": {"lock": 61.0}, "wedged": True}
        assert control.wedged(60) == 61.0
        for _ in range(2):                                    # the holder's dead letters, one batch after another
            with control.holder_waits.waiting("dead letters"), producer_waits.waiting("dead letters"):
                for _ in range(4):                            # read young and old
                    now[0] += 10
                    ok, body = health(control, None, 60, producer_waits)
                    assert ok and not body["control"]["wedged"], body
        assert body["control"]["cut_stuck_s"] == {"lock": 141.0}
        control._lock.release()
        await cut
        assert health(control, None, 60, producer_waits) == (True, {
            "producer_stuck_s": {}, "control": {"consuming": True, "cut_stuck_s": {}, "wedged": False}, "ok": True})

    asyncio.run(scenario())



def test_a_fold_waiting_on_its_dead_letters_is_not_a_wedged_path(app):
    """Through the real fold: a malformed record's dead letter the broker does not acknowledge holds the lock,
    and a cut queues behind it past the bound. That is the broker's side (a restart would meet it): named in
    the cut's waits, never read as wedged. Once the broker takes it, the cut goes out."""
    from pipeline.worker.http import health
    from pipeline.worker.stall_watch import StallWatch

    now = [0.0]

    class Assigned(RecordingConsumer):
        def assignment(self):
            return {("raw", 0)}

    class SlowBroker(MemoryTopic):
        def __init__(self):
            super().__init__()
            self.acked = None

        async def send(self, key, value):
            self.sent.append((key, value))
            self.acked = asyncio.get_running_loop().create_future()
            return self.acked

    log, dead_letters = [], SlowBroker()
    control = app.control
    control.consumer, control.partials_topic, control.dead_letter_topic = Assigned(log), LoggingTopic(log), dead_letters
    control.owned.add(("raw", 0))
    control.cut_waits, control.holder_waits = StallWatch(lambda: now[0]), StallWatch(lambda: now[0])
    good = request_event(task_id="t1", request_id="t1-r1", event_time=1_700_000_000_000)
    recs = [Record("raw", 0, 100, None, b"t1", orjson.dumps(good)), Record("raw", 0, 101, None, b"t2", b"{not json")]

    async def scenario():
        fold = asyncio.ensure_future(control.handle(RequestEvent, recs))
        while dead_letters.acked is None:
            await asyncio.sleep(0)
        cut = asyncio.ensure_future(control.publish_partials())
        await asyncio.sleep(0)
        now[0] += 61
        ok, body = health(control, None, 60, StallWatch(lambda: now[0]))
        assert control.holder_waits.kinds() == {"dead letters"} and control.wedged(60, StallWatch()) is None
        assert ok and body["control"] == {"consuming": True, "cut_stuck_s": {"lock": 61.0}, "wedged": False}
        dead_letters.acked.set_result(None)
        await fold
        return await cut

    assert asyncio.run(scenario()) == 1
    assert [entry[0] for entry in log] == ["commit", "partial"] and len(dead_letters.sent) == 1


def pool_partial(pool, source, event_time):
    builder = PartialBuilder(source, 15)
    builder.fold_request(RequestEvent(**request_event(pool=pool, event_time=event_time)))
    (partial,) = builder.drain(1)
    return partial.to_bytes()


class IdlePool:
    """Pool "idle-pool" and a neighbour on the same partials partition, the stage-2 clock in the test's hands,
    and the table's changelog writes recorded."""

    def __init__(self, app):
        from pipeline import topics
        from pipeline.worker.pictures import partition_of

        self.app, self.stage2 = app, app.stage2
        self.partitions = topics.PARTIALS.partitions(app.control.settings)
        self.partition = partition_of(b"idle-pool", self.partitions)
        assert self.partition != 0, "not test_context's default partition, or the test would prove little"
        self.neighbour = next(f"pool-{i}" for i in range(100)
                              if partition_of(f"pool-{i}".encode(), self.partitions) == self.partition)
        self.now = 1_700_000_000.0
        self.stage2.clock = lambda: self.now
        self.idle_s = self.stage2.loop.pool_idle_ms / 1000
        self.changelog = []
        send_changelog = self.stage2.table.send_changelog

        def recording(partition, key, value, *args, **kwargs):
            self.changelog.append((partition, key, value))
            return send_changelog(partition, key, value, *args, **kwargs)

        self.stage2.table.send_changelog = recording
        self.agent = next(a for a in app.agents.values() if a.name.endswith("pictures"))

    async def put(self, agent, pool, source):
        await agent.put(pool_partial(pool, source, int(self.now * 1000) - 500), key=pool.encode(),
                        partition=self.partition)

    def restart(self):
        """A new control loop rebuilt from the table, as after a restart or a rebalance."""
        from pipeline.worker.pictures import control_loop

        self.stage2.loop = control_loop(self.app.control.settings)
        self.stage2.rebuild({self.partition}, self.partitions)
        return set(self.stage2.loop.states)

    def keys(self, pool):
        from pipeline.worker.pictures import KEY_SEP

        return sorted(k for k in self.stage2.table.keys() if k.startswith(pool.encode() + KEY_SEP))


def test_a_forgotten_pools_partials_leave_the_changelog_table(app):
    """Forgetting a pool tombstoned its picture and signal but kept its partials in the table, so the
    rebuild after a restart or rebalance brought it back, signalling, until it was forgotten again."""
    idle = IdlePool(app)

    async def scenario():
        async with idle.agent.test_context() as agent:
            await idle.put(agent, "idle-pool", "raw/0")
            await idle.put(agent, "idle-pool", "raw/1")
            await idle.stage2.publish()
            idle.now += idle.idle_s + 1
            await idle.stage2.publish()
            assert len(idle.keys("idle-pool")) == 2, "outside stream iteration: queued"
            await idle.put(agent, idle.neighbour, "raw/2")
            assert idle.keys("idle-pool") == [], "deleted while a partial of the same partition was merged"
        return idle.restart()

    assert asyncio.run(scenario()) == {idle.neighbour}
    forgotten = [(b"idle-pool", None), (b"idle-pool", None)]
    assert [(k, v) for k, v in app.stage2.load_topic.sent + app.stage2.admission_topic.sent if v is None] == forgotten
    tombstones = sorted((p, k) for p, k, v in idle.changelog if v is None)
    assert tombstones == [(idle.partition, b"idle-pool\x1fraw/0/1"), (idle.partition, b"idle-pool\x1fraw/1/1")]


def test_a_pool_idle_when_the_worker_restarts_is_not_rebuilt(app):
    """The worker stopped (or lost the partition) before it forgot the pool, or before a partial of that
    partition let it delete the pool's partials: the rebuild must not bring the pool back."""
    idle = IdlePool(app)

    async def scenario():
        async with idle.agent.test_context() as agent:
            await idle.put(agent, "idle-pool", "raw/0")
            await idle.stage2.publish()
            assert idle.restart() == {"idle-pool"}, "a live pool is rebuilt"
            idle.now += idle.idle_s + 1
            assert idle.restart() == set(), "idle past pool_idle_s: left out"
            assert len(idle.keys("idle-pool")) == 1
            await idle.put(agent, idle.neighbour, "raw/1")
            assert idle.keys("idle-pool") == [], "and its partials deleted at the next merge on its partition"
        return idle.restart()

    assert asyncio.run(scenario()) == {idle.neighbour}


def sparse_backlog_records(topic, seconds=20_000):
    """One pool's request events 7 s apart (about 39 hours): one entry per event-second in its partial."""
    events = [request_event(task_id=f"t{i}", request_id=f"t{i}-r1", pool="sparse",
                            phase=("received", "completed")[i % 2], event_time=1_700_000_000_000 + 7_000 * i)
              for i in range(seconds)]
    return [Record(topic, 0, i, None, e["task_id"].encode(), orjson.dumps(e)) for i, e in enumerate(events)]


def whole_partial(recs):
    """The backlog's partial, unsplit."""
    builder = PartialBuilder("whole/0", 15)
    for rec in recs:
        builder.fold_request(RequestEvent(**orjson.loads(rec.value)))
    (whole,) = builder.drain("0-0")
    return whole


def unsplit_state(recs, config):
    """The pool's state had its backlog been merged as one partial."""
    from pipeline.load.partial import Partial
    from pipeline.load.picture import PoolState

    state = PoolState("sparse")
    state.merge(Partial.from_bytes(whole_partial(recs).to_bytes()), config)
    return state


def same_picture(a, b, config):
    pictures = [state.snapshot(config) for state in (a, b)]
    for picture in pictures:
        picture.pop("partials_merged")
    assert pictures[0] == pictures[1]


class SizeLimitedTopic(MemoryTopic):
    """Refuses what the broker refuses: a value over the topic's max.message.bytes."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    async def send(self, key, value):
        from aiokafka.errors import MessageSizeTooLargeError

        if len(value) > self.limit:
            raise MessageSizeTooLargeError(f"{len(value)} bytes over max.message.bytes {self.limit}")
        return await super().send(key, value)


def test_a_sparse_backlog_goes_out_in_parts_the_partials_topic_accepts_and_they_merge_like_one(app):
    """A cut of one pool spanning ~39 h of sparse events was one 3 MB partial: its send failed and broke the
    control path. Its parts fit the topic and stage 2 (table eviction included) ends where the whole would.
    A successor repeating the cut publishes the same parts: those still in the window are dropped by id,
    those that left it count as late, never in the picture."""
    from aiokafka import TopicPartition

    from pipeline import topics
    from pipeline.load.picture import PoolState
    from pipeline.worker.control import ControlConsumer

    settings = app.control.settings
    limit = int(topics.topic_configs(settings)[topics.PARTIALS.name(settings)][1]["max.message.bytes"])
    recs = sparse_backlog_records("raw")
    control = app.control
    control.consumer, control.partials_topic = RecordingConsumer([]), SizeLimitedTopic(limit)
    control.owned.add(("raw", 0))
    successor = ControlConsumer(settings, MemoryTopic(), SizeLimitedTopic(limit))
    pictures = next(a for a in app.agents.values() if a.name.endswith("pictures"))
    state = {}

    async def merge(agent, topic):
        for _, value in topic.sent:
            await agent.put(value, key=b"sparse")

    async def scenario():
        for start in range(0, len(recs), 5_000):
            await control.handle(RequestEvent, recs[start:start + 5_000])
        published = await control.publish_partials()
        successor.consumer = RecordingConsumer([], committed=dict(control.consumer.committed))
        await successor.assigned(successor.consumer, TopicPartition("raw", 0))
        for start in range(0, len(recs), 5_000):
            await successor.handle(RequestEvent, recs[start:start + 5_000])
        async with pictures.test_context() as agent:
            await merge(agent, control.partials_topic)
            state["first"] = app.stage2.loop.states["sparse"].to_dict()
            state["table"] = list(app.stage2.table)
            await merge(agent, successor.partials_topic)
        return published

    published = asyncio.run(scenario())
    sent = [value for _, value in control.partials_topic.sent]
    config = app.stage2.loop.configs.for_pool("sparse")
    whole = unsplit_state(recs, config)
    assert len(whole_partial(recs).to_bytes()) > limit and published == len(sent) >= 3
    assert [orjson.loads(v)["id"] for v in sent] == ["raw/0/0-19999"] + [f"raw/0/0-19999#{k}"
                                                                          for k in range(1, len(sent))]
    same_picture(PoolState.from_dict(state["first"]), whole, config)
    assert state["table"] == [b"sparse\x1fraw/0/0-19999#" + str(len(sent) - 1).encode()], \
        "the parts that left the cost window left the changelog table"
    assert successor.partials_topic.sent == control.partials_topic.sent
    repeated = app.stage2.loop.states["sparse"]
    assert repeated.duplicate_partials == 1
    assert repeated.late_events == sum(sum(agg.get("events", 0) for agg in orjson.loads(v)["requests"].values())
                                       for v in sent[:-1])
    repeated.late_events, repeated.duplicate_partials = whole.late_events, whole.duplicate_partials
    same_picture(repeated, whole, config)


@pytest.mark.integration
def test_the_broker_takes_a_sparse_backlogs_parts_it_refuses_whole(settings):
    """Against the real broker and the partials topic as the workers create it."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import MessageSizeTooLargeError

    from pipeline import topics
    from pipeline.load.config import PictureConfigs
    from pipeline.load.partial import Partial
    from pipeline.load.picture import PoolState
    from pipeline.worker.control import ControlConsumer
    from tests.integration.kafka_helpers import read_all

    name = topics.PARTIALS.name(settings)
    bootstrap = settings.kafka_bootstrap_servers
    recs = sparse_backlog_records(topics.REQUESTS.name(settings))
    config = PictureConfigs(settings).for_pool("sparse")

    class ProducerTopic:
        def __init__(self, producer):
            self.producer = producer

        async def send(self, key, value):
            return await self.producer.send(name, key=key, value=value)

    async def scenario():
        await topics.ensure_topics(settings, bootstrap)
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap,   # as the worker's: a dead letter's size
                                    max_request_size=topics.dead_letter_max_bytes(settings) + 65536)
        await producer.start()
        try:
            with pytest.raises(MessageSizeTooLargeError):
                await (await producer.send(name, key=b"sparse", value=whole_partial(recs).to_bytes()))
            control = ControlConsumer(settings, MemoryTopic(), ProducerTopic(producer))
            for start in range(0, len(recs), 5_000):
                await control.handle(RequestEvent, recs[start:start + 5_000])
            published = await control.publish_partials()
        finally:
            await producer.stop()
        return published, await read_all(bootstrap, name)

    published, landed = asyncio.run(scenario())
    assert published >= 3 and len(landed) == published
    state = PoolState("sparse")
    for record in landed:
        assert state.merge(Partial.from_bytes(record.value), config)
    same_picture(state, unsplit_state(recs, config), config)


def test_the_workers_own_producer_is_idempotent_and_waits_for_every_in_sync_replica(app):
    """Faust enables idempotence only inside transactions; the worker's transport turns it on for every send."""
    async def build():
        return app.producer._new_producer()

    producer = asyncio.run(build())
    assert producer._txn_manager is not None                 # aiokafka's idempotence state
    assert producer.client._bootstrap_servers == ["127.0.0.1:9"]
    assert app.producer._settings_default()["acks"] == -1


def test_a_rebuild_merges_partials_the_stream_skipped_from_the_reread_topic(app):
    """Faust's stream can commit past partials it never handed to the agent (a rebalance): they are on the
    partials topic but not in the table. The rebuild merges them once, only for partitions it owns, and
    they reach the table at the partition's next merge, so the rebuild after that finds them there."""
    from pipeline import metrics
    from pipeline.load.partial import Partial
    from pipeline.worker.pictures import KEY_SEP, control_loop, partition_of, stored

    stage2 = app.stage2
    now_s = 1_700_000_100.0
    stage2.clock = lambda: now_s
    mine = partition_of(b"llama-70b-a", 2)
    other = next(f"pool-{i}" for i in range(100) if partition_of(f"pool-{i}".encode(), 2) != mine)
    idle = next(f"pool-{i}" for i in range(100) if partition_of(f"pool-{i}".encode(), 2) == mine)
    now_ms = int(now_s * 1000)
    merged = pool_partial("llama-70b-a", "raw/0", now_ms - 3000)
    skipped = pool_partial("llama-70b-a", "raw/1", now_ms - 2000)
    bad_merge = Partial.from_bytes(pool_partial("llama-70b-a", "raw/5", now_ms - 3000))
    next(iter(bad_merge.requests.values())).counts["events"] = "x"   # past the parse checks: raises in the merge
    stage2.table = {b"llama-70b-a" + KEY_SEP + b"raw/0/1": stored(merged, now_ms - 2500)}
    idle_ms = now_ms - stage2.loop.pool_idle_ms - 1000
    reread = [(Partial.from_bytes(raw), raw, broker_ms) for raw, broker_ms in (
        (merged, now_ms - 2900), (skipped, now_ms - 1900), (skipped, now_ms - 1800),  # stage 1 repeated a cut
        (pool_partial(other, "raw/2", now_ms - 1000), now_ms - 900),     # another worker's pool
        (pool_partial(idle, "raw/3", idle_ms), idle_ms),                 # forgotten long ago
        (pool_partial("llama-70b-a", "raw/4", now_ms + 3_600_000), now_ms))]  # from the future
    reread.append((bad_merge, b"{}", now_ms - 1000))
    before = metrics.PARTIALS_REREAD._value.get()
    stage2.rebuild({mine}, 2, reread)
    assert set(stage2.loop.states) == {"llama-70b-a"}
    state = stage2.loop.states["llama-70b-a"]
    assert {"raw/0/1", "raw/1/1"} <= set(state.seen) and state.watermark_ms == now_ms - 2000
    assert stage2.loop.unmergeable == {"raw/5/1"}
    assert metrics.PARTIALS_REREAD._value.get() - before == 1
    assert b"llama-70b-a" + KEY_SEP + b"raw/1/1" not in stage2.table  # no table write outside a stream
    stage2.merge(Partial.from_bytes(next_one := pool_partial("llama-70b-a", "raw/6", now_ms - 1000)), next_one)
    assert b"llama-70b-a" + KEY_SEP + b"raw/1/1" in stage2.table
    assert b"llama-70b-a" + KEY_SEP + b"raw/5/1" not in stage2.table
    stage2.loop = control_loop(app.control.settings)
    stage2.rebuild({mine}, 2)
    assert set(stage2.loop.states["llama-70b-a"].seen) == {"raw/0/1", "raw/1/1", "raw/6/1"}


def test_the_reread_keeps_what_the_table_lacks_and_fully_parses_only_that(app, monkeypatch):
    """Most re-read partials are already in the table: they are told apart by their identity alone (the
    checked parse costs about 7× a plain decode), and only the others are parsed, checked and kept."""
    from types import SimpleNamespace

    from pipeline.load.partial import Partial
    from pipeline.worker import pictures
    from pipeline.worker.pictures import KEY_SEP, stored

    stage2 = app.stage2
    now_ms = int(stage2.clock() * 1000)
    known, new = (pool_partial("llama-70b-a", source, now_ms - 1000) for source in ("raw/0", "raw/1"))
    stage2.table = {b"llama-70b-a" + KEY_SEP + b"raw/0/1": stored(known, now_ms)}
    records = [SimpleNamespace(value=value, timestamp=now_ms) for value in (known, new, b"not json", b"{}")]

    async def fake_read_since(bootstrap, topic, partitions, since_ms, timeout_s, keep, into, **options):
        into.extend(kept for kept in map(keep, records) if kept is not None)
        return True

    parsed = []
    real_from_dict = Partial.from_dict.__func__
    monkeypatch.setattr(pictures, "read_since", fake_read_since)
    monkeypatch.setattr(Partial, "from_dict", classmethod(lambda cls, d: parsed.append(d["id"]) or real_from_dict(cls, d)))
    found = asyncio.run(stage2.reread("127.0.0.1:9", {0}))
    assert [(partial.id, raw) for partial, raw, _ in found] == [("raw/1/1", new)]
    assert parsed == ["raw/1/1"]


def test_a_rebuild_whose_reread_fails_goes_on_from_the_table(app, monkeypatch):
    """No broker at the re-read: the rebuild is not held up past the re-read's bound nor crashed, and the
    failure is counted."""
    from pipeline import metrics
    from pipeline.worker import pictures

    monkeypatch.setattr(pictures, "REREAD_TIMEOUT_S", 2.0)
    before = metrics.REREAD_INCOMPLETE._value.get()
    reread = asyncio.run(asyncio.wait_for(app.stage2.reread("127.0.0.1:9", {0, 1}), 10))
    assert reread == []
    assert metrics.REREAD_INCOMPLETE._value.get() - before == 1


def test_a_table_value_whose_merge_raises_costs_that_value_not_the_rebuild(app, monkeypatch):
    """Defence behind the parse checks: a partial that parses and still raises in the merge is left out of the
    rebuild (which would otherwise crash recovery on every owner of its partition) and leaves the table."""
    from pipeline.worker.pictures import KEY_SEP, partition_of, stored

    stage2 = app.stage2
    now_ms = int(stage2.clock() * 1000)
    good, bad = (pool_partial("llama-70b-a", source, now_ms - 1000) for source in ("raw/0", "raw/7"))
    stage2.table = {b"llama-70b-a" + KEY_SEP + b"raw/0/1": stored(good, now_ms),
                    b"llama-70b-a" + KEY_SEP + b"raw/7/1": stored(bad, now_ms)}
    merge = stage2.loop.merge

    def raising(partial, *args):
        if partial.id == "raw/7/1":
            raise TypeError("unsupported operand type(s) for +=: 'int' and 'str'")
        return merge(partial, *args)

    monkeypatch.setattr(stage2.loop, "merge", raising)
    stage2.rebuild({partition_of(b"llama-70b-a", 2)}, 2)
    assert set(stage2.loop.states["llama-70b-a"].seen) == {"raw/0/1"}
    assert stage2.loop.unmergeable == {"raw/7/1"}
    assert {k for keys in stage2.unwanted.values() for k in keys} == {b"llama-70b-a" + KEY_SEP + b"raw/7/1"}


def test_the_longest_session_timeout_the_settings_allow_is_one_faust_accepts(tmp_path):
    """Faust refuses to start its consumer when the session timeout exceeds its request timeout (90 s by
    default), so a worker configured with ``SLUICE_SESSION_TIMEOUT_S=300`` crashed at startup."""
    longest = Settings.__dataclass_fields__["session_timeout_s"].metadata["max"]
    settings = load_settings(env={}, kafka_bootstrap_servers="127.0.0.1:9", state_dir=str(tmp_path),
                             app_id="sluice-agent-test-timeout", dev_signing_key=True, session_timeout_s=longest)
    conf = create_app(settings).conf
    assert conf.broker_session_timeout == longest
    assert conf.broker_session_timeout < conf.broker_request_timeout


def test_a_sibling_not_heard_from_for_the_replicas_stale_time_is_no_redirect_target(app):
    """Pictures of pools whose worker stopped stay in the compacted topic: the last one, perhaps with headroom,
    must not draw moved work. Freshness is this worker's clock at arrival, never the other worker's stamps."""
    from tests.unit.test_admission_policy import picture

    stage2 = app.stage2
    hot = picture("hot", watermark=1_000, demand=1.5) | {"models": ["m"]}
    stage2.loop.pictures["hot"] = hot
    stage2.fleet = {"cool": picture("cool", demand=0.1) | {"models": ["m"]},
                    "calm": picture("calm", demand=0.1) | {"models": ["m"]}}
    stage2.fleet_heard = {"cool": 100.0}   # "calm" was in the topic at start and never heard from since
    stage2.clock = lambda: 100.0 + stage2.settings.replica_stale_after_s

    def redirects() -> list[str]:
        asyncio.run(stage2.publish())
        key, signal = stage2.admission_topic.sent[-1]
        assert key == b"hot"
        return [r["pool"] for r in orjson.loads(signal)["redirect"]]

    assert redirects() == ["cool"]
    stage2.clock = lambda: 100.1 + stage2.settings.replica_stale_after_s
    stage2.loop.published.clear()   # a new signal now, not at the heartbeat
    assert redirects() == []
