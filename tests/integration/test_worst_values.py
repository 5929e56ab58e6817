"""Worst values through the real thing: a `sluice worker` subprocess, the real broker, the embedded store, and a
RouterClient obeying the signals — asserting on the decisions routers get and on the rows that land.

The agent tests (tests/agent) check the same worst values against in-memory collaborators; here each one has
to get through Kafka (record sizes, timestamps, compaction, Faust's changelog recovery) and chdb (its own
refusals) as well. Every test but the timestamp one keeps a pool (``hot``) overloaded (or, for the tenants'
forged durations, busy and offered more than it holds) and requires its signals to stay fresh and shedding
while the worst values go by.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import base64
import re
import time
from dataclasses import replace

import orjson
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import InvalidTimestampError, KafkaError
from prometheus_client.parser import text_string_to_metric_families

from pipeline import topics
from pipeline.events import MAX_SOURCE_TIMESTAMP_MS, ReplicaSample, RequestEvent
from pipeline.load.partial import PartialBuilder
from pipeline.load.profiles import BUILTIN
from pipeline.router import Admit, Request, RouterClient
from pipeline.sim.specimens import replica_sample, request_event
from pipeline.sinks.store import open_store
from pipeline.worker.pictures import KEY_SEP, partition_of, stored
from pipeline.worker_process import healthy
from tests.conftest import run, wait_for
from tests.integration.kafka_helpers import pictures_if_read, replace_topic_config, topic_names

pytestmark = pytest.mark.integration

KEYS = {"test": "worst-values-test-secret-0123"}
POLICY = {"step_down": 0.15, "level_step_down": 0.15}
POOL = "hot"
REPLICAS = ("hot-r0", "hot-r1")
HOUR_MS, DAY_MS, YEAR_MS = 3_600_000, 86_400_000, 365 * 86_400_000
SCHEMA_MAX_MS = 4_102_444_800_000   # 2100-01-01: the schemas' bound on event_time
STALE_AFTER_S = 5.0                 # the policy's default: a picture not advancing for this long is stale
HOLD_S = STALE_AFTER_S + 2.5        # how long the pool must stay fresh and shedding after a worst value
BIG = 2_000_000                     # "2 MB": what a raw topic accepts (4 x max_event_bytes) ...
UNDER_1MIB = 1_000_000              # ... and the most a 1 MiB topic (partials, load, admission) takes instead


@pytest.fixture
def loop_settings(settings):
    return replace(settings, tick_s=0.25, fast_window_s=2.0, heartbeat_s=1.0, ingest_batch_within_s=0.05,
                   signing_keys=KEYS, signing_key_id="test", admission_policy=POLICY)


def now_ms() -> int:
    return int(time.time() * 1000)


async def until(condition, timeout_s: float, message: str):
    """conftest's ``wait_for`` off the event loop, so the fleet and the router go on while it polls."""
    return await asyncio.to_thread(wait_for, condition, timeout_s, 0.1, message)


def metric(worker, name: str, **labels) -> float:
    """Sum of ``name``'s samples (with these labels) in the worker's /metrics; 0 if it does not answer."""
    try:
        text = worker.scrape()
    except OSError:
        return 0.0
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def topic_counts(worker, topic: str) -> tuple[int, int, int]:
    """(accepted, duplicates, dead-lettered) of one source topic, as the landing path counted them."""
    return tuple(int(metric(worker, name, topic=topic)) for name in (
        "sluice_events_accepted_total", "sluice_events_duplicate_total", "sluice_events_dead_lettered_total"))


def overloaded_sample(replica: str, time_ms: int, preemptions: int) -> dict:
    return replica_sample(event_time=time_ms, replica_id=replica, pool=POOL, requests_running=16,
                          requests_waiting=40, kv_cache_usage=0.99, preemptions_total=preemptions,
                          prompt_tokens_total=0, generation_tokens_total=0, prefix_cache_hits_total=0,
                          prefix_cache_queries_total=0)


class ShedLoop:
    """An overloaded pool ``hot`` (samples every 0.25 s) and a router following its signals."""

    def __init__(self, settings):
        self.s = settings
        self.router = RouterClient(settings, settings.kafka_bootstrap_servers,
                                   {k: v.encode() for k, v in KEYS.items()}, seed=1)
        self.producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers,
                                         max_request_size=8 * 1024 * 1024, request_timeout_ms=30000)
        self.signals: list[dict] = []   # every signal of POOL the router accepted, in order
        self.pump: asyncio.Task | None = None

    async def __aenter__(self) -> "ShedLoop":
        offer = self.router.book.offer

        def offered(message):
            accepted = offer(message)
            if accepted and (signal := orjson.loads(message))["pool"] == POOL:
                self.signals.append(signal)
            return accepted

        self.router.book.offer = offered
        await self.router.start()
        await self.producer.start()
        self.pump = asyncio.create_task(self._fleet())
        return self

    async def __aexit__(self, *exc) -> None:
        self.pump.cancel()
        await asyncio.gather(self.pump, return_exceptions=True)
        await self.producer.stop()
        await self.router.stop()

    async def _fleet(self) -> None:
        preemptions = dict.fromkeys(REPLICAS, 0)
        topic = topics.REPLICAS.name(self.s)
        while True:
            for replica in REPLICAS:
                preemptions[replica] += 2
                value = orjson.dumps(overloaded_sample(replica, now_ms(), preemptions[replica]))
                await self.producer.send(topic, value, key=replica.encode())
            await asyncio.sleep(0.25)  # the fleet's sampling interval, not a synchronisation

    async def send(self, topic: str, value: bytes | None, key: bytes | None, **kw):
        """Produce one record and wait for the broker's answer (its metadata, or the error it gave)."""
        try:
            return await (await self.producer.send(topic, value, key=key, **kw))
        except KafkaError as exc:
            return exc

    def sheddable(self) -> float | None:
        signal = self.router.book.signals.get(POOL)
        return None if signal is None else signal["admit_fraction"]["sheddable"]

    async def shedding(self, timeout_s: float = 45) -> None:
        await until(lambda: (self.sheddable() or 1.0) < 1.0, timeout_s, f"{POOL} to shed sheddable work")

    async def keeps_shedding(self, since_ms: int, hold_s: float = HOLD_S,
                             request: Request = Request(POOL, "sheddable")) -> list[dict]:
        """Wait for ``hold_s`` of signals issued after ``since_ms``; every one must be fresh (not ``stale``)
        and shed ``request``'s class of new work (for its tenant, if it names one), the seq must advance with
        no gap a router would see as silence, and the router must refuse most such requests."""
        assert not request.continuing, "reads the fractions of new work"
        await until(lambda: self.signals and self.signals[-1]["issued_at"] >= since_ms + hold_s * 1000,
                    hold_s + 30, f"{hold_s:.1f}s of {POOL}'s signals after the worst values")
        window = [s for s in self.signals if s["issued_at"] >= since_ms]

        def admitted(signal: dict) -> float:
            fraction = signal["admit_fraction"][request.priority]
            for entry in signal.get("tenant_admit_fraction", ()):
                if entry["tenant"] == request.tenant:
                    fraction = min(fraction, entry["admit_fraction"][request.priority])
            return fraction

        summary = [(s["seq"], s["state"], admitted(s)) for s in window]
        assert all(s["state"] != "stale" for s in window), f"{POOL} went stale: {summary}"
        assert all(admitted(s) < 1.0 for s in window), f"{POOL} stopped shedding: {summary}"
        seqs = [s["seq"] for s in window]
        assert seqs == sorted(set(seqs)) and len(seqs) >= 3, summary
        issued = [s["issued_at"] for s in window]
        gaps = [b - a for a, b in zip(issued, issued[1:])]
        assert max(gaps) <= 3 * self.s.heartbeat_s * 1000, f"silences of {max(gaps)} ms between signals"
        assert self.router.book.signals[POOL]["valid_until"] > now_ms(), "the router holds no valid signal"
        verdicts = [self.router.decide(request) for _ in range(200)]
        assert sum(not isinstance(v, Admit) for v in verdicts) > 100, f"the router admits {request}"
        return window


def started_worker(settings, worker_factory):
    """A worker on this test's topics (made first), and the names of the two raw topics."""
    run(topics.ensure_topics(settings, settings.kafka_bootstrap_servers))
    return worker_factory(settings).start(), topics.REQUESTS.name(settings), topics.REPLICAS.name(settings)


def dead_letter_rows(settings, where: str = "1") -> list[dict]:
    """Rows of the dead_letters table (the worker must be stopped: the embedded store is one process's)."""
    store = open_store(settings)
    try:
        return store.query(
            "SELECT reason, source_topic, source_partition, source_offset, value_b64, value_size, "
            "toUnixTimestamp64Milli(source_timestamp) AS source_ts FROM dead_letters "
            f"WHERE {where} ORDER BY source_topic, source_partition, source_offset")
    finally:
        store.close()


# what a router's event carries before its attempt ends (received, admitted): no outcome, tokens out or timings
UNENDED_FIELDS = ("schema_version", "event_id", "event_time", "task_id", "request_id", "attempt", "tenant",
                  "priority", "pool", "model", "phase", "input_tokens")


def unended_event(**changes) -> dict:
    """A request event of an attempt not yet ended: the specimen with ``changes``, cut to ``UNENDED_FIELDS``."""
    return {k: v for k, v in request_event(**changes).items() if k in UNENDED_FIELDS}


# 1 -----------------------------------------------------------------------------------------------------------

def test_events_from_the_future_are_dead_lettered_and_a_shedding_pool_keeps_shedding(loop_settings,
                                                                                      worker_factory):
    """An hour, a year and the schema's last instant (2100-01-01, ~73 years) ahead: valid by the schema,
    dead-lettered as ``event_time_ahead`` by both paths; 75 years is past the schema (``out_of_range``).
    Either way the pool's watermark stays put, so its real samples keep its picture fresh and it keeps
    shedding."""
    s = loop_settings
    worker, requests_topic, replicas_topic = started_worker(s, worker_factory)

    async def scenario():
        async with ShedLoop(s) as loop:
            await loop.shedding()
            base = now_ms()
            ahead = {"1h": base + HOUR_MS, "1y": base + YEAR_MS, "2100": SCHEMA_MAX_MS, "75y": base + 75 * YEAR_MS}
            sent = {}
            for label, event_time in ahead.items():
                event = request_event(event_time=event_time, pool=POOL, task_id=f"future-{label}",
                                      request_id=f"future-{label}-r1")
                sample = overloaded_sample("hot-r0", event_time, 10**6)
                sample["requests_waiting"] = 0  # a calm sample from the future: it would end the shedding
                sample["kv_cache_usage"] = 0.1
                for topic, doc, key in ((requests_topic, event, event["task_id"]),
                                        (replicas_topic, sample, "hot-r0")):
                    md = await loop.send(topic, orjson.dumps(doc), key.encode())
                    assert not isinstance(md, Exception), md
                    sent[doc["event_id"]] = "out_of_range" if label == "75y" else "event_time_ahead"
            await until(lambda: metric(worker, "sluice_control_events_total", outcome="dead_lettered") >= len(sent),
                        30, "the control path to dead-letter the events from the future")
            window = await loop.keeps_shedding(now_ms())
            counts = await until(lambda: (c := worker.counts()).dead_lettered >= len(sent) and c, 30,
                                 "the landing path to land the dead letters")
            return sent, window, counts

    sent, window, counts = run(scenario())
    assert counts.reasons == {"event_time_ahead": 6, "out_of_range": 2}, counts.reasons
    assert metric(worker, "sluice_control_events_total", outcome="dead_lettered") == len(sent)
    worker.stop()

    letters = dead_letter_rows(s)
    got = {orjson.loads(base64.b64decode(r["value_b64"]))["event_id"]: r["reason"] for r in letters}
    assert got == sent, "each event from the future is one row of dead_letters, with its reason and bytes"
    most = max(x["admit_fraction"]["sheddable"] for x in window)
    print(f"\nfuture events: {len(sent)} dead-lettered; {len(window)} signals over {HOLD_S}s after, all "
          f"{sorted({x['state'] for x in window})}, sheddable <= {most}")


def test_a_source_whose_clock_runs_fast_within_the_skew_cannot_blind_a_shedding_pool(loop_settings, worker_factory):
    """A third replica of the pool, and requests, stamped by a clock 45 s fast: inside max_clock_skew_s, so
    accepted. Folded at their own times they would carry the pool's watermark 45 s ahead: every real sample
    late, the real replicas stale, the pool read as one calm replica, and the shedding would stop. The control
    path folds them as of its own clock, so the real replicas keep the pool shedding."""
    s = loop_settings
    worker, requests_topic, replicas_topic = started_worker(s, worker_factory)

    async def scenario():
        async with ShedLoop(s) as loop:
            await loop.shedding()

            async def fast_source():
                for n in range(10**6):
                    fast_ms = now_ms() + 45_000
                    sample = overloaded_sample("hot-fast", fast_ms, 0) | {
                        "requests_running": 0, "requests_waiting": 0, "kv_cache_usage": 0.05}
                    event = request_event(event_time=fast_ms, pool=POOL, task_id=f"fast-{n}", request_id=f"fast-{n}-r1")
                    await loop.producer.send(replicas_topic, orjson.dumps(sample), key=b"hot-fast")
                    await loop.producer.send(requests_topic, orjson.dumps(event), key=event["task_id"].encode())
                    await asyncio.sleep(0.25)  # the fast source's sampling interval, not a synchronisation

            source = asyncio.create_task(fast_source())
            try:
                await until(lambda: metric(worker, "sluice_control_events_ahead_of_clock_total") >= 8, 30,
                            "the control path to fold the fast clock's events")
                return await loop.keeps_shedding(now_ms())
            finally:
                source.cancel()
                await asyncio.gather(source, return_exceptions=True)

    window = run(scenario())
    assert metric(worker, "sluice_control_events_total", outcome="dead_lettered") == 0, "inside the skew: folded, not refused"
    print(f"\nfast clock: {len(window)} signals over {HOLD_S}s, all {sorted({x['state'] for x in window})}, "
          f"sheddable <= {max(x['admit_fraction']['sheddable'] for x in window)}")


# 2 -----------------------------------------------------------------------------------------------------------

def badly_named_tenant_partial(requests_topic: str) -> bytes:
    """A current, well-formed partial of the pool whose tenant counts name a tenant no event could name: merged,
    the name would reach the signal's tenant list, which routers validate, and they would refuse every signal
    of the pool. Stage 2 must refuse the partial instead."""
    builder = PartialBuilder(f"{requests_topic}/0", 15)
    builder.fold_request(RequestEvent(**request_event(pool=POOL, event_time=now_ms())))
    (partial,) = builder.drain("badly-named-tenant")
    doc = orjson.loads(partial.to_bytes())
    (second,) = doc["requests"].values()
    second |= {"received": 500, "received_standard": 500, "tenants": {"bad name!": [500, 0]},
               "tenant_classes": {"bad name!": [0, 500, 0, 0]}}
    return orjson.dumps(doc)


def hostile_tenant_work_partial(requests_topic: str) -> bytes:
    """A current partial whose per-tenant work counts are negative: merged, a tenant would read negative seconds
    in service a request and turn the requests/s ceiling's work ratio upside down while it is listed. Refused
    whole."""
    builder = PartialBuilder(f"{requests_topic}/2", 15)
    builder.fold_request(RequestEvent(**request_event(pool=POOL, event_time=now_ms())))
    (partial,) = builder.drain("hostile-tenant-work")
    doc = orjson.loads(partial.to_bytes())
    (second,) = doc["requests"].values()
    second |= {"tenant_service": {"acme": [500, -10**12]}}
    return orjson.dumps(doc)


def absurd_partial(requests_topic: str) -> bytes:
    """A current, well-formed partial of the pool whose counts are negative: merged (as it was before partials
    were checked), it takes a billion arrivals and completions out of the pool's window, so its demand and
    goodput read negative. Stage 2 must refuse it whole."""
    builder = PartialBuilder(f"{requests_topic}/1", 15)
    builder.fold_request(RequestEvent(**request_event(pool=POOL, event_time=now_ms())))
    (partial,) = builder.drain("absurd")
    doc = orjson.loads(partial.to_bytes())
    (second,) = doc["requests"].values()
    second |= {"received": -10**9, "received_standard": -10**9, "completed": -10**9}
    return orjson.dumps(doc)


GARBAGE = [b"\x00\xff\xfe\x80 not even UTF-8", b"not json", b"", b"[]", b"null", b'"a string"', b"1e999",
           b"{" * 10_000,  # nested past any parser's depth
           b'{"schema_version": "1", "event_id": 7, "event_time": "now", "pool": ["hot"], "replica_id": null}',
           b'{"id": 1, "pool": "hot", "newest_ms": "x", "requests": {"a": 1}, "replicas": []}',
           b'{"pool": "hot", "watermark_ms": -1, "axes": 5, "seq": 18446744073709551616}']


def test_garbage_on_every_topic_the_worker_reads_costs_records_not_the_worker(loop_settings, worker_factory):
    """Bytes that are no event, no partial, no picture and no signal — empty, wrong types, nested 10,000
    deep, 2 MB where the topic takes it (the raw topics; 1 MB on the 1 MiB ones), tombstones and null
    keys, plus a well-formed partial from 2100, one naming a tenant no event could (which, merged, would
    make routers refuse every signal of the pool) and two with negative counts (the pool's, a tenant's work) on
    the partials topic — on requests, replicas, partials,
    load and admission, keyed like the overloaded pool. The worker stays up and healthy, every raw and
    admission record is dead-lettered, and the pool's signals go on, fresh and shedding."""
    s = loop_settings
    run(topics.ensure_topics(s, s.kafka_bootstrap_servers))
    worker = worker_factory(s).start()
    names = {spec: spec.name(s) for spec in (topics.REQUESTS, topics.REPLICAS, topics.PARTIALS, topics.LOAD,
                                             topics.ADMISSION)}
    keys = {topics.REQUESTS: b"task-garbage", topics.REPLICAS: b"hot-r0", topics.PARTIALS: POOL.encode(),
            topics.LOAD: POOL.encode(), topics.ADMISSION: POOL.encode()}

    future = PartialBuilder(f"{names[topics.REQUESTS]}/0", 15)
    future.fold_request(RequestEvent(**request_event(pool=POOL, event_time=SCHEMA_MAX_MS)))
    (future_partial,) = future.drain("999999-999999")

    async def scenario():
        async with ShedLoop(s) as loop:
            await loop.shedding()
            seq_before = loop.signals[-1]["seq"]
            refused_before = sum(loop.router.book.refused.values())
            sent: dict[str, list] = {name: [] for name in names.values()}
            big_sizes = {}
            for spec, name in names.items():
                values = [*GARBAGE, None]
                if spec is topics.PARTIALS:
                    values += [future_partial.to_bytes(), badly_named_tenant_partial(names[topics.REQUESTS]),
                               absurd_partial(names[topics.REQUESTS]),
                               hostile_tenant_work_partial(names[topics.REQUESTS])]
                for value in values:
                    md = await loop.send(name, value, keys[spec])
                    assert not isinstance(md, Exception), (name, value[:40] if value else value, md)
                    sent[name].append(value)
                md = await loop.send(name, GARBAGE[0], None)    # no key at all
                if spec.compacted:                              # a compacted topic refuses a record without
                    assert isinstance(md, KafkaError), md       # a key (the broker's CorruptRecordException)
                else:
                    assert not isinstance(md, Exception), (name, md)
                    sent[name].append(GARBAGE[0])
                big = await loop.send(name, b"\xff" * BIG, keys[spec])
                if isinstance(big, Exception):                  # the topic refuses it: the most it takes
                    big = await loop.send(name, b"\xff" * UNDER_1MIB, keys[spec])
                    assert not isinstance(big, Exception), (name, big)
                    big_sizes[name] = UNDER_1MIB
                else:
                    big_sizes[name] = BIG
                sent[name].append(b"\xff" * big_sizes[name])
            since = now_ms()
            raw = [names[topics.REQUESTS], names[topics.REPLICAS]]
            expected = {t: len(sent[t]) for t in raw}
            expected[names[topics.ADMISSION]] = sum(v is not None for v in sent[names[topics.ADMISSION]])
            await until(lambda: all(topic_counts(worker, t)[2] >= n for t, n in expected.items()), 60,
                        "the landing path to dead-letter every raw and admission record")
            await until(lambda: metric(worker, "sluice_partials_refused_total") >= 1, 30,
                        "stage 2 to refuse the partial from 2100")
            window = await loop.keeps_shedding(since)
            assert window[-1]["seq"] > seq_before
            refused = sum(loop.router.book.refused.values()) - refused_before
            return (expected, big_sizes, window, refused, dict(loop.router.book.refused),
                    sent[names[topics.PARTIALS]], sent[names[topics.LOAD]])

    expected, big_sizes, window, refused, reasons, sent_partials, sent_load = run(scenario())
    assert worker.proc.poll() is None and healthy(worker.base_url), "the worker is up and healthy"
    for topic, n in expected.items():
        accepted, duplicates, dead = topic_counts(worker, topic)
        assert dead == n and duplicates == 0, (topic, accepted, duplicates, dead)
    assert topic_counts(worker, names[topics.REQUESTS])[0] == 0, "no garbage passed as a request event"
    assert refused >= expected[names[topics.ADMISSION]], f"the router saw the garbage signals: {reasons}"
    log = worker.log_path.read_text(errors="replace")
    skipped_partials = log.count("ignored a partial that does not parse or merge")
    skipped_pictures = log.count(f"skipped a record of {names[topics.LOAD]}")
    worker.stop()
    assert skipped_partials == len(sent_partials) - 1, \
        "stage 2 skipped each garbage partial, the badly named tenant's and the negative ones (and refused 2100's)"
    assert skipped_pictures == sum(v is not None for v in sent_load), "the fleet view skipped each non-picture"

    letters = dead_letter_rows(s)
    by_topic = {}
    for row in letters:
        by_topic[row["source_topic"]] = by_topic.get(row["source_topic"], 0) + 1
    assert by_topic == expected, "one dead_letters row per bad raw or admission record"
    assert max(r["value_size"] for r in letters) == BIG, "the 2 MB record landed whole in dead_letters"
    print(f"\ngarbage: dead-lettered {expected}; largest accepted per topic {big_sizes}; stage 2 skipped "
          f"{skipped_partials} partial(s), the fleet view {skipped_pictures} picture(s); router refused "
          f"{reasons}; {len(window)} signals after, all {sorted({x['state'] for x in window})}")


# 3 -----------------------------------------------------------------------------------------------------------

LONG_MAX = 2**63 - 1


def test_hostile_record_timestamps_cost_nothing_and_every_record_is_accounted_for(settings, worker_factory):
    """Kafka timestamps the broker takes by default (0, -1, -5, now + 50 min: the broker refuses more than
    an hour ahead, log.message.timestamp.after.max.ms = 3,600,000 in Kafka 4.1, and nothing behind,
    before.max.ms = Long.MAX), and, once the topic allows any time ahead, up to Long.MAX — on malformed
    records (whose dead letters carry the timestamp when a store can hold it, else null) and on valid and
    re-sent events. Every record is accepted, a duplicate or dead-lettered; every dead letter lands."""
    s = replace(settings, ingest_batch_within_s=0.05)
    bootstrap = s.kafka_bootstrap_servers
    run(topics.ensure_topics(s, bootstrap))
    topic = topics.REQUESTS.name(s)
    worker = worker_factory(s).start()
    now = now_ms()
    by_default = [0, -1, -5, now + 50 * 60_000]
    once_allowed = [now + 2 * HOUR_MS, MAX_SOURCE_TIMESTAMP_MS, MAX_SOURCE_TIMESTAMP_MS + 1, 253_402_300_799_999,
                    2**62, LONG_MAX]

    async def produce():
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=30000)
        await producer.start()
        letters, events, refused = {}, [], []

        async def send(value, ts):
            try:
                return await (await producer.send(topic, value, key=b"ts-task", timestamp_ms=ts))
            except KafkaError as exc:
                return exc

        def valid(**kw):
            return orjson.dumps(request_event(task_id="ts-task", request_id="ts-task-r1", pool="ts-pool",
                                              event_time=now_ms(), **kw))

        try:
            for ts in [*by_default, *once_allowed]:
                md = await send(b'{"schema_version": 1, "event_id": "not json', ts)
                if isinstance(md, KafkaError):
                    refused.append(ts)
                else:
                    letters[(md.partition, md.offset)] = ts
            assert refused == once_allowed, f"the broker's defaults refuse exactly these: {refused}"
            config = {**topics.REQUESTS.config(s), "message.timestamp.after.max.ms": str(LONG_MAX)}
            await replace_topic_config(bootstrap, topic, config)
            # AlterConfigs returns before the broker's log applies the change (KRaft publishes it with the next
            # metadata image): until then a record an hour ahead is still refused, and not written
            applied_by = time.monotonic() + 30
            for ts in once_allowed:
                md = await send(b'{"schema_version": 1, "event_id": "not json', ts)
                while isinstance(md, InvalidTimestampError) and time.monotonic() < applied_by:
                    await asyncio.sleep(0.2)
                    md = await send(b'{"schema_version": 1, "event_id": "not json', ts)
                assert not isinstance(md, KafkaError), (ts, md)
                letters[(md.partition, md.offset)] = ts
            for ts in (0, -1, now + 50 * 60_000, LONG_MAX):
                value = valid()
                events.append(await send(value, ts))
                if ts == LONG_MAX:  # a producer retry of the same event, far in the future by Kafka's clock
                    events.append(await send(value, 2**62))
            assert not any(isinstance(md, KafkaError) for md in events), events
        finally:
            await producer.stop()
        return letters, events

    letters, events = run(produce())
    produced = len(letters) + len(events)
    counts = wait_for(lambda: sum(c := topic_counts(worker, topic)) >= produced and c, 60,
                      message="the landing path to account for every record")
    assert counts == (len(events) - 1, 1, len(letters)), f"(accepted, duplicates, dead-lettered) = {counts}"
    assert worker.proc.poll() is None and healthy(worker.base_url)
    worker.stop()

    rows = dead_letter_rows(s)
    got = {(r["source_partition"], r["source_offset"]): r["source_ts"] for r in rows}
    expected = {where: ts if 0 <= ts <= MAX_SOURCE_TIMESTAMP_MS else None for where, ts in letters.items()}
    assert got == expected, "one dead_letters row per malformed record, with its timestamp when storable"
    assert {r["reason"] for r in rows} == {"malformed_json"}
    store = open_store(s)
    try:
        (landed,) = store.query("SELECT count() AS n, uniqExact(event_id) AS ids FROM request_events "
                                "WHERE pool = 'ts-pool'")
    finally:
        store.close()
    assert landed == {"n": len(events) - 1, "ids": len(events) - 1}
    print(f"\nhostile timestamps: {len(letters)} dead letters landed (timestamps {sorted(letters.values())}), "
          f"{len(events) - 1} events landed, 1 duplicate dropped")


# 4 -----------------------------------------------------------------------------------------------------------

def test_a_block_the_store_refuses_for_its_spread_neither_stalls_landing_nor_touches_decisions(loop_settings,
                                                                                              worker_factory):
    """101 valid request events of one pool, one task (one partition, one block), one per day over 101 days:
    ClickHouse refuses the insert (code 252, too many partitions for one INSERT block). The block lands in
    halves, each event lands or is dead-lettered (store_rejected), the next events behind it land, and the
    overloaded pool's decisions do not notice."""
    s = replace(loop_settings, sink_block_age_s=3.0)  # the 101 events gather into one block
    run(topics.ensure_topics(s, s.kafka_bootstrap_servers))
    worker = worker_factory(s).start()
    topic = topics.REQUESTS.name(s)
    task = "archive-task"

    def archived(event_time):
        return request_event(pool="archive", task_id=task, request_id=f"{task}-r1", event_time=event_time)

    async def scenario():
        async with ShedLoop(s) as loop:
            await loop.shedding()
            since = now_ms()
            today = since - since % DAY_MS + HOUR_MS
            spread = [archived(today - day * DAY_MS) for day in range(1, 102)]
            sends = [await loop.producer.send(topic, orjson.dumps(e), key=task.encode()) for e in spread]
            partitions = {md.partition for md in await asyncio.gather(*sends)}
            assert len(partitions) == 1
            await until(lambda: sum(topic_counts(worker, topic)) >= len(spread), 90,
                        "the landing path to land or dead-letter the 101-day block")
            later = [archived(now_ms()) for _ in range(5)]
            for e in later:
                md = await loop.send(topic, orjson.dumps(e), task.encode())
                assert not isinstance(md, Exception), md
            counts = await until(lambda: sum(c := topic_counts(worker, topic)) >= len(spread) + len(later) and c,
                                 60, "the events behind the refused block to land")
            window = await loop.keeps_shedding(since)
            return spread, later, counts, window

    spread, later, counts, window = run(scenario())
    reasons = worker.counts().reasons
    worker.stop()
    log = worker.log_path.read_text(errors="replace")
    assert re.search(r"store refused block request_events:\S+ \(.*Too many partitions for single INSERT block", log), \
        "the store refused the 101-day block (else this test tests nothing)"

    accepted, duplicates, dead = counts
    assert duplicates == 0 and accepted + dead == len(spread) + len(later)
    assert dead == reasons.get("store_rejected", 0), reasons
    store = open_store(s)
    try:
        rows = store.query("SELECT toString(event_id) AS id, toDate(event_time) AS day FROM request_events "
                           "WHERE pool = 'archive'")
    finally:
        store.close()
    letters = dead_letter_rows(s, "reason = 'store_rejected'")
    landed_ids = {r["id"] for r in rows}
    rejected_ids = {orjson.loads(base64.b64decode(r["value_b64"]))["event_id"] for r in letters}
    assert len(rows) == len(landed_ids) == accepted and len(letters) == dead
    assert landed_ids | rejected_ids == {e["event_id"] for e in spread + later} and not landed_ids & rejected_ids
    assert {e["event_id"] for e in later} <= landed_ids, "the events behind the refused block landed"
    print(f"\n101-day block: refused whole by the store, then {accepted} rows landed over "
          f"{len({r['day'] for r in rows})} days, {dead} dead-lettered; {len(window)} signals meanwhile, all "
          f"{sorted({x['state'] for x in window})}")


# 5 -----------------------------------------------------------------------------------------------------------

async def produce_one(bootstrap: str, topic: str, value: bytes, key: bytes, **kw) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        await (await producer.send(topic, value, key=key, **kw))
    finally:
        await producer.stop()


def test_a_changelog_poisoned_from_the_future_before_start_does_not_pin_the_pool(loop_settings, worker_factory):
    """Stage 2's changelog holds, for the overloaded pool, partials from the future — one kept before
    event times were bounded (2099, the raw partial as the table once stored it) and one an hour ahead
    (as the table stores partials now, with a fresh merge time) — when the worker starts and rebuilds its
    pictures from it. The rebuilt pool follows the real samples: fresh, and shedding."""
    s = loop_settings
    bootstrap = s.kafka_bootstrap_servers
    run(topics.ensure_topics(s, bootstrap))
    first = worker_factory(s).start()  # creates the changelog as a worker does
    changelog = topics.changelog_topic(s)
    wait_for(lambda: changelog in run(topic_names(bootstrap)), 30, message=f"{changelog} to exist")
    # Stopped right away: a SIGTERM while the landing path resumes its first partitions used to hang the
    # worker until SIGKILL (the store was closed under the resume, which held and retried forever).
    first.stop(timeout_s=30)
    assert first.proc.returncode != -signal.SIGKILL, "the worker ignored SIGTERM"

    now = now_ms()
    old = PartialBuilder(f"{topics.REQUESTS.name(s)}/1", 15)
    old.fold_request(RequestEvent(**request_event(pool=POOL, event_time=4_102_000_000_000)))
    (old_partial,) = old.drain("0-0")
    ahead = PartialBuilder(f"{topics.REPLICAS.name(s)}/0", 15)
    ahead.fold_sample(ReplicaSample(**overloaded_sample("hot-r0", now + HOUR_MS, 0)))
    (ahead_partial,) = ahead.drain("0-0")
    poison = {POOL.encode() + KEY_SEP + old_partial.id.encode(): old_partial.to_bytes(),
              POOL.encode() + KEY_SEP + ahead_partial.id.encode(): stored(ahead_partial.to_bytes(), now)}
    partition = partition_of(POOL.encode(), topics.PARTIALS.partitions(s))

    for key, value in poison.items():
        run(produce_one(bootstrap, changelog, value, key, partition=partition))
    worker = worker_factory(s).start()

    async def scenario():
        async with ShedLoop(s) as loop:
            await until(lambda: metric(worker, "sluice_partials_refused_total") >= len(poison), 60,
                        "stage 2 to meet the poisoned partials while rebuilding from its changelog")
            await loop.shedding()
            window = await loop.keeps_shedding(now_ms())
            pictures, deadline = {}, time.monotonic() + 60
            while POOL not in pictures:   # a read cut short is "not yet", not an older picture
                assert time.monotonic() < deadline, f"no whole read of {POOL}'s picture within 60 s"
                pictures = await pictures_if_read(s)
            return window, pictures

    window, pictures = run(scenario())
    watermark = pictures[POOL]["watermark_ms"]
    assert now_ms() - 10_000 < watermark <= now_ms(), f"{POOL}'s watermark {watermark} follows the real samples"
    log = worker.log_path.read_text(errors="replace")
    assert re.search(rf"ignored partial {re.escape(old_partial.id)} of pool {POOL}", log)
    assert re.search(rf"ignored partial {re.escape(ahead_partial.id)} of pool {POOL}", log)
    print(f"\npoisoned changelog: both partials from the future ignored on rebuild; {len(window)} signals after, "
          f"all {sorted({x['state'] for x in window})}; watermark {now_ms() - watermark} ms behind the clock")


# 6 -----------------------------------------------------------------------------------------------------------

LIE_FROM_S, LIE_TO_S = 10.0, 30.0   # when, in the live run's seconds, one replica lies (then is honest again)
LEAP_FROM_S, QUIET_FROM_S = 16.0, 22.0   # its queue lie gives way to leaping counters, then it goes quiet
def steady_fleet(settings, worker_factory, seconds: float):
    """A simulated fleet of ``seconds`` and a worker tuned to its SLO capacity: (fleet, capacity, settings,
    started worker)."""
    from pipeline.sim.scenarios import Fleet, slo_capacity, sluice_settings

    fleet = Fleet(duration_s=seconds, drain_s=10.0)
    capacity = slo_capacity(fleet, fleet.replicas)
    tuned = replace(sluice_settings(capacity, settings), retention_days=0)
    return fleet, capacity, tuned, worker_factory(tuned).start()


def steady_beside(settings, fleet, capacity, watch, beside, clock: dict, seen: list) -> None:
    """The steady scenario live through the worker, with ``beside(producer)`` producing next to its routers and
    agents until it returns. Every 0.25 s: ``clock["now"]`` is the run's second, the routers' admit fractions
    are appended to ``seen`` and ``watch(now, picture)`` sees the pool's newest picture."""
    from pipeline.sim.live import run_live
    from pipeline.sim.scenarios import POOL as SIM_POOL, SCENARIOS

    def watching(now, sim, pictures):
        clock["now"] = now
        signal = sim.controller.router.book.signals.get(SIM_POOL)
        if signal is not None:
            seen.append((now, dict(signal["admit_fraction"])))
        watch(now, pictures.get(SIM_POOL, {}))

    async def scenario():
        producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers)
        await producer.start()
        try:
            alongside = asyncio.create_task(beside(producer))
            await run_live(settings, SCENARIOS["steady"], fleet, capacity, settings.kafka_bootstrap_servers,
                           display=watching, display_every_s=0.25)
            await alongside
        finally:
            await producer.stop()

    run(scenario())


LEAP_PER_SAMPLE = {"prompt_tokens_total": 20_000_000, "generation_tokens_total": 2_000_000,
                   "preemptions_total": 5_000}   # per 0.5 s: inside the counter-jump bound for one GPU (1e8/s)


def test_a_replica_reporting_an_absurd_queue_or_counters_cannot_shed_its_pool(settings, worker_factory):
    """A replica (a broken GPU agent or a hostile ``gpu-agent`` principal) lies for 20 s beside a fleet at
    0.7× its SLO capacity: first the schema's largest ``requests_waiting`` (1,000,000), then counters that
    leap by 40M prompt tokens and 10,000 preemptions a second (well inside the schema and the counter-jump
    bound), and then it goes quiet for 8 s (not yet stale, its last leaps still in the fast window), and comes
    back honest with its counters restarted.

    Summed with its siblings' queues, that read as a pool at the queue axis's cap: the pool shed while its
    other replicas sat idle, and the serving capacity measured from completions followed the shedding down
    (this test used to assert both, and that they ended within a minute after the lie). Now the highest
    replica counts at most 4× the next highest, or what alone takes the axis to half the pool's limit
    (``replica_outliers``; the queue, and the token rate and preemptions over every replica with deltas in the
    window): the pictures name the liar for each lie, the compute and KV axes stay below their limits,
    critical and standard work is never shed, sheddable work is admitted in full again while the lies go on
    (the step to half the limit briefly trims it), and the serving capacity holds. Deferrable work may stay
    partly deferred during the lie (half the limit, on top of the fleet's own queue, is where the policy
    starts deferring it: measured, session 19)."""
    from pipeline.sim.scenarios import POOL as SIM_POOL

    fleet, capacity, tuned, worker = steady_fleet(settings, worker_factory, LIE_TO_S + 10)
    clock = {"now": 0.0}
    seen: list[tuple[float, dict]] = []
    named: list[float] = []   # when a picture named the liar as an outlier
    capacities: list[tuple[float, float]] = []
    axes: list[tuple[float, float, float]] = []   # (when, compute pressure, KV pressure) while the counters lie

    def watch(now, picture):
        if f"{SIM_POOL}-liar" in picture.get("replicas", {}).get("outlier_ids", []):
            named.append(now)
        if LEAP_FROM_S <= now < LIE_TO_S and "axes" in picture:
            axes.append((now, picture["axes"]["compute"]["pressure"], picture["axes"]["kv_cache"]["pressure"]))
        if not capacities or now - capacities[-1][0] >= 1.0:
            capacities.append((now, metric(worker, "sluice_pool_serving_capacity_rps", pool=SIM_POOL)))

    async def liar(producer):
        topic = topics.REPLICAS.name(tuned)
        counters = dict.fromkeys(LEAP_PER_SAMPLE, 0)
        while clock["now"] < LIE_TO_S + 5:
            now = clock["now"]
            if LEAP_FROM_S <= now < QUIET_FROM_S:
                counters = {name: value + LEAP_PER_SAMPLE[name] for name, value in counters.items()}
            elif now >= LIE_TO_S:
                counters = dict.fromkeys(LEAP_PER_SAMPLE, 0)   # an agent restarted: counters from zero
            if not QUIET_FROM_S <= now < LIE_TO_S:
                sample = replica_sample(event_time=now_ms(), replica_id=f"{SIM_POOL}-liar", pool=SIM_POOL,
                                        hardware=fleet.hardware.name, gpu_count=fleet.hardware.gpu_count,
                                        requests_running=0,
                                        requests_waiting=1_000_000 if LIE_FROM_S <= now < LEAP_FROM_S else 0,
                                        kv_cache_usage=0.3, prefix_cache_hits_total=0,
                                        prefix_cache_queries_total=0, **counters)
                await (await producer.send(topic, orjson.dumps(sample), key=sample["replica_id"].encode()))
            await asyncio.sleep(0.5)   # the agent's sampling interval, not a synchronisation

    steady_beside(worker.settings, fleet, capacity, watch, liar, clock, seen)
    during_lie = [(t, a) for t, a in seen if LIE_FROM_S <= t <= LIE_TO_S]
    trail = [(round(t), a) for t, a in during_lie[::8]]
    assert named and LIE_FROM_S <= min(named) <= LIE_FROM_S + 5, f"the pictures never named the queue's liar: {named}"
    counted = [t for t in named if LEAP_FROM_S + 2 <= t < LIE_TO_S]   # its queue reads 0 from LEAP_FROM_S on
    assert counted and min(counted) <= LEAP_FROM_S + 5 and max(counted) >= QUIET_FROM_S + 3, \
        f"the pictures did not name the counters' liar while it leapt and after it went quiet: {counted}"
    highest = (max(c for _, c, _ in axes), max(k for _, _, k in axes))
    # uncapped, the leaps read as hundreds of times the compute limit; capped, at most half the limit is added
    # to the fleet's own rate (0.4-0.5 here), and the admission assertions below say what that costs
    assert highest[0] < 1.2 and highest[1] < 1.0, f"the leaping counters took compute or KV pressure to {highest}"
    assert all(a["critical"] == a["standard"] == 1.0 for _, a in during_lie), f"the lie shed real work: {trail}"
    open_at = next((t for t, a in during_lie if t >= LIE_FROM_S + 5 and a["sheddable"] == 1.0), None)
    assert open_at is not None and all(a["sheddable"] == 1.0 for t, a in during_lie if t >= open_at + 5), \
        f"the lie kept sheddable work out while it went on: {trail}"
    budgets = [(round(t), round(c, 1)) for t, c in capacities[::4]]
    profile = tuned.profiles["sim-pool"]["capacity_rps_per_replica"] * fleet.replicas   # the demand axis's limit
    during = [c for t, c in capacities if LIE_FROM_S <= t and c > 0]   # 0: a scrape the worker did not answer
    assert min(during) >= 0.5 * profile, f"the lie drove the serving capacity down: {budgets}"
    lowest = {cls: min(a[cls] for _, a in during_lie) for cls in ("sheddable", "deferrable")}
    print(f"\na replica lying for {LIE_TO_S - LIE_FROM_S:.0f} s: named an outlier {min(named) - LIE_FROM_S:.1f} s "
          f"into its queue lie and {min(counted) - LEAP_FROM_S:.1f}–{max(counted) - LEAP_FROM_S:.1f} s into its "
          f"counters' (quiet from {QUIET_FROM_S - LEAP_FROM_S:.0f} s); compute / KV pressure at most "
          f"{highest[0]:.2f} / {highest[1]:.2f}; critical and standard never shed; lowest {lowest}, sheddable "
          f"admitted in full again {open_at - LIE_FROM_S:.1f} s into the lie; serving capacity "
          f"{profile:.1f} → {min(during):.1f} req/s at the least")


CLAIM_FROM_S, CLAIM_TO_S = 10.0, 30.0   # when a router claims absurd prompt sizes, in the live run's seconds
CLAIM_EVERY_S, CLAIM_BURST = 3.0, 2     # two claims at once every 3 s: about 1.2% of the pool's arrivals at
# 0.7× capacity, and up to 2% of the newest 2 s


def test_a_router_claiming_absurd_prompt_sizes_cannot_shrink_the_budget(settings, worker_factory):
    """Routers may put the prompt's size on ``received`` (``input_tokens``): the policy budgets the profile's
    capacity ÷ how much heavier the newest arrivals are than the fast window's (``mix_shift``).
    A router (a bug, or a hostile ``router`` principal) sends, beside a fleet at 0.7× its SLO capacity whose
    routers count their prompts, two arrivals at once every 3 s claiming the contract's largest prompt
    (10,000,000 tokens), for 20 s.

    Unclipped, two such claims among the newest 2 s of arrivals would read as a mix hundreds of times heavier
    (the policy's cap, 4×). Each prompt counts at most four times the p90 of the window's earlier seconds, which
    a burst cannot raise and claims under a tenth of the arrivals cannot move: the policy never reads a turn of
    the mix in the pictures, the serving capacity stays the profile's, and no class is shed."""
    from pipeline.admission.policy import AdmissionConfig, mix_shift
    from pipeline.sim.scenarios import POOL as SIM_POOL

    fleet, capacity, tuned, worker = steady_fleet(settings, worker_factory, CLAIM_TO_S + 5)
    clock = {"now": 0.0}
    seen: list[tuple[float, dict]] = []
    ratios: list[float] = []        # the newest arrivals' clipped mean prompt ÷ the window's, while the claims go on
    shifts: list[float] = []        # what the policy makes of each of those pictures (1.0: the mix did not turn)
    capacities: list[float] = []

    def watch(now, picture):
        detail = picture.get("axes", {}).get("demand", {}).get("detail", {})
        if CLAIM_FROM_S + 2 <= now <= CLAIM_TO_S and detail.get("prompt_tokens_window_mean"):
            ratios.append(detail["prompt_tokens_recent_mean"] / detail["prompt_tokens_window_mean"])
            shifts.append(mix_shift(picture, AdmissionConfig()))
        if CLAIM_FROM_S <= now <= CLAIM_TO_S:
            capacities.append(metric(worker, "sluice_pool_serving_capacity_rps", pool=SIM_POOL))

    async def claimant(producer):
        topic, n = topics.REQUESTS.name(tuned), 0
        while clock["now"] < CLAIM_TO_S:
            for _ in range(CLAIM_BURST if clock["now"] >= CLAIM_FROM_S else 0):
                n += 1
                event = unended_event(event_time=now_ms(), task_id=f"claim-{n}", request_id=f"claim-{n}-s0",
                                      pool=SIM_POOL, model=f"model-{SIM_POOL}", phase="received",
                                      input_tokens=10_000_000)
                await (await producer.send(topic, orjson.dumps(event), key=event["task_id"].encode()))
            await asyncio.sleep(CLAIM_EVERY_S)   # the claims' pace, not a synchronisation

    steady_beside(worker.settings, fleet, capacity, watch, claimant, clock, seen)
    during = [(round(t, 1), a) for t, a in seen if CLAIM_FROM_S <= t <= CLAIM_TO_S]
    assert len(ratios) > 20, f"the pictures carried no prompt sizes: {len(ratios)}"
    assert set(shifts) == {1.0}, f"the claims read as a heavier mix: {sorted(shifts)[-5:]}"
    profile = tuned.profiles["sim-pool"]["capacity_rps_per_replica"] * fleet.replicas
    assert all(c == pytest.approx(profile) for c in capacities if c > 0), f"the budget moved: {set(capacities)}"
    shed = [(t, a) for t, a in during if min(a[c] for c in ("critical", "standard", "sheddable")) < 1.0]
    assert not shed, f"the claims shed real work: {shed[:5]}"
    print(f"\n{CLAIM_BURST} claims of a 10M-token prompt every {CLAIM_EVERY_S:.0f} s "
          f"for {CLAIM_TO_S - CLAIM_FROM_S:.0f} s: "
          f"newest ÷ window prompts at most {max(ratios):.2f}, never a turn of the mix; serving capacity "
          f"{profile:.1f} req/s throughout; nothing shed")


# 8 -----------------------------------------------------------------------------------------------------------

SPARE = "spare"   # a calm pool beside ``hot``, serving another model


def calm_sample(replica: str, time_ms: int) -> dict:
    return replica_sample(event_time=time_ms, replica_id=replica, pool=SPARE, requests_running=1,
                          requests_waiting=0, kv_cache_usage=0.1, preemptions_total=0, prompt_tokens_total=0,
                          generation_tokens_total=0, prefix_cache_hits_total=0, prefix_cache_queries_total=0)


def test_events_naming_another_pools_model_cannot_make_a_pool_its_redirect_target(loop_settings, worker_factory):
    """A redirect moves shed work to a sibling with headroom: a pool that shares a model. ``spare`` (calm, its
    replicas fresh) serves ``m-spare``; a router sends 3% of its events naming ``hot``'s model. Counted as a
    model of ``spare`` (as every name seen used to be), that made it ``hot``'s sibling, and routers would move
    ``hot``'s work to a pool that cannot serve it. ``hot`` must keep shedding with no redirect; then, with
    ``m-hot`` on a real share of ``spare``'s events (the positive control), ``hot`` offers ``spare``."""
    worker, requests_topic, replicas_topic = started_worker(loop_settings, worker_factory)

    async def scenario():
        async with ShedLoop(loop_settings) as fleet:
            sent: list[str] = []

            async def events(pool: str, model: str, n: int) -> None:
                # completions, well inside their SLOs: they name the model without adding to the demand axis
                for i in range(n):
                    task = f"{pool}-{model}-{len(sent)}"
                    value = request_event(pool=pool, model=model, event_time=now_ms(), task_id=task,
                                          request_id=f"{task}-r1", replica_id=f"{pool}-r0")
                    assert not isinstance(await fleet.send(requests_topic, orjson.dumps(value), task.encode()),
                                          KafkaError)
                    sent.append(task)

            async def spare_fleet() -> None:
                while True:
                    for replica in ("spare-r0", "spare-r1"):
                        await fleet.producer.send(replicas_topic, orjson.dumps(calm_sample(replica, now_ms())),
                                                  key=replica.encode())
                    await asyncio.sleep(0.25)   # the fleet's sampling interval, not a synchronisation

            async def spare_completions(merged: bool) -> None:
                """Until ``spare``'s newest picture shows completions in its fast window (or none): so the 10
                events below are known to be in its state before the signals are judged."""
                deadline = asyncio.get_running_loop().time() + 30
                while True:
                    picture = (await pictures_if_read(loop_settings, 5.0)).get(SPARE)
                    if picture is not None and (picture["rates"]["completed_rps"] > 0) == merged:
                        return
                    assert asyncio.get_running_loop().time() < deadline, f"{SPARE}'s picture: {picture}"

            calm = asyncio.create_task(spare_fleet())
            try:
                await events(POOL, "m-hot", 100)
                await events(SPARE, "m-spare", 300)
                await fleet.shedding()
                await spare_completions(merged=False)   # the 300 have left spare's fast window
                await events(SPARE, "m-hot", 10)   # 10 of 310
                await spare_completions(merged=True)
                since = now_ms()
                window = await fleet.keeps_shedding(since)
                offered = {r["pool"] for s in window for r in s["redirect"]}
                assert not offered, f"{POOL} offered {offered} as a redirect target on 10 events naming its model"
                await events(SPARE, "m-hot", 150)   # now a third of spare's events
                await until(lambda: any(r["pool"] == SPARE for r in fleet.signals[-1]["redirect"]), 30,
                            f"{POOL} to offer {SPARE} once {SPARE} serves its model")
                return len(window)
            finally:
                calm.cancel()
                await asyncio.gather(calm, return_exceptions=True)

    signals = run(scenario())
    assert worker.proc.poll() is None and healthy(worker.base_url)
    print(f"\n{signals} shedding signals without a redirect to a pool with 10 of 310 events naming the model")


# 9 -----------------------------------------------------------------------------------------------------------

LOUD, QUIET = "loud", "quiet"
MAX_DURATION_S = 86_400.0   # the contract's largest duration_s
WORK_BOUND = 2.0            # tenant_shares.MAX_WORK_RATIO, as the signal's reasons must show it
# per 0.5 s: loud offers 40 standard requests/s and quiet 8; the routers report loud's 2 admitted a second and
# quiet's 4 (the demand axis at 0.3 of the profile's 20 requests/s), and 2 completions a second each: 20 in a
# 10 s window, past MIN_TENANT_FINISHED, so each tenant's own seconds in service count
ROUTED = {LOUD: {"received": 20, "admitted": 1, "completed": 1}, QUIET: {"received": 4, "admitted": 2, "completed": 1}}


class BusyLoop(ShedLoop):
    """``hot`` with its KV cache at 0.95 of its limit and nothing waiting: busy, under its target, so the trim
    holds and the feed-forward alone sets the level (the offered load over the profile's capacity)."""

    async def _fleet(self) -> None:
        topic = topics.REPLICAS.name(self.s)
        while True:
            for replica in REPLICAS:
                sample = overloaded_sample(replica, now_ms(), 0) | {
                    "requests_waiting": 0, "kv_cache_usage": 0.95 * BUILTIN[self.s.default_profile].kv_limit}
                await self.producer.send(topic, orjson.dumps(sample), key=replica.encode())
            await asyncio.sleep(0.25)  # the fleet's sampling interval, not a synchronisation


def routed_events(tenant: str, duration_s: float, n: int) -> list[dict]:
    """One pump tick of a tenant's router events in ``hot`` (``ROUTED``): each completion ``duration_s`` long
    with no queue time."""
    out = []
    for phase, count in ROUTED[tenant].items():
        for i in range(count):
            task = f"{tenant}-{n}-{phase}-{i}"
            fields = dict(event_time=now_ms(), pool=POOL, tenant=tenant, task_id=task, request_id=f"{task}-r1",
                          phase=phase)
            out.append(request_event(**fields, duration_s=duration_s, queue_s=0.0) if phase == "completed"
                       else unended_event(**fields))
    return out


def work_reasons(signals: list[dict]) -> list[float]:
    """The work ratios the signals gave as a reason (a tenant listed: an admitted request's work ÷ an offered
    one's)."""
    return [r["value"] for s in signals for r in s.get("reasons", ())
            if r["axis"] == "demand" and "tenants listed" in r.get("note", "")]


def test_a_router_forging_a_listed_tenants_durations_moves_the_ceiling_at_most_twofold(loop_settings,
                                                                                      worker_factory):
    """While a tenant is listed, the requests/s ceiling reads the admitted rate × how many times an admitted
    request's work (its tenant's seconds in service a request) is an offered one's. Durations come from the
    routers, so a router (a bug, or a hostile principal) can claim any the contract allows. ``hot`` is busy
    and offered more than its profile's capacity; ``loud`` offers 40 requests/s and is listed, ``quiet`` 8.
    Then every completion of one tenant claims the contract's longest duration (a day), the other's a second:

    - ``loud``'s claimed: the offered requests read 2.5× heavier than the admitted (ratio 0.40), and the
      ceiling would let the pool admit 2.5 times what its profile holds;
    - ``quiet``'s claimed: the admitted read 4× heavier (ratio 4.0), and the pool would shed for a fleet four
      times busier: its pressure would read 0.3 × 4 = 1.2, where the KV cache reads 0.95.

    The signals must give the bound (½, then 2) as the reason, and at 2 the pressure must stay the KV cache's
    (under 1); the listed tenant's work must stay shed with fresh signals throughout: a forged duration
    moves the ceiling at most 2× either way and never switches shedding off. A 10 s fast window: over 2 s
    the tenants' counts are too noisy to list one, and a tenant finishing fewer than MIN_TENANT_FINISHED
    attempts in the window counts at the pool's mean."""
    s = replace(loop_settings, fast_window_s=10.0)
    worker, requests_topic, _ = started_worker(s, worker_factory)
    heavy = ""   # the tenant whose completions claim a day

    async def scenario():
        nonlocal heavy
        async with BusyLoop(s) as loop:
            async def routers():
                for n in itertools.count():
                    events = [e for tenant in ROUTED for e in routed_events(
                        tenant, MAX_DURATION_S if tenant == heavy else 1.0, n)]
                    for event in events:
                        await loop.producer.send(requests_topic, orjson.dumps(event), key=event["task_id"].encode())
                    await asyncio.sleep(0.5)  # the routers' pace, not a synchronisation

            def listed() -> tuple[str, ...]:
                signal = loop.router.book.signals.get(POOL) or {}
                return tuple(e["tenant"] for e in signal.get("tenant_admit_fraction", ()))

            pump = asyncio.create_task(routers())
            try:
                await until(lambda: listed() == (LOUD,), 45, f"{LOUD} alone to be listed")
                seen = {}
                for heavy, bound in ((LOUD, 1 / WORK_BOUND), (QUIET, WORK_BOUND)):
                    since = now_ms()
                    await until(lambda: bound in work_reasons([x for x in loop.signals if x["issued_at"] >= since]),
                                30, f"the signals to read {heavy}'s claimed durations at the bound {bound}")
                    # fairness gives back to everyone else what the listed tenant's own level sheds, so what
                    # must stay shed is the listed tenant's work; held from the first signal at the bound
                    window = await loop.keeps_shedding(now_ms(), request=Request(POOL, "standard", tenant=LOUD))
                    seen[heavy] = (work_reasons([x for x in loop.signals if x["issued_at"] >= since]),
                                   [x["pressure"] for x in window], listed())
                return seen
            finally:
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)

    seen = run(scenario())
    for claimant, (ratios, _, _) in seen.items():
        assert ratios and all(1 / WORK_BOUND <= r <= WORK_BOUND for r in ratios), (claimant, ratios)
    assert max(seen[QUIET][1]) < 1.0, f"the claims moved the pressure past the KV cache's: {seen[QUIET][1]}"
    assert metric(worker, "sluice_control_events_total", outcome="dead_lettered") == 0, "the claims are valid events"
    print(f"\nforged durations of a listed tenant: {LOUD}'s claimed, work ratios {sorted(set(seen[LOUD][0]))}; "
          f"{QUIET}'s claimed, {sorted(set(seen[QUIET][0]))}, pressure at most {max(seen[QUIET][1])}, listed "
          f"{seen[QUIET][2]}; {LOUD}'s work shed with fresh signals throughout")
