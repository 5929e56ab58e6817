"""Does the control plane pay? Every scenario under every controller, in-process, against the goals.

The goals (issue 13, ``pipeline.sim.goals``): SLO-goodput at least 2× no control and cost per
SLO-successful task at most half of it wherever no control misses its SLO; at least the fixed threshold
everywhere (1.1× where that baseline lets critical attainment fall below 99%); critical attainment at
least 99%. Seed 1 here, all scenarios across the CPUs (started beside the unit tier: tests/prewarm.py);
every seed from 1 to 5 with
``sluice sim --seeds 1-5 --goals`` (docs/simulator.md has the table).

The same goals are checked on arrivals the controller was never tuned on (gamma gaps of twice Poisson's
variance, vLLM's ``burstiness`` 0.5) in the scenarios where they hold on every seed 1-5 under both Poisson
and burstier gaps (docs/simulator.md, "Arrivals and pool sizes it was not tuned on").

Where a goal is not met yet on seed 1 the test pins what is met today (``SHORT_OF``), so a regression fails
and the gap stays visible: two-pools, where no controller reaches 2× no control while both pools serve at
most their SLO capacity (docs/simulator.md, "What is still short").
"""

from dataclasses import replace

import pytest

from pipeline.sim.goals import check
from pipeline.sim.scenarios import CONTROLLED, IMPATIENT_CLIENT, SCENARIOS, Fleet, clients_name, compare_seeds
from tests import prewarm

# scenario → (least SLO-goodput vs no control, least critical attainment) where a goal is still missed
SHORT_OF = {"two-pools": (1.8, 0.99)}


# arrivals no setting was tuned on, and the scenarios whose goals hold there on every seed 1-5
UNTUNED = Fleet(arrivals="gamma", burstiness=0.5)
UNTUNED_SCENARIOS = ("spike", "replica-loss", "retry-after")
# clients that ignore Retry-After, and the scenarios whose goals hold with them on every seed 1-5
IMPATIENT = Fleet(client=IMPATIENT_CLIENT)
IMPATIENT_SCENARIOS = ("spike", "prompt-heavy-spike", "noisy-neighbour")


def compute_rows() -> dict[str, list[dict]]:
    """Every scenario on the trace's arrivals, ``UNTUNED_SCENARIOS`` on ``UNTUNED``'s and
    ``IMPATIENT_SCENARIOS`` with ``IMPATIENT``'s clients, seed 1."""
    return {"trace": compare_seeds(tuple(SCENARIOS), Fleet(), range(1, 2)),
            "untuned": compare_seeds(UNTUNED_SCENARIOS, UNTUNED, range(1, 2)),
            "impatient": compare_seeds(IMPATIENT_SCENARIOS, IMPATIENT, range(1, 2))}


@pytest.fixture(scope="module")
def computed():
    """Computed beside the unit tier when the session began (tests/prewarm.py), else here."""
    return prewarm.result("scenarios", compute_rows)


@pytest.fixture(scope="module")
def rows(computed):
    return computed["trace"]


@pytest.fixture(scope="module")
def goals(rows):
    return {line["scenario"]: line for line in check(rows)}


@pytest.fixture(scope="module")
def untuned_goals(computed):
    return {line["scenario"]: line for line in check(computed["untuned"])}


def assert_every_goal_met(line: dict) -> None:
    """Every goal, fairness's included: SLO-goodput no lower than Sluice without fairness (noisy-neighbour
    seeds 1-5 since session 44, the requests/s ceiling read in time in service while a tenant is listed:
    1.016-1.034x, and 1.024-1.043x with clients that ignore Retry-After; seed 1 1.034x and 1.029x)."""
    assert line["failed"] == "", line


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s not in SHORT_OF])
def test_sluice_meets_every_goal(goals, scenario):
    assert_every_goal_met(goals[scenario])


def test_a_bursting_tenant_pays_for_its_burst_and_the_others_keep_their_attainment(goals):
    line = goals["noisy-neighbour"]
    assert line["others"] >= line["others_no_burst"] - 0.01 and line["burst_shed_share"] >= 0.9, line


def test_warm_steps_credit_pays_where_long_contexts_are_cached(goals):
    """Long-context (4× prompts, later steps warm on their replicas): with warm steps' credit, more SLO-successful
    tasks at a lower cost each than Sluice without it, on the same tasks (seed 1: 1.001× and 0.999×; 1.001-1.020×
    and 0.981-0.999× over seeds 1-5, docs/simulator.md; most of the 2-3% read before came from a drain that
    cut deferred work off)."""
    line = goals["long-context"]
    assert line["vs_no_affinity"] >= 1.0 and line["cost_vs_no_affinity"] <= 1.0, line


@pytest.mark.parametrize("scenario", UNTUNED_SCENARIOS)
def test_goals_hold_on_arrivals_it_was_not_tuned_on(untuned_goals, scenario):
    """Gamma gaps of twice Poisson's variance, the pool's capacity measured on them as an operator's load test
    would: the spike, a replica loss and clients that honour Retry-After meet every goal as on the trace
    (seeds 1-5: 2.58-3.04x no control, 1.16-2.48x the fixed threshold, critical 0.9965-1.000)."""
    line = untuned_goals[scenario]
    assert line["failed"] == "", line


@pytest.mark.parametrize("scenario", IMPATIENT_SCENARIOS)
def test_goals_hold_with_clients_that_ignore_retry_after(computed, scenario):
    """Shed work back on the clients' own 0.5-4 s backoff, up to ten attempts, whatever the retry-after says:
    the spike, the prompt-heavy spike and the noisy neighbour meet every goal as with the scenarios' own
    clients (seeds 1-5: 2.27-2.89x no control, critical 0.991-1.000; the other tenants at their run without
    the burst, the bursting tenant 0.977-0.990 of the refusals since a tenant's level is held for at most
    the dwell; docs/simulator.md, "Clients that ignore Retry-After")."""
    assert_every_goal_met({line["scenario"]: line for line in check(computed["impatient"])}[scenario])


def test_every_row_names_the_clients_that_made_it(computed):
    """Tables saved from runs with different clients read alike; each row, and each goals line, says which."""
    for kind, clients in (("trace", "scenario"), ("untuned", "scenario"), ("impatient", "impatient")):
        assert {row["clients"] for row in computed[kind]} == {clients}
        assert {line["clients"] for line in check(computed[kind])} == {clients}
    assert clients_name(replace(IMPATIENT_CLIENT, max_attempts=3)) == "custom"


@pytest.mark.parametrize("scenario", tuple(SHORT_OF))
def test_where_a_goal_is_still_missed_sluice_holds_what_it_reaches_today(goals, scenario):
    least_vs_none, least_critical = SHORT_OF[scenario]
    line = goals[scenario]
    assert line["vs_none"] >= least_vs_none and line["critical"] >= least_critical, line
    assert line["vs_fixed"] >= 1.0, line


def test_no_run_ends_while_a_client_still_waits(rows):
    """The drain outlasts the longest wait of a deferred task: the run's end must not decide any task's outcome
    (with a 120 s drain, long-context seed 1 closed with 161 tasks still waiting to ask again; docs/simulator.md,
    change 13)."""
    assert [(r["scenario"], r["controller"], r["n_cut_off"]) for r in rows if r["n_cut_off"]] == []


def test_steady_load_is_left_alone(rows):
    by = {r["controller"]: r for r in rows if r["scenario"] == "steady"}
    assert by["sluice"]["slo_goodput"] == by["no control"]["slo_goodput"] and by["sluice"]["n_rejected"] == 0


def test_shed_order_holds_critical_last(rows):
    for r in rows:
        if r["scenario"] in CONTROLLED and r["controller"] == "sluice":
            assert r["attain_critical"] >= r["attain_standard"] >= r["attain_sheddable"], r


def test_flapping_stays_within_what_is_measured_today(rows):
    """Flapping as routers feel it (admit-fraction reversals per minute), under every scenario: 2–10 where
    the pool's limits are its own, up to ~29 where bursts of long prefills swing the queue axis across its
    limit (prompt-heavy, long-context; 16–29 over seeds 1–5 since the queue limit is a fifth of the TTFT
    objective, docs/simulator.md change 12) — a reversal every 2 s at worst is the bound pinned here."""
    assert max(r["fraction_reversals_per_min"] for r in rows if r["controller"] == "sluice") <= 30
