"""The vLLM collector against real exposition served over HTTP on 127.0.0.1, publishing to the real broker."""

import asyncio
import http.server
import threading

import orjson
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from pipeline import topics
from pipeline.collectors.vllm import Collector, Target, run
from tests.conftest import free_port
from tests.integration.kafka_helpers import read_all

pytestmark = pytest.mark.integration


@pytest.fixture
def vllm_endpoint():
    """A registry using vLLM's names (two engines, so samples must be summed, the KV fraction averaged) behind
    a real HTTP server."""
    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "running", ["engine"], registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "waiting", ["engine"], registry=registry)
    kv = Gauge("vllm:kv_cache_usage_perc", "kv", ["engine"], registry=registry)
    preempt = Counter("vllm:num_preemptions", "preemptions", ["engine"], registry=registry)
    prompt = Counter("vllm:prompt_tokens", "prompt", ["engine"], registry=registry)
    generation = Counter("vllm:generation_tokens", "generation", ["engine"], registry=registry)
    hits = Counter("vllm:prefix_cache_hits", "hits", ["engine"], registry=registry)
    queries = Counter("vllm:prefix_cache_queries", "queries", ["engine"], registry=registry)
    for engine, n in (("0", 1), ("1", 2)):
        running.labels(engine).set(3 * n)
        waiting.labels(engine).set(n)
        kv.labels(engine).set(0.2 * n)
        preempt.labels(engine).inc(n)
        prompt.labels(engine).inc(1000 * n)
        generation.labels(engine).inc(100 * n)
        hits.labels(engine).inc(10 * n)
        queries.labels(engine).inc(40 * n)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield f"http://127.0.0.1:{port}/metrics"
    server.shutdown()


@pytest.fixture
def garbage_endpoint():
    class Garbage(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>\x00\xff not metrics {{{ \n}")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()


def target(url):
    return Target(url=url, pool="p1", replica="p1-r0", hardware="H100-80GB", gpu_count=2, timeout_s=1.0)


def test_scrape_maps_vllm_names_and_sums_engines(vllm_endpoint):
    sample = Collector(target(vllm_endpoint)).collect(1_700_000_000_000)
    assert sample["requests_running"] == 9 and sample["requests_waiting"] == 3
    assert sample["kv_cache_usage"] == pytest.approx(0.3), "a fraction per engine: averaged, not summed"
    assert sample["preemptions_total"] == 3 and sample["prompt_tokens_total"] == 3000
    assert sample["prefix_cache_hits_total"] == 30 and sample["prefix_cache_queries_total"] == 120
    assert sample["healthy"] is True


def test_garbage_and_dead_endpoints_are_counted_then_unhealthy(garbage_endpoint, vllm_endpoint):
    collector = Collector(target(vllm_endpoint), unhealthy_after=3)
    good = collector.collect(1)
    collector.target.url = garbage_endpoint
    assert collector.collect(2)["healthy"] is True
    collector.target.url = f"http://127.0.0.1:{free_port()}/metrics"
    assert collector.collect(3)["healthy"] is True
    third = collector.collect(4)
    assert third["healthy"] is False and collector.failures == 3
    assert third["prompt_tokens_total"] == good["prompt_tokens_total"], "last good counters are kept"
    collector.target.url = vllm_endpoint
    assert collector.collect(5)["healthy"] is True


def test_collector_publishes_valid_samples_to_the_broker(settings, vllm_endpoint):
    from pipeline.topics import ensure_topics

    asyncio.run(ensure_topics(settings, settings.kafka_bootstrap_servers))
    published = asyncio.run(run(settings, settings.kafka_bootstrap_servers, Collector(target(vllm_endpoint)),
                                 interval_s=0.05, iterations=3))
    assert published == 3
    records = asyncio.run(read_all(settings.kafka_bootstrap_servers, topics.REPLICAS.name(settings)))
    assert len(records) == 3 and {r.key for r in records} == {b"p1-r0"}
    assert all(orjson.loads(r.value)["requests_running"] == 9 for r in records)
