"""``sluice otel-bridge`` against the real broker: OTLP/JSON records as the Collector's Kafka exporter writes them
(spans from the real OpenTelemetry SDK) become valid RequestEvents on the requests topic, bad records become dead
letters carrying their original bytes, offsets are committed after the produces, a redelivery changes nothing
downstream, and the bridged events land in ClickHouse through a real worker."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import subprocess
import sys
import time
from dataclasses import replace

import orjson
import pytest

pytest.importorskip("opentelemetry.sdk")

from aiokafka import AIOKafkaProducer  # noqa: E402
from opentelemetry.trace import SpanKind, Status, StatusCode  # noqa: E402

from pipeline import topics  # noqa: E402
from pipeline.events import RequestEvent, decode, validate  # noqa: E402
from pipeline.otel.bridge import OtelBridge  # noqa: E402
from pipeline.otel.spans import MappingConfig, map_request  # noqa: E402
from pipeline.sinks.store import open_store  # noqa: E402
from pipeline.worker_process import worker_env  # noqa: E402
from tests.conftest import run, wait_for  # noqa: E402
from tests.integration.kafka_helpers import group_lag, read_all, rewind_group  # noqa: E402
from tests.unit.test_otel_spans import Spans, chat  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture
def otel_settings(settings):
    return replace(settings, otel_topic=f"{settings.topic_namespace}.otlp_spans")


def make_records(tasks: int = 24) -> list[tuple[bytes | None, bytes | None]]:
    """(key, value) records for the spans topic: good ones (several spans and resources, other spans mixed in,
    failures), one with a good and a bad GenAI span, and records that are not OTLP/JSON at all."""
    start = time.time_ns() - 10 * 10**9
    records = []
    for i in range(tasks):
        spans = Spans(**{"service.name": f"router-{i % 3}"})
        spans.span("POST /v1/chat/completions", kind=SpanKind.SERVER, start=start,
                   attributes={"http.request.method": "POST"})
        spans.span(attributes=chat(**{"sluice.task_id": f"task-{i}", "sluice.pool": "chat-70b",
                                      "gen_ai.response.time_to_first_chunk": 0.3}), start=start)
        if i % 4 == 0:
            spans.span(attributes={"gen_ai.operation.name": "chat", "gen_ai.request.model": "llama-70b",
                                   "error.type": "timeout", "sluice.task_id": f"task-{i}", "sluice.attempt": 2},
                       status=Status(StatusCode.ERROR), start=start, seconds=30)
        records.append((None if i % 2 else b"partition-by-trace", spans.record()))
    mixed = Spans()
    mixed.span(attributes=chat(**{"sluice.task_id": "mixed"}), start=start)
    mixed.span(attributes=chat(**{"sluice.task_id": "mixed", "sluice.priority": "platinum"}), start=start)
    records.append((None, mixed.record()))
    base64_ids = orjson.loads(records[0][1])
    span = base64_ids["resourceSpans"][0]["scopeSpans"][0]["spans"][1]
    span["traceId"] = base64.b64encode(bytes.fromhex(span["traceId"])).decode()
    records += [(b"k", b'{"resourceSpans": ['), (None, b"\n\x0b\x00\x01\xff protobuf, not JSON"), (None, b"[1, 2]"),
                (None, b'{"resourceMetrics": []}'), (b"tombstone", None), (None, orjson.dumps(base64_ids))]
    return records


async def produce_records(settings, records) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers, acks="all")
    await producer.start()
    try:
        for key, value in records:
            await producer.send_and_wait(topics.otel_topic(settings), value, key=key)
    finally:
        await producer.stop()


def expectations(settings, records):
    """What the pure mapping says the records become: events produced, their distinct ids (a span sent in two
    records is one event), and dead-letter reasons by original value."""
    config = MappingConfig.of(settings)
    now_ms = int(time.time() * 1000)
    produced, event_ids, reasons = 0, set(), {}
    for _, value in records:
        mapped = map_request(value, now_ms, config)
        produced += len(mapped.events)
        event_ids |= {e["event_id"] for e in mapped.events}
        if mapped.rejection():
            reasons[value or b""] = mapped.rejection().reason
    return produced, event_ids, reasons


class BridgeProcess:
    def __init__(self, settings, log_path) -> None:
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "otel-bridge"],
                                         env=worker_env(settings), stdout=subprocess.PIPE, stderr=log)

    def stop(self) -> dict:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, self.log_path.read_text()
        return json.loads(out.decode().strip().splitlines()[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def committed(settings) -> bool:
    return run(group_lag(settings.kafka_bootstrap_servers, topics.otel_group(settings),
                         [topics.otel_topic(settings)])) == 0


def topic_records(settings, spec) -> list:
    return run(read_all(settings.kafka_bootstrap_servers, spec.name(settings)))


def check_requests(settings, records, event_ids) -> None:
    """Every record on the requests topic is an event the worker accepts, keyed by its task, one of those expected."""
    for record in records:
        event = decode(RequestEvent, record.value, record.key, settings.max_event_bytes)
        assert isinstance(event, RequestEvent), event
        assert event.event_id in event_ids and event.phase in ("completed", "failed")
    assert {orjson.loads(r.value)["event_id"] for r in records} == event_ids


def check_dead_letters(settings, letters, reasons) -> set:
    """Every dead letter is valid, carries the original bytes and the reason the pure mapping gives them."""
    for record in letters:
        letter = validate("dead_letter", orjson.loads(record.value))
        value = base64.b64decode(letter["value_b64"])
        assert letter["source_topic"] == topics.otel_topic(settings)
        assert record.key.decode() == f"{letter['source_topic']}/{letter['source_partition']}/{letter['source_offset']}"
        assert letter["reason"] == reasons[value], letter["detail"]
    assert {base64.b64decode(orjson.loads(r.value)["value_b64"]) for r in letters} == set(reasons)
    return {orjson.loads(r.value)["event_id"] for r in letters}


def test_the_bridge_publishes_valid_events_and_dead_letters_and_a_redelivery_changes_nothing(otel_settings,
                                                                                             tmp_path):
    s = otel_settings
    run(topics.ensure_topics(s, s.kafka_bootstrap_servers))
    records = make_records()
    produced, event_ids, reasons = expectations(s, records)
    assert len(event_ids) == 24 + 6 + 1 and len(reasons) == 7   # 24 chats, 6 failures, 1 of the mixed record
    assert produced == len(event_ids) + 1                        # the base64 record's other span, a second time
    run(produce_records(s, records))

    bridge = BridgeProcess(s, tmp_path / "bridge.log")
    try:
        wait_for(lambda: committed(s), 90, message="the bridge to commit every record")
        totals = bridge.stop()
    finally:
        bridge.kill()
    requests, letters = topic_records(s, topics.REQUESTS), topic_records(s, topics.DEADLETTER)
    assert len(requests) == produced and len(letters) == len(reasons)
    check_requests(s, requests, event_ids)
    letter_ids = check_dead_letters(s, letters, reasons)
    assert totals["records"] == len(records) and totals["events"] == produced
    assert totals["dead_letters"] == len(reasons)
    assert totals["skipped"] == {"not_genai": 25}  # the 24 HTTP spans, and the base64 record's copy of one

    # a crash before the commit, replayed: the group starts again from 0
    run(rewind_group(s.kafka_bootstrap_servers, topics.otel_group(s), [topics.otel_topic(s)]))
    again = BridgeProcess(s, tmp_path / "bridge-again.log")
    try:
        wait_for(lambda: committed(s), 90, message="the redelivered records to be committed again")
        again.stop()
    finally:
        again.kill()
    requests, letters = topic_records(s, topics.REQUESTS), topic_records(s, topics.DEADLETTER)
    assert len(requests) == 2 * produced and len(letters) == 2 * len(reasons)
    check_requests(s, requests, event_ids)                   # the same event ids: duplicates for the workers to drop
    assert check_dead_letters(s, letters, reasons) == letter_ids  # the same dead letters


def test_bridged_spans_land_in_clickhouse_once_through_a_real_worker(otel_settings, worker_factory):
    s = otel_settings
    records = make_records(tasks=40)
    produced, event_ids, _ = expectations(s, records)
    worker = worker_factory(s).start()
    run(produce_records(s, records))

    async def bridge_twice():
        """In-process this time; the second pass re-reads everything, as after a crash before the commit."""
        for rewind in (False, True):
            if rewind:
                await rewind_group(s.kafka_bootstrap_servers, topics.otel_group(s), [topics.otel_topic(s)])
            bridge = OtelBridge(s, s.kafka_bootstrap_servers)
            task = asyncio.create_task(bridge.run())
            deadline = time.monotonic() + 90
            while await group_lag(s.kafka_bootstrap_servers, topics.otel_group(s), [topics.otel_topic(s)]):
                assert time.monotonic() < deadline and not task.done(), "the bridge did not commit in time"
                await asyncio.sleep(0.2)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    run(bridge_twice())
    counts = wait_for(lambda: (c := worker.counts()).accepted + c.duplicates >= 2 * produced and c, 90,
                      message="the worker to account for both passes")
    assert (counts.accepted, counts.duplicates, counts.dead_lettered) == (len(event_ids),
                                                                          2 * produced - len(event_ids), 0)
    wait_for(lambda: run(group_lag(s.kafka_bootstrap_servers, topics.landing_group(s),
                                   [topics.REQUESTS.name(s)])) == 0, 60, message="the landing path to commit")
    worker.stop()

    store = open_store(s)
    try:
        rows = store.query("SELECT toString(event_id) AS id, phase, pool, task_id, ttft_s FROM request_events")
    finally:
        store.close()
    assert len(rows) == len(event_ids) and {r["id"] for r in rows} == event_ids
    assert {r["pool"] for r in rows} == {"chat-70b", "llama-70b"}
    assert sum(r["phase"] == "failed" for r in rows) == 10


def test_hostile_records_never_stop_the_bridge(otel_settings, tmp_path):
    """A spans topic created by someone else with a larger limit than Sluice declares: a 10 MB record (cut in its
    dead letter, which must fit the dead-letter topic), deep nesting and a flood of tiny spans, then a good record
    that must still come through."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    s = otel_settings
    big_limit = 16 * 1024 * 1024

    async def create_spans_topic():
        admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap_servers)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topics.otel_topic(s), 1, 1,
                                                topic_configs={"max.message.bytes": str(big_limit)})])
        finally:
            await admin.close()

    run(create_spans_topic())
    run(topics.ensure_topics(s, s.kafka_bootstrap_servers))
    huge = b'{"resourceSpans": [], "padding": "' + b"x" * (10 * 1024 * 1024) + b'"}'
    deep = b'{"resourceSpans": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    good = Spans()
    good.span(attributes=chat(**{"sluice.task_id": "after-the-storm"}), start=time.time_ns() - 10**9)

    async def produce_big():
        producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap_servers, acks="all",
                                    max_request_size=big_limit)
        await producer.start()
        try:
            for value in (huge, deep, good.record()):
                await producer.send_and_wait(topics.otel_topic(s), value)
        finally:
            await producer.stop()

    run(produce_big())
    bridge = BridgeProcess(s, tmp_path / "bridge.log")
    try:
        wait_for(lambda: committed(s), 90, message="the bridge to get past the hostile records")
        totals = bridge.stop()
    finally:
        bridge.kill()
    assert totals["events"] == 1 and totals["dead_letters"] == 2
    (request,) = topic_records(s, topics.REQUESTS)
    assert orjson.loads(request.value)["task_id"] == "after-the-storm"
    letters = {orjson.loads(r.value)["reason"]: orjson.loads(r.value) for r in topic_records(s, topics.DEADLETTER)}
    assert set(letters) == {"oversize", "malformed_json"}
    cut = validate("dead_letter", letters["oversize"])
    assert base64.b64decode(cut["value_b64"]) == huge[:4 * s.max_event_bytes]
    assert f"value cut to its first {4 * s.max_event_bytes} of {len(huge)} bytes" in cut["detail"]
    assert base64.b64decode(letters["malformed_json"]["value_b64"]) == deep


def test_a_refused_produce_rewinds_the_batch_and_commits_nothing(otel_settings):
    """The broker refuses one send: nothing is committed, the batch is read again from its first record, and
    a later pass that goes through commits it (fakes around the real ``_bridge``; no broker needed)."""
    from types import SimpleNamespace

    from aiokafka import TopicPartition
    from aiokafka.errors import KafkaTimeoutError

    s = otel_settings
    records = make_records(tasks=4)
    tp = TopicPartition(topics.otel_topic(s), 0)
    messages = [SimpleNamespace(topic=tp.topic, partition=0, offset=10 + i, timestamp=-1, key=key, value=value)
                for i, (key, value) in enumerate(records)]

    class Consumer:
        def __init__(self):
            self.seeks, self.commits = [], []

        def seek(self, partition, offset):
            self.seeks.append((partition, offset))

        async def commit(self, offsets):
            self.commits.append(offsets)

    class Producer:
        def __init__(self, fail_at):
            self.sent, self.fail_at = [], fail_at

        async def send(self, topic, value, key=None):
            future = asyncio.get_running_loop().create_future()
            if len(self.sent) == self.fail_at:
                future.set_exception(KafkaTimeoutError())
            else:
                future.set_result(None)
            self.sent.append((topic, key))
            return future

    async def scenario():
        bridge, consumer = OtelBridge(s, s.kafka_bootstrap_servers), Consumer()
        bridge._producer = Producer(fail_at=3)
        refused = await bridge._bridge(consumer, {tp: messages})
        assert refused is False and consumer.seeks == [(tp, 10)] and consumer.commits == []
        assert bridge.totals.records == 0 and bridge.totals.produce_failures == 1
        producer = bridge._producer = Producer(fail_at=None)
        assert await bridge._bridge(consumer, {tp: messages}) is True
        assert consumer.commits == [{tp: 10 + len(messages)}] and bridge.totals.records == len(messages)
        return producer.sent

    sent = run(scenario())
    produced, _, reasons = expectations(s, records)
    assert sum(t == topics.REQUESTS.name(s) for t, _ in sent) == produced
    assert sum(t == topics.DEADLETTER.name(s) for t, _ in sent) == len(reasons)


def test_a_producer_that_never_acknowledges_is_replaced_and_the_batch_read_again(otel_settings, monkeypatch):
    """An idempotent producer never gives up on a record: the bridge waited on one for as long as its broker was
    away, or for ever once its sender had died. Past ``delivery_timeout_s`` the batch rewinds uncommitted and
    the producer is replaced; a sender seen dead is replaced before the batch (fakes around the real
    ``_bridge``; no broker needed)."""
    from types import SimpleNamespace

    from aiokafka import TopicPartition

    from pipeline.otel import bridge as bridge_module
    from aiokafka.errors import OutOfOrderSequenceNumber

    from tests.unit.fake_producers import DeliveringProducer, RefusingProducer, StalledProducer

    s = otel_settings
    records = make_records(tasks=2)
    tp = TopicPartition(topics.otel_topic(s), 0)
    messages = [SimpleNamespace(topic=tp.topic, partition=0, offset=i, timestamp=-1, key=key, value=value)
                for i, (key, value) in enumerate(records)]
    consumer = SimpleNamespace(seeks=[], commits=[])
    consumer.seek = lambda partition, offset: consumer.seeks.append((partition, offset))

    async def commit(offsets):
        consumer.commits.append(offsets)

    consumer.commit = commit

    async def stop_producer(producer, timeout_s=0):
        producer.stopped = True

    monkeypatch.setattr(bridge_module, "stop_producer", stop_producer)

    async def scenario():
        bridge = OtelBridge(s, s.kafka_bootstrap_servers)
        stalled, dead, fresh = StalledProducer(sender_done=False), StalledProducer(sender_done=True), []

        async def new_producer():
            fresh.append(DeliveringProducer())
            return fresh[-1]

        bridge._new_producer, bridge.delivery_timeout_s = new_producer, 0.2
        bridge._producer = stalled
        assert await bridge._bridge(consumer, {tp: messages}) is False
        assert consumer.seeks == [(tp, 0)] and consumer.commits == [] and stalled.stopped and len(fresh) == 1
        assert await bridge._bridge(consumer, {tp: messages}) is True
        assert consumer.commits == [{tp: len(messages)}] and fresh[0].delivered
        bridge._producer = dead
        assert await bridge._bridge(consumer, {tp: messages}) is True
        assert dead.queued == [] and dead.stopped and len(fresh) == 2 and fresh[1].delivered
        spoiled = bridge._producer = RefusingProducer(OutOfOrderSequenceNumber())   # every later batch would be too
        assert await bridge._bridge(consumer, {tp: messages}) is False
        assert spoiled.stopped and bridge._producer is fresh[2]
        assert await bridge._bridge(consumer, {tp: messages}) is True and fresh[2].delivered

    run(scenario())
