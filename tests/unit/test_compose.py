"""docker-compose.yml, its override and deploy/compose/local.yml checked against the code, without an engine
(tests/integration/test_compose.py brings the local variant up for real)."""

import re
from pathlib import Path

import yaml

from pipeline.settings import ALIASES, ENV_PREFIX, Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
OVERRIDE = yaml.safe_load((ROOT / "docker-compose.override.yml").read_text())
LOCAL = yaml.safe_load((ROOT / "deploy/compose/local.yml").read_text())
KNOWN_ENV = {ENV_PREFIX + name.upper() for name in Settings.__dataclass_fields__} | set(ALIASES.values())
SERVICES = COMPOSE["services"]
BROKERS = ["kafka-1", "kafka-2", "kafka-3"]
WORKERS = ["control", "landing"]


def _env(service: str) -> dict[str, str]:
    return {k: str(v) for k, v in SERVICES[service]["environment"].items()}


def _default(value: str) -> str:
    """``${NAME:-default}`` → ``default`` (what compose substitutes when NAME is unset)."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def test_three_brokers_of_the_devstack_version_rf3_min_isr2():
    version = load_settings(env={}).kafka_version
    voters = set()
    for n, name in enumerate(BROKERS, start=1):
        env = _env(name)
        assert SERVICES[name]["image"] == f"apache/kafka:{version}"
        assert env["KAFKA_NODE_ID"] == str(n)
        assert env["KAFKA_ADVERTISED_LISTENERS"].startswith(f"PLAINTEXT://{name}:9092,")
        assert env["KAFKA_DEFAULT_REPLICATION_FACTOR"] == env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "3"
        assert env["KAFKA_MIN_INSYNC_REPLICAS"] == env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "2"
        voters.add(env["KAFKA_CONTROLLER_QUORUM_VOTERS"])
    assert voters == {"1@kafka-1:9093,2@kafka-2:9093,3@kafka-3:9093"}


def test_workers_run_one_role_each_with_real_settings():
    for role in WORKERS:
        worker = SERVICES[role]
        assert worker["command"] == ["worker", "--role", role]
        env = _env(role)
        assert set(env) <= KNOWN_ENV, set(env) - KNOWN_ENV
        settings = load_settings(env={k: _default(v) for k, v in env.items()})
        assert settings.kafka_bootstrap_servers == ",".join(f"{b}:9092" for b in BROKERS)
        assert settings.topic_replication_factor == 3
        assert settings.signing_keys and settings.signing_key_id in settings.signing_keys
        assert settings.query_token  # web_host 0.0.0.0 needs one
        assert set(worker["depends_on"]) >= set(BROKERS)
    assert "CLICKHOUSE_URL" not in _env("control")


def test_the_landing_worker_reaches_the_clickhouse_service_with_its_credentials():
    landing, clickhouse = _env("landing"), _env("clickhouse")
    assert landing["CLICKHOUSE_URL"] == f"http://clickhouse:8123/{clickhouse['CLICKHOUSE_DB']}"
    assert (landing["CLICKHOUSE_USER"], landing["CLICKHOUSE_PASSWORD"]) == (
        clickhouse["CLICKHOUSE_USER"], clickhouse["CLICKHOUSE_PASSWORD"])


def test_host_ports_are_published_on_loopback_only_by_the_override():
    assert not any("ports" in s for s in SERVICES.values())  # local.yml's host networking refuses them
    for name, service in OVERRIDE["services"].items():
        assert name in SERVICES
        assert all(p.startswith("127.0.0.1:") for p in service["ports"])
    worker_port = _env("control")["SLUICE_WEB_PORT"]
    assert OVERRIDE["services"]["control"]["ports"] == [f"127.0.0.1:6066:{worker_port}"]
    for n, broker in enumerate(BROKERS):
        external = _env(broker)["KAFKA_ADVERTISED_LISTENERS"].split("EXTERNAL://")[1]
        assert OVERRIDE["services"][broker]["ports"] == [f"{external}:{external.rsplit(':', 1)[1]}"]


def test_prometheus_scrapes_both_workers_with_the_repo_rules():
    prometheus = SERVICES["prometheus"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    (targets,) = [c["targets"] for c in config["scrape_configs"][0]["static_configs"]]
    assert sorted(targets) == sorted(f"{w}:{_env(w)['SLUICE_WEB_PORT']}" for w in WORKERS)
    assert config["rule_files"] == ["rules/*.yml"]


def test_grafana_mounts_the_provisioning_and_dashboards():
    volumes = SERVICES["grafana"]["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in volumes
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in volumes
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/sluice.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_local_override_uses_host_networking_on_loopback_and_no_clickhouse_server():
    services = LOCAL["services"]
    for name in [*BROKERS, *WORKERS, "prometheus", "clickhouse"]:
        assert services[name]["network_mode"] == "host", name
    assert services["grafana"]["profiles"] == ["server"]
    assert _default(services["landing"]["environment"]["CLICKHOUSE_URL"]) == ""
    bootstrap = _default(services["control"]["environment"]["KAFKA_BOOTSTRAP_SERVERS"])
    advertised = []
    voters = set()
    for name in BROKERS:
        env = {k: _default(str(v)) for k, v in services[name]["environment"].items()}
        assert all(l.split("//")[1].startswith("127.0.0.1:") for l in env["KAFKA_LISTENERS"].split(","))
        advertised.append(env["KAFKA_ADVERTISED_LISTENERS"].removeprefix("PLAINTEXT://"))
        voters.add(env["KAFKA_CONTROLLER_QUORUM_VOTERS"])
        controller = env["KAFKA_LISTENERS"].split("CONTROLLER://")[1]
        assert f"{BROKERS.index(name) + 1}@{controller}" in env["KAFKA_CONTROLLER_QUORUM_VOTERS"]
    assert bootstrap == ",".join(advertised)
    assert len(voters) == 1
    for role in WORKERS:
        env = {k: _default(str(v)) for k, v in services[role]["environment"].items()}
        assert env["SLUICE_WEB_HOST"] == "127.0.0.1"
        load_settings(env={**{k: _default(str(v)) for k, v in _env(role).items()}, **env})
    local_prometheus = yaml.safe_load((ROOT / "deploy/compose/prometheus.yml").read_text())
    ports = sorted(_default(services[r]["environment"]["SLUICE_WEB_PORT"]) for r in WORKERS)
    assert sorted(local_prometheus["scrape_configs"][0]["static_configs"][0]["targets"]) == [
        f"127.0.0.1:{p}" for p in ports]


def test_the_kafka_entrypoint_reads_the_same_variables_as_the_official_image():
    script = (ROOT / "deploy/docker/kafka-entrypoint.sh").read_text()
    assert "KAFKA_*)" in script and "key=${key//_/.}" in script
