"""The real worker app, whose Kafka producer's sender is ended from inside once ``<state_dir>/end-the-sender``
exists: the one fault the tests cannot cause from outside the process (an out-of-order sequence needs a broker
that lost the producer's state). The file says how:

- ``error``: the sender's next round fails as aiokafka's own unexpected errors do ("Unexpected error in
  sender routine"): every pending and later send fails with a ``KafkaError``;
- ``quietly``: the sender task is cancelled, as ``producer.stop()`` does: it ends without an error, and every
  pending and later send waits for ever.

``python -m tests.integration.sender_ending_worker``."""

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

    faust.Worker(app, loglevel=settings.log_level, quiet=True, redirect_stdouts=False).execute_from_commandline()


if __name__ == "__main__":
    main()
