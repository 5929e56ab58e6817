"""Is every partition fully replicated? Read from the cluster's metadata (aiokafka admin)."""

from __future__ import annotations

from typing import Any


async def lagging_partitions(bootstrap: str, client_options: dict[str, Any]) -> list[str]:
    """Partitions without a leader or whose in-sync set is smaller than their replica set,
    as ``topic/partition leader=L replicas=[...] isr=[...]``; empty when everything is in sync."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000, **client_options)
    await admin.start()
    try:
        lagging = []
        for topic in await admin.describe_topics():
            if topic["error_code"]:
                lagging.append(f"{topic['topic']}: error {topic['error_code']}")
                continue
            for part in topic["partitions"]:
                replicas, isr = sorted(part["replicas"]), sorted(part["isr"])
                if part["leader"] < 0 or isr != replicas:
                    lagging.append(f"{topic['topic']}/{part['partition']} leader={part['leader']} "
                                   f"replicas={replicas} isr={isr}")
        return lagging
    finally:
        await admin.close()


async def leaders(bootstrap: str, client_options: dict[str, Any]) -> dict[int, int]:
    """node id → how many partitions it leads."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000, **client_options)
    await admin.start()
    try:
        counts: dict[int, int] = {}
        for topic in await admin.describe_topics():
            for part in topic["partitions"]:
                counts[part["leader"]] = counts.get(part["leader"], 0) + 1
        return counts
    finally:
        await admin.close()
