"""The devstack's cluster shape and security as configuration: replication by cluster size, no plaintext
listener in secure mode, the ACL table's grants, and min.insync.replicas on every topic. Then its handling
of secrets and processes, with stand-ins for the JVMs: no password printed or on a command line, a failed
format or launch leaves nothing running, a slow answer is not taken for a dead cluster, broker.json is
replaced whole."""

import json
import os
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import topics
from pipeline.devstack import kafka as devstack_kafka
from pipeline.devstack.acls import acl_table
from pipeline.devstack.credentials import PRINCIPALS, client_env, credentials_path, ensure_credentials
from pipeline.devstack.kafka import ClusterInfo, DevstackError, KafkaDevstack, Layout, NodeInfo
from pipeline.devstack.node_config import NodeAddress, Security, render
from pipeline.devstack.tls import TlsFiles
from pipeline.settings import SettingsError, load_settings
from tests.conftest import wait_for


def properties(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line)


def nodes(count: int) -> list[NodeAddress]:
    return [NodeAddress(i, 9000 + i, 9100 + i) for i in range(1, count + 1)]


def test_three_nodes_replicate_everything_three_times_and_need_two_in_sync():
    voters = nodes(3)
    props = properties(render(voters[1], voters, Path("/d"), None))
    assert props["controller.quorum.voters"] == "1@127.0.0.1:9101,2@127.0.0.1:9102,3@127.0.0.1:9103"
    assert props["node.id"] == "2"
    for key in ("default.replication.factor", "offsets.topic.replication.factor",
                "transaction.state.log.replication.factor"):
        assert props[key] == "3"
    assert props["min.insync.replicas"] == props["transaction.state.log.min.isr"] == "2"
    single = properties(render(nodes(1)[0], nodes(1), Path("/d"), None))
    assert single["default.replication.factor"] == single["min.insync.replicas"] == "1"


def test_a_secure_node_serves_sasl_ssl_only_and_denies_by_default():
    voters = nodes(1)
    props = properties(render(voters[0], voters, Path("/d"), Security(TlsFiles.under(Path("/t")), "pw")))
    assert "PLAINTEXT" not in props["listeners"] and "PLAINTEXT" not in props["listener.security.protocol.map"]
    assert set(props["listener.security.protocol.map"].split(",")) == {"BROKER:SASL_SSL", "CONTROLLER:SASL_SSL"}
    assert props["listener.name.broker.sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert props["authorizer.class.name"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
    assert props["super.users"] == "User:admin"
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["ssl.keystore.type"] == props["ssl.truststore.type"] == "PEM"


@pytest.mark.parametrize("namespace", ["", "tenant1"])
def test_only_the_worker_may_write_the_admission_topic_and_agents_only_replica_samples(namespace):
    settings = load_settings(env={}, topic_namespace=namespace, app_id="app", otel_topic="spans")
    table = acl_table(settings)
    grants = {(a.principal, a.resource_type, a.pattern, a.name, op) for a in table for op in a.operations}
    admission, requests = topics.ADMISSION.name(settings), topics.REQUESTS.name(settings)
    assert admission.startswith(f"{namespace}." if namespace else "sluice.")
    writers = {p for p, kind, _, name, op in grants if kind == "TOPIC" and name == admission and op in ("WRITE", "ALL")}
    assert writers == {"sluice"}
    assert ("router", "TOPIC", "LITERAL", admission, "READ") in grants
    assert ("router", "TOPIC", "LITERAL", requests, "WRITE") in grants
    assert {(kind, name, op) for p, kind, _, name, op in grants if p == "gpu-agent"} == {
        ("TOPIC", topics.REPLICAS.name(settings), "WRITE"), ("TOPIC", topics.REPLICAS.name(settings), "DESCRIBE")}
    assert ("sluice", "GROUP", "PREFIXED", "app", "READ") in grants
    assert ("sluice", "TOPIC", "PREFIXED", "app-", "ALL") in grants  # Faust's changelog and leader topics
    # the spans topic: written by the Collector's own principal only, read (and bridged) by the worker
    assert {(kind, name, op) for p, kind, _, name, op in grants if p == "otel-collector"} == {
        ("TOPIC", "spans", "WRITE"), ("TOPIC", "spans", "DESCRIBE")}
    assert {p for p, kind, _, name, op in grants if name == "spans" and op in ("WRITE", "ALL")} == {"otel-collector"}
    assert ("sluice", "TOPIC", "LITERAL", "spans", "READ") in grants
    assert ("sluice", "TOPIC", "LITERAL", requests, "WRITE") in grants
    router = {(kind, name, op) for p, kind, _, name, op in grants if p == "router"}
    assert router == {("TOPIC", admission, "READ"), ("TOPIC", admission, "DESCRIBE"),
                      ("TOPIC", requests, "WRITE"), ("TOPIC", requests, "DESCRIBE")}


def test_replicated_topics_carry_min_insync_replicas_and_a_bad_value_is_refused():
    settings = load_settings(env={}, topic_replication_factor=3, topic_min_insync_replicas=2)
    assert all(config["min.insync.replicas"] == "2" for _, config in topics.topic_configs(settings).values())
    with pytest.raises(SettingsError, match="topic_min_insync_replicas"):
        load_settings(env={}, topic_replication_factor=2, topic_min_insync_replicas=3)


@pytest.mark.parametrize("factor,wanted,expected", [(1, 2, "1"), (2, 2, "2"), (3, 1, "1"), (1, 1, "1")])
def test_every_topic_sets_min_insync_replicas_capped_at_its_replication_factor(factor, wanted, expected):
    """Never the broker's default: one replica on brokers whose default is 2 in sync (the three-node
    devstack's) would refuse every acks=all write with NOT_ENOUGH_REPLICAS on brokers before Kafka 3.7,
    which do not cap the effective min ISR at the replica count."""
    settings = load_settings(env={}, topic_replication_factor=factor, topic_min_insync_replicas=wanted,
                             otel_topic="spans")
    configs = topics.topic_configs(settings)
    assert "spans" in configs
    assert {name: config.get("min.insync.replicas") for name, (_, config) in configs.items()} == {
        name: expected for name in configs}
    assert topics.replication_config(settings) == {"min.insync.replicas": expected}  # Faust's changelog



# -- credentials -------------------------------------------------------------------------------------------

def test_credentials_gain_a_missing_principal_and_keep_the_others(tmp_path):
    path = credentials_path(tmp_path)
    path.write_text(json.dumps({"admin": "a" * 48, "sluice": "b" * 48, "router": "c" * 48, "gpu-agent": "d" * 48}))
    os.chmod(path, 0o600)
    made = ensure_credentials(tmp_path)
    assert set(made) == set(PRINCIPALS) and "otel-collector" in made
    assert [made[name] for name in ("admin", "sluice", "router", "gpu-agent")] == [c * 48 for c in "abcd"]
    assert json.loads(path.read_text()) == made
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_credentials(tmp_path) == made  # stable once complete


def test_client_env_names_neither_a_password_nor_the_bootstrap_list(tmp_path):
    env = dict(line.split("=", 1) for line in client_env("sluice", tmp_path / "ca.pem"))
    assert env == {"SLUICE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "SLUICE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
                   "SLUICE_KAFKA_SASL_USERNAME": "sluice", "SLUICE_KAFKA_SSL_CA_FILE": str(tmp_path / "ca.pem")}


class FakeDevstack:
    """What ``sluice kafka start`` needs of ``KafkaDevstack``, without a JVM."""

    def __init__(self, settings, brokers=None, secure=None):
        self.home = settings.kafka_dir
        self.secure = bool(secure)
        self.brokers = brokers or 1
        self.ca_file = self.home / "tls" / "ca.pem"

    def start(self):
        nodes = tuple(NodeInfo(i, 1000 + i, 9000 + i, 9100 + i, "p", "d", "l") for i in range(1, self.brokers + 1))
        return ClusterInfo(bootstrap=",".join(f"127.0.0.1:{n.port}" for n in nodes), version="4.1.1",
                           secure=self.secure, started_at=0.0, nodes=nodes), False

    def apply_acls(self, settings):
        pass

    def credentials(self):
        return ensure_credentials(self.home)


@pytest.mark.parametrize("brokers", [1, 3])
def test_kafka_start_prints_no_password_and_no_bootstrap_env(brokers, tmp_path, monkeypatch, capsys):
    from pipeline.cli import main

    monkeypatch.setattr(devstack_kafka, "KafkaDevstack", FakeDevstack)
    for name in [n for n in os.environ if n.startswith("SLUICE_") or n == "KAFKA_BOOTSTRAP_SERVERS"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLUICE_STATE_DIR", str(tmp_path))
    assert main(["kafka", "start", "--secure", "--brokers", str(brokers)]) == 0
    out = capsys.readouterr().out
    for principal, password in ensure_credentials(tmp_path / "kafka").items():
        assert password not in out, f"{principal}'s password printed"
    assert "SASL_PASSWORD=" not in out.replace("export SLUICE_KAFKA_SASL_PASSWORD=", "")
    assert "BOOTSTRAP_SERVERS" not in out
    env = dict(line.split("=", 1) for line in out.splitlines() if line.startswith("SLUICE_"))
    assert env["SLUICE_KAFKA_SASL_USERNAME"] == "sluice"
    assert env["SLUICE_KAFKA_SSL_CA_FILE"] == str(tmp_path / "kafka" / "tls" / "ca.pem")
    assert str(credentials_path(tmp_path / "kafka")) in out
    assert env.get("SLUICE_TOPIC_REPLICATION_FACTOR") == ("3" if brokers == 3 else None)


# -- the devstack's process handling, with stand-in processes ---------------------------------------------------

def devstack(tmp_path, brokers=1, secure=False) -> KafkaDevstack:
    return KafkaDevstack(load_settings(env={}, state_dir=str(tmp_path)), brokers=brokers, secure=secure)


def gone(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def test_a_failed_format_kills_the_other_formats(tmp_path, monkeypatch):
    stack = devstack(tmp_path, brokers=2)
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(cmd, **kwargs):
        argfile = Path(cmd[-1][1:])
        props = argfile.read_text().split('"-c"\n', 1)[1].split("\n", 1)[0].strip('"')
        fake = ["sleep", "60"] if "node-1" in props else ["sh", "-c", "echo broken config; exit 3"]
        proc = real_popen(fake, **kwargs)
        started.append(proc)
        return proc

    monkeypatch.setattr(devstack_kafka.subprocess, "Popen", popen)
    planned = []
    for node_id in (1, 2):
        (tmp_path / f"node-{node_id}").mkdir()
        node_dir = tmp_path / f"node-{node_id}"
        planned.append((None, node_dir / "server.properties", node_dir / "data"))
    began = time.monotonic()
    with pytest.raises(DevstackError, match="broken config"):
        stack._format(Layout(2, False, "abc"), planned)
    assert time.monotonic() - began < 10
    assert len(started) == 2 and all(proc.poll() is not None for proc in started)  # the sleeper killed too
    assert not list(tmp_path.glob("node-*/format.args"))


def test_a_secure_format_keeps_every_password_off_the_command_line(tmp_path, monkeypatch):
    stack = devstack(tmp_path, secure=True)
    seen = {}
    real_popen = subprocess.Popen

    def popen(cmd, **kwargs):
        seen["cmd"] = cmd
        seen["argfile"] = Path(cmd[-1][1:]).read_text()
        seen["mode"] = stat.S_IMODE(Path(cmd[-1][1:]).stat().st_mode)
        return real_popen(["true"], **kwargs)

    monkeypatch.setattr(devstack_kafka.subprocess, "Popen", popen)
    (tmp_path / "kafka").mkdir()
    home = tmp_path / "kafka"
    stack._format(Layout(1, True, "abc"), [(None, home / "server.properties", home / "data")])
    passwords = stack.credentials()
    assert not any(password in " ".join(seen["cmd"]) for password in passwords.values())
    assert seen["cmd"][-1].startswith("@") and seen["mode"] == 0o600
    assert f"name=admin,password={passwords['admin']}" in seen["argfile"]
    assert [p for name, p in passwords.items() if name != "admin" and p in seen["argfile"]] == []  # admin only


def stand_in(props: Path) -> list[str]:
    """A process whose command line looks like a node's (``_alive`` checks for kafka.Kafka and its properties)."""
    return [sys.executable, "-c", "import time; time.sleep(120)", "kafka.Kafka", str(props)]


def test_a_failed_launch_stops_the_nodes_already_started(tmp_path, monkeypatch):
    stack = devstack(tmp_path, brokers=3)
    pids = []

    def launch(node_id, props, log_path):
        if node_id == 3:
            raise OSError("no more processes")
        # not yet exec'd into a node when the launch fails (as a JVM just after Popen): no kafka.Kafka in its
        # command line for its first seconds, so only its pid tells it is ours
        late = {**os.environ, "NODE": shlex.join(stand_in(props))}
        proc = subprocess.Popen(["sh", "-c", 'sleep 3; eval exec "$NODE"'], env=late, start_new_session=True)
        pids.append(proc.pid)
        assert stack.info() is None or len(stack.info().nodes) == node_id - 1  # recorded as each one starts
        return proc.pid

    monkeypatch.setattr(stack, "fetch", lambda: False)
    monkeypatch.setattr(stack, "_format", lambda layout, nodes: None)
    monkeypatch.setattr(stack, "_launch", launch)
    try:
        with pytest.raises(OSError):
            stack.start(timeout_s=5)
        assert len(pids) == 2
        # (a process's command line empties a moment before it is a zombie: allow it to finish exiting)
        wait_for(lambda: all(gone(pid) for pid in pids), 5, interval_s=0.05, message="the started nodes to be gone")
        assert stack.info() is None
    finally:
        for pid in pids:
            if not gone(pid):
                os.killpg(pid, 9)
                os.waitpid(pid, 0)


def test_a_slow_answer_from_live_nodes_is_asked_again_before_the_cluster_is_called_dead(tmp_path, monkeypatch):
    stack = devstack(tmp_path)
    stack.home.mkdir(parents=True)
    info = ClusterInfo(bootstrap="127.0.0.1:9", version="4.1.1", secure=False, started_at=0.0,
                       nodes=(NodeInfo(1, 1, 9, 10, "p", "d", "l"),))
    stack.info_path.write_text(info.to_json())
    asked = []

    def answers(bootstrap, timeout_s=2.0, client_options=None):
        asked.append(timeout_s)
        return timeout_s >= 10  # the cluster answers, in more than two seconds

    monkeypatch.setattr(devstack_kafka, "answers_metadata", answers)
    monkeypatch.setattr(stack, "_alive", lambda node: True)
    assert stack.status() == "running"
    assert asked[0] == 2.0 and max(asked) >= 10
    monkeypatch.setattr(stack, "_alive", lambda node: False)
    asked.clear()
    assert stack.status() == "dead" and asked == []  # a node gone: dead without asking


def test_broker_json_is_replaced_whole(tmp_path, monkeypatch):
    stack = devstack(tmp_path)
    stack.home.mkdir(parents=True)
    writes = []
    real_open = os.open

    def spy(path, *args, **kwargs):
        writes.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(devstack_kafka.os, "open", spy)
    info = ClusterInfo(bootstrap="127.0.0.1:9", version="4.1.1", secure=False, started_at=0.0,
                       nodes=(NodeInfo(1, 1, 9, 10, "p", "d", "l"),))
    stack._record(info)
    assert stack.info() == info
    assert writes and all(w != str(stack.info_path) for w in writes)  # written beside it, then renamed
    assert list(stack.home.iterdir()) == [stack.info_path]


def test_the_devstacks_own_client_options_mask_the_password(tmp_path, monkeypatch):
    stack = devstack(tmp_path, secure=True)
    monkeypatch.setattr(KafkaDevstack, "ca_file", property(lambda self: Path("/etc/ssl/certs/ca-certificates.crt")))
    options = stack.client_options("router")
    assert options["sasl_plain_password"] == stack.credentials()["router"]
    assert stack.credentials()["router"] not in repr(options)
