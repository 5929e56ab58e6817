from itertools import islice

import pytest

from pipeline import topics
from pipeline.events import ReplicaSample, RequestEvent, decode
from pipeline.settings import load_settings
from pipeline.sim.replay import generate, load_trace

import orjson


def test_topic_names_follow_the_contract_and_namespace():
    plain = load_settings(env={})
    assert topics.REQUESTS.name(plain) == "sluice.requests.v1"
    assert topics.ADMISSION.name(load_settings(env={"SLUICE_TOPIC_NAMESPACE": "ci"})) == "ci.sluice.admission.v1"
    configs = topics.topic_configs(plain)
    assert configs["sluice.admission.v1"][1]["cleanup.policy"] == "compact"
    assert configs["sluice.load.v1"][1]["cleanup.policy"] == "compact"
    assert configs["sluice.requests.v1"][0] == plain.topic_partitions
    assert int(configs["sluice.requests.v1"][1]["max.message.bytes"]) > plain.max_event_bytes
    # the stage-2 rebuild finds its re-read's start by broker time; raw topics keep the producers' times
    assert {name for name, (_, cfg) in configs.items() if cfg.get("message.timestamp.type") == "LogAppendTime"} \
        == {"sluice.partials.v1"}


def test_compacted_topics_bound_how_long_a_superseded_record_is_read():
    """A router starting reads the admission topic from its start: every compacted topic Sluice creates
    (and stage 2's changelog) rolls and compacts within ``topic_compaction_lag_s``; the others expire."""
    settings = load_settings(env={"SLUICE_TOPIC_COMPACTION_LAG_S": "90", "SLUICE_ADMISSION_COMPACTION_LAG_S": "7"})
    configs = topics.topic_configs(settings)
    lags = {name: cfg["max.compaction.lag.ms"] for name, (_, cfg) in configs.items()
            if cfg["cleanup.policy"] == "compact"}
    assert lags == {"sluice.load.v1": "90000", "sluice.admission.v1": "7000"}
    for name, (_, cfg) in configs.items():
        if name in lags:
            assert cfg["segment.ms"] == lags[name] and "retention.ms" not in cfg
        else:
            assert "max.compaction.lag.ms" not in cfg and int(cfg["retention.ms"]) > 0
    changelog = topics.changelog_config(settings)
    assert changelog["max.compaction.lag.ms"] == "90000" and changelog["delete.retention.ms"] == "3600000"
    assert changelog["min.insync.replicas"] == "1"
    default = load_settings(env={})
    assert (default.topic_compaction_lag_s, default.admission_compaction_lag_s) == (600, 3600)
    with pytest.raises(Exception, match="topic_compaction_lag_s"):
        load_settings(env={"SLUICE_TOPIC_COMPACTION_LAG_S": "0"})


def test_drift_is_checked_on_sluices_existing_topics_and_the_changelog_not_the_collectors_spans_topic():
    s = load_settings(env={"SLUICE_OTEL_TOPIC": "otlp_spans"})
    existing = {topics.LOAD.name(s), "otlp_spans", "someone.elses.topic"}
    assert set(topics.drift_checked(s, existing)) == {topics.LOAD.name(s), topics.changelog_topic(s)}
    assert topics.drift_checked(s, existing)[topics.LOAD.name(s)] == topics.LOAD.config(s)


def test_config_drift_names_each_declared_key_a_topic_does_not_match():
    declared = {"cleanup.policy": "compact", "max.compaction.lag.ms": "600000", "segment.ms": "600000"}
    created_by_an_older_release = {"cleanup.policy": "compact", "max.compaction.lag.ms": "9223372036854775807",
                                   "segment.ms": "604800000", "retention.ms": "604800000"}
    assert topics.config_drift(declared, created_by_an_older_release) == {
        "max.compaction.lag.ms": ("9223372036854775807", "600000"), "segment.ms": ("604800000", "600000")}
    assert topics.config_drift(declared, declared | {"retention.ms": "1"}) == {}   # undeclared keys: the operator's
    assert topics.config_drift({"segment.ms": "1"}, {}) == {"segment.ms": (None, "1")}


def test_trace_is_bundled_and_complete():
    trace = load_trace()
    assert len(trace) == 19_366
    assert trace[0].offset_s == 0 and 3500 < trace[-1].offset_s < 3600


def test_replay_is_deterministic_valid_and_time_ordered():
    trace = load_trace()
    a = list(islice(generate(trace, rate=50, seconds=30, seed=3, start_ms=0), 2000))
    b = list(islice(generate(trace, rate=50, seconds=30, seed=3, start_ms=0), 2000))
    assert a == b
    assert [e.at_s for e in a] == sorted(e.at_s for e in a)
    for item in a:
        cls = RequestEvent if item.kind == "request" else ReplicaSample
        assert isinstance(decode(cls, orjson.dumps(item.event), item.key.encode(), 1 << 20), cls), item


def test_replay_rate_is_time_scaled():
    trace = load_trace()
    received = [e for e in generate(trace, rate=40, seconds=60, seed=1, start_ms=0)
                if e.kind == "request" and e.event["phase"] == "received" and e.event["attempt"] == 1
                and e.event["request_id"].endswith("-s0")]
    assert 0.8 * 40 * 60 < len(received) < 1.2 * 40 * 60


def test_a_topic_is_ready_only_when_known_and_every_partition_has_a_leader():
    described = [
        {"topic": "ready", "error_code": 0, "partitions": [{"partition": 0, "leader": 1}, {"partition": 1, "leader": 2}]},
        {"topic": "electing", "error_code": 0, "partitions": [{"partition": 0, "leader": 1}, {"partition": 1, "leader": -1}]},
        {"topic": "unknown", "error_code": 3, "partitions": []},
        {"topic": "no-partitions-yet", "error_code": 0, "partitions": []},
    ]
    assert topics.leaderless(described) == ["electing", "no-partitions-yet", "unknown"]
    assert topics.leaderless(described[:1]) == []


def test_an_admin_request_is_asked_again_on_a_retriable_error_only():
    """aiokafka's admin client sends a request to one broker picked at random: one not ready (down, or listed
    before its listener accepts) failed ``ensure_topics``, and so a worker's start, on that pick alone."""
    import asyncio
    import time

    from aiokafka.errors import NodeNotReadyError, TopicAuthorizationFailedError

    from pipeline.topics import _retried

    def failing(errors: list):
        async def request():
            if errors:
                raise errors.pop(0)
            return "answered"
        return request

    assert asyncio.run(_retried(failing([NodeNotReadyError(), NodeNotReadyError()]), time.monotonic() + 10)) \
        == "answered"
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(_retried(failing([TopicAuthorizationFailedError()]), time.monotonic() + 10))
    with pytest.raises(NodeNotReadyError):   # past the deadline: the error, not a wait without end
        asyncio.run(_retried(failing([NodeNotReadyError()] * 100), time.monotonic()))
