"""The real LiteLLM proxy with Sluice's hook, the real broker and a real worker, driven by the openai client.

LiteLLM's mock responses stand in for the model backend (``mock_response`` in the model entry), so the
proxy's full request path runs — auth, the pre-call hook, routing, logging hooks — without a GPU.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import replace

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from pipeline import topics
from pipeline.pools_view import PicturesCutShort, latest_pictures
from pipeline.sinks.store import open_store
from pipeline.worker_process import worker_env
from tests.conftest import free_port, run, wait_for
from tests.integration.kafka_helpers import group_lag, read_all

openai = pytest.importorskip("openai")
pytest.importorskip("litellm")
pytestmark = pytest.mark.integration

KEYS = {"test": "litellm-proxy-test-secret-0123"}
# critical is never shed (floor 1): what an operator sets who promises critical work always gets through
POLICY = {"critical_floor": 1.0}
POOL = "hot"


def overloaded_sample(replica: str, now_ms: int, preemptions: int) -> dict:
    return {"schema_version": 1, "event_id": str(uuid.uuid4()), "event_time": now_ms, "replica_id": replica,
            "pool": POOL, "hardware": "H100-80GB", "gpu_count": 4, "requests_running": 16, "requests_waiting": 40,
            "kv_cache_usage": 0.99, "preemptions_total": preemptions, "prompt_tokens_total": 0,
            "generation_tokens_total": 0, "prefix_cache_hits_total": 0, "prefix_cache_queries_total": 0,
            "healthy": True}


@pytest.fixture
def proxy_settings(settings):
    return replace(settings, tick_s=0.25, fast_window_s=2.0, heartbeat_s=1.0, ingest_batch_within_s=0.05,
                   signing_keys=KEYS, signing_key_id="test", admission_policy=POLICY, dev_signing_key=False)


@pytest.fixture
def proxy(proxy_settings, tmp_path):
    """``litellm --config`` on 127.0.0.1 with the hook named in its config, configured like a worker."""
    config = tmp_path / "litellm.yaml"
    config.write_text(f"""model_list:
  - model_name: {POOL}
    litellm_params:
      model: openai/{POOL}-model
      api_key: sk-unused
      mock_response: "Hello from the mock backend"
  - model_name: {POOL}-broken
    litellm_params:
      model: openai/{POOL}-model
      api_key: sk-unused
      api_base: http://127.0.0.1:9/v1
      num_retries: 0
litellm_settings:
  callbacks: pipeline.integrations.litellm_hook.sluice_admission
""")
    port, master = free_port(), f"sk-{secrets.token_hex(16)}"
    # the bundled model price map: no fetch from the internet at start
    env = {**worker_env(proxy_settings), "LITELLM_MASTER_KEY": master, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    log = open(tmp_path / "litellm.log", "wb")
    litellm_bin = os.path.join(os.path.dirname(sys.executable), "litellm")
    proc = subprocess.Popen([litellm_bin, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def live() -> bool:
        assert proc.poll() is None, (tmp_path / "litellm.log").read_text()[-3000:]
        try:
            return urllib.request.urlopen(f"{base}/health/liveliness", timeout=2).status == 200
        except OSError:
            return False

    try:
        wait_for(live, 120, interval_s=0.5, message="the LiteLLM proxy to answer")
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=master, max_retries=0, timeout=30)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def whole_topic(s, topic: str) -> list:
    """The topic's records for a failure report: none if the broker does not give them within 30 s, so the
    report never hangs or replaces the failure it explains."""
    async def bounded():
        return await asyncio.wait_for(read_all(s.kafka_bootstrap_servers, topic), 30)
    try:
        return run(bounded())
    except Exception:
        return []


def what_reached_the_worker(s, picture: dict | None, tmp_path, worker) -> str:
    """For a failure: the picture's times and rates, the request events on the topic by phase (did the hook's
    emitter deliver them?), the worker's control-path counters (did it read and fold them?), and the warnings
    and errors in the worker's and the proxy's logs."""
    read = picture and {k: picture.get(k) for k in ("watermark_ms", "published_at_ms", "rates", "late_events")}
    phases: dict[str, int] = {}
    sent: list = []   # (partition, offset, record time, event time) of each request event
    for record in whole_topic(s, topics.REQUESTS.name(s)):
        try:
            doc = orjson.loads(record.value)
            key = f"{doc.get('phase')}@{str(doc.get('task_id', '')).split('-')[0]}"
            sent.append((record.partition, record.offset, record.timestamp, doc.get("event_time")))
        except Exception:
            key = "unparsed"
        phases[key] = phases.get(key, 0) + 1
    phases["sent (partition, offset, record time, event time)"] = sorted(sent)[-40:]
    logs = []
    for name in ("worker-0.log", "litellm.log"):
        path = tmp_path / name
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        flagged = [line for line in lines if any(w in line for w in ("WARN", "ERROR", "Traceback", "sluice:", "Error"))
                   and "shed by Sluice" not in line]
        logs.append(f"{name} ({len(lines)} lines), flagged: " + "\n".join(flagged[-25:]))
    try:
        counters = [line for line in worker.scrape().splitlines() if line.startswith((
            "sluice_control_events_total", "sluice_consumer_lag_records", "sluice_partials_",
            "sluice_events_accepted_total", "sluice_events_dead_lettered_total", "sluice_worker_producer_wait",
            "sluice_admission_signals_published_total", "sluice_picture_lag_seconds_count",
            "sluice_pool_step_failures_total", "sluice_control_cut_wait")) and "_created" not in line]
    except Exception as exc:
        counters = [f"the worker's /metrics did not answer: {exc!r}"]
    try:
        health = urllib.request.urlopen(f"{worker.base_url}/healthz", timeout=5).read().decode()[:1500]
    except urllib.error.HTTPError as exc:
        health = f"{exc.code}: {exc.fp.read(1500).decode(errors='replace') if exc.fp else ''}"
    except Exception as exc:
        health = f"did not answer: {exc!r}"
    try:   # the worker's own newest picture of the pool: stage 2's state, whatever reached the topic
        own = [{k: p.get(k) for k in ("published_at_ms", "watermark_ms", "rates")} for p in orjson.loads(
            urllib.request.urlopen(f"{worker.base_url}/pools", timeout=5).read())["pools"] if p.get("pool") == POOL]
    except Exception as exc:
        own = f"did not answer: {exc!r}"
    # every picture of the pool on the load topic, read to its end (30 s at most): did the worker stop
    # publishing them, or did the test's reads stop short of the newest?
    published = []
    for record in whole_topic(s, topics.LOAD.name(s)):
        try:
            doc = orjson.loads(record.value)
            if doc.get("pool") == POOL:
                published.append((record.offset, doc.get("published_at_ms"), doc.get("watermark_ms"),
                                  doc.get("rates", {}).get("goodput_tasks_per_s")))
        except Exception:
            published.append((record.offset, "unparsed"))
    # every partial stage 1 cut: did the proxy's calls reach a published partial (stage 1), or did stage 2
    # merge them without a picture (stage 2)?
    partials = []
    for record in whole_topic(s, topics.PARTIALS.name(s)):
        try:
            doc = orjson.loads(record.value)
            partials.append((record.timestamp, doc.get("id"), doc.get("pool"), doc.get("newest_ms"),
                             sorted(doc.get("requests", {})), len(doc.get("replicas", {}))))
        except Exception:
            partials.append((record.offset, "unparsed"))
    return (f"the partials (time, id, pool, newest_ms, request seconds, replicas): {partials[-30:]} of "
            f"{len(partials)}; "
            f"the last picture: {read}; the pool's pictures on the load topic (offset, published, watermark, "
            f"goodput): {published[-12:]} of {len(published)}; the worker's /pools: {own}; the worker's /healthz: "
            f"{health}; request events on the topic: {phases}; the worker's counters: " + "\n".join(counters)
            + "; " + "; ".join(logs))


def call(client, priority: str, task: str):
    """One chat call with Sluice's headers: (HTTP status, Retry-After header or None)."""
    try:
        client.chat.completions.create(model=POOL, messages=[{"role": "user", "content": "hi"}],
                                       extra_headers={"x-sluice-priority": priority, "x-sluice-task-id": task,
                                                      "x-sluice-final": "true"})
        return 200, None
    except openai.APIStatusError as exc:
        return exc.status_code, exc.response.headers.get("retry-after")


def test_the_proxy_sheds_sheddable_calls_with_429_passes_critical_and_its_events_land(
        proxy_settings, worker_factory, proxy, tmp_path):
    s = proxy_settings
    run(topics.ensure_topics(s, s.kafka_bootstrap_servers))
    worker = worker_factory(s).start()
    calm = [call(proxy, "sheddable", f"calm-{i}") for i in range(5)]
    assert calm == [(200, None)] * 5, "no signal yet: the hook admits (fail-open)"
    with pytest.raises(openai.APIStatusError):  # a backend that refuses connections: the call fails, as it would
        proxy.chat.completions.create(model=f"{POOL}-broken", messages=[{"role": "user", "content": "hi"}],
                                      extra_headers={"x-sluice-task-id": "broken-0"})

    async def overload_until_shed():
        producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap_servers)
        await producer.start()
        try:
            preemptions, statuses, deadline = 0, [], time.monotonic() + 60
            while time.monotonic() < deadline:
                preemptions += 2
                now = int(time.time() * 1000)
                for replica in ("hot-r0", "hot-r1"):
                    await producer.send(topics.REPLICAS.name(s), orjson.dumps(overloaded_sample(replica, now, preemptions)),
                                        key=replica.encode())
                status = await asyncio.to_thread(call, proxy, "sheddable", f"probe-{preemptions}")
                if status[0] == 429:
                    statuses = [await asyncio.to_thread(call, proxy, p, f"{p}-{i}")
                                for i in range(10) for p in ("sheddable", "critical")]
                    return status, statuses
                await asyncio.sleep(0.25)
            raise AssertionError("the proxy never shed a sheddable call under overload")
        finally:
            await producer.stop()

    first_shed, statuses = run(overload_until_shed())
    assert first_shed[1] is not None and int(first_shed[1]) >= 1, "a 429 carries Retry-After"
    sheddable = [st for i, st in enumerate(statuses) if i % 2 == 0]
    critical = [st for i, st in enumerate(statuses) if i % 2 == 1]
    assert critical == [(200, None)] * 10, "critical calls pass"
    assert sum(code == 429 for code, _ in sheddable) >= 8, sheddable

    # the calls' events move the pool's picture and land with the right fields: the completed final calls are
    # the pool's goodput over the cost window (arrivals are a rate over fast_window_s, 2 s here, which a loaded
    # machine's picture read can come after: CI, session 15)
    last: dict = {"cut_short": 0}

    async def agents_sample():
        """The replicas' agents go on sampling, as real ones do every second: a picture counts whole seconds
        before its watermark, so calls whose events all fall in the newest second are counted only once a
        later event moves it on (the failures of sessions 18-33: every partial merged, the last picture's
        watermark in the second of the completions, nothing after it)."""
        producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap_servers)
        await producer.start()
        try:
            for replica in ("hot-r0", "hot-r1"):
                await producer.send(topics.REPLICAS.name(s), orjson.dumps(
                    overloaded_sample(replica, int(time.time() * 1000), 0)), key=replica.encode())
        finally:
            await producer.stop()

    def picture_counts_calls():
        run(agents_sample())
        try:
            picture = last["picture"] = run(latest_pictures(s, s.kafka_bootstrap_servers, timeout_s=10)).get(POOL)
        except PicturesCutShort:
            last["cut_short"] += 1   # not yet: what was read may be older than the newest picture
            return False
        return picture is not None and picture["rates"]["goodput_tasks_per_s"] > 0 and picture
    try:
        wait_for(picture_counts_calls, 60, message="the pool's picture to count the proxy's calls")
    except AssertionError as exc:   # in CI (sessions 18, 23, 24, 26), unexplained: say where the events stopped
        raise AssertionError(f"{exc} ({last['cut_short']} read(s) cut short); "
                             f"{what_reached_the_worker(s, last.get('picture'), tmp_path, worker)}") from None
    raw = [topics.REQUESTS.name(s), topics.REPLICAS.name(s)]
    wait_for(lambda: run(group_lag(s.kafka_bootstrap_servers, topics.landing_group(s), raw)) == 0, 60,
             message="the calls' events to land")
    worker.stop()
    store = open_store(s)
    try:
        rows = store.query("SELECT task_id, phase, priority, tenant, model, error_type, input_tokens, output_tokens, "
                           "ttft_s FROM request_events WHERE pool IN ('hot', 'hot-broken')")
    finally:
        store.close()
    by_task: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_task.setdefault(row["task_id"], {})[row["phase"]] = row
    calm_0 = by_task["calm-0"]
    assert set(calm_0) == {"received", "admitted", "first_token", "completed"}
    done = calm_0["completed"]
    assert (done["priority"], done["model"]) == ("sheddable", POOL) and done["tenant"]
    assert done["output_tokens"] > 0 and done["input_tokens"] > 0 and done["ttft_s"] is not None
    shed = [t for t in by_task.values() if "rejected" in t]
    assert len(shed) >= 9 and all(t["rejected"]["error_type"] in ("sluice_shed", "sluice_predicted_wait") for t in shed)
    assert all(set(by_task[f"critical-{i}"]) >= {"admitted", "completed"} for i in range(10))
    failed = by_task["broken-0"]["failed"]
    assert failed["error_type"] and failed["output_tokens"] == 0, failed
