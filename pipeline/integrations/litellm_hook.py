"""Sluice in a LiteLLM proxy: an admission verdict before each call, RequestEvents after it.

Name the instance in the proxy's config (docs/integrations.md)::

    litellm_settings:
      callbacks: pipeline.integrations.litellm_hook.sluice_admission

Settings come from the environment (``SLUICE_*``) like every Sluice process.
The hook answers from memory — the router library's ``Decider`` over the
signals it follows — and hands events to a buffered emitter, so the call
path never waits on Kafka. Kafka down: the signal book keeps its last
signals (fail-static), then the decider falls back to adaptive throttling
(fail-open); events are buffered, then dropped and counted. An error inside
Sluice is logged and counted and the call goes on: Sluice never fails a
user's call by accident, only by a verdict.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
import logging
import math
import time
from dataclasses import replace
from datetime import datetime
from typing import Any

from fastapi import HTTPException
from litellm.integrations.custom_logger import CustomLogger

from .. import metrics
from ..admission.keyring import keyring
from ..broker import bootstrap_servers
from ..load.config import PictureConfigs
from ..router import Defer, EventEmitter, Redirect, Reject, RouterClient
from ..settings import Settings, load_settings
from .litellm_calls import (STASH, CallInfo, call_info, completion_events, event, failure_event,
                            priority_ceiling, verdict_event)

log = logging.getLogger(__name__)
CALL_TYPES = {"completion", "acompletion", "text_completion", "atext_completion"}
RECONNECT_MAX_S = 30.0
MAX_SHED_TASKS = 100_000   # shed tasks remembered (about 200 bytes each), the oldest forgotten first
# and for this long at most: a retry of shed work comes within the longest retry-after plus a client's own
# back-off; a task id seen again hours later (a client that reuses ids) is new work, not a retry of shed work
SHED_MEMORY_S = 900.0


def _seconds(value: Any) -> float | None:
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


class SluiceAdmission(CustomLogger):
    def __init__(self, settings: Settings | None = None) -> None:
        super().__init__()
        self.settings = settings or load_settings()
        self.configs = PictureConfigs(self.settings)
        # (tenant, task id) of calls this hook shed lately, oldest first: their next attempts are retries of
        # shed work (``after_shed``), judged by the admit fraction and not spent from the retry budget
        self._shed: OrderedDict[tuple[str, str], float] = OrderedDict()   # → when it was shed (monotonic)
        self.clock = time.monotonic
        bootstrap = bootstrap_servers(self.settings)
        self.router = RouterClient(self.settings, bootstrap, keyring(self.settings))
        self.emitter = EventEmitter(self.settings, bootstrap)
        self._connecting: list[asyncio.Task] = []

    # -- Kafka, in the background -------------------------------------------------------------------

    def _connect(self) -> None:
        """Start following signals and publishing events, once, on the proxy's event loop."""
        if not self._connecting:
            loop = asyncio.get_running_loop()
            self._connecting = [loop.create_task(self._keep_trying(start))
                                for start in (self.router.start, self.emitter.start)]

    async def _keep_trying(self, start: Any) -> None:
        stop = self.router.stop if start == self.router.start else self.emitter.stop
        delay = 1.0
        while True:
            try:
                await start()
                return
            except Exception as exc:  # Kafka down or refusing: decide from memory, buffer events, retry
                log.warning("sluice: %s failed (%s); retrying in %.0f s", start.__qualname__, exc, delay)
                try:
                    await stop()   # what the failed start opened: a retry must not leak a client
                except Exception:
                    pass
                await asyncio.sleep(delay)
                delay = min(RECONNECT_MAX_S, delay * 2)

    async def close(self, drain_timeout_s: float = 10.0) -> None:
        """Stop following signals and deliver the buffered events (up to ``drain_timeout_s``), for a process
        that embeds the hook and shuts down on purpose (the LiteLLM proxy has no shutdown call for callbacks)."""
        from ..topic_reader import cancel

        for task in self._connecting:
            await cancel(task)
        self._connecting = []   # a call after this connects again
        await self.router.stop()
        await self.emitter.stop(drain_timeout_s)

    @staticmethod
    def _serves(model_group: str) -> bool:
        """Whether the proxy has a model group of that name (a pool named by metadata may have none)."""
        try:
            from litellm.proxy.proxy_server import llm_router

            return llm_router is not None and model_group in set(llm_router.get_model_names())
        except Exception:
            return False

    @staticmethod
    async def _key_may_call(key: Any, model_group: str) -> bool:
        """Whether LiteLLM's own model checks let this key, and its team, call ``model_group``. The proxy checked
        the group the caller asked for before this hook; a move to a sibling group must pass the same checks, or
        a caller could reach a group its key may not call. Anything these checks cannot settle (another LiteLLM
        release, a key object without the fields) is a no: the move does not happen and the shedding stands."""
        try:
            from litellm.proxy._types import LiteLLM_TeamTable
            from litellm.proxy.auth.auth_checks import can_key_call_model, can_team_access_model
            from litellm.proxy.proxy_server import llm_model_list, llm_router

            await can_key_call_model(model=model_group, llm_model_list=llm_model_list, valid_token=key,
                                     llm_router=llm_router)
            if key.team_id is not None:
                team = LiteLLM_TeamTable(team_id=key.team_id, models=list(key.team_models or []))
                await can_team_access_model(model=model_group, team_object=team, llm_router=llm_router,
                                            team_model_aliases=key.team_model_aliases)
            return True
        except Exception:
            return False

    def _slo(self, pool: str) -> tuple[float, float]:
        """The pool's (TTFT, TPOT) objectives, from its profile. Not through ``PictureConfigs.for_pool``,
        which keeps one config per pool named: the pool is the model a caller asks for, checked by the proxy
        only after this hook, so invented names grew the proxy's memory by about 290 bytes a call."""
        s = self.settings
        profile = self.configs.profiles[s.pool_profiles.get(pool, s.default_profile)]
        return profile.slo_ttft_s, profile.slo_tpot_s

    def _after_shed(self, call: CallInfo) -> CallInfo:
        """A later attempt of a task this hook shed: the retry of shed work. Without it, work shed in an
        overload came back counted against the retry budget, and a recovered pool refused most of it."""
        self._forget_old_sheds()
        if call.attempt > 1 and (call.tenant, call.task_id) in self._shed:
            return replace(call, after_shed=True)
        return call

    def _forget_old_sheds(self) -> None:
        """Drop what was shed more than ``SHED_MEMORY_S`` ago (the oldest first: the dict is kept in shed order)."""
        horizon = self.clock() - SHED_MEMORY_S
        while self._shed and next(iter(self._shed.values())) < horizon:
            self._shed.popitem(last=False)

    def _remember(self, call: CallInfo, verdict: Any) -> None:
        """Only tasks the caller named (a call's own id never comes back, and would push the others out); a
        task is forgotten when its retry of shed work goes through, not when a parallel call of it does."""
        if not call.task_named:
            return
        key = (call.tenant, call.task_id)
        if isinstance(verdict, (Reject, Defer)):
            self._shed[key] = self.clock()
            self._shed.move_to_end(key)
            if len(self._shed) > MAX_SHED_TASKS:
                self._shed.popitem(last=False)
        elif call.after_shed:
            self._shed.pop(key, None)

    # -- the call path ------------------------------------------------------------------------------

    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict, call_type: str) -> dict:
        for key in ("metadata", "litellm_metadata"):  # only this hook writes the stash: a caller's is dropped
            if isinstance(data.get(key), dict):
                data[key].pop(STASH, None)
        if call_type not in CALL_TYPES:
            return data
        started = time.perf_counter()
        refusal = None
        try:
            self._connect()
            call = call_info(data, getattr(user_api_key_dict, "team_id", None),
                             getattr(user_api_key_dict, "user_id", None), data.get("litellm_call_id"), self._slo,
                             priority_ceiling(user_api_key_dict, self.settings.litellm_max_priority))
            call = self._after_shed(call)
            verdict = self.router.decide(call.request())
            if isinstance(verdict, Redirect) and not (self._serves(verdict.pool)
                                                      and await self._key_may_call(user_api_key_dict, verdict.pool)):
                # a pool this proxy has no model group for, or one the caller's key may not call: the move
                # cannot happen, the shedding stands (and the events say so)
                verdict = self.router.decider.reject(call.pool, verdict.reason)
            self._remember(call, verdict)
            now_ms = int(time.time() * 1000)
            self.emitter.emit(event(call, "received", now_ms))
            self.emitter.emit(verdict_event(call, verdict, now_ms))
            if isinstance(verdict, (Reject, Defer)):
                refusal = verdict
            else:
                if isinstance(verdict, Redirect):  # move: the sibling pool's model group serves the call
                    data["model"] = verdict.pool
                    call = replace(call, pool=verdict.pool, model=verdict.pool)
                    self.emitter.emit(event(call, "received", now_ms))
                    self.emitter.emit(event(call, "admitted", now_ms))
                metadata = data.get("metadata")
                if not isinstance(metadata, dict):
                    metadata = data["metadata"] = {}
                metadata[STASH] = call.stash()
        except Exception:
            log.exception("sluice: admission hook failed; the call goes on")
            metrics.ROUTER_HOOK_ERRORS.inc()
        finally:
            metrics.ROUTER_HOOK_SECONDS.observe(time.perf_counter() - started)
        if refusal is not None:
            reason = "deferred" if isinstance(refusal, Defer) else refusal.reason
            raise HTTPException(status_code=429, headers={"Retry-After": str(max(1, math.ceil(refusal.retry_after_s)))},
                                detail={"error": f"shed by Sluice admission control ({reason})",
                                        "retry_after_s": refusal.retry_after_s})
        return data

    # -- after the call (LiteLLM's logging hooks, off the response path) ----------------------------

    @staticmethod
    def _stashed(kwargs: dict) -> CallInfo | None:
        for metadata in ((kwargs.get("litellm_params") or {}).get("metadata"), kwargs.get("metadata")):
            if isinstance(metadata, dict) and STASH in metadata:
                return CallInfo.unstash(metadata[STASH])
        return None

    async def async_log_success_event(self, kwargs: dict, response_obj: Any, start_time: Any, end_time: Any) -> None:
        try:
            call = self._stashed(kwargs)
            if call is None:
                return
            self.router.record(True)
            start, end = _seconds(start_time), _seconds(end_time) or time.time()
            first = _seconds(kwargs.get("completion_start_time"))
            for doc in completion_events(call, response_obj, start if start is not None else end, first, end):
                self.emitter.emit(doc)
        except Exception:
            log.exception("sluice: success hook failed")
            metrics.ROUTER_HOOK_ERRORS.inc()

    async def async_log_failure_event(self, kwargs: dict, response_obj: Any, start_time: Any, end_time: Any) -> None:
        try:
            call = self._stashed(kwargs)
            if call is None:
                return
            exception = kwargs.get("exception")
            status = getattr(exception, "status_code", None)
            if not (isinstance(status, int) and 400 <= status < 500):  # a caller's own error is not the backend's
                self.router.record(False)
            end = _seconds(end_time) or time.time()
            start = _seconds(start_time)
            self.emitter.emit(failure_event(call, exception, start if start is not None else end, end,
                                            _seconds(kwargs.get("completion_start_time"))))
        except Exception:
            log.exception("sluice: failure hook failed")
            metrics.ROUTER_HOOK_ERRORS.inc()


_instance: SluiceAdmission | None = None


def __getattr__(name: str) -> Any:
    """``sluice_admission``, the instance a proxy config names, built on first access (from the
    environment's settings), so importing this module costs no settings or Kafka client."""
    global _instance
    if name == "sluice_admission":
        if _instance is None:
            _instance = SluiceAdmission()
        return _instance
    raise AttributeError(name)
