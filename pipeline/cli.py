"""``sluice`` — the command line: devstack, worker, producer, store and the demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from .settings import Settings, SettingsError, load_settings, settings_table


def _settings(**overrides: Any) -> Settings:
    try:
        return load_settings(**overrides)
    except SettingsError as exc:
        sys.exit(f"sluice: {exc}")


def cmd_kafka(args: argparse.Namespace) -> int:
    from .devstack.credentials import WORKER, client_env, credentials_path
    from .devstack.kafka import DevstackError, KafkaDevstack
    from .devstack.node_config import replication

    settings = _settings()
    if settings.kafka_bootstrap_servers:
        print(f"KAFKA_BOOTSTRAP_SERVERS is set ({settings.kafka_bootstrap_servers}); the devstack is not used")
        return 0
    try:
        if args.action == "start":
            devstack = KafkaDevstack(settings, brokers=args.brokers, secure=args.secure)
            started = time.monotonic()
            info, downloaded = devstack.start()
            how = "downloaded jars" if downloaded else "cached jars"
            pids = ", ".join(f"node {n.node_id} pid {n.pid}" for n in info.nodes)
            print(f"kafka {info.version} running at {info.bootstrap} ({pids}, {how}, "
                  f"{time.monotonic() - started:.1f}s)")
            # Environment for Sluice processes: never the bootstrap list (read from broker.json, it changes
            # on every start) and never a password (stdout ends up in CI logs).
            factor, min_isr = replication(len(info.nodes))
            if factor > 1:
                print(f"# {len(info.nodes)} brokers: give the topics Sluice creates {factor} replicas "
                      f"(the brokers' own topics have {factor}, {min_isr} in sync)")
                print(f"SLUICE_TOPIC_REPLICATION_FACTOR={factor}")
            if devstack.secure:
                devstack.apply_acls(settings)
                path = credentials_path(devstack.home)
                print(f"# SASL_SSL (SCRAM-SHA-512) only; ACLs applied for namespace '{settings.topic_namespace}' "
                      f"and app_id '{settings.app_id}'")
                print(f"# passwords: {path} (mode 0600), one per principal ({', '.join(devstack.credentials())});"
                      f" set SLUICE_KAFKA_SASL_PASSWORD to the principal's, e.g.")
                print(f"#   export SLUICE_KAFKA_SASL_PASSWORD=\"$(python3 -c 'import json,sys; "
                      f"print(json.load(open(sys.argv[1]))[sys.argv[2]])' {path} {WORKER})\"")
                print(f"# the CA file is the devstack's own ({devstack.ca_file.parent}); it stays valid across "
                      "restarts")
                print("\n".join(client_env(WORKER, devstack.ca_file)))
        elif args.action == "stop":
            print("kafka stopped" if KafkaDevstack(settings).stop() else "kafka was not running")
        else:
            devstack = KafkaDevstack(settings)
            state = devstack.status()
            info = devstack.info()
            where = ""
            if info:
                nodes = ", ".join(f"node {n.node_id} pid {n.pid}" for n in info.nodes)
                where = f" at {info.bootstrap} ({nodes}{', secure' if info.secure else ''})"
            print(f"kafka {state}{where}")
            return {"running": 0, "stopped": 3, "dead": 1}[state]
    except DevstackError as exc:
        print(f"sluice kafka {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_topics(args: argparse.Namespace) -> int:
    from .devstack.kafka import bootstrap_servers
    from .topics import ensure_topics

    settings = _settings()
    created = asyncio.run(ensure_topics(settings, bootstrap_servers(settings)))
    print("created: " + (", ".join(created) if created else "nothing (all topics exist)"))
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    from .sinks.migrations import prepare_store
    from .sinks.store import open_store

    settings = _settings()
    store = open_store(settings)
    try:
        applied = prepare_store(store, settings)
    finally:
        store.close()
    print("applied: " + (", ".join(applied) if applied else "nothing (store is current)"))
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    import faust

    from .broker import NoBroker, bootstrap_servers
    from .topics import ensure_topics
    from .worker.app import create_app

    settings = _settings(**({"role": args.role} if args.role else {}))
    try:
        asyncio.run(ensure_topics(settings, bootstrap_servers(settings)))
    except NoBroker as exc:
        sys.exit(f"sluice worker: {exc}")
    try:
        app = create_app(settings)
    except SettingsError as exc:
        sys.exit(f"sluice worker: {exc}")
    worker = faust.Worker(app, loglevel=settings.log_level, quiet=True, redirect_stdouts=False)
    tune_garbage_collector()
    worker.execute_from_commandline()
    return 0


YOUNG_COLLECTION_THRESHOLD = 50_000


def tune_garbage_collector() -> None:
    """Fewer, larger young collections, and start-up's objects out of every collection's way.

    A worker allocates a few objects per event, nearly all dead within the
    batch, while everything imported at start-up lives for ever. CPython's
    default (a young collection every 700 allocations, promoting survivors
    towards full collections that walk the whole heap) cost about half of
    building each event (docs/performance.md). ``gc.freeze()`` moves what
    exists now to a generation no collection scans; a young collection every
    ``YOUNG_COLLECTION_THRESHOLD`` allocations finds almost all of them dead.
    Reference cycles are still collected.
    """
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])


def cmd_otel_bridge(args: argparse.Namespace) -> int:
    import logging

    from .broker import NoBroker, bootstrap_servers
    from .otel.bridge import OtelBridge
    from .topics import ensure_topics

    settings = _settings()
    level = {"crit": "CRITICAL", "warn": "WARNING"}.get(settings.log_level, settings.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        bridge = OtelBridge(settings, bootstrap_servers(settings))
        asyncio.run(ensure_topics(settings, bridge.bootstrap))
    except (NoBroker, SettingsError) as exc:
        sys.exit(f"sluice otel-bridge: {exc}")
    asyncio.run(bridge.serve())
    print(json.dumps(bridge.totals.as_dict()))
    return 0


def cmd_produce(args: argparse.Namespace) -> int:
    from aiokafka.errors import KafkaError

    from .bounded_producer import START_TIMEOUT_S, NotDelivered
    from .devstack.kafka import bootstrap_servers
    from .sim.producer import produce
    from .sim.replay import Fleet, generate, load_trace
    from .sim.specimens import bad_inputs

    settings = _settings()
    trace = load_trace(Path(args.trace) if args.trace else None)
    fleet = Fleet(pools=tuple(args.pools.split(",")), replicas_per_pool=args.replicas_per_pool)
    start_ms = int(time.time() * 1000)
    events = generate(trace, args.rate, args.seconds, args.seed, start_ms, fleet)
    catalogue = bad_inputs(settings.max_event_bytes)
    bad = [catalogue[i % len(catalogue)] for i in range(args.bad)]
    try:
        counts = asyncio.run(produce(settings, bootstrap_servers(settings), events, paced=not args.fast, bad=bad))
    except asyncio.TimeoutError:
        sys.exit(f"sluice produce: the broker did not answer within {START_TIMEOUT_S:.0f} s")
    except (NotDelivered, KafkaError) as exc:
        sys.exit(f"sluice produce: the broker did not take the events ({type(exc).__name__}: {exc})")
    print(json.dumps({"requests": counts.requests, "replicas": counts.replicas, "bad": counts.bad,
                      "total": counts.total, "bad_reasons": counts.bad_reasons}))
    return 0


def cmd_pools(args: argparse.Namespace) -> int:
    from .devstack.kafka import bootstrap_servers
    from .pools_view import PicturesCutShort, format_table, latest_pictures

    settings = _settings()
    try:
        pictures = asyncio.run(latest_pictures(settings, bootstrap_servers(settings), args.timeout))
    except PicturesCutShort as exc:
        sys.exit(f"sluice pools: {exc}, so a pool's newest picture may be missing: is the broker slow? "
                 "(--timeout gives the read longer)")
    if args.format == "json":
        print(json.dumps({"pools": [pictures[p] for p in sorted(pictures)]}, indent=2))
    else:
        print(format_table(pictures, use_colour=sys.stdout.isatty()))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from .devstack.kafka import bootstrap_servers
    from .pools_view import run_top

    settings = _settings()
    run_top(settings, bootstrap_servers(settings), args.refresh, args.iterations)
    return 0


def cmd_collect(args: argparse.Namespace) -> int:
    import logging

    from .collectors.vllm import Collector, Target, run
    from .devstack.kafka import bootstrap_servers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    settings = _settings()
    target = Target(url=args.url, pool=args.pool, replica=args.replica, hardware=args.hardware,
                    gpu_count=args.gpu_count, engine=args.engine, dcgm_url=args.dcgm_url)
    collector = Collector(target, unhealthy_after=args.unhealthy_after)
    try:
        asyncio.run(run(settings, bootstrap_servers(settings), collector, args.interval, args.iterations))
    except KeyboardInterrupt:
        pass
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    from .query_client import QueryFailed, render, run_query

    try:
        rows, truncated = run_query(_settings(), args.sql, args.url)
    except QueryFailed as exc:
        print(f"sluice query: {exc}", file=sys.stderr)
        return 2
    print(render(rows, args.format))
    if truncated:
        print("(truncated to query_max_rows rows)", file=sys.stderr)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .query_client import QueryFailed, render
    from .report import pool_report

    try:
        rows = pool_report(_settings(), args.since_hours, args.url)
    except QueryFailed as exc:
        print(f"sluice report: {exc}", file=sys.stderr)
        return 2
    print(render(rows, args.format))
    return 0


def cmd_settings(args: argparse.Namespace) -> int:
    if args.markdown:
        print(settings_table())
    else:
        print(json.dumps(_settings().redacted(), indent=2))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(_settings(), seconds=args.seconds)


def cmd_sim(args: argparse.Namespace) -> int:
    from .query_client import render
    from .sim.replica import Hardware
    from .sim.scenarios import CLIENTS, SCENARIOS, Fleet, compare, compare_seeds, slo_capacity

    if args.chunked_prefill < 0:
        print("sluice sim: --chunked-prefill takes a token budget per engine step (0: off)", file=sys.stderr)
        return 2
    hardware = Hardware(priority_scheduling=args.engine_priority, max_batched_tokens=args.chunked_prefill)
    fleet = Fleet(replicas=args.replicas, duration_s=args.seconds, seed=args.seed, arrivals=args.arrivals,
                  burstiness=args.burstiness, hardware=hardware,
                  client=CLIENTS[args.clients])
    names = tuple(args.scenario or SCENARIOS)
    if args.seeds:
        first, _, last = args.seeds.partition("-")
        rows = compare_seeds(names, fleet, range(int(first), int(last or first) + 1), _settings())
    else:
        from .sim.chart import ChartsUnavailable

        try:
            rows = compare(names, fleet, _settings(), Path(args.charts) if args.charts else None)
        except ChartsUnavailable as exc:
            print(f"sluice sim: {exc}", file=sys.stderr)
            return 2
    if args.goals:
        from .sim.goals import check

        checked = check(rows)
        print(render(checked, args.format))
        return 1 if any(line["failed"] for line in checked) else 0
    if args.format == "table" and not args.seeds:
        capacity = slo_capacity(fleet, fleet.replicas)
        print(f"SLO capacity of {fleet.replicas} replicas: {capacity.tasks_per_s:.1f} tasks/s "
              f"({capacity.slo_goodput:.1f} SLO-successful tasks/s)")
    print(render(rows, args.format))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(_settings(), events=args.events, as_json=args.json, lag_rate=args.lag_rate,
                      lag_seconds=args.lag_seconds, long_seconds=args.long_seconds, rounds=args.rounds)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .sim.scenarios import CLIENTS, SCENARIOS
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    kafka = sub.add_parser("kafka", help="local Apache Kafka (KRaft) for development and tests")
    kafka.add_argument("action", choices=("start", "stop", "status"))
    kafka.add_argument("--brokers", type=int, default=None,
                       help="nodes (combined broker + controller); 3 or more replicate every topic 3 times "
                            "(default: what the state directory holds, else 1)")
    kafka.add_argument("--secure", action="store_true", default=None,
                       help="SASL_SSL only (SCRAM-SHA-512), the project's own CA, ACLs (docs/kafka-cluster.md)")
    kafka.set_defaults(func=cmd_kafka)

    sub.add_parser("topics", help="create every Sluice topic that is missing").set_defaults(func=cmd_topics)

    db = sub.add_parser("db", help="ClickHouse store")
    db.add_argument("action", choices=("migrate",))
    db.set_defaults(func=cmd_db)

    worker = sub.add_parser("worker", help="run a pipeline worker (Faust)")
    worker.add_argument("--role", choices=("all", "control", "landing"),
                        help="control path, landing path, or both (default: the role setting, `all`)")
    worker.set_defaults(func=cmd_worker)

    sub.add_parser("otel-bridge", help="OpenTelemetry GenAI spans (OTLP/JSON from the Collector's Kafka exporter, "
                                       "topic otel_topic) → RequestEvents; docs/integrations.md"
                   ).set_defaults(func=cmd_otel_bridge)

    produce = sub.add_parser("produce", help="replay the Azure trace as RequestEvents and ReplicaSamples")
    produce.add_argument("--trace", help="trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens); default: the bundled one")
    produce.add_argument("--rate", type=float, default=20.0, help="requests per second (the trace is time-scaled)")
    produce.add_argument("--seconds", type=float, default=60.0, help="seconds of traffic to generate")
    produce.add_argument("--seed", type=int, default=1, help="seed for tasks, tenants, priorities and failures")
    produce.add_argument("--pools", default="llama-70b-a,llama-8b-a", help="comma-separated pool names")
    produce.add_argument("--replicas-per-pool", type=int, default=4)
    produce.add_argument("--bad", type=int, default=0, help="also send this many invalid records (every category)")
    produce.add_argument("--fast", action="store_true", help="send as fast as possible instead of in real time")
    produce.set_defaults(func=cmd_produce)

    pools = sub.add_parser("pools", help="every pool's load picture: axes and pressures")
    pools.add_argument("--format", choices=("table", "json"), default="table")
    pools.add_argument("--timeout", type=float, default=10.0,
                       help="seconds to read the load topic to its end (default 10); exit 1 if that is not enough")
    pools.set_defaults(func=cmd_pools)

    top = sub.add_parser("top", help="live view of the pools, refreshed in place")
    top.add_argument("--refresh", type=float, default=1.0, help="seconds between redraws")
    top.add_argument("--iterations", type=int, default=None, help="stop after this many redraws")
    top.set_defaults(func=cmd_top)

    collect = sub.add_parser("collect", help="scrape a serving engine and publish ReplicaSamples")
    collect.add_argument("engine", choices=("vllm", "sglang"))
    collect.add_argument("--url", required=True, help="the engine's Prometheus endpoint, e.g. http://host:8000/metrics")
    collect.add_argument("--pool", required=True)
    collect.add_argument("--replica", required=True)
    collect.add_argument("--hardware", required=True, help="accelerator type as priced, e.g. H100-80GB")
    collect.add_argument("--gpu-count", type=int, default=1)
    collect.add_argument("--dcgm-url", help="optional DCGM exporter endpoint on the same host")
    collect.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    collect.add_argument("--unhealthy-after", type=int, default=3, help="failed scrapes in a row before unhealthy")
    collect.add_argument("--iterations", type=int, default=None, help="stop after this many samples")
    collect.set_defaults(func=cmd_collect)

    query = sub.add_parser("query", help="read-only SQL against the store (through the worker for chdb)")
    query.add_argument("sql")
    query.add_argument("--format", choices=("table", "json", "csv"), default="table")
    query.add_argument("--url", help="a worker's /query endpoint (default: this machine's worker)")
    query.set_defaults(func=cmd_query)

    report = sub.add_parser("report", help="per pool: requests, success, TTFT/TPOT quantiles, SLO attainment, "
                                           "cost per successful task, waste share")
    report.add_argument("--format", choices=("table", "json", "csv"), default="table")
    report.add_argument("--since-hours", type=float, default=None, help="only the last N hours (default: all)")
    report.add_argument("--url", help="a worker's /query endpoint (default: this machine's worker)")
    report.set_defaults(func=cmd_report)

    settings = sub.add_parser("settings", help="show the effective settings (secrets masked)")
    settings.add_argument("--markdown", action="store_true", help="print the documentation table instead")
    settings.set_defaults(func=cmd_settings)

    demo = sub.add_parser("demo", help="a replica-loss incident through the real pipeline, compared with baselines")
    demo.add_argument("--seconds", type=float, default=180.0, help="length of the incident, real time")
    demo.set_defaults(func=cmd_demo)

    sim = sub.add_parser("sim", help="fleet simulator: every scenario under every controller, in-process")
    sim.add_argument("--scenario", action="append", choices=tuple(SCENARIOS),
                     help="a scenario (repeatable; default: all)")
    sim.add_argument("--seconds", type=float, default=300.0, help="scenario length, simulated seconds")
    sim.add_argument("--replicas", type=int, default=10)
    sim.add_argument("--seed", type=int, default=1)
    sim.add_argument("--seeds", help="a range of seeds, e.g. 1-5: every scenario under each, in parallel processes")
    sim.add_argument("--engine-priority", action="store_true",
                     help="replicas schedule critical work first (vLLM --scheduling-policy priority) instead of FCFS")
    sim.add_argument("--chunked-prefill", type=int, default=0, metavar="TOKENS",
                     help="replicas process at most TOKENS per step, long prompts prefilled in chunks (vLLM "
                          "max_num_batched_tokens with chunked prefill, e.g. 8192); 0: a step prefills every prompt "
                          "it takes in, whole")
    sim.add_argument("--goals", action="store_true",
                     help="print Sluice's ratios and the goals each (scenario, seed) misses; exit 1 if any")
    sim.add_argument("--arrivals", choices=("trace", "gamma"), default="trace",
                     help="the Azure trace time-scaled, or gamma-distributed gaps")
    sim.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson, < 1 burstier)")
    sim.add_argument("--clients", choices=tuple(CLIENTS), default="scenario",
                     help="each scenario's own clients, or clients that ignore Retry-After and retry shed work "
                          "on their own 0.5-4 s backoff, up to ten attempts")
    sim.add_argument("--charts", help="directory for one PNG per scenario")
    sim.add_argument("--format", choices=("table", "json", "csv"), default="table")
    sim.set_defaults(func=cmd_sim)

    bench = sub.add_parser("bench", help="measure stage figures against a baseline in the same run")
    bench.add_argument("--events", type=int, default=200_000,
                       help="events to push through ingest (the scaling run takes at least 600,000)")
    bench.add_argument("--lag-rate", type=float, default=10000, help="events/s for the lag stage")
    bench.add_argument("--lag-seconds", type=float, default=30, help="seconds of real-time traffic for it")
    bench.add_argument("--long-seconds", type=float, default=600,
                       help="length of the long control-worker run, its RSS sampled over time, which stops "
                            "early at ten million events (0: skip it)")
    bench.add_argument("--rounds", type=positive_int, default=3,
                       help="runs of the throughput, lag and decode stages, interleaved: each figure is "
                            "reported as their median with its spread")
    bench.add_argument("--json", action="store_true", help="print JSON instead of a table")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except SettingsError as exc:  # e.g. a TLS file that does not load, found when the first client is built
        sys.exit(f"sluice {args.command}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
