"""Seeing the load picture: ``sluice pools`` (one look) and ``sluice top`` (live).

Both read the compacted ``sluice.load.v1`` topic, which holds the newest
picture of every pool whichever worker computes it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any


from . import topics
from .kafka_clients import client_options
from .load.picture import AXES, read_picture
from .settings import Settings
from .topic_reader import open_from_beginning, read_to_end

log = logging.getLogger(__name__)

SHORT = {"demand": "demand", "queue": "queue", "kv_cache": "kv", "compute": "compute", "latency": "latency",
         "errors": "errors", "cost": "cost"}
GREEN, YELLOW, RED, BOLD, RESET = "\033[32m", "\033[33m", "\033[31m", "\033[1m", "\033[0m"


def colour(pressure: float) -> str:
    return GREEN if pressure < 0.7 else YELLOW if pressure < 1.0 else RED


def format_table(pictures: dict[str, dict[str, Any]], use_colour: bool) -> str:
    head = f"{'pool':<24}{'state':>8}{'rps':>8}" + "".join(f"{SHORT[a]:>9}" for a in AXES) + f"{'replicas':>10}"
    lines = [head, "-" * len(head)]
    for pool in sorted(pictures):
        p = pictures[pool]
        cells = ""
        for axis in AXES:
            value = p["axes"][axis]["pressure"]
            text = f"{value:9.2f}"
            cells += f"{colour(value)}{text}{RESET}" if use_colour else text
        pressure = p["pressure"]
        overall = f"{pressure:8.2f}"
        if use_colour:
            overall = f"{BOLD}{colour(pressure)}{overall}{RESET}"
        replicas = f"{p['replicas']['fresh']}/{p['replicas']['total']}"
        lines.append(f"{pool[:23]:<24}{overall}{p['rates']['arrival_rps']:8.1f}{cells}{replicas:>10}")
    if not pictures:
        lines.append("(no pictures yet: is a worker running and are events flowing?)")
    lines.append("pressure = value ÷ limit per axis (1.00 = at the limit); state = the largest; replicas fresh/total")
    return "\n".join(lines)


def absorb(pictures: dict, batch: dict) -> set[str]:
    """Newest picture per pool from a fetched batch of sluice.load.v1; a record that is not a picture is skipped.
    Returns the pools whose picture the batch replaced."""
    replaced: set[str] = set()
    for messages in batch.values():
        for message in messages:
            if message.value is None:
                if message.key is not None:
                    pictures.pop(message.key.decode("utf-8", "replace"), None)
                continue
            try:
                picture = read_picture(message.value)
            except ValueError as exc:
                log.warning("skipped a record of %s at offset %d: %s", message.topic, message.offset, exc)
                continue
            pictures[picture["pool"]] = picture
            replaced.add(picture["pool"])
    return replaced


class PicturesCutShort(TimeoutError):
    """The load topic was not read to its end in time, so a pool's newest picture may be missing: an older
    one would pass for it, silently."""


async def latest_pictures(settings: Settings, bootstrap: str, timeout_s: float = 10.0) -> dict[str, dict]:
    """The newest picture of every pool, read from the compacted topic up to its end at call time;
    ``PicturesCutShort`` if ``timeout_s`` ran out first."""
    topic = topics.LOAD.name(settings)
    consumer, ends = await open_from_beginning(bootstrap, topic, **client_options(settings))
    pictures: dict[str, dict] = {}
    try:
        complete = await read_to_end(consumer, ends, lambda batch: absorb(pictures, batch), timeout_s)
    finally:
        await consumer.stop()
    if not complete:
        raise PicturesCutShort(f"{topic} was not read to its end within {timeout_s:g} s")
    return pictures


async def top(settings: Settings, bootstrap: str, refresh_s: float = 1.0, iterations: int | None = None) -> None:
    """Redraw the pools table every ``refresh_s`` until interrupted (or ``iterations`` redraws)."""
    consumer, _ = await open_from_beginning(bootstrap, topics.LOAD.name(settings), **client_options(settings))
    pictures: dict[str, dict] = {}
    use_colour = sys.stdout.isatty()
    drawn = 0
    try:
        while iterations is None or drawn < iterations:
            deadline = time.monotonic() + refresh_s
            while time.monotonic() < deadline:
                absorb(pictures, await consumer.getmany(timeout_ms=100))
            stamp = time.strftime("%H:%M:%S")
            sys.stdout.write(("\033[H\033[2J" if use_colour else "") + f"sluice top — {stamp}\n\n"
                             + format_table(pictures, use_colour) + "\n")
            sys.stdout.flush()
            drawn += 1
    finally:
        await consumer.stop()


def run_top(settings: Settings, bootstrap: str, refresh_s: float, iterations: int | None) -> None:
    try:
        asyncio.run(top(settings, bootstrap, refresh_s, iterations))
    except KeyboardInterrupt:
        pass
