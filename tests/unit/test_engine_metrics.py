"""Engine exposition → sample fields: what one odd scrape can do to a replica's sample."""

import pytest

from pipeline.collectors.engine_metrics import ScrapeError, parse_engine
from pipeline.collectors.vllm import Collector, Target


def exposition(kv=("0.5", "0.55"), running="3", prompt="1000"):
    lines = ["# TYPE vllm:num_requests_running gauge", "# TYPE vllm:num_requests_waiting gauge",
             "# TYPE vllm:kv_cache_usage_perc gauge", "# TYPE vllm:prompt_tokens counter"]
    for engine, usage in enumerate(kv):
        lines += [f'vllm:num_requests_running{{engine="{engine}"}} {running}',
                  f'vllm:num_requests_waiting{{engine="{engine}"}} 1',
                  f'vllm:kv_cache_usage_perc{{engine="{engine}"}} {usage}',
                  f'vllm:prompt_tokens_total{{engine="{engine}"}} {prompt}']
    return "\n".join(lines) + "\n"


def test_kv_usage_is_averaged_over_data_parallel_engines_and_counts_are_summed():
    """Summed, two engines about half full read 1.0: a pool at its KV limit with half its cache free."""
    fields = parse_engine(exposition(), "vllm")
    assert fields["kv_cache_usage"] == pytest.approx(0.525)
    assert fields["requests_running"] == 6 and fields["prompt_tokens_total"] == 2000


@pytest.mark.parametrize("text", [exposition(running="+Inf"), exposition(prompt="NaN"), exposition(kv=("NaN",)),
                                  exposition(running="-3")])
def test_a_value_that_is_not_a_finite_non_negative_number_fails_the_scrape(text):
    with pytest.raises(ScrapeError):
        parse_engine(text, "vllm")


@pytest.mark.parametrize("text", [exposition(running="+Inf"), exposition(prompt="NaN"), exposition(running="1e12")])
def test_the_collector_counts_such_a_scrape_as_failed_and_goes_on(monkeypatch, text):
    """``int(+Inf)`` raised OverflowError out of ``collect`` (the collector exited), and a value the sample's
    schema refuses reset the failure count while the sample built with it was dropped at publishing: the
    replica went silent and never read unhealthy."""
    collector = Collector(Target(url="http://127.0.0.1:1/metrics", replica="r1", pool="p", hardware="H100-80GB"))
    monkeypatch.setattr(collector, "_fetch", lambda url: text)
    samples = [collector.collect(1_700_000_000_000 + i) for i in range(3)]
    assert collector.failures_in_a_row == 3 and [s["healthy"] for s in samples] == [True, True, False]
    monkeypatch.setattr(collector, "_fetch", lambda url: exposition())
    assert collector.collect(1_700_000_001_000)["healthy"] and collector.failures_in_a_row == 0


@pytest.mark.parametrize("value", ["NaN", "+Inf"])
def test_non_finite_gpu_utilisation_fails_the_dcgm_scrape_before_the_clamp(value):
    from pipeline.collectors.engine_metrics import parse_dcgm

    with pytest.raises(ScrapeError):
        parse_dcgm(f'# TYPE DCGM_FI_DEV_GPU_UTIL gauge\nDCGM_FI_DEV_GPU_UTIL{{gpu="0"}} {value}\n')
    assert parse_dcgm('# TYPE DCGM_FI_DEV_GPU_UTIL gauge\nDCGM_FI_DEV_GPU_UTIL{gpu="0"} 150\n') == {"gpu_util": 1.0}


def test_a_producer_that_stops_delivering_costs_one_sample_and_is_replaced(monkeypatch):
    """An idempotent producer never gives up on a record: the collector waited on it for as long as the broker
    was away, or for ever once its sender had died, and its replica went stale with nothing said. A sample not
    acknowledged in time is skipped and counted; the producer is replaced (a dead sender before sending)."""
    import asyncio

    from pipeline.collectors import vllm
    from tests.unit.fake_producers import DeliveringProducer, StalledProducer

    async def scenario():
        made = [DeliveringProducer(), DeliveringProducer()]

        async def start_producer(bootstrap, **options):
            return made.pop(0)

        async def stop_producer(producer, timeout_s=0.1):
            producer.stopped = True

        monkeypatch.setattr(vllm, "start_producer", start_producer)
        monkeypatch.setattr(vllm, "stop_producer", stop_producer)
        lost = vllm.COLLECTOR_SAMPLES_LOST._value.get()
        stalled = StalledProducer(sender_done=False)
        outcomes = []
        producer = stalled
        for value in (b"s0", b"s1"):
            producer, delivered = await vllm._publish(producer, "unused", {}, "topic", value, b"r", 0.2)
            outcomes.append(delivered)
        dead = StalledProducer(sender_done=True)
        producer, delivered = await vllm._publish(dead, "unused", {}, "topic", b"s2", b"r", 0.2)
        outcomes.append(delivered)
        return outcomes, stalled, dead, made, vllm.COLLECTOR_SAMPLES_LOST._value.get() - lost

    outcomes, stalled, dead, left, lost = asyncio.run(scenario())
    assert outcomes == [False, True, True] and lost == 1
    assert stalled.queued == [b"r"] and stalled.stopped
    assert dead.queued == [] and dead.stopped and left == [], "the dead one is replaced before it is sent to"


def test_a_spoiled_producer_is_replaced_but_a_refusal_ends_the_collector(monkeypatch):
    """An out-of-order sequence refuses every later sample of that producer: replaced. Any other refusal (the
    collector's principal may not write the topic) is configuration: it ends the collector, loudly."""
    import asyncio

    from aiokafka.errors import OutOfOrderSequenceNumber, TopicAuthorizationFailedError

    from pipeline.collectors import vllm
    from tests.unit.fake_producers import RefusingProducer

    async def stop_producer(producer, timeout_s=0.1):
        producer.stopped = True

    monkeypatch.setattr(vllm, "stop_producer", stop_producer)

    async def scenario():
        spoiled = RefusingProducer(OutOfOrderSequenceNumber())
        producer, delivered = await vllm._publish(spoiled, "unused", {}, "topic", b"s0", b"r", 0.2)
        assert (producer, delivered) == (None, False) and spoiled.stopped
        with pytest.raises(TopicAuthorizationFailedError):
            await vllm._publish(RefusingProducer(TopicAuthorizationFailedError()), "unused", {}, "topic", b"s1",
                                b"r", 0.2)

    asyncio.run(scenario())
