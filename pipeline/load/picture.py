"""A pool's load picture: merged partials → the seven axes, each a raw value and a pressure.

Time is event time only. A pool's *watermark* is the newest event time
merged; windows are the whole seconds before the watermark's second
(``fast_window_s`` for demand, queue, kv, compute, latency and errors,
``cost_window_s`` for cost and goodput). When a partial arrives, a second
older than the watermark by more than ``allowed_lateness_s`` is closed: data
for it is counted as late and left out. Partials are deduplicated by id, so a redelivered one is not
counted twice.

Replicas are bounded per pool. One silent for ``stale_after_s`` is stale, for twice that gone (it
counts only in cost); a gone replica is dropped once its seconds leave the cost window, or sooner when
the pool already tracks ``max_replicas`` and a new replica needs the room. When every tracked replica
may still be serving, the new one is refused and counted (``replicas_refused``): churning or invented
replica ids cannot grow the state, and a live replica is never pushed out for them.

``PoolState.picture`` gives the typed ``LoadPicture``; ``PoolState.snapshot``
its wire form, published on sluice.load.v1 (schema ``schemas/load_picture.v1.json``)
and read back with ``read_picture``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import Any, Mapping

import orjson

from ..events import PRIORITIES
from .aggregates import IDENTIFIER, OTHER_TENANTS, REPLICA_SUMS, ReplicaAgg, RequestAgg
from .cache_share import cache_share
from .model_share import MAX_MODEL_NAME, MAX_MODELS, ModelShares
from .tenant_load import MAX_PICTURE_TENANTS, tenant_load
from .axes import (AXES, AXIS_FUNCTIONS, PRESSURE_CAP, RECENT_PROMPTS_S, Axis, Readings, Replicas, finite, pressure,
                   quantiles)
from .partial import Partial
from .profiles import Profile
from .sketch import QuantileSketch
from .replica_outliers import SOLO_SHARE, capped_sums, top_capped

__all__ = ["AXES", "PRESSURE_CAP", "LoadPicture", "PictureConfig", "PoolState", "pressure", "read_picture"]

MAX_REPLICAS = 1024  # replicas tracked per pool: invented or churning replica ids cannot grow a pool's state


@dataclass(frozen=True)
class PictureConfig:
    profile: Profile
    prices: Mapping[str, float]
    fast_window_s: int
    cost_window_s: int
    allowed_lateness_s: float
    stale_after_s: float
    max_replicas: int = MAX_REPLICAS


class PoolState:
    """Everything stage 2 keeps for one pool; serialisable for the changelog table."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.watermark_ms = 0
        self.requests: dict[int, RequestAgg] = {}
        self.replicas: dict[str, ReplicaAgg] = {}
        self.seen: dict[str, int] = {}  # partial id → its newest_ms, for deduplication
        self.late_events = 0
        self.partials_merged = 0
        self.duplicate_partials = 0
        self.replicas_refused = 0  # replica entries of partials refused at max_replicas
        self.evicted: list[str] = []  # partial ids that left the window in the last merge
        self.models = ModelShares()  # which models the pool serves: a sibling's evidence for redirects
        self._kept_from: int | None = None  # the window's first second at the last eviction
        self._by_newest: list[tuple[int, str]] = []  # heap of (newest_ms, partial id) over ``seen``

    # -- merging -------------------------------------------------------------------------------------

    def merge(self, partial: Partial, config: PictureConfig, not_after_ms: int | None = None) -> bool:
        """Fold a partial in; False (and nothing changes) when its id was merged before. ``not_after_ms`` (the
        merging worker's clock) bounds how far the partial may move the watermark: one from a worker whose
        clock runs fast (within the skew stage 2 accepts) moved it ahead, so every other source's events read
        late and every replica gone, and an overloaded pool read idle. Its own seconds ahead of the clock
        are kept and count once the watermark reaches them."""
        if partial.id in self.seen:
            self.duplicate_partials += 1
            return False
        self.seen[partial.id] = partial.newest_ms
        heapq.heappush(self._by_newest, (partial.newest_ms, partial.id))
        self.partials_merged += 1
        self.models.add(partial.model_events, partial.model_total)
        closed_before = self._closed_before(config)
        newest = partial.newest_ms if not_after_ms is None else min(partial.newest_ms, not_after_ms)
        if newest > self.watermark_ms:
            self.watermark_ms = newest
        for second, agg in partial.requests.items():
            if second < closed_before:
                self.late_events += agg.counts["events"]
                continue
            mine = self.requests.get(second)
            if mine is None:
                self.requests[second] = agg
            else:
                mine.merge(agg)
        gone: list[str] | None = None  # replicas that may make room, found once per merge and only if needed
        for replica_id, incoming in partial.replicas.items():
            mine = self.replicas.get(replica_id)
            if mine is None:
                if len(self.replicas) >= config.max_replicas:
                    if gone is None:
                        gone = self._gone_longest_last(config)
                    if not self._make_room(gone, config):
                        self.replicas_refused += 1
                        continue
                mine = self.replicas[replica_id] = ReplicaAgg()
            if incoming.latest is not None:
                mine.see(incoming.latest)
            for second, deltas in incoming.seconds.items():
                if second < closed_before:
                    self.late_events += 1
                else:
                    mine.add(second, deltas)
        self._evict(config)
        return True

    def _closed_before(self, config: PictureConfig) -> int:
        """Seconds before this one are closed: late relative to what had been merged so far."""
        return int((self.watermark_ms - config.allowed_lateness_s * 1000) // 1000)

    def _gone_before(self, config: PictureConfig) -> int:
        """A replica silent since before this (twice the stale threshold) is presumed gone: no capacity, no KV."""
        return self.watermark_ms - 2 * int(config.stale_after_s * 1000)

    def _gone_longest_last(self, config: PictureConfig) -> list[str]:
        """The gone replicas, most recently sampled first (so ``pop`` takes the one silent longest)."""
        gone_before = self._gone_before(config)
        gone = [(_sampled_ms(agg), r) for r, agg in self.replicas.items() if _sampled_ms(agg) < gone_before]
        return [r for _, r in sorted(gone, reverse=True)]

    def _make_room(self, gone: list[str], config: PictureConfig) -> bool:
        """Evict the replica silent longest among ``gone`` (it only still counts in cost) for a new one.
        False when every replica tracked may still be serving: then the new one is refused, never a live one."""
        gone_before = self._gone_before(config)
        while gone:
            agg = self.replicas.get(replica_id := gone.pop())
            if agg is not None and _sampled_ms(agg) < gone_before:  # not sampled again earlier in this merge
                del self.replicas[replica_id]
                return True
        return False

    def _evict(self, config: PictureConfig) -> None:
        """Drop what left the window, touching only what did: scanning every second and every partial id
        kept, on every merge, made a rebuild quadratic (16,000 partials of one pool: 21 s)."""
        keep_from = self.watermark_ms // 1000 - config.cost_window_s - int(config.allowed_lateness_s) - 1
        before, self._kept_from = self._kept_from, keep_from
        self.evicted = []
        while self._by_newest and self._by_newest[0][0] < keep_from * 1000:
            pid = heapq.heappop(self._by_newest)[1]
            if self.seen.pop(pid, None) is not None:
                self.evicted.append(pid)
        if keep_from == before:
            return
        # no second older than the window's start can have been added since (they are late), so only the
        # seconds it passed over go, unless it jumped further than there are seconds kept
        def leaving(seconds: dict) -> list[int]:
            if before is None or keep_from - before > len(seconds):
                return [s for s in seconds if s < keep_from]
            return [s for s in range(before, keep_from) if s in seconds]

        for second in leaving(self.requests):
            del self.requests[second]
        # a replica goes once its seconds have left the cost window and it is gone (never while still quiet)
        forget_before = min(keep_from * 1000, self._gone_before(config))
        for replica_id, agg in list(self.replicas.items()):
            for second in leaving(agg.seconds):
                del agg.seconds[second]
            if _sampled_ms(agg) < forget_before and not agg.seconds:
                del self.replicas[replica_id]

    # -- reading -------------------------------------------------------------------------------------

    def _window(self, seconds: int) -> range:
        end = self.watermark_ms // 1000
        return range(end - seconds, end)

    def _requests_in(self, seconds: int, sketches: bool = True) -> RequestAgg:
        """The window's request aggregates added up; without ``sketches``, the event counts only, not the
        sketches or the tenants' counts (the cost window spans minutes and reads two counts: merging the rest
        every tick was most of a picture's cost)."""
        total = RequestAgg()
        for second in self._window(seconds):
            agg = self.requests.get(second)
            if agg is not None:
                total.merge(agg) if sketches else total.merge_counts(agg, tenants=False)
        return total

    def _sketch_in(self, name: str, seconds: int, newest_left_out: int = 0) -> QuantileSketch:
        """One of the request sketches over the last ``seconds``, less the newest ``newest_left_out`` of them."""
        total = QuantileSketch()
        for second in self._window(seconds)[:seconds - newest_left_out]:
            agg = self.requests.get(second)
            if agg is not None and name in agg.sketches:
                total.merge(agg.sketches[name])
        return total

    def _replica_sums(self, replica: ReplicaAgg, seconds: int, names: tuple[str, ...] = REPLICA_SUMS) -> dict[str, float]:
        sums = dict.fromkeys(names, 0.0)
        for second in self._window(seconds):
            deltas = replica.seconds.get(second)
            if deltas:
                for name in names:
                    sums[name] += deltas.get(name, 0.0)
        return sums

    def _replica_classes(self, config: PictureConfig) -> Replicas:
        fresh, stale, unhealthy = [], [], []
        for replica_id, agg in sorted(self.replicas.items()):
            latest = agg.latest
            if latest is None or self.watermark_ms - latest.event_time > config.stale_after_s * 1000:
                stale.append(replica_id)
            elif not latest.healthy:
                unhealthy.append(replica_id)
            else:
                fresh.append(replica_id)
        # a replica that just went quiet may still be serving: its cache counts as full; one silent for
        # twice the threshold is presumed gone, and only its capacity is missed (a dead replica would
        # otherwise hold the KV axis up until it is forgotten)
        gone_before = self._gone_before(config)
        quiet = [r for r in stale if self.replicas[r].latest is not None
                 and self.replicas[r].latest.event_time >= gone_before]
        return Replicas(tuple(fresh), tuple(unhealthy), tuple(stale), tuple(quiet))

    def readings(self, config: PictureConfig) -> Readings:
        """The windows added up at the watermark: what every axis function reads."""
        fast, slow = config.fast_window_s, config.cost_window_s
        replicas = self._replica_classes(config)
        samples = {r: a.latest for r, a in self.replicas.items() if a.latest is not None}
        sums = {r: self._replica_sums(a, fast) for r, a in self.replicas.items()}
        # the queue (of the replicas reporting now), the token rate and the preemptions (of every replica with
        # counters in the window), the highest of each counted at most a multiple of the next
        # (replica_outliers): one replica cannot shed its pool alone
        sampled = replicas.fresh + replicas.unhealthy
        p, alone = config.profile, SOLO_SHARE * max(len(replicas.fresh), 1)
        requests = self._requests_in(fast)
        # the queue axis reads waiting ÷ completions/s: its floor is in the pool's drain, not its capacity (a
        # quiet pool's liar read 10 with a capacity floor)
        drain_rps = requests.counts["completed"] / fast
        waiting, top = top_capped({r: samples[r].requests_waiting for r in sampled},
                                  SOLO_SHARE * p.queue_wait_fraction * p.slo_ttft_s * drain_rps)
        sums, capped = capped_sums(sums, (
            (("prompt_tokens", "generation_tokens"), alone * p.compute_limit * p.peak_tokens_per_s * fast),
            (("preemptions",), alone * p.preemptions_per_s_limit * fast)))
        outliers = ({top} - {None}) | capped
        return Readings(
            profile=config.profile, prices=config.prices, fast_s=fast, cost_s=slow,
            requests=requests, cost_requests=self._requests_in(slow, sketches=False),
            replicas=replace(replicas, outliers=tuple(sorted(outliers))), samples=samples, waiting=waiting,
            sums=sums, cost_sums={r: self._replica_sums(a, slow, ("gpu_seconds",)) for r, a in self.replicas.items()},
            recent_prompts=self._sketch_in("prompt", RECENT_PROMPTS_S),
            earlier_prompts=self._sketch_in("prompt", fast, RECENT_PROMPTS_S))

    def picture(self, config: PictureConfig) -> "LoadPicture":
        """The pool's picture now: every axis in ``AXIS_FUNCTIONS``, with the rates and latencies beside them."""
        r = self.readings(config)
        c, fast = r.requests.counts, r.fast_s
        rates = {"arrival_rps": c["received"] / fast, "admitted_rps": c["admitted"] / fast,
                 "input_tokens_per_s": c["input_tokens"] / fast, "output_tokens_per_s": c["output_tokens"] / fast,
                 "goodput_tasks_per_s": r.cost_requests.counts["task_successes"] / r.cost_s,
                 "completed_rps": c["completed"] / fast}
        return LoadPicture(
            pool=self.pool, profile=config.profile.name, models=self.models.listed(),
            watermark_ms=self.watermark_ms, fast_window_s=fast, cost_window_s=r.cost_s,
            axes={name: axis(r) for name, axis in AXIS_FUNCTIONS.items()}, replicas=r.replicas, rates=rates,
            latency_s=quantiles(r.requests), late_events=self.late_events,
            partials_merged=self.partials_merged, duplicate_partials=self.duplicate_partials,
            replicas_refused=self.replicas_refused, cache=cache_share(r), tenants=tenant_load(r.requests, fast))

    def snapshot(self, config: PictureConfig) -> dict[str, Any]:
        """The picture as published on sluice.load.v1 and served at /pools."""
        return self.picture(config).to_dict()

    # -- persistence ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"pool": self.pool, "watermark_ms": self.watermark_ms, "late_events": self.late_events,
                **self.models.to_dict(), "replicas_refused": self.replicas_refused,
                "partials_merged": self.partials_merged, "duplicate_partials": self.duplicate_partials,
                "seen": self.seen, "requests": {str(k): v.to_dict() for k, v in self.requests.items()},
                "replicas": {k: v.to_dict() for k, v in self.replicas.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PoolState":
        state = cls(data["pool"])
        state.watermark_ms = data["watermark_ms"]
        state.late_events = data["late_events"]
        state.partials_merged = data["partials_merged"]
        state.duplicate_partials = data["duplicate_partials"]
        state.replicas_refused = data.get("replicas_refused", 0)
        state.models = ModelShares.from_dict(data)
        state.seen = dict(data["seen"])
        state._by_newest = [(newest, pid) for pid, newest in state.seen.items()]
        heapq.heapify(state._by_newest)
        state.requests = {int(k): RequestAgg.from_dict(v) for k, v in data["requests"].items()}
        state.replicas = {k: ReplicaAgg.from_dict(v) for k, v in data["replicas"].items()}
        return state


@dataclass(frozen=True)
class LoadPicture:
    """One pool's picture at its watermark: seven axes, the pool's pressure and what it was computed from."""

    pool: str
    profile: str
    models: tuple[str, ...]               # sorted; pools that share a model are siblings for redirects
    watermark_ms: int
    fast_window_s: int
    cost_window_s: int
    axes: Mapping[str, Axis]              # in AXES order
    replicas: Replicas
    rates: Mapping[str, float]
    latency_s: Mapping[str, Mapping[str, float | None]]  # ttft/tpot/queue → p50/p95/p99
    late_events: int
    partials_merged: int
    duplicate_partials: int
    replicas_refused: int = 0             # not on the wire: load_picture.v1 has no field for it
    cache: Mapping[str, Any] | None = None  # cache_share: hit rates and cached-input share (the share lever)
    tenants: list[dict[str, Any]] | None = None  # tenant_load: offered and admitted attempts/s per tenant

    @property
    def pressure(self) -> float:
        """The pool's pressure: its largest axis pressure."""
        return max(a.pressure for a in self.axes.values())

    @property
    def binding_axis(self) -> str:
        """The axis that sets the pool's pressure (the first in ``AXES`` on a tie)."""
        return max(AXES, key=lambda name: self.axes[name].pressure)

    def to_dict(self) -> dict[str, Any]:
        """The wire form (sluice.load.v1, /pools): no infinities, values rounded to 6 places."""
        return {
            "pool": self.pool,
            "profile": self.profile,
            "models": list(self.models),
            "watermark_ms": self.watermark_ms,
            "windows_s": {"fast": self.fast_window_s, "cost": self.cost_window_s},
            "pressure": self.pressure,
            "binding_axis": self.binding_axis,
            "axes": {name: axis.to_dict() for name, axis in self.axes.items()},
            "replicas": self.replicas.to_dict(),
            "rates": dict(self.rates),
            "latency_s": {name: {k: finite(v) for k, v in qs.items()} for name, qs in self.latency_s.items()},
            "late_events": self.late_events,
            "partials_merged": self.partials_merged,
            "duplicate_partials": self.duplicate_partials,
            **({"cache": dict(self.cache)} if self.cache is not None else {}),
            **({"tenants": list(self.tenants)} if self.tenants is not None else {}),
        }


def _sampled_ms(replica: ReplicaAgg) -> int:
    """When the replica was last sampled; -1 for never (only a malformed partial has no sample): gone at once."""
    return replica.latest.event_time if replica.latest is not None else -1


# -- reading pictures back ---------------------------------------------------------------------------

MAX_PICTURE_BYTES = 1 << 16  # a picture is a few kB; anything far larger is not one
MAX_EPOCH_MS = 4102444800000  # 2100-01-01, as in the event schemas
# detail fields a reader indexes directly (the admission policy, the metrics export)
DETAIL_READ = {"demand": ("admitted_rps", "first_attempts_rps", "input_tokens_per_s"),
               "queue": ("requests_waiting", "drain_rps", "predicted_wait_s"),
               "kv_cache": ("preemptions_per_s_per_replica",),
               "errors": ("retry_amplification",)}
REPLICA_COUNTS = ("total", "fresh", "stale", "unhealthy")
NUMBER = (int, float)


def read_picture(raw: bytes) -> dict[str, Any]:
    """A picture from sluice.load.v1, checked just enough that its readers cannot trip on it.

    Any worker reads every record of that compacted topic, so one bad record
    must cost one picture, not the worker: whatever the bytes, this returns a
    picture or raises ``ValueError`` saying what is wrong. It checks what the
    admission policy, the metrics and ``sluice pools`` read (identity, the
    seven axes, replica counts, rates), not the whole schema.
    """
    if not isinstance(raw, (bytes, bytearray)):
        raise ValueError(f"a load picture is bytes, got {type(raw).__name__}")
    if len(raw) > MAX_PICTURE_BYTES:
        raise ValueError(f"load picture is {len(raw)} bytes, the limit is {MAX_PICTURE_BYTES}")
    try:
        picture = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"load picture is not JSON: {exc}") from None
    _object(picture, "load picture")
    pool = _field(picture, "pool", (str,), "load picture")
    if len(pool) > 64 or not IDENTIFIER.match(pool):
        raise ValueError("pool must be an identifier of at most 64 characters")
    if len(_field(picture, "profile", (str,), "load picture")) > 128:
        raise ValueError("profile has more than 128 characters")
    _count(picture, "watermark_ms", "load picture", MAX_EPOCH_MS)
    models = _field(picture, "models", (list,), "load picture")
    if len(models) > MAX_MODELS or not all(type(m) is str and len(m) <= MAX_MODEL_NAME for m in models):
        raise ValueError(f"models must be at most {MAX_MODELS} strings of at most {MAX_MODEL_NAME} characters")
    _pressure(picture, "load picture")
    axes = _field(picture, "axes", (dict,), "load picture")
    if axes.keys() != set(AXES):
        missing, extra = [a for a in AXES if a not in axes], sorted(map(str, axes.keys() - set(AXES)))[:3]
        raise ValueError(f"axes must be exactly {', '.join(AXES)}"
                         + (f"; missing {', '.join(missing)}" if missing else "")
                         + (f"; unknown {', '.join(repr(e[:32]) for e in extra)}" if extra else ""))
    for name in AXES:
        _axis(axes[name], name)
    if picture.get("binding_axis") not in AXES:
        raise ValueError("binding_axis must name one of the axes")
    replicas = _field(picture, "replicas", (dict,), "load picture")
    for name in REPLICA_COUNTS:
        _count(replicas, name, "replicas")
    rates = _field(picture, "rates", (dict,), "load picture")
    _field(rates, "arrival_rps", NUMBER, "rates")
    for name, value in rates.items():
        _number(value, f"rates.{_name(name)}")
    if "tenants" in picture:
        _tenants(picture["tenants"])
    return picture


def _tenants(rows: Any) -> None:
    """The optional per-tenant rows the policy's fair shares read (tenant_load's shape)."""
    if type(rows) is not list or len(rows) > MAX_PICTURE_TENANTS + 1:
        raise ValueError(f"tenants must be an array of at most {MAX_PICTURE_TENANTS + 1} rows")
    for row in rows:
        _object(row, "tenants[]")
        tenant = _field(row, "tenant", (str,), "tenants[]")
        if not 0 < len(tenant) <= 64 or not (tenant == OTHER_TENANTS or IDENTIFIER.match(tenant)):
            raise ValueError("tenants[].tenant must be a tenant name (the contract's) of 1 to 64 characters")
        for name in ("offered_rps", "admitted_rps"):
            _number(_field(row, name, NUMBER, "tenants[]"), f"tenants[].{name}")
        if "offered_rps_by_class" in row:
            by_class = _field(row, "offered_rps_by_class", (dict,), "tenants[]")
            for name in PRIORITIES:
                _number(_field(by_class, name, NUMBER, "tenants[].offered_rps_by_class"),
                        f"tenants[].offered_rps_by_class.{name}")
        for name in ("finished_rps", "service_s_per_s"):
            if name in row:
                _number(_field(row, name, NUMBER, "tenants[]"), f"tenants[].{name}")


JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
              type(None): "null"}


def _kind(value: Any) -> str:
    """A hostile value's JSON type, never its repr (which can be huge or nested past the recursion limit)."""
    return JSON_TYPES.get(type(value), type(value).__name__)


def _name(name: str) -> str:
    return name if len(name) <= 32 else name[:32] + "…"


def _object(value: Any, where: str) -> None:
    if type(value) is not dict:
        raise ValueError(f"{where} must be a JSON object, got {_kind(value)}")


def _field(obj: dict, name: str, types: tuple[type, ...], where: str) -> Any:
    if name not in obj:
        raise ValueError(f"{where} has no {name}")
    value = obj[name]
    if type(value) not in types:
        wanted = "number" if types == NUMBER else JSON_TYPES[types[0]]
        raise ValueError(f"{where}.{name} must be {'an' if wanted[0] in 'aeiou' else 'a'} {wanted}, "
                         f"got {_kind(value)}")
    return value


def _count(obj: dict, name: str, where: str, most: int = 1 << 53) -> None:
    if not 0 <= _field(obj, name, (int,), where) <= most:
        raise ValueError(f"{where}.{name} must be between 0 and {most}")


def _number(value: Any, where: str, nullable: bool = False) -> None:
    """Readers do arithmetic on these: a number (orjson admits no NaN or infinity), never negative."""
    if value is None and nullable:
        return
    if type(value) not in NUMBER:
        raise ValueError(f"{where} must be a number{' or null' if nullable else ''}, got {_kind(value)}")
    if value < 0:
        raise ValueError(f"{where} must not be negative")


def _pressure(obj: dict, where: str) -> None:
    if not 0 <= _field(obj, "pressure", NUMBER, where) <= PRESSURE_CAP:
        raise ValueError(f"{where}.pressure must be between 0 and {PRESSURE_CAP:g}")


def _axis(axis: Any, name: str) -> None:
    where = f"axes.{name}"
    _object(axis, where)
    _pressure(axis, where)
    if "value" not in axis:
        raise ValueError(f"{where} has no value")
    _number(axis["value"], f"{where}.value", nullable=True)
    _number(_field(axis, "limit", NUMBER, where), f"{where}.limit")
    detail = _field(axis, "detail", (dict,), where)
    for key in DETAIL_READ.get(name, ()):
        if key not in detail:
            raise ValueError(f"{where}.detail has no {key}")
    for key, value in detail.items():
        if name == "demand" and key in ("first_attempts_rps", "offered_rps"):
            _object(value, f"{where}.detail.{key}")
            for priority, rate in value.items():
                _number(rate, f"{where}.detail.{key}.{_name(priority)}")
        else:
            _number(value, f"{where}.detail.{_name(key)}", nullable=True)
