"""Compacted topics through the real broker: a reader from the start (a router starting, ``sluice pools``,
stage 2's rebuild) reads what is current, not every record written since the open segment was created."""

from __future__ import annotations

import logging
from dataclasses import replace

from aiokafka import AIOKafkaProducer

from pipeline import topics
from tests.conftest import run, wait_for
from tests.integration.kafka_helpers import read_all

POOLS = [f"pool-{i}".encode() for i in range(3)]


async def publish(bootstrap: str, topic: str, rounds: int) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    await producer.start()
    try:
        for n in range(rounds):
            for pool in POOLS:
                await producer.send(topic, b'{"picture": %d}' % n, key=pool, partition=0)   # queued, batched
        await producer.flush()
    finally:
        await producer.stop()


def test_a_reader_from_the_start_reads_what_is_current_within_the_compaction_lag(settings, caplog):
    s = replace(settings, topic_compaction_lag_s=1.0, admission_compaction_lag_s=1.0)
    bootstrap = s.kafka_bootstrap_servers
    run(topics.ensure_topics(s, bootstrap))
    load = topics.LOAD.name(s)
    run(publish(bootstrap, load, 400))
    written = len(run(read_all(bootstrap, load)))
    assert written == 400 * len(POOLS), "every picture is read back before any compaction"

    # The open segment rolls on the first append past the lag; the log cleaner then compacts it (it looks
    # for work every 15 s by default). A picture a second keeps appending, as a worker's tick does.
    reads = []

    def compacted() -> bool:
        run(publish(bootstrap, load, 1))
        reads.append(len(run(read_all(bootstrap, load))))
        return reads[-1] <= 4 * len(POOLS)

    try:
        wait_for(compacted, 90, 1.0, "the load topic's compaction")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; records read from the start, a second apart: {reads}") from None
    newest = {}
    for record in run(read_all(bootstrap, load)):
        newest[record.key] = record.value
    assert set(newest) == set(POOLS), "compaction keeps every pool's newest picture"
    print(f"\n{written} pictures written; after {len(reads)} s a reader from the start reads {reads[-1]}")

    with caplog.at_level(logging.WARNING, logger="pipeline.topics"):
        run(topics.ensure_topics(settings, bootstrap))   # a release that declares the default lag
    drift = [r.getMessage() for r in caplog.records if "has another config" in r.getMessage()]
    assert {m.split()[1] for m in drift} == {load, topics.ADMISSION.name(s)}, drift
    assert "max.compaction.lag.ms=1000 (declared 600000)" in next(m for m in drift if load in m), drift
    assert "max.compaction.lag.ms=1000 (declared 3600000)" in next(m for m in drift if load not in m), drift
