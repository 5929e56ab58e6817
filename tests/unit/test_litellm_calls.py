"""The LiteLLM hook's pure side: what a proxy call becomes, and that every event it emits is one the
worker accepts (the requests topic's own decoder), whatever the caller sent."""

from types import SimpleNamespace

import orjson
import pytest
from hypothesis import given, strategies as st

from pipeline.events import RequestEvent, Rejected
from pipeline.ingest import decode
from pipeline.integrations.litellm_calls import (CallInfo, call_info, completion_events, event, failure_event,
                                                 priority_ceiling, verdict_event)
from pipeline.router import ADMIT, Defer, Redirect, Reject

SLO = lambda pool: (2.0, 0.1)  # noqa: E731


def accepted(doc: dict) -> bool:
    result = decode(RequestEvent, orjson.dumps(doc), doc["task_id"].encode(), 1 << 20)
    assert not isinstance(result, Rejected), (result, doc)
    return True


def proxy_data(headers=None, metadata=None, model="chat-8b"):
    return {"model": model, "litellm_call_id": "0f8c2a4e-call", "metadata": metadata or {},
            "proxy_server_request": {"headers": headers or {}}}


def test_headers_name_priority_task_and_attempt_and_the_key_names_the_tenant():
    call = call_info(proxy_data({"X-Sluice-Priority": "Critical", "x-sluice-task-id": "task-7",
                                 "x-sluice-attempt": "2", "x-sluice-step": "1"}), "team-a", "user-b",
                     "0f8c2a4e-call", SLO)
    assert (call.priority, call.task_id, call.request_id, call.attempt, call.step, call.tenant, call.pool) == (
        "critical", "task-7", "0f8c2a4e-call", 2, 1, "team-a", "chat-8b")
    assert call.request().continuing and call.request().retry and call.final is False
    assert call.request().tenant == "team-a"   # the key's team: what fair shares between tenants are judged by


def test_a_caller_claims_no_class_above_its_ceiling_which_its_keys_or_teams_metadata_sets():
    """Critical is the class shed last and never for a tenant's fair share: an operator can keep it for the keys
    or teams an admin marks (``sluice_max_priority`` in their metadata) and lower everyone else's claim."""
    claim = proxy_data({"x-sluice-priority": "critical"})
    assert call_info(claim, "t", "u", "c", SLO, max_priority="standard").priority == "standard"
    assert call_info(claim, "t", "u", "c", SLO, max_priority="critical").priority == "critical"
    sheddable = proxy_data({"x-sluice-priority": "sheddable"})
    assert call_info(sheddable, "t", "u", "c", SLO, max_priority="standard").priority == "sheddable", \
        "a ceiling only lowers"
    plain = SimpleNamespace(metadata={}, team_metadata=None)
    team_marked = SimpleNamespace(metadata={"sluice_max_priority": "bogus"},
                                  team_metadata={"sluice_max_priority": "Critical"})
    self_raised = SimpleNamespace(metadata={"sluice_max_priority": "critical"}, team_metadata=None)
    team_raised = SimpleNamespace(metadata={"sluice_max_priority": "critical"},
                                  team_metadata={"sluice_max_priority": "sheddable"})
    self_lowered = SimpleNamespace(metadata={"sluice_max_priority": "deferrable"},
                                   team_metadata={"sluice_max_priority": "critical"})
    assert [priority_ceiling(key, "standard") for key in (plain, team_marked, self_raised, team_raised,
                                                         self_lowered, object())] == [
        "standard", "critical", "standard", "sheddable", "deferrable", "standard"], \
        "a team's metadata sets the ceiling; a key's own (which internal users can write) only lowers it"
    own = proxy_data({"x-sluice-priority": "critical"}, metadata={"sluice_max_priority": "critical"})
    assert call_info(own, "t", "u", "c", SLO, max_priority=priority_ceiling(plain, "standard")).priority == \
        "standard", "the caller's own request metadata sets no ceiling"


def test_metadata_works_too_and_defaults_make_a_one_step_standard_task():
    data = proxy_data(metadata={"sluice_priority": "sheddable", "sluice_pool": "chat-8b-eu"})
    call = call_info(data, None, "user-b", "id-1", SLO)
    assert (call.priority, call.pool, call.tenant, call.task_id, call.final) == (
        "sheddable", data["model"], "user-b", "id-1", True), "the pool is where the call goes, not what it names"
    plain = call_info(proxy_data(), None, None, "id-2", SLO)
    assert (plain.priority, plain.tenant, plain.attempt, plain.step) == ("standard", "default", 1, 0)


@pytest.mark.parametrize("headers", [
    {"x-sluice-priority": "urgent!!"}, {"x-sluice-attempt": "-3"}, {"x-sluice-attempt": "10000"},
    {"x-sluice-task-id": "täsk with spaces\n" * 40}, {"x-sluice-step": ["1"]}, {"x-sluice-final": "maybe"},
])
def test_a_callers_odd_values_fall_back_and_never_fail_the_call(headers):
    call = call_info(proxy_data(headers, model="My Model (beta)"), "team with spaces", None, "id-3", SLO)
    for doc in (event(call, "received", 1_790_000_000_000), verdict_event(call, Reject(3.0, "shed"), 1_790_000_000_000)):
        assert accepted(doc)


def test_every_verdict_and_outcome_is_a_valid_event():
    call = call_info(proxy_data({"x-sluice-priority": "sheddable"}), "t", None, "id-4", SLO)
    now = 1_790_000_000_000
    phases = [verdict_event(call, v, now)["phase"] for v in (ADMIT, Reject(2.0, "shed"), Defer(30.0), Redirect("b"))]
    assert phases == ["admitted", "rejected", "deferred", "redirected"]
    usage = SimpleNamespace(prompt_tokens=900, completion_tokens=51,
                            prompt_tokens_details=SimpleNamespace(cached_tokens=512))
    first, done = completion_events(call, SimpleNamespace(usage=usage), 1_790_000_000.0, 1_790_000_000.4,
                                    1_790_000_002.4)
    assert (first["phase"], first["ttft_s"], done["phase"], done["input_tokens"], done["cached_input_tokens"],
            done["output_tokens"], done["tpot_s"], done["duration_s"]) == (
        "first_token", 0.4, "completed", 900, 512, 51, 0.04, 2.4)
    failed = failure_event(call, TimeoutError("slow"), 1_790_000_000.0, 1_790_000_010.0)
    assert (failed["phase"], failed["error_type"]) == ("cancelled", "timeout")
    for doc in [verdict_event(call, v, now) for v in (ADMIT, Reject(2.0, "shed"), Defer(30.0), Redirect("b"))] + [
            first, done, failed, failure_event(call, ValueError("x"), 1.79e9, 1.79e9 + 1)]:
        assert accepted(doc)


def test_a_response_without_usage_still_completes():
    call = call_info(proxy_data(), None, None, "id-5", SLO)
    _, done = completion_events(call, {"choices": []}, 1_790_000_000.0, None, 1_790_000_001.0)
    assert done["input_tokens"] == done["output_tokens"] == 0 and accepted(done)


def test_the_stash_survives_the_proxys_metadata_round_trip():
    call = call_info(proxy_data(), "t", None, "id-6", SLO)
    assert CallInfo.unstash(orjson.loads(orjson.dumps(call.stash()))) == call
    assert CallInfo.unstash({"bogus": 1}) is None


@given(st.dictionaries(st.sampled_from(["x-sluice-priority", "x-sluice-task-id", "x-sluice-attempt",
                                        "x-sluice-step", "x-sluice-final", "x-sluice-pool"]),
                       st.one_of(st.text(max_size=300), st.integers(), st.none(), st.booleans())),
       st.one_of(st.text(max_size=200), st.none()), st.one_of(st.text(max_size=100), st.none()))
def test_whatever_the_caller_sends_the_events_are_valid(headers, model, team):
    call = call_info(proxy_data(headers, model=model), team, None, "id-7", SLO)
    assert accepted(event(call, "received", 1_790_000_000_000))
    assert accepted(verdict_event(call, Reject(1.0, "shed"), 1_790_000_000_000))
