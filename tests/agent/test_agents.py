"""Faust glue without a broker: stage 1's batch handling with in-memory collaborators, and the
stage-2 ``pictures`` agent in Faust's ``test_context()``."""

import asyncio

import orjson
import pytest

from pipeline.agents import create_app
from pipeline.events import ReplicaSample, RequestEvent
from pipeline.ingest import Record
from pipeline.load.partial import PartialBuilder
from pipeline.settings import load_settings
from pipeline.sim.specimens import bad_inputs, replica_sample, request_event


class MemorySink:
    def __init__(self):
        self.rows: dict[str, list[bytes]] = {}
        self.held = False

    async def land(self, table, rows, dedup_token):
        self.rows.setdefault(table, []).extend(rows)


class MemoryTopic:
    def __init__(self):
        self.sent: list[tuple[bytes, bytes]] = []

    async def send(self, key, value):
        self.sent.append((key, value))
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


@pytest.fixture
def app(tmp_path):
    settings = load_settings(env={}, kafka_bootstrap_servers="127.0.0.1:9", state_dir=str(tmp_path),
                             app_id="sluice-agent-test", sink_block_age_s=0)  # land every batch at once
    app = create_app(settings)
    app.finalize()
    app.conf.store = "memory://"
    app.flow_control.resume()
    app.stage1.sink = MemorySink()
    app.stage1.dead_letter_topic = MemoryTopic()
    app.stage1.partials_topic = MemoryTopic()
    app.stage2.load_topic = MemoryTopic()
    app.stage2.admission.topic = MemoryTopic()
    return app


def records(topic, items):
    return [Record(topic, 0, offset, None, key, value) for offset, (key, value) in enumerate(items)]


def test_stage1_lands_good_dead_letters_bad_and_folds_partials(app):
    good = [request_event(task_id=f"task-{i}", request_id=f"task-{i}-r1") for i in range(5)]
    bad = bad_inputs(app.stage1.settings.max_event_bytes)
    batch = records("raw", [(e["task_id"].encode(), orjson.dumps(e)) for e in good] + [(k, v) for _, v, k in bad])

    async def scenario():
        await (await app.stage1.handle(RequestEvent, batch))
        return await app.stage1.publish_partials()

    assert asyncio.run(scenario()) == 1
    landed = [orjson.loads(r)["event_id"] for r in app.stage1.sink.rows["request_events"]]
    assert landed == [e["event_id"] for e in good]
    assert [orjson.loads(v)["reason"] for _, v in app.stage1.dead_letter_topic.sent] == [r for r, _, _ in bad]
    (key, value), = app.stage1.partials_topic.sent
    partial = orjson.loads(value)
    assert key == b"llama-70b-a" and partial["id"].startswith("raw/0/")
    assert sum(b.get("completed", 0) for b in partial["requests"].values()) == 5


def test_stage1_samples_land_in_their_table(app):
    sample = replica_sample()
    async def scenario():
        await (await app.stage1.handle(ReplicaSample, records("raw", [(b"r1", orjson.dumps(sample))])))

    asyncio.run(scenario())
    assert [orjson.loads(r)["event_id"] for r in app.stage1.sink.rows["replica_samples"]] == [sample["event_id"]]


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
    state = app.stage2.states["llama-70b-a"]
    assert state.partials_merged == 2 and state.duplicate_partials == 1
    (key, value), = app.stage2.load_topic.sent
    assert key == b"llama-70b-a" and orjson.loads(value)["partials_merged"] == 2
    (key, signal), = app.stage2.admission.topic.sent
    from pipeline.admission.keyring import keyring
    from pipeline.admission.signing import verify

    assert key == b"llama-70b-a" and verify(signal, keyring(app.stage1.settings))["pool"] == "llama-70b-a"


def test_redirects_can_name_pools_computed_by_other_workers(app):
    from tests.unit.test_admission_policy import picture

    hot = picture("hot", watermark=1_000, demand=1.5) | {"models": ["m"]}
    elsewhere = picture("cool", demand=0.1) | {"models": ["m"]}
    other_model = picture("other", demand=0.1) | {"models": ["x"]}
    asyncio.run(app.stage2.admission.evaluate({"hot": hot}, {"cool": elsewhere, "other": other_model, "hot": hot},
                                              now_ms=1_000))
    (key, message), = app.stage2.admission.topic.sent
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
        await (await app.stage1.handle(RequestEvent, batch(start)))
        await app.stage1.publish_partials()

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

    app.stage1.store = LiveStore()
    assert asyncio.run(app.stage1.check_store()) is True
    app.stage1.store = DeadStore()
    assert asyncio.run(app.stage1.check_store()) is False and app.stage1.store_ok is False


def test_rows_the_store_refuses_are_dead_lettered_and_the_rest_land(app):
    from pipeline.sinks.store import StoreRejected

    class PickySink(MemorySink):
        async def land(self, table, rows, dedup_token):
            if table == "request_events" and any(b'"tenant":"poison"' in r for r in rows):
                raise StoreRejected("Code: 27. CANNOT_PARSE_INPUT_ASSERTION_FAILED")
            await super().land(table, rows, dedup_token)

    app.stage1.sink = PickySink()
    events = [request_event(task_id=f"task-{i}", request_id=f"task-{i}-r1", tenant="poison" if i == 2 else "acme")
              for i in range(4)]
    batch = records("raw", [(e["task_id"].encode(), orjson.dumps(e)) for e in events])

    async def scenario():
        return await (await app.stage1.handle(RequestEvent, batch))

    assert asyncio.run(scenario()) == {("raw", 0): 4}, "the whole block is accounted for and committable"
    landed = [orjson.loads(r)["event_id"] for r in app.stage1.sink.rows["request_events"]]
    assert landed == [e["event_id"] for i, e in enumerate(events) if i != 2]
    (key, value), = app.stage1.dead_letter_topic.sent
    letter = orjson.loads(value)
    assert letter["reason"] == "store_rejected" and key == b"raw/0/2"
    assert orjson.loads(app.stage1.sink.rows["dead_letters"][0])["source_offset"] == 2


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

    app.stage1.sink = CountingSink()
    app.stage1.settings = replace(app.stage1.settings, sink_block_rows=6, sink_block_age_s=60)
    events = [request_event(task_id=f"task-{i}", request_id=f"task-{i}-r1") for i in range(8)]
    recs = [Record("raw", 0, i, None, e["task_id"].encode(), orjson.dumps(e)) for i, e in enumerate(events)]

    async def scenario():
        first = await (await app.stage1.handle(RequestEvent, recs[:3]))
        second = await (await app.stage1.handle(RequestEvent, recs[3:6]))
        third = await (await app.stage1.handle(RequestEvent, recs[6:]))
        return first, second, third

    first, second, third = asyncio.run(scenario())
    assert first == {} and third == {}, "nothing is committed before it lands"
    assert second == {("raw", 0): 6}
    assert app.stage1.sink.inserts == [("request_events", "request_events:raw/0/0-5", 6)]
    assert ("raw", 0) in app.stage1.open_blocks and app.stage1.open_blocks[("raw", 0)].start == 6
    assert app.stage1.publish_partials is not None and app.stage1.builders, "folded at once, landed later"
