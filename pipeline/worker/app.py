"""The Faust application, wired by role: thin glue between Kafka and the pure cores.

``sluice worker [--role control|landing|all]`` and ``faust -A pipeline.agents
worker`` both run it. Roles:

- **control** — stage 1 (``ControlConsumer``: raw topics → partials, group
  ``<app_id>-control``) and stage 2 (``Stage2``: partials → pictures and signed
  signals, Faust's group ``<app_id>`` with its changelog table). No store.
- **landing** — ``LandingConsumer``: raw topics and signals → ClickHouse,
  exactly once (group ``<app_id>-landing``), and the read-only /query.
- **all** — both, independent inside one process (the default, and what the
  embedded store needs: its directory is locked to one process).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import faust

from .. import metrics, topics
from ..broker import bootstrap_servers
from ..kafka_clients import faust_credentials
from ..load.partial import Partial
from ..settings import Settings
from ..sinks.store import StoreUnavailable
from . import kafka_transport
from .control import ControlConsumer
from .http import add_pages
from .landing import LandingConsumer
from .pictures import Stage2
from .stall_watch import PRODUCER_WAITS, ControlWedged, ProducerSpent, RestartExit, aiokafka_producer, spent

log = logging.getLogger(__name__)
STORE_RETRY_S = 5.0


def _bytes_topic(app: faust.App, settings: Settings, spec: topics.TopicSpec) -> Any:
    partitions, config = topics.topic_configs(settings)[spec.name(settings)]
    return app.topic(spec.name(settings), key_type=bytes, value_type=bytes, key_serializer="raw",
                     value_serializer="raw", partitions=partitions, config=config,
                     replicas=settings.topic_replication_factor)


def create_app(settings: Settings) -> faust.App:
    datadir = settings.state_dir / "faust" / settings.app_id
    datadir.parent.mkdir(parents=True, exist_ok=True)
    bootstrap = bootstrap_servers(settings)
    app = faust.App(
        # a landing-only worker runs no agents: it must not join stage 2's group
        settings.app_id if settings.role != "landing" else f"{settings.app_id}-landing-web",
        broker=f"{kafka_transport.SCHEME}://{bootstrap}",  # aiokafka, with an idempotent producer
        broker_credentials=faust_credentials(settings),
        key_serializer="raw",
        value_serializer="raw",
        store="memory://",
        datadir=str(datadir),
        web_host=settings.web_host,
        web_bind=settings.web_host,
        web_port=settings.web_port,
        web_in_thread=False,
        topic_partitions=topics.PARTIALS.partitions(settings),
        topic_replication_factor=settings.topic_replication_factor,  # changelog and leader topics too
        producer_acks=-1,
        consumer_max_fetch_size=topics.raw_topic_max_bytes(settings),
        producer_max_request_size=topics.dead_letter_max_bytes(settings) + 65536,
        broker_commit_interval=1.0,
        broker_session_timeout=settings.session_timeout_s,
        broker_heartbeat_interval=settings.heartbeat_interval_s,
        # Faust refuses to start a consumer whose session timeout exceeds its request timeout (default 90 s)
        broker_request_timeout=max(90.0, settings.session_timeout_s + 30.0),
        consumer_auto_offset_reset="earliest",
        loghandlers=[],
    )
    dead_letters = _bytes_topic(app, settings, topics.DEADLETTER)
    control = stage2 = landing = None
    if settings.role in ("control", "all"):
        control, stage2 = _control_role(app, settings, bootstrap, dead_letters)
    if settings.role in ("landing", "all"):
        landing = _landing_role(app, settings, bootstrap, dead_letters)
    app.control, app.stage2, app.landing = control, stage2, landing

    @app.on_before_shutdown.connect
    async def close_store(sender: Any, **kwargs: Any) -> None:
        if landing is not None:
            await landing.close()

    spent_exit = RestartExit(settings.producer_spent_exit_s)
    wedged_exit = RestartExit(settings.producer_spent_exit_s)

    @app.timer(interval=1.0)
    async def exit_when_only_a_restart_cures() -> None:
        """End the worker when its producer is spent (stall_watch) or its control path is wedged
        (ControlConsumer.wedged): nothing in it can bring a new producer or free the path."""
        reason = spent(aiokafka_producer(app), PRODUCER_WAITS)
        if spent_exit.due(reason) and not app.should_stop:
            log.error("the Kafka producer is spent (%s): the worker exits, to be restarted with a new one", reason)
            await _crash(app, settings, ProducerSpent(reason))
        wedged = control.wedged(settings.producer_stall_s) if control is not None else None
        if wedged_exit.due(None if wedged is None else f"{wedged:.0f} s") and not app.should_stop:
            log.error("the control path is wedged (a cut has queued on its lock for %.0f s while the holder waits "
                      "on nothing at the broker): the worker exits, to be restarted", wedged)
            await _crash(app, settings, ControlWedged(f"a cut queued on the lock for {wedged:.0f} s"))

    metrics.attach_faust_sensors(app)
    add_pages(app, settings, control, landing, stage2)
    return app


async def _crash(app: faust.App, settings: Settings, reason: Exception) -> None:
    """Stop the worker with an error, and hard if the stop takes ``producer_spent_exit_s``: a spent producer's
    flush waits for ever on batches an ended sender never delivers, a wedged path's stop on its lock."""
    asyncio.get_running_loop().call_later(settings.producer_spent_exit_s, _exit_hard, reason)
    await app.crash(reason)


def _exit_hard(reason: Exception) -> None:
    log.critical("the worker's stop did not end (%s: %s): exiting without it", type(reason).__name__, reason)
    os._exit(1)


def _control_role(app: faust.App, settings: Settings, bootstrap: str, dead_letters: Any) -> tuple:
    partials = _bytes_topic(app, settings, topics.PARTIALS)
    table = app.Table(topics.PARTIALS_TABLE, partitions=topics.PARTIALS.partitions(settings), key_type=bytes,
                      value_type=bytes, extra_topic_configs=topics.changelog_config(settings))
    control = ControlConsumer(settings, dead_letters, partials)
    metrics.CUT_WAIT.set_function(control.cut_waits.longest)
    stage2 = Stage2(settings, table, _bytes_topic(app, settings, topics.LOAD),
                    _bytes_topic(app, settings, topics.ADMISSION))

    @app.agent(partials, name=f"{settings.app_id}.pictures")
    async def pictures(stream: Any) -> None:
        async for value in stream:
            try:
                stage2.merge(Partial.from_bytes(value), value)
            except Exception as exc:  # one bad record costs that record, never the agent (it would crash-loop)
                log.warning("ignored a partial that does not parse or merge: %s: %.200s", type(exc).__name__, exc)

    @app.task
    async def cut() -> None:
        """Partials out often, so the newest merged data at a tick is about a cut interval old, not a tick.
        A plain loop, not a Faust timer: a cut that outlasts the interval (a backlog's fold holds the lock)
        is the next one's wait, not an overlap warning every time."""
        while True:
            await asyncio.sleep(settings.cut_interval_s)
            await control.publish_partials()

    @app.timer(interval=settings.tick_s)
    async def tick() -> None:
        await stage2.publish()

    @app.on_rebalance_complete.connect
    async def after_recovery(sender: Any, **kwargs: Any) -> None:
        """The table has just been recovered from its changelog: rebuild the pools this worker now owns,
        with what the partials topic holds that the table lacks."""
        name = topics.PARTIALS.name(settings)
        active = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == name}
        reread = await stage2.reread(bootstrap, active)  # streams resume only after this handler
        stage2.rebuild(active, topics.PARTIALS.partitions(settings), reread)

    @app.task
    async def control_loop() -> None:
        await topics.ensure_topics(settings, bootstrap)
        await control.consume(bootstrap)

    @app.task
    async def fleet_pictures() -> None:
        await stage2.follow_fleet(bootstrap, topics.LOAD.name(settings))

    return control, stage2


def _landing_role(app: faust.App, settings: Settings, bootstrap: str, dead_letters: Any) -> LandingConsumer:
    landing = LandingConsumer(settings, dead_letters)

    @app.task
    async def landing_loop() -> None:
        await topics.ensure_topics(settings, bootstrap)
        while True:
            try:
                await landing.ready()
                break
            except StoreUnavailable as exc:
                log.warning("landing waits for the store (%s); retrying in %.0f s", exc, STORE_RETRY_S)
                await asyncio.sleep(STORE_RETRY_S)
        await landing.consume(bootstrap)

    @app.timer(interval=5.0)
    async def store_health() -> None:
        await landing.check_store()

    return landing
