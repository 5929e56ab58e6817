"""The real worker app, whose Kafka producer's sender task is ended from inside once ``<state_dir>/end-the-sender``
exists: a spent producer, the one fault the tests cannot cause from outside the process (an out-of-order
sequence needs a broker that lost the producer's state). ``python -m tests.integration.sender_ending_worker``."""

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
        sender_task(app.producer._producer).cancel()

    faust.Worker(app, loglevel=settings.log_level, quiet=True, redirect_stdouts=False).execute_from_commandline()


if __name__ == "__main__":
    main()
