"""docker-compose.yml cannot run here (no Docker engine), so check it against the code instead."""

from pathlib import Path

import yaml

from pipeline.settings import ALIASES, ENV_PREFIX, Settings, load_settings

COMPOSE = yaml.safe_load((Path(__file__).resolve().parents[2] / "docker-compose.yml").read_text())
KNOWN_ENV = {ENV_PREFIX + name.upper() for name in Settings.__dataclass_fields__} | set(ALIASES.values())


def test_kafka_image_matches_the_devstack_version():
    assert COMPOSE["services"]["kafka"]["image"] == f"apache/kafka:{load_settings(env={}).kafka_version}"


def test_worker_environment_names_real_settings_and_loads():
    env = {k: str(v) for k, v in COMPOSE["services"]["worker"]["environment"].items()}
    assert set(env) <= KNOWN_ENV, set(env) - KNOWN_ENV
    settings = load_settings(env=env)
    assert settings.kafka_bootstrap_servers == COMPOSE["services"]["kafka"]["environment"][
        "KAFKA_ADVERTISED_LISTENERS"].split("//")[1]
    assert f"127.0.0.1:{settings.web_port}:{settings.web_port}" in COMPOSE["services"]["worker"]["ports"]


def test_worker_reaches_the_clickhouse_service_with_its_credentials():
    worker = COMPOSE["services"]["worker"]["environment"]
    clickhouse = COMPOSE["services"]["clickhouse"]["environment"]
    assert worker["CLICKHOUSE_URL"].endswith("/" + clickhouse["CLICKHOUSE_DB"])
    assert (worker["CLICKHOUSE_USER"], worker["CLICKHOUSE_PASSWORD"]) == (
        clickhouse["CLICKHOUSE_USER"], clickhouse["CLICKHOUSE_PASSWORD"])


def test_prometheus_scrapes_the_worker_with_the_repo_rules():
    prometheus = COMPOSE["services"]["prometheus"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy/prometheus/prometheus.yml").read_text())
    (target,) = config["scrape_configs"][0]["static_configs"][0]["targets"]
    port = COMPOSE["services"]["worker"]["environment"]["SLUICE_WEB_PORT"]
    assert target == f"worker:{port}"
    assert config["rule_files"] == ["rules/*.yml"]
