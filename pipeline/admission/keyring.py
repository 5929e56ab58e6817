"""Signing keys from settings: the controller's active key and the ids routers accept."""

from __future__ import annotations

import logging

from ..contract import Invalid, compile_schema, load_schema
from ..settings import Settings, SettingsError

log = logging.getLogger(__name__)
DEV_KEYS = {"dev": "sluice-development-key-do-not-use-in-production"}
# a key id the signal schema refuses makes routers refuse every signal signed with it: fail at start-up instead
KEY_ID = compile_schema(load_schema("admission_signal")["properties"]["key_id"], "key_id")


def keyring(settings: Settings) -> dict[str, bytes]:
    """Key id → secret; without configured keys, the development key only where explicitly allowed."""
    if not settings.signing_keys and not settings.dev_signing_key:
        raise SettingsError("no signing keys: set SLUICE_SIGNING_KEYS (key id → secret of 16+ characters), or "
                            "SLUICE_DEV_SIGNING_KEY=true on a development machine")
    keys = settings.signing_keys or DEV_KEYS
    if not settings.signing_keys:
        log.warning("admission signals are signed with the development key (dev_signing_key): "
                    "anyone can forge them; set SLUICE_SIGNING_KEYS")
    ring = {}
    for key_id, secret in keys.items():
        try:
            KEY_ID(key_id, "key_id")
        except Invalid as exc:
            raise SettingsError(f"signing key id {key_id!r} does not fit admission_signal.v1 ({exc})") from None
        if not isinstance(secret, str) or len(secret) < 16:
            raise SettingsError(f"signing key {key_id!r} must be a string of at least 16 characters")
        ring[key_id] = secret.encode()
    return ring


def active_key(settings: Settings) -> tuple[str, bytes]:
    ring = keyring(settings)
    if settings.signing_key_id not in ring:
        raise SettingsError(f"signing_key_id {settings.signing_key_id!r} is not in signing_keys")
    return settings.signing_key_id, ring[settings.signing_key_id]
