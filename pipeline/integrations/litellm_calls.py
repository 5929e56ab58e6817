"""What the LiteLLM hook needs to know about a proxy call, and the RequestEvents it publishes. Pure.

No LiteLLM import and no clock reads (times are passed in), so the mapping
is unit-tested without a proxy. Where each field comes from (docs/integrations.md):

- **pool**: the model group the call goes to (``data["model"]``), never a
  name the caller gives: a caller could name a pool with no signal, or a quiet
  one, and pass the shedding of its own, and switching its call to the pool it
  names would pass the proxy's check of which models its key may call;
- **priority, task id, attempt, step**: ``x-sluice-priority``,
  ``x-sluice-task-id``, ``x-sluice-attempt``, ``x-sluice-step`` request headers,
  or ``sluice_priority`` / ``sluice_task_id`` / ``sluice_attempt`` /
  ``sluice_step`` in the request's ``metadata``; defaults: ``standard``, the
  call id (a one-step task), 1, 0. ``x-sluice-final`` / ``sluice_final``
  (true/false) says whether this is the task's last step and try; default:
  true for a one-step task, unknown otherwise. Values out of range fall back
  to the defaults: a caller's typo never fails its call;
- **tenant**: the API key's team, else its user, else ``default`` — from the
  proxy's key, never from the request, so a caller cannot borrow a tenant.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

from ..events import PRIORITIES
from ..router import Defer, Redirect, Reject, Request, Verdict

MAX_ID = 128          # characters kept of a caller-supplied id (the contract's bound)
MAX_ATTEMPT = 100
NAME = re.compile(r"[^A-Za-z0-9._:/@+-]")  # what a tenant, pool or model name may hold (the contract)
STASH = "sluice_call"  # the metadata key the hook keeps a call's CallInfo under, for the logging hooks


@dataclass(frozen=True)
class CallInfo:
    task_id: str
    request_id: str
    attempt: int
    step: int
    tenant: str
    priority: str
    pool: str
    model: str
    slo_ttft_s: float
    slo_tpot_s: float
    final: bool = False   # the task's last step and try, as far as the caller said
    after_shed: bool = False   # a later attempt of a task admission shed (the hook remembers which)
    task_named: bool = False   # the caller named the task (else its id is the call's own, never seen again)

    def request(self) -> Request:
        return Request(self.pool, self.priority, continuing=self.step > 0, retry=self.attempt > 1,
                       slo_ttft_s=self.slo_ttft_s, tenant=self.tenant, after_shed=self.after_shed)

    def stash(self) -> dict:
        return asdict(self)

    @classmethod
    def unstash(cls, value: Any) -> "CallInfo | None":
        try:
            return cls(**value)
        except TypeError:
            return None


def _lookup(data: Mapping[str, Any], name: str) -> Any:
    """``x-sluice-<name>`` header, else ``sluice_<name>`` in the request metadata."""
    headers = ((data.get("proxy_server_request") or {}).get("headers") or {})
    for key, value in headers.items() if isinstance(headers, Mapping) else ():
        if isinstance(key, str) and key.lower() == f"x-sluice-{name.replace('_', '-')}":
            return value
    for meta_key in ("metadata", "litellm_metadata"):
        meta = data.get(meta_key)
        if isinstance(meta, Mapping) and f"sluice_{name}" in meta:
            return meta[f"sluice_{name}"]
    return None


def _text(value: Any) -> str | None:
    """A caller-supplied id as the contract takes it (printable ASCII, no spaces), or None."""
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        text = "".join(ch for ch in str(value) if "!" <= ch <= "~")[:MAX_ID]
        return text or None
    return None


def _name(value: Any, limit: int) -> str | None:
    """A tenant, pool or model name as the contract takes it: disallowed characters become ``-``."""
    text = _text(value)
    if text is None:
        return None
    text = NAME.sub("-", text)[:limit]
    return text if text[0].isalnum() else None


def _count(value: Any, low: int, default: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return default
    return number if low <= number <= MAX_ATTEMPT else default


def _flag(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    return None


def priority_ceiling(key: Any, default: str) -> str:
    """The highest class this caller may claim. ``sluice_max_priority`` in its team's metadata sets it (teams
    are an admin's), else ``default`` (the ``litellm_max_priority`` setting); the key's own metadata can only
    lower it, since LiteLLM lets internal users mint keys with any metadata. The caller's request metadata is
    not consulted; a value that names no class is ignored."""
    def named(metadata: Any) -> str | None:
        value = metadata.get("sluice_max_priority") if isinstance(metadata, Mapping) else None
        return value.lower() if isinstance(value, str) and value.lower() in PRIORITIES else None

    ceiling = named(getattr(key, "team_metadata", None)) or default
    own = named(getattr(key, "metadata", None))
    return own if own is not None and PRIORITIES.index(own) > PRIORITIES.index(ceiling) else ceiling


def call_info(data: Mapping[str, Any], team_id: Any, user_id: Any, call_id: str,
              slo: Callable[[str], tuple[float, float]], max_priority: str = "critical") -> CallInfo:
    """The call as Sluice sees it, from the proxy's request ``data`` and the caller's key; ``slo(pool)``
    gives the pool's (TTFT, TPOT) objectives; a class claimed above ``max_priority`` is lowered to it."""
    model = _name(data.get("model"), 128) or "unknown"
    priority = _lookup(data, "priority")
    priority = priority.lower() if isinstance(priority, str) and priority.lower() in PRIORITIES else "standard"
    priority = PRIORITIES[max(PRIORITIES.index(priority), PRIORITIES.index(max_priority))]
    request_id = _text(call_id) or str(uuid.uuid4())
    task_id = _text(_lookup(data, "task_id"))
    final = _flag(_lookup(data, "final"))
    pool = _name(model, 64) or "unknown"
    slo_ttft_s, slo_tpot_s = slo(pool)
    return CallInfo(task_id=task_id or request_id, request_id=request_id,
                    attempt=_count(_lookup(data, "attempt"), 1, 1), step=_count(_lookup(data, "step"), 0, 0),
                    tenant=_name(team_id, 64) or _name(user_id, 64) or "default", priority=priority, pool=pool,
                    model=model, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
                    final=final if final is not None else task_id is None, task_named=task_id is not None)


def event(call: CallInfo, phase: str, now_ms: int, **fields: Any) -> dict:
    """One RequestEvent of ``call`` (contract v1); ``fields`` are the phase's measurements."""
    doc = {"schema_version": 1, "event_id": str(uuid.uuid4()), "event_time": now_ms, "task_id": call.task_id,
           "request_id": call.request_id, "attempt": call.attempt, "tenant": call.tenant,
           "priority": call.priority, "pool": call.pool, "model": call.model, "phase": phase}
    doc.update({k: v for k, v in fields.items() if v is not None})
    return doc


def verdict_event(call: CallInfo, verdict: Verdict, now_ms: int) -> dict:
    """The event that records a verdict: admitted, rejected (final: the caller decides to retry), deferred
    or redirected."""
    if isinstance(verdict, Reject):
        return event(call, "rejected", now_ms, **_terminal(call, 0.0), error_type=f"sluice_{verdict.reason}")
    if isinstance(verdict, Defer):
        return event(call, "deferred", now_ms)
    if isinstance(verdict, Redirect):
        return event(call, "redirected", now_ms)
    return event(call, "admitted", now_ms)


def _terminal(call: CallInfo, duration_s: float, input_tokens: int | None = 0, output_tokens: int | None = 0) -> dict:
    """What the contract requires of every terminal event."""
    return {"task_final": call.final, "input_tokens": input_tokens or 0, "output_tokens": output_tokens or 0,
            "duration_s": round(min(max(duration_s, 0.0), 86400.0), 6), "slo_ttft_s": call.slo_ttft_s,
            "slo_tpot_s": call.slo_tpot_s}


def _usage(response: Any) -> tuple[int | None, int | None, int | None]:
    usage = getattr(response, "usage", None)
    if usage is None and isinstance(response, Mapping):
        usage = response.get("usage")
    if usage is None:
        return None, None, None

    def get(obj: Any, name: str) -> Any:
        return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)

    details = get(usage, "prompt_tokens_details")
    cached = get(details, "cached_tokens") if details is not None else None
    return tuple(v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
                 for v in (get(usage, "prompt_tokens"), cached, get(usage, "completion_tokens")))


def completion_events(call: CallInfo, response: Any, start_s: float, first_token_s: float | None,
                      end_s: float) -> list[dict]:
    """first_token and completed for a successful call (times in epoch seconds)."""
    input_tokens, cached, output = _usage(response)
    first = first_token_s if first_token_s is not None and start_s <= first_token_s <= end_s else end_s
    ttft = round(first - start_s, 6)
    tpot = round((end_s - first) / (output - 1), 6) if output and output > 1 else None
    return [event(call, "first_token", int(first * 1000), ttft_s=ttft),
            event(call, "completed", int(end_s * 1000), **_terminal(call, end_s - start_s, input_tokens, output),
                  cached_input_tokens=cached, ttft_s=ttft, tpot_s=tpot)]


def failure_event(call: CallInfo, exception: Any, start_s: float, end_s: float,
                  first_token_s: float | None = None) -> dict:
    """failed (or cancelled, for a timeout) for a call that raised; with its TTFT when a first token came,
    so a stream cut later is not read as a first token that never arrived."""
    name = type(exception).__name__ if exception is not None else "unknown"
    timeout = "timeout" in name.lower()
    ttft = round(first_token_s - start_s, 6) if first_token_s is not None and start_s <= first_token_s <= end_s else None
    return event(call, "cancelled" if timeout else "failed", int(end_s * 1000), **_terminal(call, end_s - start_s),
                 error_type=_text("timeout" if timeout else name) or "unknown", ttft_s=ttft)
