"""The LiteLLM hook itself, without a proxy: verdicts become HTTP answers, Kafka down costs nothing, and
an error inside Sluice never fails the call."""

import asyncio
import os
import time
from types import SimpleNamespace

import pytest

from pipeline.admission.signing import sign
from pipeline.settings import load_settings
from tests.conftest import free_port
from tests.unit.test_signing import example_signal

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the internet on import
pytest.importorskip("litellm")
from fastapi import HTTPException  # noqa: E402

from pipeline.integrations.litellm_hook import SluiceAdmission  # noqa: E402

KEYS = {"k": "litellm-hook-test-secret-0123"}
KEY = SimpleNamespace(team_id="team-a", user_id="u1")


def hook() -> SluiceAdmission:
    """Pointed at a closed port: Kafka is down for the whole test."""
    settings = load_settings(env={}, kafka_bootstrap_servers=f"127.0.0.1:{free_port()}", signing_keys=KEYS,
                             signing_key_id="k")
    return SluiceAdmission(settings)


def publish(h: SluiceAdmission, **fields) -> None:
    now = int(time.time() * 1000)
    signal = example_signal() | {"pool": "hot", "seq": now, "issued_at": now, "valid_until": now + 6000,
                                 "max_predicted_wait_s": 0.0, "redirect": [],
                                 "defer": {"classes": ["deferrable"], "retry_after_s": 42.0}}
    shed = {"critical": 1.0, "standard": 1.0, "sheddable": 0.0, "deferrable": 0.0}
    signal["admit_fraction"] = signal["continuing_task_admit_fraction"] = shed
    signal.update(fields)
    assert h.router.book.offer(sign(signal, "k", KEYS["k"].encode())), h.router.book.refused


def data(priority: str) -> dict:
    return {"model": "hot", "litellm_call_id": f"call-{priority}", "messages": [],
            "proxy_server_request": {"headers": {"x-sluice-priority": priority}}}


def pre_call(h: SluiceAdmission, priority: str):
    return asyncio.run(h.async_pre_call_hook(KEY, None, data(priority), "acompletion"))


def test_shed_and_deferred_calls_get_429_with_their_retry_after_and_critical_passes():
    h = hook()
    publish(h)
    with pytest.raises(HTTPException) as shed:
        pre_call(h, "sheddable")
    assert shed.value.status_code == 429 and int(shed.value.headers["Retry-After"]) >= 1
    with pytest.raises(HTTPException) as deferred:
        pre_call(h, "deferrable")
    assert deferred.value.status_code == 429 and 42 <= int(deferred.value.headers["Retry-After"]) <= 63, \
        "the deferral's retry-after, spread 1–1.5× so deferred work does not return in one wave"
    admitted = pre_call(h, "critical")
    assert admitted["metadata"]["sluice_call"]["priority"] == "critical"
    phases = [e["phase"] for e in list(h.emitter.queue._queue)]
    assert phases == ["received", "rejected", "received", "deferred", "received", "admitted"]


def key(models: list[str], team_models: list[str] | None = None):
    """A proxy key as LiteLLM's auth hands it to the hook: the model groups it, and its team, may call."""
    from litellm.proxy._types import UserAPIKeyAuth

    return UserAPIKeyAuth(models=models, team_id="team-a" if team_models is not None else None,
                          team_models=team_models or [], user_id="u1")


def test_a_redirect_switches_the_model_group_when_the_proxy_serves_it(monkeypatch):
    h = hook()
    publish(h, redirect=[{"pool": "cool", "weight": 1.0, "cold_prefill_cost_s": 0.1}])
    monkeypatch.setattr(SluiceAdmission, "_serves", staticmethod(lambda group: group == "cool"))
    assert asyncio.run(h.async_pre_call_hook(key([]), None, data("sheddable"), "acompletion"))["model"] == "cool"
    monkeypatch.setattr(SluiceAdmission, "_serves", staticmethod(lambda group: False))
    with pytest.raises(HTTPException) as shed:   # a pool with no model group here: shed, never a broken call
        asyncio.run(h.async_pre_call_hook(key([]), None, data("sheddable"), "acompletion"))
    assert shed.value.status_code == 429


def test_a_redirect_never_reaches_a_model_group_the_callers_key_or_team_may_not_call(monkeypatch):
    """LiteLLM checked the key against the group the caller asked for before the hook; a move to a sibling
    group must pass the same check, or shedding would hand callers groups their key is refused. Refused, the
    move becomes the shedding it replaced: a 429 with the signal's spread retry-after, and events that say
    rejected."""
    h = hook()
    publish(h, redirect=[{"pool": "cool", "weight": 1.0, "cold_prefill_cost_s": 0.1}])
    monkeypatch.setattr(SluiceAdmission, "_serves", staticmethod(lambda group: True))
    for caller in (key(["hot"]), key([], team_models=["hot"]), KEY):   # KEY: no model fields at all
        h.emitter.queue._queue.clear()
        with pytest.raises(HTTPException) as shed:
            asyncio.run(h.async_pre_call_hook(caller, None, data("sheddable"), "acompletion"))
        assert shed.value.status_code == 429 and 21 <= int(shed.value.headers["Retry-After"]) <= 63
        assert [e["phase"] for e in list(h.emitter.queue._queue)] == ["received", "rejected"]
    moved = asyncio.run(h.async_pre_call_hook(key(["hot", "cool"], team_models=["hot", "cool"]), None,
                                              data("sheddable"), "acompletion"))
    assert moved["model"] == "cool"


def test_a_pool_the_caller_names_changes_neither_the_pool_nor_the_model_group(monkeypatch):
    """Naming a pool with no signal (or a quiet one) must not pass the shedding of the pool the call goes to,
    nor move the call to a model group its key may not call (the proxy checked the key before this hook)."""
    h = hook()
    publish(h)
    monkeypatch.setattr(SluiceAdmission, "_serves", staticmethod(lambda group: True))
    for named in ({"metadata": {"sluice_pool": "no-signal-here"}},
                  {"proxy_server_request": {"headers": {"x-sluice-priority": "sheddable", "x-sluice-pool": "x"}}}):
        with pytest.raises(HTTPException) as shed:
            asyncio.run(h.async_pre_call_hook(KEY, None, data("sheddable") | named, "acompletion"))
        assert shed.value.status_code == 429, "judged by hot's signal, where the call goes"


def test_with_a_ceiling_only_keys_marked_by_an_admin_send_critical_work():
    """``litellm_max_priority = standard``: an unmarked key's critical claim is judged as standard (and its
    events say standard), as is one whose own metadata raises its ceiling; a key of a team whose metadata says
    ``sluice_max_priority: critical`` keeps it."""
    from litellm.proxy._types import UserAPIKeyAuth

    settings = load_settings(env={}, kafka_bootstrap_servers=f"127.0.0.1:{free_port()}", signing_keys=KEYS,
                             signing_key_id="k", litellm_max_priority="standard")
    h = SluiceAdmission(settings)
    publish(h)
    unmarked, self_raised = UserAPIKeyAuth(team_id="team-a"), UserAPIKeyAuth(metadata={"sluice_max_priority": "critical"})
    marked = UserAPIKeyAuth(team_id="team-a", team_metadata={"sluice_max_priority": "critical"})
    for key in (unmarked, self_raised):
        stashed = asyncio.run(h.async_pre_call_hook(key, None, data("critical"), "acompletion"))["metadata"]
        assert stashed["sluice_call"]["priority"] == "standard"
    stashed = asyncio.run(h.async_pre_call_hook(marked, None, data("critical"), "acompletion"))["metadata"]
    assert stashed["sluice_call"]["priority"] == "critical"
    lowered = UserAPIKeyAuth(metadata={"sluice_max_priority": "sheddable"})
    with pytest.raises(HTTPException) as shed:   # hot sheds sheddable work: a key kept to sheddable is shed
        asyncio.run(h.async_pre_call_hook(lowered, None, data("critical"), "acompletion"))
    assert shed.value.status_code == 429


def test_a_callers_own_stash_is_dropped_so_it_cannot_borrow_a_tenant_or_pool():
    h = hook()
    forged = {"task_id": "t", "request_id": "r", "attempt": 1, "step": 0, "tenant": "someone-else", "priority":
              "critical", "pool": "victim", "model": "victim", "slo_ttft_s": 1.0, "slo_tpot_s": 0.1, "final": True}
    embedding = {"model": "hot", "metadata": {"sluice_call": dict(forged)}}
    asyncio.run(h.async_pre_call_hook(KEY, None, embedding, "aembedding"))
    assert "sluice_call" not in embedding["metadata"]
    completion = data("critical") | {"metadata": {"sluice_call": dict(forged)}}
    stashed = asyncio.run(h.async_pre_call_hook(KEY, None, completion, "acompletion"))["metadata"]["sluice_call"]
    assert (stashed["tenant"], stashed["pool"]) == ("team-a", "hot")


def test_without_kafka_or_a_signal_every_call_goes_through_and_fast():
    h = hook()
    started = time.perf_counter()
    for priority in ("sheddable", "critical", "deferrable"):
        assert pre_call(h, priority)["model"] == "hot"
    assert time.perf_counter() - started < 5


def test_an_error_inside_sluice_never_fails_the_call(monkeypatch):
    h = hook()
    monkeypatch.setattr(h.router, "decide", lambda request: 1 / 0)
    assert pre_call(h, "sheddable")["model"] == "hot"
    asyncio.run(h.async_log_success_event({"litellm_params": {"metadata": {"sluice_call": {"bad": 1}}}},
                                          None, None, None))


def test_close_stops_the_background_connects_and_the_emitter():
    """A process embedding the hook shuts it down without leaving tasks retrying a broker or clients open."""
    h = hook()

    async def scenario():
        await h.async_pre_call_hook(KEY, None, data("critical"), "acompletion")   # starts connecting
        connecting = list(h._connecting)
        assert connecting and not any(task.done() for task in connecting)
        await h.close(drain_timeout_s=0.1)
        return connecting

    connecting = asyncio.run(scenario())
    assert all(task.done() for task in connecting)
    assert h.emitter._task is None or h.emitter._task.done()


def test_the_next_attempt_of_a_call_it_shed_is_a_retry_of_shed_work_not_a_budgeted_retry(monkeypatch):
    """The hook never set ``after_shed``: work it shed came back (``x-sluice-attempt: 2``) counted against the
    retry budget, and a pool recovered from its overload refused most of it (188 of 200, in review)."""
    h = hook()
    publish(h)
    asked = []
    decide = h.router.decide
    monkeypatch.setattr(h.router, "decide", lambda request: asked.append(request) or decide(request))

    def call(task: str, attempt: int, priority: str = "sheddable") -> dict:
        return {"model": "hot", "litellm_call_id": f"{task}-{attempt}", "messages": [], "proxy_server_request": {
            "headers": {"x-sluice-priority": priority, "x-sluice-task-id": task, "x-sluice-attempt": str(attempt)}}}

    with pytest.raises(HTTPException):
        asyncio.run(h.async_pre_call_hook(KEY, None, call("t1", 1), "acompletion"))
    asyncio.run(h.async_pre_call_hook(KEY, None, call("t2", 1, "critical"), "acompletion"))
    with pytest.raises(HTTPException):
        asyncio.run(h.async_pre_call_hook(KEY, None, call("t1", 2), "acompletion"))
    asyncio.run(h.async_pre_call_hook(KEY, None, call("t2", 2, "critical"), "acompletion"))
    other_team = SimpleNamespace(team_id="team-b", user_id="u2")
    asyncio.run(h.async_pre_call_hook(other_team, None, call("t1", 2, "critical"), "acompletion"))
    assert [(r.retry, r.after_shed) for r in asked] == [(False, False), (False, False), (True, True), (True, False),
                                                        (True, False)], "another tenant's t1 is not this one's"
    # a parallel call of t1 going through does not make the hook forget it; calls without a task id are not kept
    asyncio.run(h.async_pre_call_hook(KEY, None, call("t1", 1, "critical"), "acompletion"))
    for i in range(50):
        with pytest.raises(HTTPException):
            pre_call(h, "sheddable")
    assert list(h._shed) == [("team-a", "t1")]


def test_a_task_shed_long_ago_is_forgotten(monkeypatch):
    """The memory of shed tasks was bounded by count only: at a low shed rate a task id shed hours earlier, reused
    by a client for new work, was still taken for a retry of shed work (and kept off the retry budget)."""
    h = hook()
    publish(h)
    now = [1_000.0]
    h.clock = lambda: now[0]
    asked = []
    decide = h.router.decide
    monkeypatch.setattr(h.router, "decide", lambda request: asked.append(request) or decide(request))

    def call(task: str, attempt: int) -> dict:
        return {"model": "hot", "litellm_call_id": f"{task}-{attempt}-{now[0]}", "messages": [],
                "proxy_server_request": {"headers": {"x-sluice-priority": "sheddable", "x-sluice-task-id": task,
                                                     "x-sluice-attempt": str(attempt)}}}

    for task in ("old", "recent"):
        with pytest.raises(HTTPException):
            asyncio.run(h.async_pre_call_hook(KEY, None, call(task, 1), "acompletion"))
        now[0] += 600
    for task in ("old", "recent"):   # 1,200 s and 600 s after they were shed
        with pytest.raises(HTTPException):
            asyncio.run(h.async_pre_call_hook(KEY, None, call(task, 2), "acompletion"))
    assert [(r.retry, r.after_shed) for r in asked[2:]] == [(True, False), (True, True)], "old, then recent"


def test_invented_model_names_do_not_grow_the_hooks_memory():
    h = hook()
    for i in range(300):
        asyncio.run(h.async_pre_call_hook(KEY, None, {"model": f"invented-{i}", "messages": []}, "acompletion"))
    assert len(h.configs._cache) == 0
