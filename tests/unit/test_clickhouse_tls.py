"""A ClickHouse server URL: https speaks TLS verified against ``clickhouse_ca_file``, http stays plain."""

from __future__ import annotations

import shutil

import pytest

from pipeline.settings import SettingsError, load_settings
from pipeline.sinks.store import StoreUnavailable, open_store
from tests.pki import OneShotTlsServer, make_pki

PASSWORD = "ch-s3cret"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    return make_pki(tmp_path_factory.mktemp("pki"))


def connect(url: str, **overrides) -> OneShotTlsServer:
    """Open the store against a one-shot server (which then hangs up) and return what the server saw."""
    server = overrides.pop("server")
    settings = load_settings(env={}, clickhouse_url=url.format(port=server.port), clickhouse_password=PASSWORD,
                             **overrides)
    with pytest.raises(StoreUnavailable) as failed:
        open_store(settings)
    assert PASSWORD not in str(failed.value)
    assert server.done.wait(10)
    return server


def test_https_is_tls_verified_against_the_ca_file(pki):
    server = connect("https://127.0.0.1:{port}/sluice", server=OneShotTlsServer(pki), clickhouse_ca_file=str(pki.ca))
    assert server.handshake == "ok" and server.first_bytes.split(b" ")[0] in (b"GET", b"POST")


def test_https_refuses_a_server_the_trust_store_does_not_know(pki):
    server = connect("https://127.0.0.1:{port}/sluice", server=OneShotTlsServer(pki))
    assert server.handshake.startswith("failed")


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_https_without_verification_is_still_encrypted(pki):
    server = connect("https://127.0.0.1:{port}/sluice", server=OneShotTlsServer(pki), clickhouse_verify=False)
    assert server.handshake == "ok"


def test_http_stays_plain(pki):
    server = OneShotTlsServer(pki)
    connect("http://127.0.0.1:{port}/sluice", server=server)
    assert server.handshake == "no tls" and server.first_bytes.split(b" ")[0] in (b"GET", b"POST")


@pytest.mark.parametrize("overrides,message", [
    ({"clickhouse_url": "clickhouse://host:9000/db"}, "http:// or https://"),
    ({"clickhouse_url": "http://host:8123/db", "clickhouse_ca_file": "/etc/hosts"}, "not an https:// URL"),
    ({"clickhouse_url": "https://host:8443/db", "clickhouse_ca_file": "/nonexistent/ca.pem"}, "no such file"),
    # clickhouse-connect would turn these into client options over Sluice's own: verification off unseen
    ({"clickhouse_url": "https://host:8443/db?verify=false"}, "query parameters"),
    ({"clickhouse_url": "https://host:8443/db?ca_cert=/tmp/other.pem", "clickhouse_ca_file": "/etc/hosts"},
     "query parameters"),
    ({"clickhouse_url": "http://host:8123/db?"}, "query parameters"),
])
def test_bad_clickhouse_tls_settings_fail_at_load(overrides, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(env={}, **overrides)


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_a_query_parameter_cannot_switch_verification_off(pki, monkeypatch):
    """Why the URL's query is refused: given to clickhouse-connect, ``?verify=false`` wins over
    ``clickhouse_verify`` and the store talks to a server its CA never vouched for."""
    from pipeline.settings import Settings

    monkeypatch.setattr("pipeline.settings._check_clickhouse_tls", lambda s: None)  # as before the check
    server = OneShotTlsServer(pki)
    settings = load_settings(env={}, clickhouse_url=f"https://127.0.0.1:{server.port}/sluice?verify=false",
                             clickhouse_password=PASSWORD)
    assert isinstance(settings, Settings) and settings.clickhouse_verify
    with pytest.raises(StoreUnavailable):
        open_store(settings)
    assert server.done.wait(10)
    assert server.handshake == "ok"  # an unknown CA, accepted: the DSN's parameter overrode verification
