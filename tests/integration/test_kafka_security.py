"""A secure devstack (SASL_SSL with SCRAM-SHA-512, the project's CA, ACLs): who gets in and what each
principal may do, then the whole pipeline authenticated — a worker as ``sluice``, events from ``router``
and ``gpu-agent``, signals read by an authenticated router client, rows in the store.

A refused connection is asserted as what aiokafka raises for every refusal (``KafkaConnectionError``,
"Unable to bootstrap"), next to the same client with the right credentials getting in; a refused topic
operation as ``TopicAuthorizationFailedError`` (or, for a topic the principal may not even describe, the
topic listed as unauthorized in the client's metadata with nothing read)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import AIOKafkaClient, AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

from pipeline import topics
from pipeline.devstack.credentials import ADMIN, GPU_AGENT, OTEL_COLLECTOR, ROUTER, WORKER
from pipeline.kafka_clients import client_options, producer_options
from pipeline.router.kafka_client import RouterClient
from pipeline.settings import load_settings
from pipeline.sim.producer import produce
from pipeline.sim.replay import Fleet, generate, load_trace
from pipeline.topic_reader import open_from_beginning, read_to_end
from pipeline.worker_process import WorkerProcess
from tests.integration.kafka_helpers import landed_requests
from tests.conftest import free_port, run, wait_for
from tests.integration.cluster import DevstackCluster

pytestmark = pytest.mark.integration
REFUSED_WITHIN_S = 30.0
POOLS = ("pool-a", "pool-b")
TOPIC_AUTHORIZATION_FAILED = 29


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """One secure node, its topics (and an OTLP spans topic) created by ``admin`` and the ACL table applied
    for one namespace."""
    cluster = DevstackCluster(tmp_path_factory.mktemp("secure-kafka"), brokers=1, secure=True)
    namespace = "s" + uuid.uuid4().hex[:10]
    state = tmp_path_factory.mktemp("secure-state")

    def as_principal(principal: str, password: str | None = None, **overrides):
        return load_settings(env={}, kafka_bootstrap_servers=cluster.bootstrap, topic_namespace=namespace,
                             app_id=f"sluice-{namespace}", state_dir=str(state), retention_days=0,
                             max_event_age_s=0, dev_signing_key=True, kafka_security_protocol="SASL_SSL",
                             kafka_sasl_mechanism="SCRAM-SHA-512", kafka_sasl_username=principal,
                             kafka_sasl_password=password or cluster.devstack.credentials()[principal],
                             kafka_ssl_ca_file=str(cluster.devstack.ca_file), otel_topic=f"{namespace}-spans",
                             **overrides)

    try:
        cluster.start()  # inside the try: a start that fails half-way still stops what it started
        run(topics.ensure_topics(as_principal(ADMIN), cluster.bootstrap))
        cluster.devstack.apply_acls(as_principal(ADMIN))
        yield cluster, as_principal
    finally:
        cluster.stop()


async def bootstrap_error(bootstrap: str, **options) -> BaseException | None:
    """What connecting with ``options`` raises (None: it got in)."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=5000, **options)
    try:
        await asyncio.wait_for(client.bootstrap(), REFUSED_WITHIN_S)
        return None
    except asyncio.TimeoutError as exc:
        raise AssertionError(f"not refused within {REFUSED_WITHIN_S:.0f}s: the client hangs") from exc
    except Exception as exc:
        return exc
    finally:
        await client.close()


def assert_refused_connection(error: BaseException | None, what: str) -> None:
    assert error is not None, f"{what} got in"
    assert isinstance(error, KafkaConnectionError) and "Unable to bootstrap" in str(error), \
        f"{what}: refused for another reason than the connection: {error!r}"


async def create_topic_error(settings, name: str) -> int:
    """The error code of creating topic ``name`` as ``settings``' principal (0: created)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers, request_timeout_ms=15000,
                                **client_options(settings))
    await admin.start()
    try:
        response = await admin.create_topics([NewTopic(name, 1, 1)])
        (topic, code, _), = response.topic_errors
        assert topic == name
        return code
    finally:
        await admin.close()


async def read_refusal(settings, topic: str) -> str:
    """How reading ``topic`` (which holds records) from the beginning as ``settings``' principal is refused:
    the fetch fails with TopicAuthorizationFailedError (a principal that may describe the topic), or the
    metadata lists the topic as unauthorized and nothing is read (one that may not even describe it).
    Fails if a record is read."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False,
                                auto_offset_reset="earliest", request_timeout_ms=15000, **client_options(settings))
    await consumer.start()
    try:
        part = TopicPartition(topic, 0)
        consumer.assign([part])
        await consumer.seek_to_beginning(part)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                batch = await consumer.getmany(timeout_ms=1000)
            except TopicAuthorizationFailedError:
                return "TopicAuthorizationFailedError"
            assert not batch, f"{settings.kafka_sasl_username} read {topic}"
            if topic in consumer._client.cluster.unauthorized_topics:
                # no leader is known for a topic the metadata lists as unauthorized: nothing can be fetched
                return "unauthorized in metadata"
        raise AssertionError(f"{settings.kafka_sasl_username} read nothing from {topic} in 10 s, but was not "
                             "refused either")
    finally:
        await consumer.stop()


async def send(settings, topic: str, value: bytes, key: bytes = b"k") -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers, request_timeout_ms=15000,
                                **producer_options(settings))
    await producer.start()
    try:
        await asyncio.wait_for(producer.send_and_wait(topic, value, key=key), REFUSED_WITHIN_S)
    finally:
        await producer.stop()


async def read_topic(settings, topic: str) -> list[bytes]:
    consumer, ends = await open_from_beginning(settings.kafka_bootstrap_servers, topic, **client_options(settings))
    values: list[bytes] = []
    try:
        assert await read_to_end(consumer, ends, lambda batch: [values.extend(m.value for m in ms)
                                                              for ms in batch.values()], timeout_s=30)
        return values
    finally:
        await consumer.stop()


def test_anonymous_plaintext_and_tls_without_sasl_are_refused(secure):
    cluster, as_principal = secure
    began = time.monotonic()
    plaintext = run(bootstrap_error(cluster.bootstrap))
    assert_refused_connection(plaintext, "a PLAINTEXT client")
    tls_only = client_options(as_principal(WORKER)) | {"security_protocol": "SSL"}
    for key in ("sasl_mechanism", "sasl_plain_username", "sasl_plain_password"):
        tls_only.pop(key)
    no_sasl = run(bootstrap_error(cluster.bootstrap, **tls_only))
    assert_refused_connection(no_sasl, "a TLS client without SASL")
    print(f"\nrefused in {time.monotonic() - began:.1f}s: PLAINTEXT {plaintext!r}; TLS without SASL {no_sasl!r}")
    # the same TLS client, with SASL: in (so the refusals above were the missing authentication)
    assert run(bootstrap_error(cluster.bootstrap, **client_options(as_principal(WORKER)))) is None


@pytest.mark.parametrize("principal", [ROUTER, OTEL_COLLECTOR])
def test_a_wrong_password_is_refused(secure, principal):
    cluster, as_principal = secure
    error = run(bootstrap_error(cluster.bootstrap, **client_options(as_principal(principal, password="not-it"))))
    assert_refused_connection(error, "a wrong password")
    assert run(bootstrap_error(cluster.bootstrap, **client_options(as_principal(principal)))) is None
    print(f"\nwrong password for {principal}: {error!r}; the right one gets in")


def test_the_router_reads_signals_and_writes_requests_but_never_the_admission_topic(secure):
    cluster, as_principal = secure
    admin, router = as_principal(ADMIN), as_principal(ROUTER)
    admission, requests = topics.ADMISSION.name(router), topics.REQUESTS.name(router)
    run(send(admin, admission, b"from-admin", key=b"pool-x"))
    assert b"from-admin" in run(read_topic(router, admission))
    run(send(router, requests, b"{}", key=b"task"))
    with pytest.raises(TopicAuthorizationFailedError):
        run(send(router, admission, b"forged", key=b"pool-x"))


def test_the_router_reads_no_raw_topic_writes_no_samples_or_spans_and_creates_no_topic(secure):
    _, as_principal = secure
    admin, router = as_principal(ADMIN), as_principal(ROUTER)
    requests, replicas = topics.REQUESTS.name(router), topics.REPLICAS.name(router)
    for topic in (requests, replicas):
        run(send(admin, topic, b"{}", key=b"from-admin"))  # something a successful read would return
    refusals = {topic: run(read_refusal(router, topic)) for topic in (requests, replicas)}
    assert refusals[requests] == "TopicAuthorizationFailedError"  # it may describe (and write) requests
    for topic in (replicas, router.otel_topic):
        with pytest.raises(TopicAuthorizationFailedError):
            run(send(router, topic, b"{}", key=b"forged"))
    assert run(create_topic_error(router, f"{router.topic_namespace}.made-by-router")) == TOPIC_AUTHORIZATION_FAILED
    print(f"\nrouter refused: reading {refusals}; writing replicas and spans; creating a topic")


def test_a_gpu_agent_writes_replica_samples_only(secure):
    _, as_principal = secure
    agent, admin = as_principal(GPU_AGENT), as_principal(ADMIN)
    admission = topics.ADMISSION.name(agent)
    run(send(agent, topics.REPLICAS.name(agent), b"{}", key=b"replica"))
    with pytest.raises(TopicAuthorizationFailedError):
        run(send(agent, topics.REQUESTS.name(agent), b"{}", key=b"task"))
    with pytest.raises(TopicAuthorizationFailedError):
        run(send(agent, admission, b"forged", key=b"pool-x"))
    run(send(admin, admission, b"from-admin", key=b"pool-y"))
    assert run(read_refusal(agent, admission)) in ("TopicAuthorizationFailedError", "unauthorized in metadata")


def test_an_otel_collector_writes_spans_only(secure):
    _, as_principal = secure
    collector, worker = as_principal(OTEL_COLLECTOR), as_principal(WORKER)
    spans = collector.otel_topic
    run(send(collector, spans, b'{"resourceSpans": []}', key=b"trace"))
    assert b'{"resourceSpans": []}' in run(read_topic(worker, spans))  # the bridge's principal reads them
    for topic in (topics.REQUESTS.name(collector), topics.ADMISSION.name(collector)):
        with pytest.raises(TopicAuthorizationFailedError):
            run(send(collector, topic, b"{}", key=b"forged"))
    assert run(read_refusal(collector, spans)) == "TopicAuthorizationFailedError"


def test_a_principal_new_to_credentials_json_is_added_to_the_running_cluster(secure):
    """What happens when a release adds a principal: the stored file lacks it, a password is made for it, and
    ``start`` on the running cluster creates the SCRAM user (through the Admin API, not the storage format)."""
    import json

    from pipeline.devstack.credentials import credentials_path

    cluster, as_principal = secure
    path = credentials_path(cluster.devstack.home)
    stored = json.loads(path.read_text())
    old_password = stored.pop(OTEL_COLLECTOR)
    path.write_text(json.dumps(stored))
    new_password = cluster.devstack.credentials()[OTEL_COLLECTOR]
    assert new_password != old_password and json.loads(path.read_text())[ROUTER] == stored[ROUTER]
    assert_refused_connection(run(bootstrap_error(cluster.bootstrap, **client_options(as_principal(OTEL_COLLECTOR)))),
                              "a password the cluster does not know yet")
    info, _ = cluster.devstack.start()  # running: only the principals that cannot log in are created
    assert info.bootstrap == cluster.bootstrap
    assert run(bootstrap_error(cluster.bootstrap, **client_options(as_principal(OTEL_COLLECTOR)))) is None
    assert_refused_connection(run(bootstrap_error(cluster.bootstrap, **client_options(
        as_principal(OTEL_COLLECTOR, password=old_password)))), "the replaced password")
    assert run(bootstrap_error(cluster.bootstrap, **client_options(as_principal(ROUTER)))) is None


def test_the_pipeline_runs_authenticated_end_to_end(secure, tmp_path):
    cluster, as_principal = secure
    worker_settings = as_principal(WORKER, web_port=free_port(), tick_s=0.25, chdb_path=str(tmp_path / "chdb"))
    router, agent = as_principal(ROUTER), as_principal(GPU_AGENT)
    worker = WorkerProcess(worker_settings, tmp_path / "worker.log")
    events = list(generate(load_trace(), rate=20, seconds=10, seed=3, start_ms=int(time.time() * 1000),
                           fleet=Fleet(pools=POOLS)))
    requests = [e for e in events if e.kind == "request"]
    replicas = [e for e in events if e.kind != "request"]
    seen: dict[str, int] = {}

    async def follow_signals() -> None:
        from pipeline.admission.keyring import keyring

        client = RouterClient(router, cluster.bootstrap, keyring(router))
        await client.start()
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and not all(p in client.book.signals for p in POOLS):
                await asyncio.sleep(0.5)
            seen.update({p: 1 for p in POOLS if p in client.book.signals})
        finally:
            await client.stop()

    try:
        worker.start(timeout_s=120)
        produced = run(produce(router, cluster.bootstrap, requests, paced=False))
        run(produce(agent, cluster.bootstrap, replicas, paced=False))
        assert produced.requests == len(requests)
        run(follow_signals())
        assert set(seen) == set(POOLS), f"the router got verified signals for {sorted(seen)} only"
        wait_for(lambda: worker_landed(worker_settings) >= len(requests), 120, interval_s=1.0,
                 message="every request event to land")
    finally:
        worker.stop()
    rows = landed_requests(worker_settings)
    assert rows == {"rows": len(requests), "ids": len(requests)}
    print(f"\nsecure pipeline: {len(requests)} request events from `router`, {len(replicas)} samples from "
          f"`gpu-agent`, signals for {sorted(seen)} verified by an authenticated router client, "
          f"{rows['rows']} rows landed by `sluice`")


def worker_landed(settings) -> int:
    """Request events the worker's landing path has in the store (through its read-only /query)."""
    from pipeline.query_client import QueryFailed, run_query

    try:
        rows, _ = run_query(settings, "SELECT count() AS n FROM request_events")
    except QueryFailed:
        return 0
    return int(rows[0]["n"]) if rows else 0
