"""``faust -A pipeline.agents worker`` loads ``app`` from here; the worker itself lives in ``pipeline.worker``."""

from __future__ import annotations

from typing import Any

import faust

from .settings import load_settings
from .worker.app import create_app

__all__ = ["create_app"]
_default_app: faust.App | None = None


def __getattr__(name: str) -> Any:
    """``pipeline.agents.app``, built on first use so that importing this module needs no broker."""
    global _default_app
    if name != "app":
        raise AttributeError(name)
    if _default_app is None:
        _default_app = create_app(load_settings())
    return _default_app
