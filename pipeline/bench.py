"""``sluice bench``: stage figures measured against a baseline in the same run.

Ingest: a topic is filled with N valid events, then read twice — by a raw
aiokafka consume + orjson decode loop (the floor any Python consumer pays)
and by one real ``sluice worker`` subprocess, which also validates, lands
rows in ClickHouse and commits. The ratio is worker ÷ raw.

Landing: the sink's inserts alone (blocks with deduplication tokens into
``request_events`` and its per-minute view) against plain inserts of the same
rows into a copy of the table with no view and no deduplication; landing lag
(event time → queryable) comes from the real-time stage.

Landing under a query: the latency of each such insert while an analyst's
query runs through the store's read-only path, against the same inserts
without it.

The stages that are ratios of short runs repeat ``--rounds`` times,
interleaved, and print medians with their spread (``over_rounds``): one run
on a shared two-core machine moves by more than most changes.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import statistics
import threading
import time
import urllib.request
import uuid
from dataclasses import replace
from itertools import islice, takewhile
from pathlib import Path
from typing import Any, Callable, Iterator

import orjson
from aiokafka import AIOKafkaConsumer

from . import topics
from .devstack.kafka import bootstrap_servers
from .kafka_clients import client_options
from .settings import Settings
from .topic_reader import open_from_beginning
from .sim.producer import produce
from .sim.replay import generate, load_trace
from .worker_process import WorkerProcess


async def raw_consume_decode(settings: Settings, bootstrap: str, topic: str, expected: int) -> float:
    """Seconds for a bare aiokafka consumer to fetch and orjson-decode ``expected`` records."""
    consumer, _ = await open_from_beginning(bootstrap, topic, max_partition_fetch_bytes=4 * 1024 * 1024,
                                            fetch_max_bytes=64 * 1024 * 1024, **client_options(settings))
    try:
        seen = 0
        started = time.perf_counter()
        while seen < expected:
            batch = await consumer.getmany(timeout_ms=500, max_records=10000)
            for messages in batch.values():
                for message in messages:
                    orjson.loads(message.value)
                seen += len(messages)
        return time.perf_counter() - started
    finally:
        await consumer.stop()


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


HANDLED = {"landing": ("sluice_events_accepted_total", "sluice_events_dead_lettered_total",
                       "sluice_events_duplicate_total"),
           "control": ("sluice_control_events_total",)}


def handled(worker: WorkerProcess, role: str) -> float:
    """Events a worker's ``role`` path has finished with (landed or folded, dead-lettered, duplicate)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = worker.scrape(timeout_s=2.0)
    except OSError:
        return 0.0
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name in HANDLED[role])


EVENTS_PER_REQUEST = 7.0  # the trace's lifecycle events per request incl. retries, plus replica samples
BACKLOG_S = 10 * 3600   # generated traffic spans at most this much event time, all of it in the past


def _request_events(events: int, seed: int = 11) -> list:
    """Request events of a backlog that ends now: every one valid for the workers' time bounds.

    Traffic generated forward from now would run ahead of the workers' clock after the first
    ``max_clock_skew_s`` and be dead-lettered (event_time_ahead): a benchmark of dead-lettering.
    """
    return list(islice(_backlog(seed), events))


def _backlog(seed: int = 11) -> Iterator:
    """The request events of ``_request_events``, generated lazily (about 70M of them)."""
    return (e for e in generate(load_trace(), rate=500, seconds=BACKLOG_S, seed=seed,
                                start_ms=int(time.time() * 1000) - BACKLOG_S * 1000) if e.kind == "request")


def bench_ingest(settings: Settings, events: int, work_dir: Path, role: str = "landing", workers: int = 1,
                 valid: list | None = None) -> dict:
    """Events/s one path reads, validates and folds (control) or lands exactly once (landing), with
    ``workers`` workers of that role, against a bare aiokafka consume + orjson decode of the same topic.

    The workers join their group on empty topics and are stopped (SIGSTOP) while the backlog is produced,
    then continued together: started on a full topic, the first to join read a share of it alone before
    the others had partitions, and the group's rebalances took seconds of the run (session 12 measured
    nothing with two and three workers that way). Their session timeout is raised so the stop does not
    cost them their partitions."""
    run_settings = replace(_isolated(settings, work_dir), role=role, topic_partitions=max(settings.topic_partitions, 6),
                           session_timeout_s=STOPPED_SESSION_TIMEOUT_S)
    ns = run_settings.topic_namespace
    bootstrap = run_settings.kafka_bootstrap_servers
    asyncio.run(topics.ensure_topics(run_settings, bootstrap))
    valid = valid if valid is not None else _request_events(events)
    # the control role's stage 2 is Faust's group (app_id): it rebalances as each worker starts
    groups = ([topics.control_group(run_settings), run_settings.app_id] if role == "control"
              else [topics.landing_group(run_settings)])
    procs = [WorkerProcess(replace(run_settings, web_port=_free_port()), work_dir / f"{ns}-{role}-{i}.log")
             for i in range(workers)]
    try:
        for proc in procs:
            proc.start()
        asyncio.run(wait_for_groups(run_settings, bootstrap, groups, workers, GROUP_FORMED_TIMEOUT_S))
        for proc in procs:
            proc.pause()
        stopped = time.perf_counter()
        asyncio.run(produce(run_settings, bootstrap, valid, paced=False))
        produce_s = time.perf_counter() - stopped
        raw_s = asyncio.run(raw_consume_decode(run_settings, bootstrap, topics.REQUESTS.name(run_settings),
                                               len(valid)))
        stopped_s = time.perf_counter() - stopped
        if stopped_s > STOPPED_MAX_S:   # the members may have left their groups: a rebalance in the window
            raise RuntimeError(f"bench workers were stopped {stopped_s:.0f} s, over {STOPPED_MAX_S:.0f} s: "
                               "use fewer events")
        for proc in procs:
            proc.resume()
        samples = []   # (time, events handled by each worker)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            counts = [handled(proc, role) for proc in procs]
            samples.append((time.perf_counter(), counts))
            if sum(counts) >= len(valid):
                break
            time.sleep(0.05)
        rss = max(_rss_mib(proc.pid) for proc in procs)
    finally:
        for proc in procs:
            proc.resume()
        for proc in procs:
            proc.stop()
    if sum(samples[-1][1]) < len(valid):
        raise RuntimeError(f"bench {role} workers did not finish in 600 s")
    rate = _steady_rate(samples, len(valid))
    return {
        "role": role, "workers": workers, "events": len(valid),
        "produce_events_per_s": round(len(valid) / produce_s),
        "raw_consume_decode_events_per_s": round(len(valid) / raw_s),
        "worker_events_per_s": round(rate) if rate else None,
        "worker_vs_raw_ratio": round(rate * raw_s / len(valid), 3) if rate else None,
        "worker_rss_mib": round(rss, 1),
        "partitions": run_settings.topic_partitions,
        "batch_max": run_settings.ingest_batch_max,
        "store": None if role == "control" else ("server" if run_settings.clickhouse_url else "chdb"),
    }


STOPPED_SESSION_TIMEOUT_S = 300.0   # the settings' maximum (and the consumers' poll and rebalance limits)
STOPPED_MAX_S = 0.8 * STOPPED_SESSION_TIMEOUT_S
GROUP_FORMED_TIMEOUT_S = 120.0


async def wait_for_groups(settings: Settings, bootstrap: str, groups: list[str], members: int,
                          timeout_s: float) -> None:
    """Until every one of ``groups`` is Stable with ``members`` members in the same look (each member then
    holds its partitions)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **client_options(settings))
    await admin.start()
    try:
        deadline = time.monotonic() + timeout_s
        seen: dict[str, tuple] = {}
        while time.monotonic() < deadline:
            for name in groups:   # one a call: aiokafka failed to decode one response describing two
                response, = await admin.describe_consumer_groups([name])
                error, _group, state, _type, _protocol, listed, *_ = response.groups[0]
                seen[name] = (state, len(listed), f"error code {error}")
            if all(seen[name][:2] == ("Stable", members) for name in groups):
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"groups {groups} not all Stable with {members} members in {timeout_s:.0f} s "
                           f"(last: {seen})")
    finally:
        await admin.close()


def _steady_rate(samples: list[tuple[float, list[float]]], total: int) -> float | None:
    """Events/s while every worker was consuming: from the first sample where each has handled some
    (the group has formed) to the one where 90% is done (before the last partitions' tail)."""
    start = next((i for i, (_, counts) in enumerate(samples) if all(counts)), None)
    end = next((i for i, (_, counts) in enumerate(samples) if sum(counts) >= 0.9 * total), None)
    if start is None or end is None or end <= start:
        return None
    (t0, c0), (t1, c1) = samples[start], samples[end]
    return (sum(c1) - sum(c0)) / (t1 - t0)


LONG_EVENTS = 10_000_000
RSS_EVERY_S = 5.0


def bench_steady_rss(settings: Settings, work_dir: Path, events_per_s: float = 10_000, seconds: float = 420,
                     **overrides: Any) -> dict:
    """One control worker's RSS under real-time traffic for longer than the cost window, where its
    changelog table and per-second aggregates stop growing (a backlog spans too little event time to
    fill them). Not part of ``main``: it takes ``seconds``."""
    run_settings = replace(_isolated(settings, work_dir), role="control", **overrides)
    bootstrap = run_settings.kafka_bootstrap_servers
    asyncio.run(topics.ensure_topics(run_settings, bootstrap))
    worker = WorkerProcess(run_settings, work_dir / f"{run_settings.topic_namespace}-steady-rss.log")
    samples: list[tuple[int, float]] = []
    stop = threading.Event()

    def sample() -> None:
        started = time.monotonic()
        while not stop.wait(20):
            samples.append((round(time.monotonic() - started), round(_rss_mib(worker.pid), 1)))

    sampler = threading.Thread(target=sample)
    try:
        worker.start()
        sampler.start()
        stream = generate(load_trace(), rate=events_per_s / EVENTS_PER_REQUEST, seconds=seconds, seed=3,
                          start_ms=int(time.time() * 1000))
        produced = asyncio.run(produce(run_settings, bootstrap, stream, paced=True, stamp=True))
        exposition = worker.scrape()
    finally:
        stop.set()
        if sampler.is_alive():
            sampler.join()
        worker.stop()
    return {"cut_interval_s": run_settings.cut_interval_s, "events_per_s": round(produced.total / seconds),
            "partials_per_s": round(counter_total(exposition, "sluice_partials_published_total") / seconds, 1),
            "rss_mib_every_20_s": samples}


def bench_long_run(settings: Settings, work_dir: Path, seconds: float, max_events: int = LONG_EVENTS) -> dict:
    """One control worker fed for ``seconds`` (or until it has handled ``max_events``), its RSS sampled
    every ``RSS_EVERY_S``: a worker that keeps per-event state (ids seen, sketches per key) grows with
    the events it has read, which no short run shows.

    The producer runs in this process while the worker reads, so on two cores the events/s here is
    the pair's, not the worker's (that is ``control_path``). Growth is the least-squares slope of RSS
    over events handled after warm-up (the first 20% of the run), in MiB per million events."""
    run_settings = replace(_isolated(settings, work_dir), role="control",
                           topic_partitions=max(settings.topic_partitions, 6))
    bootstrap = run_settings.kafka_bootstrap_servers
    asyncio.run(topics.ensure_topics(run_settings, bootstrap))
    stop = threading.Event()
    stream = takewhile(lambda _: not stop.is_set(), islice(_backlog(), max_events))
    producer = threading.Thread(target=lambda: asyncio.run(produce(run_settings, bootstrap, stream, paced=False)),
                                daemon=True)
    worker = WorkerProcess(replace(run_settings, web_port=_free_port()),
                           work_dir / f"{run_settings.topic_namespace}-long.log")
    samples: list[tuple[float, float, float]] = []   # (seconds since start, events handled, RSS MiB)
    try:
        worker.start()
        producer.start()
        started = time.monotonic()
        while True:
            elapsed = time.monotonic() - started
            count = handled(worker, "control")
            samples.append((elapsed, count, _rss_mib(worker.pid)))
            if elapsed >= seconds or count >= max_events:
                break
            time.sleep(min(RSS_EVERY_S, max(0.0, seconds - elapsed)))
    finally:
        stop.set()
        producer.join(timeout=60)
        worker.stop()
    return long_run_figures(samples)


def long_run_figures(samples: list[tuple[float, float, float]]) -> dict:
    """Events/s, RSS after warm-up and at the end, and RSS growth per million events after warm-up."""
    elapsed, count, _ = samples[-1]
    settled = [s for s in samples if s[0] >= 0.2 * elapsed] or samples[-1:]
    xs, ys = [s[1] / 1e6 for s in settled], [s[2] for s in settled]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else None
    every = max(1, len(samples) // 10)
    return {"seconds": round(elapsed, 1), "events": int(count),
            "events_per_s": round(count / elapsed) if elapsed else None,
            "rss_after_warm_up_mib": round(settled[0][2], 1), "rss_end_mib": round(samples[-1][2], 1),
            "rss_max_mib": round(max(s[2] for s in samples), 1),
            "rss_growth_mib_per_million_events": None if slope is None else round(slope, 2),
            "rss_over_time": [(round(t), int(c), round(r)) for t, c, r in
                              samples[::every] + ([] if (len(samples) - 1) % every == 0 else samples[-1:])]}


SCALING_EVENTS = 600_000


def bench_scaling(settings: Settings, events: int, work_dir: Path, max_workers: int = 3) -> dict:
    """Control-path events/s with 1..``max_workers`` control workers (each run on its own topics), over at
    least ``SCALING_EVENTS``: at about 100,000 events/s a smaller backlog is read in a second or two, too
    short a window for the 50 ms samples and the workers' first fetches."""
    events = max(events, SCALING_EVENTS)
    valid = _request_events(events)
    out = {}
    for workers in range(1, max_workers + 1):
        figures = bench_ingest(settings, events, work_dir, "control", workers, valid)
        out[f"control_workers_{workers}_events_per_s"] = figures["worker_events_per_s"]
    base = out["control_workers_1_events_per_s"]
    for workers in range(2, max_workers + 1):
        value = out[f"control_workers_{workers}_events_per_s"]
        out[f"speedup_{workers}_vs_1"] = round(value / base, 2) if base and value else None
    out["events"] = events
    out["cores"] = os.cpu_count()
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _landing_blocks(rows: int, block_rows: int) -> list[tuple[bytes, str, int]]:
    """``rows`` request events as the sink lands them: (newline-delimited rows, deduplication token, last source
    offset) per block, from topic ``bench``, partition 0."""
    from .events import RequestEvent
    from .ingest import Record
    from .sinks.blocks import process_block

    records = [Record("bench", 0, i, None, e.key.encode(), orjson.dumps(e.event))
               for i, e in enumerate(_request_events(rows, seed=13))]
    blocks = [process_block(RequestEvent, records[i:i + block_rows], 1 << 20, 0)
              for i in range(0, len(records), block_rows)]
    return [(b"\n".join(b.landed_rows()), b.token(b.table), b.next_offset - 1) for b in blocks]


LANDING_ROWS = 600_000   # the landing stage's least rows: several rollup intervals, as a stream has


def bench_landing(rows: int, block_rows: int, work_dir: Path, rollup_interval_s: float = 1.0) -> dict:
    """Rows/s through the sink's insert path vs plain inserts of the same rows, one chdb store.

    The sink's path is its inserts into ``request_events`` and, every ``rollup_interval_s`` and once at the
    end, the rollup of what they landed into ``pool_minute`` (``sinks.rollup``) on a second client beside them,
    as the landing worker does;
    the plain path inserts the same blocks into a ``MergeTree`` with no key. The fsync comparison inserts the
    blocks into fresh copies of ``request_events``, with and without ``store_fsync``."""
    from .sinks import rollup
    from .sinks.migrations import migrate, set_fsync
    from .sinks.store import ClickHouseStore

    payloads = _landing_blocks(rows, block_rows)
    store = ClickHouseStore.embedded(work_dir / f"landing-{uuid.uuid4().hex[:6]}")
    try:
        migrate(store)
        store.command("CREATE TABLE plain_events AS request_events ENGINE = MergeTree ORDER BY tuple()")
        started = time.perf_counter()
        for payload, _, _ in payloads:
            store.insert("plain_events", payload)
        plain_s = time.perf_counter() - started
        rolling = store.second_writer()
        landed, stop, rollups = [-1], threading.Event(), [0]

        def roll_up_beside() -> None:
            """What landed, every ``rollup_interval_s`` and once at the end, on the second client."""
            rolled = -1
            while True:
                last_one = stop.wait(rollup_interval_s)
                if landed[0] > rolled:
                    ranges = [("bench", 0, rolled + 1, landed[0])]
                    rollup.roll_up(rolling, ranges, rollup.token(ranges))
                    rollups[0], rolled = rollups[0] + 1, ranges[0][3]
                if last_one:
                    return

        roller = threading.Thread(target=roll_up_beside, daemon=True)
        started = time.perf_counter()
        roller.start()
        for payload, token, last in payloads:
            store.insert("request_events", payload, token)
            landed[0] = last
        stop.set()
        roller.join()
        sink_s = time.perf_counter() - started
        landed_rows, = store.query("SELECT count() AS n FROM request_events")
        terminal, = store.query("SELECT count() AS n FROM request_events WHERE phase IN "
                                f"{rollup.TERMINAL_PHASES}")
        per_minute, = store.query("SELECT sum(requests) AS n FROM pool_minute")
        # the cost of store_fsync: the same blocks into fresh copies, with and without, alternating, median of 3
        spent: dict[bool, list[float]] = {False: [], True: []}
        for round_no in range(3):
            for fsync in (False, True):
                table = f"fsync_{int(fsync)}_{round_no}"
                store.command(f"CREATE TABLE {table} AS request_events")
                set_fsync(store, table, fsync)
                started = time.perf_counter()
                for payload, token, _ in payloads:
                    store.insert(table, payload, token)
                spent[fsync].append(time.perf_counter() - started)
        no_fsync_s, fsync_s = (sorted(spent[f])[1] for f in (False, True))
    finally:
        store.close()
    if per_minute["n"] != terminal["n"]:
        raise RuntimeError(f"the rollups counted {per_minute['n']} terminal attempts of {terminal['n']}")
    return {"rows": rows, "block_rows": block_rows, "landed_rows": landed_rows["n"], "rollups": rollups[0],
            "sink_rows_per_s": round(rows / sink_s),
            "plain_insert_rows_per_s": round(rows / plain_s),
            "sink_vs_plain_ratio": round(plain_s / sink_s, 3),
            "sink_fsync_rows_per_s": round(rows / fsync_s),
            "fsync_vs_no_fsync_ratio": round(no_fsync_s / fsync_s, 3)}



# what a successful task cost, per pool and tenant, over all history: the cost views' joins over every row
ANALYST_QUERY = ("SELECT pool, tenant, sum(successful_tasks) AS ok, round(sum(fleet_cost_usd), 2) AS cost_usd, "
                 "round(sum(waste_cost_usd) / sum(fleet_cost_usd), 4) AS waste_share "
                 "FROM cost_per_successful_task GROUP BY pool, tenant ORDER BY pool, tenant")


def bench_landing_under_query(block_rows: int, work_dir: Path, fsync: bool = True, distinct_rows: int = 25_000,
                              copies: int = 40, inserts: int = 120, rounds: int = 4) -> dict:
    """Insert latency of the sink's blocks (p50, p95, p99, max) while an analyst's query runs through the
    store's read-only path, against the same inserts without it, one chdb store.

    The query reads ``copies`` + 1 times ``distinct_rows`` rows (copied in SQL, new event and task ids)
    and runs back to back through the whole of its arm. The arms alternate, ``rounds`` of each, so the
    table's growth and its background merges weigh on both alike; every insert is a block of the
    distinct rows under a token of its own (the table takes it like a new one).
    """
    from .sinks.migrations import apply_durability, migrate
    from .sinks.readonly import ReadLimits
    from .sinks.store import ClickHouseStore

    payloads = [payload for payload, _, _ in _landing_blocks(distinct_rows, block_rows)]
    store = ClickHouseStore.embedded(work_dir / f"under-query-{uuid.uuid4().hex[:6]}")
    try:
        migrate(store)
        apply_durability(store, fsync)
        for n, payload in enumerate(payloads):
            store.insert("request_events", payload, f"request_events:prefill/{n}")
        store.command("INSERT INTO request_events SELECT e.* REPLACE (generateUUIDv4(n.number) AS event_id, "
                      "concat(e.task_id, '/', toString(n.number)) AS task_id) "
                      f"FROM request_events AS e CROSS JOIN numbers({copies}) AS n")
        queried, = store.query("SELECT count() AS n FROM request_events")
        limits = ReadLimits(max_execution_s=30.0)
        store.read_only(ANALYST_QUERY, limits)   # the reader opens once, outside the measurement
        spent: dict[bool, list[float]] = {False: [], True: []}
        query_s: list[float] = []
        failed: list[str] = []
        sent = 0

        def analyst(stop: threading.Event) -> None:
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    store.read_only(ANALYST_QUERY, limits)
                except Exception as exc:   # reported with the figures: an arm without its query is no measurement
                    failed.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                    return
                query_s.append(time.perf_counter() - started)

        for round_no in range(rounds):
            for with_query in (round_no % 2 == 1, round_no % 2 == 0):   # which arm goes first alternates
                stop = threading.Event()
                reader = threading.Thread(target=analyst, args=(stop,), daemon=True) if with_query else None
                if reader is not None:
                    reader.start()
                for _ in range(inserts // rounds):
                    payload = payloads[sent % len(payloads)]
                    started = time.perf_counter()
                    store.insert("request_events", payload, f"request_events:bench/{sent}")
                    spent[with_query].append(time.perf_counter() - started)
                    sent += 1
                if reader is not None:
                    stop.set()
                    reader.join()   # its last query ends before the next arm without one starts
    finally:
        store.close()
    figures = {"block_rows": block_rows, "rows_queried": queried["n"], "inserts_per_arm": len(spent[False]),
               "fsync": fsync, "queries_run": len(query_s), "query_p50_s": _percentile(query_s, 0.5),
               "query_failed": failed[0] if failed else None}
    for with_query, arm in ((False, "alone"), (True, "under_query")):
        ms = [s * 1000 for s in spent[with_query]]
        figures |= {f"insert_{arm}_{name}_ms": _percentile(ms, q)
                    for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("max", 1.0))}
    base = figures["insert_alone_p99_ms"]
    figures["p99_under_query_vs_alone"] = round(figures["insert_under_query_p99_ms"] / base, 2) if base else None
    return figures


def _isolated(settings: Settings, work_dir: Path) -> Settings:
    """Settings for one bench stage: its own topics, group, port and store."""
    ns = f"bench{uuid.uuid4().hex[:6]}"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return replace(settings, topic_namespace=ns, app_id=f"sluice-{ns}", web_port=port,
                   dev_signing_key=not settings.signing_keys,
                   kafka_bootstrap_servers=bootstrap_servers(settings), state_dir=work_dir / ns)


async def _collect_lags(settings: Settings, bootstrap: str, stop: asyncio.Event) -> list[tuple[int, int]]:
    """(published_at, watermark) in ms of every picture published until ``stop`` is set."""
    topic = topics.LOAD.name(settings)
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="latest",
                                group_id=f"{settings.app_id}-lag-reader", **client_options(settings))
    await consumer.start()
    lags: list[tuple[int, int]] = []
    try:
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=200)
            for messages in batch.values():
                for message in messages:
                    picture = orjson.loads(message.value)
                    lags.append((picture["published_at_ms"], picture["watermark_ms"]))
    finally:
        await consumer.stop()
    return lags


def picture_lags(pictures: list[tuple[int, int]], ended_ms: float) -> list[float]:
    """Each picture's lag, seconds: how far its watermark was behind the traffic when it was published,
    or when the traffic ended if that was earlier. After the last event a picture's watermark is that
    event, and ``published_at − watermark`` grows with the idle time since (up to a tick plus the hops):
    counted so, the last tick's pictures were the top two of a run's ~120, and so its p99 (0.43-0.59 s
    against 0.16 s). A pipeline still behind when the traffic ends keeps the lag it had then."""
    return [max(0.0, (min(published_ms, ended_ms) - watermark_ms) / 1000) for published_ms, watermark_ms in pictures]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts of a Prometheus histogram, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name + "_bucket":
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return buckets


def bucket_quantile(buckets: dict[float, float], q: float) -> float | None:
    """Quantile from cumulative buckets, interpolated within its bucket."""
    if not buckets or buckets[max(buckets)] == 0:
        return None
    ordered = sorted(buckets.items())
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return round(lower_bound + (bound - lower_bound) * share, 3)
        lower_bound, lower_count = bound, count
    return None


def counter_total(text: str, name: str) -> float:
    """A Prometheus counter's value, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


def histogram_quantile(text: str, name: str, q: float) -> float | None:
    return bucket_quantile(histogram_buckets(text, name), q)


def bench_decide(calls: int = 200_000) -> dict:
    """decide() per call, against a baseline loop calling a trivial function in the same run."""
    from .admission.policy import AdmissionConfig, Decision, decide
    from .admission.signing import sign
    from .router import Decider, Request, SignalBook

    keys = {"bench": b"bench-signing-key-0123"}
    axes = {a: {"value": 0.0, "limit": 1.0, "pressure": 1.2, "detail": {}} for a in
            ("demand", "queue", "kv_cache", "compute", "latency", "errors", "cost")}
    axes["queue"]["detail"] = {"predicted_wait_s": 0.5, "requests_waiting": 4, "drain_rps": 8.0}
    axes["demand"]["detail"] = {"input_tokens_per_s": 1000.0}
    picture = {"pool": "p", "watermark_ms": 1, "pressure": 1.2, "axes": axes, "rates": {"arrival_rps": 1.0},
               "replicas": {"total": 1, "fresh": 1, "stale": 0, "unhealthy": 0}}
    decision = Decision("p")
    for i in range(1, 5):
        decision = decide(picture, decision, AdmissionConfig(), i * 250)
    book = SignalBook(keys, clock=lambda: 0.5)
    book.offer(sign({"event_id": "0b6f3a52-9a38-4f0e-8d6e-3f0c1f1a2b3c", "event_time": 1, **decision.signal},
                    "bench", keys["bench"]))
    decider = Decider(book, seed=1, clock=lambda: 0.5)
    requests = [Request("p", c, continuing=i % 3 == 0, slo_ttft_s=2.0)
                for i, c in enumerate(("critical", "standard", "sheddable", "deferrable") * 4)]

    def trivial(request: Request) -> Request:
        return request

    started = time.perf_counter()
    for i in range(calls):
        trivial(requests[i & 15])
    baseline = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(calls):
        decider.decide(requests[i & 15])
    spent = time.perf_counter() - started
    return {"calls": calls, "decide_us_per_call": round(spent / calls * 1e6, 3),
            "baseline_call_us": round(baseline / calls * 1e6, 3),
            "decide_vs_baseline_ratio": round(spent / baseline, 1)}


def bench_decode(events: int = 60_000, rounds: int = 5) -> dict:
    """The control path's pure work per event — decode, validate, fold — with the compiled fast path
    (``fast_decode``) against the full validator alone, same events, same run (best of ``rounds``)."""
    from itertools import islice, takewhile

    from . import events as event_types
    from .events import ReplicaSample, RequestEvent
    from .ingest import Record, decode_records
    from .load.partial import PartialBuilder
    from .sim.replay import generate, load_trace

    generated = list(islice(generate(load_trace(), rate=200, seconds=3600, seed=7, start_ms=1_700_000_000_000),
                            events))
    records: dict[type, list] = {RequestEvent: [], ReplicaSample: []}
    for i, e in enumerate(generated):
        cls = RequestEvent if e.kind == "request" else ReplicaSample
        key = e.event[cls.key_field].encode()
        records[cls].append(Record("bench", 0, i, None, key, orjson.dumps(e.event)))

    def once() -> float:
        started = time.perf_counter()
        builder = PartialBuilder("bench/0", 15)
        for cls, recs in records.items():
            fold = builder.fold_request if cls is RequestEvent else builder.fold_sample
            for event in decode_records(cls, recs, 1 << 20, 0).events:
                fold(event)
        return time.perf_counter() - started

    fast = min(once() for _ in range(rounds))
    saved = dict(event_types.ACCEPT)
    event_types.ACCEPT.clear()
    try:
        full = min(once() for _ in range(rounds))
    finally:
        event_types.ACCEPT.update(saved)
    return {"events": len(generated), "fast_path_events_per_s": round(len(generated) / fast),
            "full_validator_events_per_s": round(len(generated) / full), "fast_vs_full_ratio": round(full / fast, 2)}


def bench_litellm_hook(settings: Settings, calls: int = 20_000) -> dict:
    """What the LiteLLM hook adds before a call is sent: verdict, events handed to the emitter and the
    metadata stash, per call (p50, p99), against ``Decider.decide`` alone in the same run. Kafka is
    pointed at a closed port: the hook never waits on it, so this is its cost in the call path."""
    import os
    from dataclasses import replace as with_fields
    from types import SimpleNamespace

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        from .integrations.litellm_hook import SluiceAdmission
    except ImportError:
        return {"skipped": "litellm is not installed (pip install 'sluice[litellm]')"}
    from .router import Request

    keys = {"bench": "bench-signing-key-0123"}
    hook = SluiceAdmission(with_fields(settings, kafka_bootstrap_servers=f"127.0.0.1:{_free_port()}",
                                       signing_keys=keys, signing_key_id="bench"))
    key = SimpleNamespace(team_id="team-a", user_id=None)
    request = Request("bench-pool", "critical", slo_ttft_s=2.0)

    async def run() -> tuple[list[float], float]:
        spent = []
        for i in range(calls):
            data = {"model": "bench-pool", "litellm_call_id": f"call-{i}",
                    "proxy_server_request": {"headers": {"x-sluice-priority": "critical"}}}
            started = time.perf_counter()
            await hook.async_pre_call_hook(key, None, data, "acompletion")
            spent.append((time.perf_counter() - started) * 1e6)
            if hook.emitter.queue.full():
                while not hook.emitter.queue.empty():
                    hook.emitter.queue.get_nowait()
        started = time.perf_counter()
        for _ in range(calls):
            hook.router.decide(request)
        decide_s = (time.perf_counter() - started) / calls
        await hook.close(drain_timeout_s=0)   # nothing to deliver them to: the broker is a closed port
        return spent, decide_s

    spent, decide_only = asyncio.run(run())
    return {"calls": calls, "hook_us_p50": round(_percentile(spent, 0.5), 1),
            "hook_us_p99": round(_percentile(spent, 0.99), 1), "decide_only_us": round(decide_only * 1e6, 2),
            "hook_vs_decide_ratio": round(_percentile(spent, 0.5) / (decide_only * 1e6), 1)}


def bench_picture_lag(settings: Settings, events_per_s: float, seconds: float, work_dir: Path,
                      role: str = "control", **overrides: Any) -> dict:
    """Picture lag and decision latency at a stated rate, with the settings' tick and cut interval unless
    ``overrides`` name others: events are produced in real time, event time = production time. ``role``
    ``all`` adds the landing path to the same process (and the landing lag to the figures): what its
    inserts cost the decisions' tail."""
    run_settings = replace(_isolated(settings, work_dir), role=role, **overrides)
    bootstrap = run_settings.kafka_bootstrap_servers
    asyncio.run(topics.ensure_topics(run_settings, bootstrap))
    worker = WorkerProcess(run_settings, work_dir / f"{run_settings.topic_namespace}-lag-worker.log")
    try:
        worker.start()

        def scrape() -> str:
            return urllib.request.urlopen(f"{worker.base_url}/metrics", timeout=5).read().decode()

        # generated before the clock starts: on two cores, generating while producing took 40% of the
        # producer's core from the worker it measures (event times are stamped when sent)
        stream = list(generate(load_trace(), rate=events_per_s / EVENTS_PER_REQUEST, seconds=seconds, seed=3,
                               start_ms=int(time.time() * 1000)))
        gc.freeze()   # or the collector walks those events again and again, pausing the sends it times

        async def measure() -> tuple[list[float], int, str]:
            stop = asyncio.Event()
            reader = asyncio.create_task(_collect_lags(run_settings, bootstrap, stop))
            await asyncio.sleep(1.0)
            produced = await produce(run_settings, bootstrap, stream, paced=True, stamp=True)
            # while traffic flows: signals published after it stops count the idle time as latency (pictures:
            # picture_lags)
            ended_ms = time.time() * 1000
            during = await asyncio.to_thread(scrape)
            await asyncio.sleep(3 * run_settings.tick_s + 1)
            stop.set()
            return picture_lags(await reader, ended_ms), produced.total, during

        try:
            lags, total, during = asyncio.run(measure())
        finally:
            gc.unfreeze()
        rss = _rss_mib(worker.pid)
        exposition = scrape()
    finally:
        worker.stop()
    return {"role": role, "target_events_per_s": events_per_s, "achieved_events_per_s": round(total / seconds),
            "seconds": seconds, "tick_s": run_settings.tick_s,
            "cut_interval_s": run_settings.cut_interval_s, "pictures": len(lags),
            "picture_lag_p50_s": _percentile(lags, 0.5), "picture_lag_p99_s": _percentile(lags, 0.99),
            "decision_latency_p50_s": histogram_quantile(during, "sluice_decision_latency_seconds", 0.5),
            "decision_latency_p99_s": histogram_quantile(during, "sluice_decision_latency_seconds", 0.99),
            "landing_lag_p50_s": histogram_quantile(exposition, "sluice_landing_lag_seconds", 0.5),
            "landing_lag_p99_s": histogram_quantile(exposition, "sluice_landing_lag_seconds", 0.99),
            "fold_batch_p99_s": histogram_quantile(exposition, "sluice_ingest_batch_seconds", 0.99),
            "sink_block_p99_s": histogram_quantile(exposition, "sluice_sink_batch_seconds", 0.99),
            "partials_per_s": round(counter_total(during, "sluice_partials_published_total") / seconds, 1),
            "worker_rss_mib": round(rss, 1)}


def over_rounds(runs: list[dict]) -> dict:
    """One stage's figures over several runs of it: every number that varied as its median (the middle
    run's, ``median_low``: a figure some run measured, not an average of two), with its spread [lowest,
    highest] beside it, so one noisy run on a shared two-core machine is not read as a change. A figure
    that some runs could not measure (``None``, or absent) says in how many it was, ``<figure>_measured``;
    figures that did not vary, and anything not a number, are shown once."""
    out: dict[str, Any] = {"rounds": len(runs)}
    keys = list(dict.fromkeys(key for run in runs for key in run))
    for key in keys:
        values = [run.get(key) for run in runs]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) < len(values) and any(v is None for v in values):
            out[f"{key}_measured"] = f"{len(numbers)}/{len(values)}"
        if numbers and len(numbers) == len([v for v in values if v is not None]):
            out[key] = statistics.median_low(numbers)
            if min(numbers) != max(numbers):
                out[f"{key}_spread"] = [min(numbers), max(numbers)]
        else:
            out[key] = next((v for v in values if v is not None), None)
    return out


def print_table(figures: dict) -> None:
    width = max(len(k) for k in figures)
    for key, value in figures.items():
        print(f"{key:<{width}}  {value}")


def main(settings: Settings, events: int, as_json: bool, lag_rate: float, lag_seconds: float,
         long_seconds: float = 600.0, rounds: int = 3) -> int:
    """Every stage; the single-worker throughput, lag, landing and decode stages ``rounds`` times,
    interleaved (a slow stretch of the machine then touches every stage's spread, not one stage's
    median), each reported as the median and spread of its runs. Once: the scaling run (three workers'
    worth of minutes), landing under a query (its own 240 timed inserts are the sample), the LiteLLM
    hook (its p50/p99 are over 20,000 calls) and the long run (ten minutes)."""
    if rounds < 1:
        raise ValueError("bench: rounds must be at least 1")
    work_dir = settings.state_dir / "bench"
    work_dir.mkdir(parents=True, exist_ok=True)
    stages: dict[str, Callable[[], dict]] = {
        "control_path": lambda: bench_ingest(settings, events, work_dir, "control"),
        "landing_path": lambda: bench_ingest(settings, events, work_dir, "landing"),
        "landing": lambda: bench_landing(max(events, LANDING_ROWS), settings.sink_block_rows, work_dir,
                                         settings.sink_rollup_interval_s),
        "picture_and_decision_lag": lambda: bench_picture_lag(settings, lag_rate, lag_seconds, work_dir),
        "lag_with_landing_in_the_same_worker": lambda: bench_picture_lag(settings, lag_rate, lag_seconds, work_dir,
                                                                         role="all"),
        "decode_and_fold": bench_decode,
        "router_decide": bench_decide,
    }
    runs: dict[str, list[dict]] = {stage: [] for stage in stages}
    for _ in range(rounds):
        for stage, run in stages.items():
            runs[stage].append(run())
    figures = {stage: over_rounds(results) for stage, results in runs.items()}
    figures |= {"control_scaling": bench_scaling(settings, events, work_dir),
                "landing_under_query": bench_landing_under_query(settings.sink_block_rows, work_dir,
                                                                 settings.store_fsync),
                "litellm_hook": bench_litellm_hook(settings)}
    if long_seconds > 0:
        figures["control_long_run"] = bench_long_run(settings, work_dir, long_seconds)
    if as_json:
        print(json.dumps(figures, indent=2))
    else:
        for stage, values in figures.items():
            print(f"== {stage}")
            print_table(values)
    return 0
