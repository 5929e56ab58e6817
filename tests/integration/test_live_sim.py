"""The closed loop through the real pipeline: the simulator publishes to Kafka, a real worker builds the
picture and signs signals, the simulated routers follow them with the real RouterClient."""

import asyncio
from dataclasses import replace

import pytest

from pipeline.sim.live import run_live
from pipeline.sim.scenarios import SCENARIOS, Fleet, slo_capacity, sluice_settings
from tests.conftest import wait_for

pytestmark = pytest.mark.integration


def test_replica_loss_through_the_pipeline_is_shed_and_every_event_lands(settings, worker_factory):
    fleet = Fleet(duration_s=60.0, drain_s=90.0)
    scenario = replace(SCENARIOS["replica-loss"], lose_at_s=20.0, back_at_s=50.0)
    capacity = slo_capacity(fleet, fleet.replicas)
    tuned = replace(sluice_settings(capacity, settings), retention_days=0)
    worker = worker_factory(tuned).start()

    sim, outcome = asyncio.run(run_live(worker.settings, scenario, fleet, capacity,
                                        settings.kafka_bootstrap_servers))

    controller = sim.controller
    assert controller.states, "the routers verified and followed the worker's signals"
    assert controller.lowest_admit["deferrable"] < 1.0, "the replica loss was shed, lowest class first"
    assert controller.lowest_admit["critical"] == 1.0
    assert controller.router.book.refused == {}, "no signal failed verification"
    assert all(t.outcome is not None for t in sim.stats.tasks) and outcome.arrivals == len(sim.stats.tasks)
    assert outcome.attainment["critical"] >= 0.95
    wait_for(lambda: worker.counts().accepted >= sim.stats.published, 60,
             message="every event the simulator published to land")
    assert worker.counts().dead_lettered == 0
    print(f"\nlive replica-loss: {sim.stats.published} events, {len(controller.states)} state changes "
          f"{controller.states}, lowest admit {controller.lowest_admit}, SLO-goodput {outcome.slo_goodput:.1f}")
