"""HMAC-SHA256 signatures over the exact bytes of an AdmissionSignal.

No JSON canonicalisation is needed, so any language can verify with byte
operations (docs/admission-signal.md):

- the controller serialises the signal with ``signature`` as the **last**
  field, set to 64 ``0`` characters; those bytes are the *signed bytes*;
- it computes ``hex(HMAC-SHA256(key, signed bytes))`` (64 lowercase hex
  digits) and writes them over the zeros;
- a router checks that the message ends with ``"signature":"<64 hex>"}``,
  puts the 64 zeros back, recomputes the HMAC with the key named by
  ``key_id`` and compares in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Mapping

import orjson

PLACEHOLDER = b"0" * 64
MAX_VALIDITY_S = 60.0   # the longest a signal may be valid for: routers refuse a longer one (SignalBook)
TAIL = re.compile(rb'"signature":"([0-9a-f]{64})"\}\Z')


class SignatureError(ValueError):
    """A signal that must not be trusted: unsigned, tampered, or signed with an unknown key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def sign(signal: Mapping, key_id: str, secret: bytes) -> bytes:
    """The signal's wire bytes, signed. ``signal`` must not contain ``signature``."""
    body = {k: v for k, v in signal.items() if k not in ("signature", "key_id")}
    body["key_id"] = key_id
    body["signature"] = PLACEHOLDER.decode()
    signed = orjson.dumps(body)
    digest = hmac.new(secret, signed, hashlib.sha256).hexdigest().encode()
    return signed[: -len(PLACEHOLDER) - 2] + digest + b'"}'


def signed_bytes(message: bytes) -> tuple[bytes, str]:
    """(the bytes the HMAC covers, the signature hex) of a received message."""
    match = TAIL.search(message)
    if match is None:
        raise SignatureError("unsigned", "message does not end with a 64-hex signature field")
    return message[: match.start(1)] + PLACEHOLDER + b'"}', match.group(1).decode()


def verify(message: bytes, keys: Mapping[str, bytes]) -> dict:
    """The decoded signal if its signature is valid under the key it names; raises SignatureError."""
    covered, signature = signed_bytes(message)
    try:
        document = orjson.loads(message)
    except orjson.JSONDecodeError as exc:
        raise SignatureError("malformed", str(exc)) from None
    key_id = document.get("key_id") if isinstance(document, dict) else None
    secret = keys.get(key_id) if isinstance(key_id, str) else None
    if secret is None:
        raise SignatureError("unknown_key", f"key_id {key_id!r} is not in this router's keyring")
    expected = hmac.new(secret, covered, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, signature):
        raise SignatureError("bad_signature", "HMAC does not match: tampered or wrongly keyed")
    return document
