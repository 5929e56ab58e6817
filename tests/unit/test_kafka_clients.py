"""Kafka connection options: one place, the same for aiokafka and Faust, refused when inconsistent, no secret shown,
and used by every client the pipeline builds."""

from __future__ import annotations

import ast
import asyncio
import logging
import shutil
import socket
import subprocess
import sys
import ssl
from pathlib import Path

import pytest

from pipeline.kafka_clients import client_options, faust_credentials, producer_options, ssl_context
from pipeline.settings import SettingsError, load_settings
from tests.pki import OneShotTlsServer, make_pki

PIPELINE = Path(__file__).resolve().parents[2] / "pipeline"
PASSWORD = "hunter2-kafka"
SASL = {"kafka_sasl_username": "sluice", "kafka_sasl_password": PASSWORD}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    return make_pki(tmp_path_factory.mktemp("pki"))


def settings(**overrides):
    return load_settings(env={}, **overrides)


def test_plaintext_adds_nothing_and_faust_gets_no_credentials():
    s = settings()
    assert client_options(s) == {} and ssl_context(s) is None and faust_credentials(s) is None
    assert producer_options(s) == {"acks": "all", "enable_idempotence": True}


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"])
def test_sasl_plaintext_authenticates_without_tls(mechanism):
    options = client_options(settings(kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_mechanism=mechanism,
                                      **SASL))
    assert options == {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": mechanism,
                       "sasl_plain_username": "sluice", "sasl_plain_password": PASSWORD}


def test_sasl_ssl_defaults_to_scram_sha_512_and_the_system_trust_store():
    s = settings(kafka_security_protocol="SASL_SSL", **SASL)
    options = producer_options(s)
    context = options.pop("ssl_context")
    assert options == {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                       "sasl_plain_username": "sluice", "sasl_plain_password": PASSWORD,
                       "acks": "all", "enable_idempotence": True}
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2


def test_the_ca_file_replaces_the_system_store_and_the_context_is_built_once(pki):
    s = settings(kafka_security_protocol="SSL", kafka_ssl_ca_file=str(pki.ca))
    context = ssl_context(s)
    assert [dict(c["subject"][0])["commonName"] for c in context.get_ca_certs()] == ["ca"]
    assert client_options(s) == {"security_protocol": "SSL", "ssl_context": context}
    assert ssl_context(settings(kafka_security_protocol="SSL", kafka_ssl_ca_file=str(pki.ca))) is context


def test_hostname_check_can_be_turned_off_but_the_chain_is_still_verified(pki):
    context = ssl_context(settings(kafka_security_protocol="SSL", kafka_ssl_ca_file=str(pki.ca),
                                   kafka_ssl_check_hostname=False))
    assert not context.check_hostname and context.verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"])
def test_faust_connects_exactly_as_the_aiokafka_clients(protocol, pki):
    import faust
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    extra = {"kafka_ssl_ca_file": str(pki.ca)} if "SSL" in protocol.split("_") else {}
    s = settings(kafka_security_protocol=protocol, **(SASL if protocol.startswith("SASL") else {}), **extra)
    app = faust.App("kafka-clients-test", broker="kafka://127.0.0.1:9", broker_credentials=faust_credentials(s))
    assert credentials_to_aiokafka_auth(app.conf.broker_credentials, app.conf.ssl_context) == {
        "security_protocol": "PLAINTEXT", **({"ssl_context": None} if protocol == "SASL_PLAINTEXT" else {}),
        **client_options(s)}


def test_mutual_tls_loads_the_client_certificate_also_from_one_file(pki):
    for cert, key in ((pki.client_cert, pki.client_key), (pki.client_pem, pki.client_pem)):
        assert ssl_context(settings(kafka_security_protocol="SSL", kafka_ssl_ca_file=str(pki.ca),
                                    kafka_ssl_cert_file=str(cert), kafka_ssl_key_file=str(key))) is not None


@pytest.mark.parametrize("overrides,message", [
    ({"kafka_security_protocol": "SASL_SSL"}, "needs kafka_sasl_username and kafka_sasl_password"),
    ({"kafka_security_protocol": "SASL_SSL", "kafka_sasl_username": "sluice"}, "needs kafka_sasl_username"),
    ({"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_sasl_password": "x"}, "needs kafka_sasl_username"),
    ({"kafka_sasl_username": "sluice", "kafka_sasl_password": "x"}, "PLAINTEXT does not use them"),
    ({"kafka_security_protocol": "SSL", **SASL}, "SSL does not use them"),
    ({"kafka_ssl_ca_file": "/etc/hosts"}, "kafka_ssl_ca_file set but kafka_security_protocol=PLAINTEXT"),
    ({"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_ssl_cert_file": "/etc/hosts",
      "kafka_ssl_key_file": "/etc/hosts", **SASL}, "uses no TLS"),
    ({"kafka_security_protocol": "SSL", "kafka_ssl_cert_file": "/etc/hosts"}, "go together"),
    ({"kafka_security_protocol": "SSL", "kafka_ssl_key_file": "/etc/hosts"}, "go together"),
    ({"kafka_security_protocol": "SSL", "kafka_ssl_ca_file": "/nonexistent/ca.pem"}, "no such file"),
    ({"kafka_security_protocol": "TLS"}, "kafka_security_protocol"),
    ({"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "GSSAPI", **SASL}, "kafka_sasl_mechanism"),
])
def test_inconsistent_security_fails_at_load_naming_the_setting(overrides, message):
    with pytest.raises(SettingsError, match=message):
        settings(**overrides)


def test_tls_files_that_do_not_load_fail_with_the_setting_name(pki, tmp_path):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases = [({"kafka_ssl_ca_file": str(garbage)}, "kafka_ssl_ca_file"),
             ({"kafka_ssl_cert_file": str(pki.client_cert), "kafka_ssl_key_file": str(pki.server_key)},
              "kafka_ssl_cert_file"),
             ({"kafka_ssl_cert_file": str(pki.client_cert), "kafka_ssl_key_file": str(pki.encrypted_key)},
              "kafka_ssl_key_file is encrypted")]
    for overrides, message in cases:
        s = settings(kafka_security_protocol="SSL", **overrides)
        for build in (ssl_context, client_options, producer_options, faust_credentials):
            with pytest.raises(SettingsError, match=message):
                build(s)


def test_the_password_is_never_shown():
    s = settings(kafka_security_protocol="SASL_SSL", **SASL)
    options = client_options(s)
    assert options["sasl_plain_password"] == PASSWORD and options["sasl_plain_password"].encode() == PASSWORD.encode()
    shown = [repr(s), str(s), str(s.redacted()), repr(options), str(options), repr(producer_options(s)),
             repr(faust_credentials(s))]
    assert not [text for text in shown if PASSWORD in text]
    assert s.redacted()["kafka_sasl_password"] == "***"
    with pytest.raises(SettingsError) as refused:
        settings(kafka_sasl_password=PASSWORD)
    assert PASSWORD not in str(refused.value)


def test_sasl_plaintext_to_a_remote_broker_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="pipeline.kafka_clients"):
        client_options(settings(kafka_security_protocol="SASL_PLAINTEXT", kafka_bootstrap_servers="127.0.0.1:9092",
                                **SASL))
        assert not caplog.records
        remote = settings(kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_mechanism="PLAIN",
                          kafka_bootstrap_servers="127.0.0.1:9092,kafka-7.example:9092", **SASL)
        client_options(remote)
        client_options(remote)
    (record,) = caplog.records
    assert "kafka-7.example" in record.message and "PLAIN sends the password" in record.message
    assert "127.0.0.1" not in record.message


def test_the_context_verifies_a_real_tls_server_and_presents_the_client_certificate(pki):
    def handshake(context: ssl.SSLContext, require_client_cert: bool = False) -> str:
        server = OneShotTlsServer(pki, require_client_cert)
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw, \
                    context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(b"hello")
                tls.recv(1)
        except (ssl.SSLError, OSError) as exc:
            return f"client refused: {exc}"
        finally:
            server.done.wait(5)
        return server.handshake

    trusted = settings(kafka_security_protocol="SSL", kafka_ssl_ca_file=str(pki.ca))
    assert handshake(ssl_context(trusted)) == "ok"
    untrusted = settings(kafka_security_protocol="SSL", kafka_ssl_ca_file=str(pki.other_ca))
    assert "CERTIFICATE_VERIFY_FAILED" in handshake(ssl_context(untrusted))
    mutual = settings(kafka_security_protocol="SSL", kafka_ssl_ca_file=str(pki.ca),
                      kafka_ssl_cert_file=str(pki.client_cert), kafka_ssl_key_file=str(pki.client_key))
    assert handshake(ssl_context(mutual), require_client_cert=True) == "ok"


def test_aiokafka_speaks_tls_with_these_options(pki):
    """A producer built from the options opens TLS to the bootstrap server before any Kafka request."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import KafkaConnectionError

    server = OneShotTlsServer(pki)
    s = settings(kafka_security_protocol="SASL_SSL", kafka_ssl_ca_file=str(pki.ca), **SASL)

    async def start() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=f"127.0.0.1:{server.port}", request_timeout_ms=3000,
                                    **producer_options(s))
        try:
            await producer.start()
        finally:
            await producer.stop()

    with pytest.raises(KafkaConnectionError):
        asyncio.run(start())
    assert server.done.wait(5) and server.handshake == "ok" and server.first_bytes  # a Kafka request, under TLS


CONSTRUCTORS = {"AIOKafkaProducer", "AIOKafkaConsumer", "AIOKafkaAdminClient", "AIOKafkaClient",
                "open_from_beginning"}
PRODUCERS = {"AIOKafkaProducer"}
# open_from_beginning and start_producer hand their callers' options on (start_producer's callers are checked below)
PASS_THROUGH = {("topic_reader.py", "options"), ("bounded_producer.py", "options")}
NOT_HERE = ("devstack",)  # the development broker's own tooling: rewritten for a secure devstack on its own


def _name(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def test_every_kafka_client_in_the_pipeline_is_built_with_these_options():
    missing = []
    for path in sorted(PIPELINE.rglob("*.py")):
        relative = path.relative_to(PIPELINE)
        if relative.parts[0] in NOT_HERE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = _name(node.func)
            spread = {(_name(k.value.func) if isinstance(k.value, ast.Call) else _name(k.value))
                      for k in node.keywords if k.arg is None}
            where = f"{relative}:{node.lineno} {name}"
            if name == "start_producer" and not path.name == "bounded_producer.py":
                if "producer_options" not in spread and "options" not in spread:
                    missing.append(where)
            elif name in CONSTRUCTORS:
                wanted = {"producer_options"} if name in PRODUCERS else {"client_options", "producer_options"}
                if not (spread & wanted or any((path.name, s) in PASS_THROUGH for s in spread)):
                    missing.append(where)
            elif name == "App" and _name(getattr(node.func, "value", node.func)) == "faust":
                credentials = [k.value for k in node.keywords if k.arg == "broker_credentials"]
                if not (credentials and _name(getattr(credentials[0], "func", credentials[0])) == "faust_credentials"):
                    missing.append(where)
    assert not missing, "Kafka clients built without pipeline.kafka_clients: " + ", ".join(missing)


def test_the_router_library_still_imports_no_kafka_library():
    check = "import sys, pipeline.router, pipeline.kafka_clients; print(sorted(m for m in sys.modules " \
            "if m.split('.')[0] in ('aiokafka', 'faust', 'kafka')))"
    out = subprocess.run([sys.executable, "-c", check], cwd=PIPELINE.parent, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_the_aiokafka_internals_the_bounded_stop_relies_on_are_there():
    """``bounded_producer`` reads a producer's sender task and fails its accumulator's batches: an aiokafka
    release that renames them must fail here, not leave a stop that closes less than it says."""
    import asyncio

    from aiokafka import AIOKafkaProducer

    from pipeline.bounded_producer import sender_stopped, sender_task

    async def build():
        producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:9")
        return producer, type(producer._sender).sender_task, producer._message_accumulator.fail_all, producer.client

    producer, task_property, fail_all, client = asyncio.run(build())
    assert isinstance(task_property, property) and callable(fail_all) and hasattr(client, "close")
    assert sender_task(producer) is None and not sender_stopped(producer), "not started: no sender task yet"
