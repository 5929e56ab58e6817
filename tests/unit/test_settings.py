import dataclasses
from pathlib import Path

import pytest

from pipeline.settings import Settings, SettingsError, load_settings, settings_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_defaults_work_without_any_configuration():
    settings = load_settings(env={})
    assert settings.topic_namespace == "" and settings.web_host == "127.0.0.1"
    assert settings.chdb_dir == settings.state_dir / "chdb"


def test_environment_overrides_file_overrides_default(tmp_path):
    config = tmp_path / "sluice.toml"
    config.write_text('web_port = 7000\ntopic_partitions = 8\n')
    settings = load_settings(env={"SLUICE_CONFIG": str(config), "SLUICE_WEB_PORT": "7001"})
    assert settings.web_port == 7001 and settings.topic_partitions == 8


def test_kafka_bootstrap_servers_alias():
    assert load_settings(env={"KAFKA_BOOTSTRAP_SERVERS": "10.0.0.1:9092"}).kafka_bootstrap_servers == "10.0.0.1:9092"


@pytest.mark.parametrize("env,message", [
    ({"SLUICE_WEB_PORT": "eighty"}, "web_port"),
    ({"SLUICE_WEB_PORT": "70000"}, "maximum"),
    ({"SLUICE_LOG_LEVEL": "loud"}, "log_level"),
    ({"SLUICE_TOPIC_NAMESPACE": "a b"}, "topic_namespace"),
    ({"SLUICE_CONFIG": "/nonexistent/sluice.toml"}, "SLUICE_CONFIG"),
    ({"SLUICE_CUT_INTERVAL_S": "1.0"}, "cut_interval_s=1.0 is longer than tick_s"),
    ({"SLUICE_CUT_INTERVAL_S": "0.01"}, "cut_interval_s"),
    ({"SLUICE_REPLICA_STALE_AFTER_S": "nan"}, "replica_stale_after_s=nan must be a finite number"),
    ({"SLUICE_MAX_CLOCK_SKEW_S": "inf"}, "max_clock_skew_s=inf must be a finite number"),
])
def test_bad_configuration_fails_loudly_naming_the_setting(env, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(env=env)


def test_unknown_setting_in_file_is_refused(tmp_path):
    config = tmp_path / "sluice.toml"
    config.write_text('web_prot = 7000\n')
    with pytest.raises(SettingsError, match="web_prot"):
        load_settings(env={"SLUICE_CONFIG": str(config)})


def test_password_is_never_shown():
    assert load_settings(env={"SLUICE_CLICKHOUSE_PASSWORD": "hunter2"}).redacted()["clickhouse_password"] == "***"


def test_every_setting_is_documented_in_the_readme():
    readme = README.read_text()
    for f in dataclasses.fields(Settings):
        assert f"`SLUICE_{f.name.upper()}`" in readme, f"{f.name} is not in the README"
    assert settings_table().splitlines()[0] in readme
