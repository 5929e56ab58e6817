"""The scenarios, the pool's measured SLO capacity, and running one scenario under one controller.

Loads are stated as multiples of the pool's **SLO capacity** — the highest
steady task rate at which, with no admission control, at least 99% of tasks
of every class still meet their TTFT objective — measured here by a search
over short steady runs of the same simulator (what an operator's load test
would find). The capacity also configures Sluice's profile for the pool
(admitted requests/s and peak tokens/s per replica), as an operator would
from that load test; nothing else about the controller is fitted.
"""

from __future__ import annotations

import heapq
import inspect
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from ..admission.flapping import reversals_per_minute
from ..admission.policy import MAX_RETRY_AFTER_S
from ..cost import price_table
from ..router.decider import RETRY_AFTER_SPREAD
from ..settings import Settings, load_settings
from .arrivals import RateSchedule, gamma_arrivals, rotated, trace_arrivals
from .controllers import FixedThreshold, NoControl, SluiceInProcess
from .goals import NO_AFFINITY, UNFAIR
from .fleet import ClientPolicy, FleetEvent, FleetSim, Sibling
from .chart import MISSING, ChartsUnavailable, Incident, Panel, available, render
from .outcome import Outcome, summarise, tenant_figures, timeline
from .replay import load_trace
from .replica import Hardware

POOL = "chat-8b"
SIBLING = "chat-8b-b"   # a second pool of the same model, for scenarios where work can move
START_MS = 1_750_000_000_000
ATTAINMENT_TARGET = 0.99
AGGRESSIVE_CLIENT = ClientPolicy(ttft_timeout_s=4.0, max_attempts=6, backoff_base_s=0.25, backoff_cap_s=2.0)
# SDKs that honour a 429's Retry-After to the second and retry shed work up to five times: shed work
# comes back exactly when told, so a controller that tells everyone the same time gets it back in waves
POLITE_CLIENT = ClientPolicy(shed_retries=5)
POLITE_JITTER_CLIENT = ClientPolicy(shed_retries=5, retry_after_jitter=0.5)
# HTTP clients that never read a 429's Retry-After: shed work comes back on their own short backoff
# (0.5 s doubling, capped at 4 s), up to ten attempts — the opposite of the polite clients above
IMPATIENT_CLIENT = ClientPolicy(max_attempts=10, backoff_base_s=0.5, backoff_cap_s=4.0, ignore_retry_after=True)
# ``sluice sim --clients``: which clients replace every scenario's own (None: each scenario keeps its own)
CLIENTS: dict[str, ClientPolicy | None] = {"scenario": None, "impatient": IMPATIENT_CLIENT}


def clients_name(client: ClientPolicy | None) -> str:
    """The ``--clients`` name of a fleet's clients, for each row: tables saved from different runs say
    which clients made them ("custom" for a policy set in code)."""
    return next((name for name, policy in CLIENTS.items() if policy == client), "custom")


@dataclass(frozen=True)
class Traffic:
    """The requests' shape relative to the trace: a code assistant sends long prompts for short answers."""

    prompt_factor: float = 1.0
    output_factor: float = 1.0


PROMPT_HEAVY = Traffic(prompt_factor=4.0, output_factor=0.25)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    base_load: float                          # × SLO capacity
    spike_load: float | None = None           # × SLO capacity during the spike
    spike_from_s: float = 60.0
    spike_to_s: float = 180.0
    lose_fraction: float = 0.0                # replicas lost at ``lose_at_s``
    lose_at_s: float = 60.0
    back_at_s: float | None = None
    long_context_from_s: float | None = None
    client: ClientPolicy = field(default_factory=ClientPolicy)
    traffic: Traffic = field(default_factory=Traffic)   # its SLO capacity is measured for this shape
    sibling_replicas: int = 0                 # a sibling pool of the same model (SIBLING) ...
    sibling_load: float = 0.0                 # ... with this steady load, × its own SLO capacity
    tenants: tuple[str, ...] = ()             # tenants sharing ``base_load`` equally (empty: drawn at random)
    burst_factor: float | None = None         # the first tenant's rate × this from spike_from_s to spike_to_s

    @property
    def burst_tenant(self) -> str | None:
        return self.tenants[0] if self.tenants and self.burst_factor is not None else None

    def lost(self, replicas: int) -> int:
        """Replicas this scenario takes down, of ``replicas``."""
        return math.ceil(self.lose_fraction * replicas - 1e-9)


SCENARIOS = {s.name: s for s in (
    Scenario("steady", "0.7× SLO capacity throughout", 0.7),
    Scenario("spike", "0.7× capacity, 2× capacity from 60 s to 180 s", 0.7, spike_load=2.0),
    Scenario("replica-loss", "0.9× capacity; 30% of replicas lost at 60 s, back cold at 240 s", 0.9,
             lose_fraction=0.3, back_at_s=240.0),
    Scenario("retry-storm", "the spike, with clients that time out at 4 s and retry 6 times quickly", 0.7,
             spike_load=2.0, client=AGGRESSIVE_CLIENT),
    Scenario("long-context", "0.9× capacity; prompts 4× longer from 60 s (KV cache binds first)", 0.9,
             long_context_from_s=60.0),
    Scenario("retry-after", "the spike, with clients that honour Retry-After exactly and retry shed work 5 times",
             0.7, spike_load=2.0, client=POLITE_CLIENT),
    Scenario("retry-after-jitter", "the spike, with clients that honour Retry-After ±50% and retry shed work "
             "5 times", 0.7, spike_load=2.0, client=POLITE_JITTER_CLIENT),
    Scenario("two-pools", "the spike in one pool; a sibling pool of the same model (as many replicas) at 0.4× "
             "its capacity, where work can move with a cold cache", 0.7, spike_load=2.0, sibling_replicas=10,
             sibling_load=0.4),
    Scenario("prompt-heavy-spike", "code-assistant traffic (prompts 4×, outputs ¼): 0.7×, 2× from 60 s to 180 s, "
             "clients honouring Retry-After", 0.7, spike_load=2.0, client=POLITE_CLIENT, traffic=PROMPT_HEAVY),
    Scenario("noisy-neighbour", "four tenants at 0.7× capacity together; one bursts to 5× its rate from 60 s "
             "to 180 s (1.4× capacity)", 0.7, tenants=("acme", "globex", "initech", "umbrella"), burst_factor=5.0),
    Scenario("prompt-heavy-loss", "code-assistant traffic: 0.9×; 30% of replicas lost at 60 s, back cold at 240 s; "
             "clients honouring Retry-After", 0.9, lose_fraction=0.3, back_at_s=240.0, client=POLITE_CLIENT,
             traffic=PROMPT_HEAVY),
)}
# where warm later steps make up much of the work (long or cached prompts, replicas lost and back cold):
# also run without the affinity credit, to show what it buys
AFFINITY = ("long-context", "prompt-heavy-spike", "prompt-heavy-loss")
# where the controller must pay for itself
CONTROLLED = ("spike", "replica-loss", "retry-storm", "retry-after", "retry-after-jitter", "two-pools",
              "prompt-heavy-spike", "noisy-neighbour", "prompt-heavy-loss")


@dataclass(frozen=True)
class Fleet:
    replicas: int = 10
    hardware: Hardware = Hardware()
    duration_s: float = 300.0
    # after the arrivals, until every task has ended or this long: the longest a deferred task waits to ask
    # again, then for its first token; a shorter drain counts work its client still waits for as failed, so
    # the run's end, not the controller, decides its outcome (``n_cut_off`` counts any such task)
    drain_s: float = MAX_RETRY_AFTER_S * RETRY_AFTER_SPREAD + ClientPolicy.deferrable_timeout_s
    arrivals: str = "trace"        # or "gamma"
    burstiness: float = 1.0
    seed: int = 1
    client: ClientPolicy | None = None   # every scenario's clients replaced by these (None: each scenario's own)


@dataclass(frozen=True)
class Capacity:
    tasks_per_s: float             # highest steady rate meeting the SLO
    slo_goodput: float             # SLO-successful tasks/s at that rate
    requests_per_s_per_replica: float
    peak_tokens_per_s_per_replica: float


def _arrivals(fleet: Fleet, schedule: RateSchedule, duration_s: float, traffic: Traffic = Traffic(), stream: int = 0):
    """Arrivals at ``schedule``; ``stream`` > 0 draws another stretch of the trace (or another gamma seed),
    for tenants whose bursts should not line up."""
    trace = load_trace()
    if stream:
        trace = rotated(trace, stream * len(trace) // 7)
    if fleet.arrivals == "gamma":
        arrivals = gamma_arrivals(trace, schedule, duration_s, fleet.burstiness, fleet.seed * 101 + stream)
    else:
        arrivals = trace_arrivals(trace, schedule, duration_s)
    if traffic == Traffic():
        return arrivals
    return (replace(a, input_tokens=max(1, int(a.input_tokens * traffic.prompt_factor)),
                    output_tokens=max(1, int(a.output_tokens * traffic.output_factor))) for a in arrivals)


def _steady(fleet: Fleet, replicas: int, rate: float, client: ClientPolicy, duration_s: float = 120.0,
            traffic: Traffic = Traffic()) -> Outcome:
    sim = FleetSim(POOL, replicas, fleet.hardware,
                   _arrivals(fleet, RateSchedule(((0.0, rate),)), duration_s, traffic),
                   NoControl(), client, seed=fleet.seed, start_ms=START_MS, duration_s=duration_s, drain_s=60.0)
    return summarise(sim, sim.run(), duration_s)


# capacity searches already made: (the fleet as the search reads it, replicas, client, traffic) → capacity
_CAPACITIES: dict[tuple, Capacity] = {}


def _search_key(fleet: Fleet, replicas: int, client: ClientPolicy, traffic: Traffic) -> tuple:
    """The search reads the fleet's hardware, arrivals and seed only: fleets that differ in duration or size
    share one search."""
    return replace(fleet, replicas=Fleet.replicas, duration_s=Fleet.duration_s, drain_s=Fleet.drain_s,
                   client=None), replicas, client, traffic


def slo_capacity(fleet: Fleet, replicas: int, client: ClientPolicy = ClientPolicy(),
                 traffic: Traffic = Traffic()) -> Capacity:
    """Binary search for the highest steady task rate where every class keeps ≥ 99% TTFT attainment."""
    key = _search_key(fleet, replicas, client, traffic)
    if key not in _CAPACITIES:
        _CAPACITIES[key] = _search(key)
    return _CAPACITIES[key]


def _search(key: tuple) -> Capacity:
    fleet, replicas, client, traffic = key
    lo, hi = 0.5 * replicas, 8.0 * replicas
    best = _steady(fleet, replicas, lo, client, traffic=traffic)
    for _ in range(7):
        mid = (lo + hi) / 2
        outcome = _steady(fleet, replicas, mid, client, traffic=traffic)
        if min(outcome.attainment.values()) >= ATTAINMENT_TARGET:
            lo, best = mid, outcome
        else:
            hi = mid
    saturated = _steady(fleet, replicas, hi * 1.5, client, traffic=traffic)  # its peak: tokens/s while arriving
    return Capacity(tasks_per_s=round(lo, 3), slo_goodput=best.slo_goodput,
                    requests_per_s_per_replica=best.requests_per_s / replicas,
                    peak_tokens_per_s_per_replica=saturated.tokens_per_s / replicas)


def sluice_settings(capacity: Capacity, base: Settings | None = None) -> Settings:
    """The pool's profile from the measured capacity: ``balanced`` limits, this hardware's rates."""
    base = base or load_settings(env={})
    profile = {"capacity_rps_per_replica": round(capacity.requests_per_s_per_replica, 3),
               "peak_tokens_per_s": round(capacity.peak_tokens_per_s_per_replica, 1),
               "slo_ttft_s": 2.0}
    # the simulated GPU agents sample every second: a replica is stale after five missed samples
    return replace(base, profiles={**base.profiles, "sim-pool": profile},
                   pool_profiles={POOL: "sim-pool", SIBLING: "sim-pool"}, replica_stale_after_s=5.0)


def scenario_arrivals(scenario: Scenario, fleet: Fleet, capacity: Capacity):
    """The scenario pool's arrivals: one stream, or one per tenant (merged in time, each task tagged)."""
    if not scenario.tenants:
        return _arrivals(fleet, schedule_for(scenario, capacity), fleet.duration_s, scenario.traffic)
    base = scenario.base_load * capacity.tasks_per_s / len(scenario.tenants)
    streams = []
    for i, tenant in enumerate(scenario.tenants):
        schedule = RateSchedule(((0.0, base),))
        if tenant == scenario.burst_tenant:
            schedule = RateSchedule(((0.0, base), (scenario.spike_from_s, base * scenario.burst_factor),
                                     (scenario.spike_to_s, base)))
        streams.append(_tagged(tenant, _arrivals(fleet, schedule, fleet.duration_s, scenario.traffic, stream=i + 1)))
    return heapq.merge(*streams, key=lambda a: a.at_s)


def _tagged(tenant: str, arrivals):
    for arrival in arrivals:
        yield replace(arrival, tenant=tenant)


def schedule_for(scenario: Scenario, capacity: Capacity) -> RateSchedule:
    base = scenario.base_load * capacity.tasks_per_s
    if scenario.spike_load is None:
        return RateSchedule(((0.0, base),))
    spike = scenario.spike_load * capacity.tasks_per_s
    return RateSchedule(((0.0, base), (scenario.spike_from_s, spike), (scenario.spike_to_s, base)))


def controllers(settings: Settings, seed: int, tenants: bool = False,
                affinity: bool = False) -> dict[str, Callable[[], object]]:
    """The controllers compared; with ``tenants``, Sluice without its fair shares between tenants too; with
    ``affinity``, Sluice without the credit for warm steps."""
    out = {"no control": NoControl, "fixed threshold": FixedThreshold,
           "sluice": lambda: SluiceInProcess(settings, POOL, START_MS, seed)}
    for wanted, label, knob in ((tenants, UNFAIR, {"tenant_fairness": False}), (affinity, NO_AFFINITY, {"warm_credit": 0})):
        if wanted:
            without = replace(settings, admission_policy={**settings.admission_policy, **knob})
            out[label] = lambda without=without: SluiceInProcess(without, POOL, START_MS, seed)
    return out


def build_sim(scenario: Scenario, controller, fleet: Fleet, capacity: Capacity, emit=None,
              start_ms: int = START_MS) -> FleetSim:
    lost = scenario.lost(fleet.replicas)
    events = (FleetEvent(scenario.lose_at_s, lost, scenario.back_at_s),) if lost else ()
    siblings = ()
    if scenario.sibling_replicas:
        rate = scenario.sibling_load * capacity.tasks_per_s * scenario.sibling_replicas / fleet.replicas
        siblings = (Sibling(SIBLING, scenario.sibling_replicas, _arrivals(
            fleet, RateSchedule(((0.0, rate),)), fleet.duration_s, scenario.traffic)),)
    return FleetSim(POOL, fleet.replicas, fleet.hardware, scenario_arrivals(scenario, fleet, capacity), controller,
                    fleet.client or scenario.client, seed=fleet.seed, start_ms=start_ms, duration_s=fleet.duration_s,
                    drain_s=fleet.drain_s, fleet_events=events, long_context_from_s=scenario.long_context_from_s,
                    emit=emit, siblings=siblings)


def run_scenario(scenario: Scenario, controller, fleet: Fleet = Fleet(), capacity: Capacity | None = None,
                 emit=None, start_ms: int = START_MS) -> tuple[FleetSim, Outcome]:
    capacity = capacity or slo_capacity(fleet, fleet.replicas, traffic=scenario.traffic)
    sim = build_sim(scenario, controller, fleet, capacity, emit, start_ms)
    return sim, summarise(sim, sim.run(), fleet.duration_s)


def reference_capacity(scenario: Scenario, fleet: Fleet) -> Capacity:
    """The SLO capacity for the replicas alive during the scenario's hardest stretch."""
    alive = fleet.replicas - scenario.lost(fleet.replicas)
    return slo_capacity(fleet, alive, traffic=scenario.traffic)


def run_controllers(scenario: Scenario, fleet: Fleet, capacity: Capacity, settings: Settings) -> dict[str, tuple]:
    """One scenario under every controller: label → (simulator, outcome)."""
    return {label: run_scenario(scenario, make(), fleet, capacity)
            for label, make in controllers(settings, fleet.seed, scenario.burst_tenant is not None,
                                           scenario.name in AFFINITY).items()}


def compare(names: tuple[str, ...] = tuple(SCENARIOS), fleet: Fleet = Fleet(), settings: Settings | None = None,
            charts: Path | None = None) -> list[dict]:
    """Every scenario under every controller, in-process; one row per (scenario, controller).

    With ``charts``, each scenario's timeline is drawn to ``charts/<scenario>.png`` (``ChartsUnavailable``
    before anything runs when matplotlib is not installed).
    """
    if charts is not None and not available():
        raise ChartsUnavailable(MISSING)
    rows = []
    for name in names:
        scenario = SCENARIOS[name]
        capacity = slo_capacity(fleet, fleet.replicas, traffic=scenario.traffic)  # the operator's load test
        tuned = sluice_settings(capacity, settings)
        price = price_table(tuned.gpu_prices).get(fleet.hardware.name, 0.0)
        reference = reference_capacity(scenario, fleet)
        runs = run_controllers(scenario, fleet, capacity, tuned)
        for label, (sim, outcome) in runs.items():
            row = outcome.row(name, label, reference.slo_goodput, price, getattr(sim.controller, "state_changes", 0))
            history = getattr(sim.controller, "history", [])
            row["fraction_reversals_per_min"] = round(reversals_per_minute(
                (fractions for t, _, fractions in history if t <= fleet.duration_s), fleet.duration_s), 2)
            row["seed"] = fleet.seed
            row["clients"] = clients_name(fleet.client)
            if scenario.burst_tenant is not None:
                row |= tenant_figures(sim.stats, scenario.burst_tenant)
                if label == "sluice":   # what the other tenants get from Sluice without the burst
                    calm, _ = run_scenario(replace(scenario, burst_factor=None),
                                           controllers(tuned, fleet.seed)["sluice"](), fleet, capacity)
                    row["attain_others_no_burst"] = tenant_figures(calm.stats, scenario.burst_tenant)["attain_others"]
            rows.append(row)
        if charts is not None:
            charts.mkdir(parents=True, exist_ok=True)
            draw(charts / f"{name}.png", f"{name}: {scenario.description}",
                 {label: sim for label, (sim, _) in runs.items()}, fleet.duration_s, scenario,
                 fleet.replicas)
    return rows


def _searches(scenario: Scenario, fleet: Fleet) -> set[tuple]:
    """The capacity searches ``compare`` makes for the scenario: the operator's load test and the reference."""
    alive = fleet.replicas - scenario.lost(fleet.replicas)
    return {_search_key(fleet, n, ClientPolicy(), scenario.traffic) for n in (fleet.replicas, alive)}


def _runs(scenario: Scenario) -> int:
    """About how many pool-runs ``compare`` makes for the scenario (``controllers``, the calm run of a tenant
    burst, both pools of two): the longest jobs go first."""
    runs = 3 + 2 * (scenario.burst_tenant is not None) + (scenario.name in AFFINITY)
    return runs * (2 if scenario.sibling_replicas else 1)


def _compare_one(args: tuple) -> list[dict]:
    names, fleet, settings, capacities = args
    _CAPACITIES.update(capacities)
    return compare(names, fleet, settings)


def compare_seeds(names: tuple[str, ...], fleet: Fleet, seeds: range, settings: Settings | None = None,
                  processes: int | None = None) -> list[dict]:
    """``compare`` under each seed, in as many processes as there are CPUs: first the distinct capacity
    searches, then one job per (seed, scenario), the longest first, so that no process waits on another's
    share. The rows are the same as ``compare``'s in one process (a scenario's run depends on nothing else)."""
    import os
    from concurrent.futures import ProcessPoolExecutor

    cpus = processes or os.cpu_count() or 1
    fleets = [replace(fleet, seed=seed) for seed in seeds]
    wanted = sorted({key for f in fleets for name in names for key in _searches(SCENARIOS[name], f)} - set(_CAPACITIES),
                    key=repr)
    jobs = sorted(((name, f) for f in fleets for name in names), key=lambda job: -_runs(SCENARIOS[job[0]]))
    with ProcessPoolExecutor(cpus) as pool:
        _CAPACITIES.update(zip(wanted, pool.map(_search, wanted)))
        results = pool.map(_compare_one, [((name,), f, settings, _CAPACITIES) for name, f in jobs])
        rows = [row for found in results for row in found]
    order = {name: i for i, name in enumerate(names)}
    return sorted(rows, key=lambda r: (r["seed"], order[r["scenario"]]))


def incidents(scenario: Scenario, duration_s: float, replicas: int = 10) -> tuple[Incident, ...]:
    """What the scenario does to the pool, for the chart: the spike, the replicas lost, the longer prompts."""
    out = []
    if scenario.spike_load is not None:
        out.append(Incident(f"spike: {scenario.spike_load:g}× SLO capacity", scenario.spike_from_s,
                            min(scenario.spike_to_s, duration_s)))
    if scenario.burst_tenant is not None:
        out.append(Incident(f"tenant {scenario.burst_tenant}: {scenario.burst_factor:g}× its rate", scenario.spike_from_s,
                            min(scenario.spike_to_s, duration_s)))
    lost = scenario.lost(replicas)
    if lost:
        back = scenario.back_at_s
        markers = ((back, "replicas back, cold"),) if back is not None and back < duration_s else ()
        out.append(Incident(f"{lost} of {replicas} replicas lost", scenario.lose_at_s,
                            back if back is not None and back < duration_s else duration_s, markers))
    if scenario.long_context_from_s is not None:
        factor = inspect.signature(FleetSim).parameters["long_context_factor"].default   # build_sim keeps it
        out.append(Incident(f"prompts {factor:g}× longer", scenario.long_context_from_s, duration_s))
    return tuple(i for i in out if i.start_s < duration_s)


def draw(path: Path, title: str, sims: dict, duration_s: float, scenario: Scenario | None = None,
         replicas: int = Fleet().replicas) -> Path:
    """Goodput, admitted share and KV usage over time, one line per controller, the scenario's incidents
    marked; raises ``chart.ChartsUnavailable`` without matplotlib."""
    lines = {label: timeline(sim, duration_s) for label, sim in sims.items()}
    top = max([y for series in lines.values() for _, y in series["slo_goodput"]] + [1.0])
    panels = [Panel("SLO-goodput: tasks completed within their TTFT SLO (10 s moving mean)",
                    {k: v["slo_goodput"] for k, v in lines.items()}, round(top * 1.1 + 0.5), "tasks/s"),
              Panel("admitted share of the router's decisions (10 s moving mean)",
                    {k: v["admit_fraction"] for k, v in lines.items()}, 1.05, "share (0–1)"),
              Panel("KV cache usage, mean of live replicas", {k: v["kv_usage"] for k, v in lines.items()}, 1.05,
                    "usage (0–1)")]
    marks = incidents(scenario, duration_s, replicas) if scenario is not None else ()
    return render(path, title, panels, duration_s, incidents=marks)
