"""The stage-1 agents in Faust's test context: no broker, collaborators swapped for in-memory ones."""

import asyncio

import orjson
import pytest

from pipeline.agents import create_app
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
                             ingest_batch_within_s=0.01, app_id="sluice-agent-test")
    app = create_app(settings)
    app.finalize()
    app.conf.store = "memory://"
    app.flow_control.resume()
    app.stage1.sink = MemorySink()
    app.stage1.dead_letter_topic = MemoryTopic()
    return app


def agent(app, name):
    return next(a for a in app.agents.values() if a.name.endswith(name))


async def wait_until(condition, timeout_s=10.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_ingest_requests_lands_good_and_dead_letters_bad(app):
    good = [request_event(task_id=f"task-{i}", request_id=f"task-{i}-r1") for i in range(5)]
    bad = bad_inputs(app.stage1.settings.max_event_bytes)

    async def scenario():
        async with agent(app, "ingest_requests").test_context() as ingest:
            for event in good:
                await ingest.put(orjson.dumps(event), key=event["task_id"].encode())
            for _, value, key in bad:
                await ingest.put(value, key=key)
            await wait_until(lambda: len(app.stage1.sink.rows.get("request_events", [])) +
                             len(app.stage1.dead_letter_topic.sent) >= len(good) + len(bad))

    asyncio.run(scenario())
    landed = [orjson.loads(r)["event_id"] for r in app.stage1.sink.rows["request_events"]]
    assert landed == [e["event_id"] for e in good]
    reasons = [orjson.loads(v)["reason"] for _, v in app.stage1.dead_letter_topic.sent]
    assert reasons == [reason for reason, _, _ in bad]


def test_ingest_replicas_lands_samples_in_their_table(app):
    sample = replica_sample()

    async def scenario():
        async with agent(app, "ingest_replicas").test_context() as ingest:
            await ingest.put(orjson.dumps(sample), key=b"r1")
            await ingest.put(orjson.dumps(sample), key=None)
            await wait_until(lambda: app.stage1.sink.rows.get("replica_samples") and app.stage1.dead_letter_topic.sent)

    asyncio.run(scenario())
    assert [orjson.loads(r)["event_id"] for r in app.stage1.sink.rows["replica_samples"]] == [sample["event_id"]]
    assert orjson.loads(app.stage1.dead_letter_topic.sent[0][1])["reason"] == "null_key"
