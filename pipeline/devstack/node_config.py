"""``server.properties`` of one devstack node: a combined KRaft broker + controller on 127.0.0.1.

Replication follows the cluster's size: with three or more nodes every topic (Sluice's, Faust's, the
consumer offsets, transaction state) gets three replicas and needs two in sync to accept a write, so one
node can die without losing an acknowledged record or refusing producers. A secure node serves only
SASL_SSL: clients and the brokers among themselves authenticate with SCRAM-SHA-512 on the ``BROKER``
listener; the ``CONTROLLER`` listener (Raft and broker registration) uses SASL_SSL with PLAIN, because
KRaft controllers cannot use SCRAM (its credentials live in the metadata log the controllers serve), and
only the ``admin`` principal is accepted there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .credentials import ADMIN, MECHANISM
from .tls import TlsFiles


@dataclass(frozen=True)
class NodeAddress:
    node_id: int
    port: int             # the client (and inter-broker) listener
    controller_port: int  # the KRaft controller listener


@dataclass(frozen=True)
class Security:
    tls: TlsFiles
    admin_password: str


def replication(brokers: int) -> tuple[int, int]:
    """(replication factor, min in-sync replicas) for a cluster of ``brokers`` nodes."""
    factor = min(brokers, 3)
    return factor, 2 if factor >= 3 else 1


def render(node: NodeAddress, voters: list[NodeAddress], data_dir: Path, security: Security | None) -> str:
    factor, min_isr = replication(len(voters))
    quorum = ",".join(f"{v.node_id}@127.0.0.1:{v.controller_port}" for v in voters)
    client = "BROKER" if security else "PLAINTEXT"
    lines = [
        "process.roles=broker,controller",
        f"node.id={node.node_id}",
        f"controller.quorum.voters={quorum}",
        f"listeners={client}://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}",
        f"advertised.listeners={client}://127.0.0.1:{node.port}",
        "controller.listener.names=CONTROLLER",
        f"inter.broker.listener.name={client}",
        f"log.dirs={data_dir}",
        "num.partitions=1",
        f"default.replication.factor={factor}",
        f"min.insync.replicas={min_isr}",
        f"offsets.topic.replication.factor={factor}",
        "offsets.topic.num.partitions=8",
        f"transaction.state.log.replication.factor={factor}",
        f"transaction.state.log.min.isr={min_isr}",
        f"share.coordinator.state.topic.replication.factor={factor}",
        f"share.coordinator.state.topic.min.isr={min_isr}",
        "group.initial.rebalance.delay.ms=0",
        "auto.create.topics.enable=true",
        "log.segment.bytes=67108864",
        "log.cleaner.dedupe.buffer.size=33554432",
        # a killed node's partitions move within seconds, and it rejoins the ISR as soon as it catches up
        "replica.lag.time.max.ms=10000",
        "broker.session.timeout.ms=6000",
        "broker.heartbeat.interval.ms=1000",
    ]
    lines += _security_lines(security) if security else [
        "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"]
    return "\n".join(lines) + "\n"


def _security_lines(security: Security) -> list[str]:
    password = security.admin_password
    return [
        "listener.security.protocol.map=BROKER:SASL_SSL,CONTROLLER:SASL_SSL",
        f"sasl.mechanism.inter.broker.protocol={MECHANISM}",
        f"listener.name.broker.sasl.enabled.mechanisms={MECHANISM}",
        f"listener.name.broker.{MECHANISM.lower()}.sasl.jaas.config="
        f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{ADMIN}" password="{password}";',
        "sasl.mechanism.controller.protocol=PLAIN",
        "listener.name.controller.sasl.enabled.mechanisms=PLAIN",
        "listener.name.controller.plain.sasl.jaas.config="
        f'org.apache.kafka.common.security.plain.PlainLoginModule required username="{ADMIN}" password="{password}" '
        f'user_{ADMIN}="{password}";',
        "ssl.keystore.type=PEM",
        f"ssl.keystore.location={security.tls.keystore}",
        "ssl.truststore.type=PEM",
        f"ssl.truststore.location={security.tls.ca}",
        "ssl.client.auth=none",
        "ssl.endpoint.identification.algorithm=https",
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        f"super.users=User:{ADMIN}",
        "allow.everyone.if.no.acl.found=false",
    ]


def admin_client_properties(security: Security) -> str:
    """A Java admin client's properties for the ``admin`` principal (used to apply ACLs)."""
    return "\n".join([
        "security.protocol=SASL_SSL",
        f"sasl.mechanism={MECHANISM}",
        f'sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required '
        f'username="{ADMIN}" password="{security.admin_password}";',
        "ssl.truststore.type=PEM",
        f"ssl.truststore.location={security.tls.ca}",
        "",
    ])
