"""The real worker app with a fault injected from inside, on a trigger file in its state directory: the
faults the tests cannot cause from outside the process.

``<state_dir>/end-the-sender`` ends the Kafka producer's sender (an out-of-order sequence needs a broker that
lost the producer's state). The file says how:

- ``error``: the sender's next round fails as aiokafka's own unexpected errors do ("Unexpected error in
  sender routine"): every pending and later send fails with a ``KafkaError``;
- ``quietly``: the sender task is cancelled, as ``producer.stop()`` does: it ends without an error, and every
  pending and later send waits for ever.

``<state_dir>/wedge-the-control-path`` takes the control path's lock and never lets go, as a holder stuck
on something no watch times would: every cut queues behind it.

``python -m tests.integration.faulty_worker``."""

from __future__ import annotations

import asyncio

import faust

from pipeline.bounded_producer import sender_task
from pipeline.settings import load_settings
from pipeline.worker.app import create_app


def main() -> None:
    settings = load_settings()
    app = create_app(settings)
    trigger = settings.state_dir / "end-the-sender"

    @app.task
    async def end_the_sender() -> None:
        while not trigger.exists():
            await asyncio.sleep(0.1)
        producer = app.producer._producer
        if trigger.read_text().strip() == "quietly":
            sender_task(producer).cancel()
            return

        def broken(*args, **kwargs):
            raise RuntimeError("injected: the sender's round failed")

        producer._sender._message_accumulator.drain_by_nodes = broken

    @app.task
    async def wedge_the_control_path() -> None:
        while not (settings.state_dir / "wedge-the-control-path").exists():
            await asyncio.sleep(0.1)
        await app.control._lock.acquire()

    faust.Worker(app, loglevel=settings.log_level, quiet=True, redirect_stdouts=False).execute_from_commandline()


if __name__ == "__main__":
    main()
