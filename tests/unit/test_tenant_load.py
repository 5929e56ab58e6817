"""Per-tenant load in the picture: bounded in stage 1 and in the picture, every attempt still counted."""

import pytest

from pipeline.events import RequestEvent
from pipeline.load.aggregates import MAX_TENANTS, OTHER_TENANTS, RequestAgg
from pipeline.load.tenant_load import MAX_PICTURE_TENANTS
from pipeline.sim.specimens import request_event
from tests.reference import reference
from tests.unit.test_picture import sample, snapshot_of


def attempt(second: int, tenant: str, phase: str, n: int = 0) -> RequestEvent:
    return RequestEvent(**request_event(event_time=second * 1000 + 500, pool="p", tenant=tenant, phase=phase,
                                        task_id=f"{tenant}-{second}-{n}", request_id=f"{tenant}-{second}-{n}-r"))


def picture_of(events) -> dict:
    return snapshot_of([sample("r1", second, 0, 0.3, 0) for second in range(100, 111)], events)


def test_a_noisy_tenant_leads_the_list_and_the_rest_are_one_row():
    events = []
    for second in range(101, 111):
        for n in range(10):                                   # 10 attempts/s, 5 admitted
            events.append(attempt(second, "noisy", "received", n))
            if n % 2 == 0:
                events.append(attempt(second, "noisy", "admitted", n))
        for t in range(20):                                   # twenty quiet tenants, one attempt/s each
            events += [attempt(second, f"team{t:02d}", "received"), attempt(second, f"team{t:02d}", "admitted")]
    rows = picture_of(events)["tenants"]
    quiet = rows[1]["offered_rps"]
    assert rows[0]["tenant"] == "noisy" and rows[1]["tenant"] == "team00" and quiet > 0
    assert rows[0]["offered_rps"] == pytest.approx(10 * quiet) and rows[0]["admitted_rps"] == pytest.approx(5 * quiet)
    assert len(rows) == MAX_PICTURE_TENANTS + 1 and rows[-1]["tenant"] == OTHER_TENANTS
    assert rows[-1]["offered_rps"] == pytest.approx(5 * quiet)    # the five quiet tenants past the first fifteen
    assert sum(r["offered_rps"] for r in rows) == pytest.approx(30 * quiet)
    assert not list(reference("load_picture").iter_errors(picture_of(events)))


def test_stage_one_counts_at_most_max_tenants_names_a_second_and_loses_no_attempt():
    agg = RequestAgg()
    for t in range(3 * MAX_TENANTS):
        agg.fold(attempt(100, f"t{t}", "received"))
    assert len(agg.tenants) == MAX_TENANTS + 1 and agg.tenants[OTHER_TENANTS][0] == 2 * MAX_TENANTS
    merged = RequestAgg()
    merged.merge(agg)
    merged.merge(RequestAgg.from_dict(agg.to_dict()))
    assert len(merged.tenants) == MAX_TENANTS + 1
    assert sum(c[0] for c in merged.tenants.values()) == 2 * 3 * MAX_TENANTS


@pytest.mark.parametrize("hostile", [[1, 2], {"a": [1]}, {"a": [1, -1]}, {"a": [1, 2.5]}, {"a": [True, 1]},
                                     {"a": "1,2"}, {"x" * 65: [1, 1]}, {"a": [1, 1 << 60]}])
def test_a_partial_with_malformed_tenant_counts_is_refused_whole(hostile):
    with pytest.raises(ValueError):
        RequestAgg.from_dict({"received": 1, "tenants": hostile})


def test_a_picture_without_tenants_from_an_older_worker_is_still_valid():
    picture = picture_of([attempt(105, "a", "received")])
    assert [(r["tenant"], r["admitted_rps"]) for r in picture["tenants"]] == [("a", 0.0)]
    del picture["tenants"]
    assert not list(reference("load_picture").iter_errors(picture))


def test_a_tenants_offered_work_is_counted_per_class_and_partials_of_older_workers_still_merge():
    """The fair shares shed a tenant's own lower classes first, so the picture says what each tenant offers
    per class; a partial from a worker before the per-class counts ([received, admitted]) still merges."""
    events = []
    for second in range(101, 111):
        events += [RequestEvent(**request_event(event_time=second * 1000 + 500, pool="p", tenant="a", phase="received",
                                                priority=priority, task_id=f"a-{second}-{priority}",
                                                request_id=f"a-{second}-{priority}-r"))
                   for priority in ("critical", "standard", "standard", "deferrable")]
    (row,) = picture_of(events)["tenants"]
    by_class = row["offered_rps_by_class"]
    assert by_class["standard"] == pytest.approx(2 * by_class["critical"]) and by_class["sheddable"] == 0.0
    assert sum(by_class.values()) == pytest.approx(row["offered_rps"])
    old = RequestAgg.from_dict({"received": 3, "tenants": {"a": [3, 1]}})
    new = RequestAgg.from_dict({"received": 1, "tenants": {"a": [1, 1]}, "tenant_classes": {"a": [0, 1, 0, 0]}})
    old.merge_counts(new)
    assert old.tenants["a"] == [4, 2, 0, 1, 0, 0, 0, 0]


def test_a_worker_from_before_the_per_class_counts_still_reads_the_partials():
    """Workers are rolled one at a time: the per-class counts travel under a key an older worker ignores, and
    ``tenants`` keeps the [received, admitted] shape it validates."""
    agg = RequestAgg()
    agg.fold(attempt(100, "a", "received"))
    wire = agg.to_dict()
    assert wire["tenants"] == {"a": [1, 0]} and sum(wire["tenant_classes"]["a"]) == 1
    older = {k: v for k, v in wire.items() if k != "tenant_classes"}   # what a session-7 worker reads
    assert RequestAgg.from_dict(older).tenants["a"][:2] == [1, 0]


def finished(second: int, tenant: str, n: int, duration: float | None, queue: float | None = None,
             phase: str = "completed") -> RequestEvent:
    return RequestEvent(**request_event(event_time=second * 1000 + 500, pool="p", tenant=tenant, phase=phase,
                                        task_id=f"{tenant}-{second}-{n}", request_id=f"{tenant}-{second}-{n}-r",
                                        input_tokens=1000, output_tokens=100, duration_s=duration, queue_s=queue))


def test_a_tenants_work_per_request_is_its_finished_attempts_time_in_service():
    """Fair shares change whose requests are admitted, and tenants' requests differ: the picture says each
    tenant's seconds in service (duration less queue time) per finished attempt, completed or failed, and
    the wire carries them under a key an older worker ignores. An attempt without a duration says nothing
    about its tenant's work and is not counted."""
    events = []
    for second in range(101, 111):
        events += [finished(second, "heavy", n, 9.0, queue=1.0) for n in range(2)]
        events += [finished(second, "light", n, 2.5, queue=0.5) for n in range(3)]
        events += [finished(second, "light", 3, 1.5, phase="failed"),
                   finished(second, "light", 4, None)]
    rows = {r["tenant"]: r for r in picture_of(events)["tenants"]}
    assert rows["heavy"]["service_s_per_s"] / rows["heavy"]["finished_rps"] == pytest.approx(8.0)
    assert rows["light"]["service_s_per_s"] / rows["light"]["finished_rps"] == pytest.approx(7.5 / 4)
    assert rows["light"]["finished_rps"] == pytest.approx(2 * rows["heavy"]["finished_rps"])
    assert not list(reference("load_picture").iter_errors(picture_of(events)))
    agg = RequestAgg()
    agg.fold(finished(100, "a", 0, 3.25, queue=4.0))   # queued longer than it lasted: says nothing, not counted
    agg.fold(finished(100, "a", 1, 3.25, queue=0.25))
    agg.fold(finished(100, "a", 2, 3.25, queue=3.25))
    wire = agg.to_dict()
    assert wire["tenant_service"] == {"a": [2, 3000]}
    assert RequestAgg.from_dict(wire).tenants["a"] == agg.tenants["a"]
    older = {k: v for k, v in wire.items() if k != "tenant_service"}   # from a worker before the service counts
    assert RequestAgg.from_dict(older).tenants["a"][-2:] == [0, 0]
    stale = older | {"tenant_work": {"a": [2, 2200]}}   # session 43's token counts, read by nobody now
    assert RequestAgg.from_dict(stale).tenants["a"][-2:] == [0, 0]


@pytest.mark.parametrize("hostile", [{"a": [1]}, {"a": [1, 2, 3]}, {"a": [1, -5]}, {"a": [1, 1.5]}, [1, 2]])
def test_tenant_service_counts_of_the_wrong_shape_refuse_the_partial(hostile):
    with pytest.raises(ValueError):
        RequestAgg.from_dict({"received": 1, "tenant_service": hostile})


@pytest.mark.parametrize("hostile", [{"a": [1, 2, 3]}, {"a": [0, 0, 0, 0, 0]}, {"a": [0, -1, 0, 0]}, [1, 2, 3, 4]])
def test_per_class_tenant_counts_of_the_wrong_shape_refuse_the_partial(hostile):
    with pytest.raises(ValueError):
        RequestAgg.from_dict({"received": 1, "tenant_classes": hostile})


@pytest.mark.parametrize("rows,why", [
    ("x", "array"), ([{"tenant": "a"}] * 18, "at most"), ([{"tenant": "", "offered_rps": 1, "admitted_rps": 1}], "1 to 64"),
    ([{"tenant": "a", "offered_rps": -1, "admitted_rps": 1}], "negative"),
    ([{"tenant": "a", "offered_rps": 1, "admitted_rps": 1, "offered_rps_by_class": {"critical": 1}}], "has no standard"),
    ([{"tenant": "a", "offered_rps": "1", "admitted_rps": 1}], "number"),
    ([{"tenant": "a", "offered_rps": 1, "admitted_rps": 1, "service_s_per_s": -1}], "negative"),
    ([{"tenant": "a", "offered_rps": 1, "admitted_rps": 1, "finished_rps": None}], "number")])
def test_a_picture_whose_tenants_the_policy_could_trip_on_is_refused_by_its_readers(rows, why):
    """Any worker reads every picture of the load topic: tenant rows the fair shares read are checked too."""
    import orjson

    from pipeline.load.picture import read_picture

    picture = picture_of([attempt(105, "a", "received")]) | {"tenants": rows}
    with pytest.raises(ValueError, match=why):
        read_picture(orjson.dumps(picture))


@pytest.mark.parametrize("name", ["a b", "é", "-lead", "a\nb", ""])
def test_a_partial_naming_a_tenant_no_event_could_name_is_refused(name):
    """Any worker can write the partials topic: a tenant name outside the contract's pattern would reach the
    signal's tenant list, which routers validate, and make them refuse every signal of the pool."""
    with pytest.raises(ValueError):
        RequestAgg.from_dict({"received": 1, "tenants": {name: [1, 0]}})
