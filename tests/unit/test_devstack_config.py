"""The devstack's cluster shape and security as configuration: replication by cluster size, no plaintext
listener in secure mode, the ACL table's grants, and min.insync.replicas on every replicated topic."""

from pathlib import Path

import pytest

from pipeline import topics
from pipeline.devstack.acls import acl_table
from pipeline.devstack.node_config import NodeAddress, Security, render
from pipeline.devstack.tls import TlsFiles
from pipeline.settings import SettingsError, load_settings


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
    settings = load_settings(env={}, topic_namespace=namespace, app_id="app")
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


def test_replicated_topics_carry_min_insync_replicas_and_a_bad_value_is_refused():
    assert "min.insync.replicas" not in topics.ADMISSION.config(load_settings(env={}))
    settings = load_settings(env={}, topic_replication_factor=3, topic_min_insync_replicas=2)
    assert all(config["min.insync.replicas"] == "2" for _, config in topics.topic_configs(settings).values())
    with pytest.raises(SettingsError, match="topic_min_insync_replicas"):
        load_settings(env={}, topic_replication_factor=2, topic_min_insync_replicas=3)
