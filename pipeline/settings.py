"""Typed settings: the one place every knob is declared, defaulted and documented.

Precedence: environment (``SLUICE_<NAME>``) over an optional TOML file
(``SLUICE_CONFIG``) over the defaults below. ``KAFKA_BOOTSTRAP_SERVERS`` is
honoured as an alias of ``SLUICE_KAFKA_BOOTSTRAP_SERVERS`` because that is the
name operators already use. A bad value fails at start-up with the setting's
name, never later on the data path.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tomllib
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .events import PRIORITIES

ENV_PREFIX = "SLUICE_"
CONFIG_FILE_ENV = "SLUICE_CONFIG"
ALIASES = {"kafka_bootstrap_servers": "KAFKA_BOOTSTRAP_SERVERS", "clickhouse_url": "CLICKHOUSE_URL",
           "clickhouse_user": "CLICKHOUSE_USER", "clickhouse_password": "CLICKHOUSE_PASSWORD"}
SECRET_SETTINGS = {"clickhouse_password", "signing_keys", "query_token", "kafka_sasl_password"}
KAFKA_TLS_PROTOCOLS = ("SSL", "SASL_SSL")
KAFKA_SASL_PROTOCOLS = ("SASL_PLAINTEXT", "SASL_SSL")


class SettingsError(ValueError):
    """A setting has a value the pipeline cannot run with."""


def _doc(text: str, **kw: Any) -> dict:
    return {"doc": text, **kw}


@dataclass(frozen=True)
class Settings:
    kafka_bootstrap_servers: str = field(default="", metadata=_doc(
        "Kafka bootstrap servers (host:port,...). Empty: use the broker that "
        "`sluice kafka start` recorded in the state directory."))
    kafka_security_protocol: str = field(default="PLAINTEXT", metadata=_doc(
        "How every Sluice Kafka client connects: `PLAINTEXT`, `SSL` (TLS), `SASL_PLAINTEXT` or `SASL_SSL` "
        "(SASL over TLS: production). See docs/security.md.",
        choices=("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")))
    kafka_sasl_mechanism: str = field(default="SCRAM-SHA-512", metadata=_doc(
        "SASL mechanism with a `SASL_*` protocol (`PLAIN` sends the password itself: only over TLS).",
        choices=("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")))
    kafka_sasl_username: str = field(default="", metadata=_doc(
        "SASL principal of this process (`sluice` workers, `router`, `gpu-agent`); required with `SASL_*`."))
    kafka_sasl_password: str = field(default="", metadata=_doc(
        "SASL password; required with `SASL_*`. Never logged."))
    kafka_ssl_ca_file: str = field(default="", metadata=_doc(
        "PEM CA bundle that verifies the brokers' certificates (`SSL`, `SASL_SSL`). Empty: the system "
        "trust store."))
    kafka_ssl_cert_file: str = field(default="", metadata=_doc(
        "PEM client certificate for mutual TLS (with `kafka_ssl_key_file`); empty: none."))
    kafka_ssl_key_file: str = field(default="", metadata=_doc(
        "Unencrypted PEM private key of `kafka_ssl_cert_file` (may be the same file)."))
    kafka_ssl_check_hostname: bool = field(default=True, metadata=_doc(
        "Check that a broker's certificate names the host connected to. Off only for brokers reached by "
        "an address their certificates do not list; the chain is verified either way."))
    kafka_version: str = field(default="4.1.1", metadata=_doc(
        "Apache Kafka release the devstack fetches from Maven Central."))
    kafka_heap_mb: int = field(default=768, metadata=_doc(
        "Maximum JVM heap of the devstack broker, MiB.", min=128))
    cache_dir: Path = field(default=Path("~/.cache/sluice"), metadata=_doc(
        "Downloaded artifacts (Kafka jars), reused across runs."))
    state_dir: Path = field(default=Path("~/.local/state/sluice"), metadata=_doc(
        "Broker data, broker address file and the embedded ClickHouse store."))
    topic_namespace: str = field(default="", metadata=_doc(
        "Prefix for every topic name (`<ns>.sluice.requests.v1`); empty keeps "
        "the contract names. Lets tests and tenants share a broker.",
        pattern=r"[A-Za-z0-9_-]*"))
    topic_partitions: int = field(default=4, metadata=_doc(
        "Partitions of the raw event topics when Sluice creates them.", min=1, max=1024))
    topic_replication_factor: int = field(default=1, metadata=_doc(
        "Replication factor of topics Sluice creates (1 for the devstack, 3 in production).",
        min=1, max=16))
    topic_min_insync_replicas: int = field(default=2, metadata=_doc(
        "`min.insync.replicas` of every topic Sluice creates (its own and Faust's changelog): an acks=all "
        "write needs this many replicas, so one broker can die without losing an acknowledged record. "
        "Capped at `topic_replication_factor` (one replica: 1) and always set on the topic, so a broker "
        "default above the replication factor cannot refuse every write (brokers before Kafka 3.7 do not "
        "cap it themselves).", min=1, max=16))
    topic_compaction_lag_s: float = field(default=600.0, metadata=_doc(
        "Longest a superseded load picture or stage 2 changelog record is kept before compaction, seconds "
        "(`max.compaction.lag.ms` and `segment.ms` of those topics). Kafka never compacts a partition's open "
        "segment, which by default rolls at 1 GiB or 7 days: without this, `sluice pools` and a worker "
        "rebuilding stage 2 would read days of superseded records (a picture per pool per tick).",
        min=1.0, max=7 * 86400.0))
    admission_compaction_lag_s: float = field(default=3600.0, metadata=_doc(
        "The same bound for the admission topic, seconds. A router starting reads this much of signals at most "
        "(about 1 KB each; the demo's pool published one a second); the landing path lands every signal unless "
        "the store is out for longer, after which only each pool's newest signal is sure to land.",
        min=1.0, max=7 * 86400.0))
    app_id: str = field(default="sluice", metadata=_doc(
        "Faust application id: consumer group and changelog topic prefix.",
        pattern=r"[A-Za-z0-9._-]+"))
    role: str = field(default="all", metadata=_doc(
        "What a worker runs: `control` (validate → fold → picture → policy → signed signal; no store), "
        "`landing` (raw events and signals → ClickHouse, exactly once) or `all` (both, independent, in one "
        "process: the default, and the only way to serve the embedded store's readers).",
        choices=("all", "control", "landing")))
    session_timeout_s: float = field(default=10.0, metadata=_doc(
        "How long a silent worker keeps its partitions before the group moves them to the others, seconds "
        "(Kafka consumer session timeout, both paths and stage 2; heartbeats every third of it, at most 3 s): the "
        "bound on a dead worker's gap.",
        min=6, max=300))
    web_host: str = field(default="127.0.0.1", metadata=_doc(
        "Address the worker's HTTP endpoints (/healthz, /metrics) bind to."))
    web_port: int = field(default=6066, metadata=_doc(
        "Port of the worker's HTTP endpoints.", min=1, max=65535))
    query_token: str = field(default="", metadata=_doc(
        "Bearer token the worker's read-only /query endpoint requires; mandatory when `web_host` is not "
        "a loopback address. Never logged."))
    query_max_rows: int = field(default=10000, metadata=_doc(
        "Most rows /query and `sluice query` return; longer results are cut and marked truncated.",
        min=1, max=10_000_000))
    query_max_seconds: float = field(default=30.0, metadata=_doc(
        "Longest an analyst's query may run (the engine's max_execution_time), seconds.", min=0.1, max=3600))
    query_max_memory_mb: int = field(default=2048, metadata=_doc(
        "Most memory an analyst's query may use (the engine's max_memory_usage), MiB.", min=16, max=1 << 20))
    ingest_batch_max: int = field(default=2000, metadata=_doc(
        "Most events one fetch of either path decodes as one batch.", min=1, max=100000))
    ingest_batch_within_s: float = field(default=0.25, metadata=_doc(
        "Longest either path waits to fill a batch, seconds.", min=0.001, max=60))
    max_event_bytes: int = field(default=1048576, metadata=_doc(
        "Largest accepted event value, bytes; larger ones are dead-lettered.",
        min=1024, max=16777216))
    ingest_landing_depth: int = field(default=2, metadata=_doc(
        "Batches the landing path lets land in ClickHouse while it decodes the next: more rides out slow "
        "inserts, at the cost of memory (each is up to `ingest_batch_max` events).",
        min=1, max=16))
    sink_block_rows: int = field(default=5000, metadata=_doc(
        "Rows a source partition's block gathers before it lands as one insert (ClickHouse: thousands of "
        "rows per insert). Each insert has a fixed cost, so larger blocks land faster when a backlog fills "
        "them, at the cost of memory (docs/performance.md).",
        min=1, max=1_000_000))
    sink_block_bytes: int = field(default=64 << 20, metadata=_doc(
        "Bytes of source records a partition's block gathers at most before it lands, whatever its rows: "
        "records up to the raw topics' limit (4 × `max_event_bytes`) are dead-lettered with their original "
        "bytes, and 5,000 of them in one block would hold gigabytes.", min=1 << 20, max=1 << 30))
    sink_block_age_s: float = field(default=1.0, metadata=_doc(
        "Longest a block gathers rows before it lands, seconds: the bound on landing lag it adds "
        "(0 lands every fetched batch at once).", min=0, max=60))
    sink_rollup_interval_s: float = field(default=1.0, metadata=_doc(
        "How often the landing path rolls what it landed up into `pool_minute`, seconds: how far the "
        "per-minute table trails `request_events`. Each rollup is one `INSERT … SELECT` (a view did it per "
        "insert, at about a quarter of the landing path's time; docs/storage.md).", min=0, max=600))
    dedup_recent_ids: int = field(default=20000, metadata=_doc(
        "Event ids per source partition each path remembers to drop a re-sent event (a producer retry) "
        "before it is folded or landed: the landing path exactly the last this many, reloaded from the store "
        "after a restart; the control path at least the last this many and at most about twice.",
        min=0, max=10_000_000))
    store_fsync: bool = field(default=True, metadata=_doc(
        "Landed tables fsync each part and its directory before an insert returns, so rows are on disk "
        "before their offsets are committed (a host crash loses nothing). Off: about 20% more rows/s, and "
        "a crash can lose rows the page cache held. Applied at worker start and by `sluice db migrate`."))
    retention_days: int = field(default=30, metadata=_doc(
        "Days landed rows and per-minute aggregates are kept (ClickHouse TTL); 0 keeps them forever. "
        "Applied at worker start and by `sluice db migrate`.", min=0, max=36500))
    clickhouse_url: str = field(default="", metadata=_doc(
        "ClickHouse server URL (http://host:8123/db). Empty: the embedded chdb "
        "store under `chdb_path`."))
    clickhouse_user: str = field(default="default", metadata=_doc(
        "ClickHouse server user (server backend only)."))
    clickhouse_password: str = field(default="", metadata=_doc(
        "ClickHouse server password (server backend only; never logged)."))
    clickhouse_ca_file: str = field(default="", metadata=_doc(
        "PEM CA bundle that verifies an `https://` `clickhouse_url`. Empty: the system trust store."))
    clickhouse_verify: bool = field(default=True, metadata=_doc(
        "Verify an `https://` ClickHouse server's certificate and host name. Off: encrypted but "
        "unauthenticated (a warning is logged)."))
    chdb_path: str = field(default="", metadata=_doc(
        "Embedded ClickHouse data directory. Empty: `<state_dir>/chdb`."))
    log_level: str = field(default="info", metadata=_doc(
        "Worker log level.", choices=("crit", "error", "warn", "info", "debug")))
    producer_stall_s: float = field(default=60.0, metadata=_doc(
        "A wait on the worker's Kafka producer (signals, partials, dead letters) longer than this, seconds, is "
        "named in /healthz's body (producer_stuck_s): an idempotent producer never gives up on a batch the "
        "broker does not acknowledge. It does not fail the check (a restart meets the same broker); a producer "
        "whose sender ended or that a refusal spoiled does. A control-path cut waiting this long (its lock, the "
        "group commit, the partials' send) is named there too (control.cut_stuck_s).", min=5, max=3600))
    producer_spent_exit_s: float = field(default=5.0, metadata=_doc(
        "A worker whose Kafka producer is spent (its sender ended, or a refusal spoiled it) or whose control path "
        "is wedged (a cut queued on its lock past producer_stall_s while the holder waits on nothing at the "
        "broker) exits with an error this long after that was first seen (checked every second), seconds, and "
        "hard if its stop takes as long again (a wedged path's stop always does: it waits on the same lock), so "
        "that a supervisor restarting on exit (compose's restart policy, systemd) brings a new producer or a "
        "free path: Faust cannot replace a producer in a running app. (A send that fails on a spent producer "
        "ends the worker at once.)", min=1, max=3600))
    tick_s: float = field(default=0.5, metadata=_doc(
        "Stage 2 steps the control loop every tick, seconds: pictures of changed pools, decisions, signals. "
        "The admission policy's steps (gain, step_down, level steps) are per tick, tuned at 0.5.",
        min=0.05, max=60))
    cut_interval_s: float = field(default=0.1, metadata=_doc(
        "Stage 1 cuts its builders into per-pool partials this often, seconds: the newest events a decision "
        "sees are at most about this plus two hops old. Shorter costs more partials (each source partition "
        "sends one per pool per cut; stage 2 merges each and its changelog table keeps it for the cost window). "
        "At most tick_s.", min=0.05, max=60))
    fast_window_s: float = field(default=10.0, metadata=_doc(
        "Event-time window of the fast axes (demand, queue, latency, errors), seconds.", min=1, max=3600))
    cost_window_s: float = field(default=300.0, metadata=_doc(
        "Event-time window of the cost axis and goodput, seconds.", min=1, max=86400))
    allowed_lateness_s: float = field(default=30.0, metadata=_doc(
        "Events this much older than a pool's newest event are counted as late and left out.",
        min=0, max=86400))
    max_clock_skew_s: float = field(default=60.0, metadata=_doc(
        "Events whose event_time is more than this ahead of the worker's clock are dead-lettered "
        "(`event_time_ahead`): a fast clock or a forged time must never move a pool's watermark.",
        min=1, max=86400))
    max_event_age_s: float = field(default=7 * 86400.0, metadata=_doc(
        "Events older than this (by the worker's clock) are dead-lettered (`event_time_too_old`); 0 accepts "
        "any age (replaying an old trace). Bounds how many day partitions one landing block can touch.",
        min=0, max=10 * 365 * 86400))
    replica_stale_after_s: float = field(default=15.0, metadata=_doc(
        "A replica with no sample for this long (event time) is stale: saturated, its capacity leaves the pool.",
        min=1, max=86400))
    default_profile: str = field(default="balanced", metadata=_doc(
        "Profile of pools not named in `pool_profiles`."))
    pool_profiles: dict = field(default_factory=dict, metadata=_doc(
        "Pool → profile name, e.g. `{\"chat-70b\": \"interactive\"}` (TOML table or JSON)."))
    profiles: dict = field(default_factory=dict, metadata=_doc(
        "Profiles added to or overriding the built-in `interactive`, `balanced` and `batch` "
        "(limits and SLOs per axis; see docs/load-picture.md)."))
    max_pools: int = field(default=1000, metadata=_doc(
        "Most pools one controller tracks; partials of further new pools are refused and counted "
        "(sluice_pools_refused_total), so invented pool names cannot grow memory or signal traffic.",
        min=1, max=1_000_000))
    pool_idle_s: float = field(default=600.0, metadata=_doc(
        "A pool with no event for this long is forgotten: its state goes, and its picture and signal are "
        "removed from the compacted topics (tombstones).", min=10, max=30 * 86400))
    heartbeat_s: float = field(default=2.0, metadata=_doc(
        "An admission signal is republished at least this often, so silence is told from stability.",
        min=0.1, max=300))
    admission_policy: dict = field(default_factory=dict, metadata=_doc(
        "Overrides of the admission policy's knobs (thresholds, dwell, steps, floors, validity; "
        "see docs/admission-signal.md)."))
    signing_key_id: str = field(default="dev", metadata=_doc(
        "Key id the controller signs admission signals with (must be in `signing_keys`)."))
    dev_signing_key: bool = field(default=False, metadata=_doc(
        "Sign admission signals with the built-in development key when `signing_keys` is empty. Off: a "
        "controller without keys refuses to start (anyone can read the development key). Refused with a "
        "non-loopback `web_host`."))
    signing_keys: dict = field(default_factory=dict, metadata=_doc(
        "Key id → HMAC secret for admission signals; routers accept every id listed (rotation "
        "overlap). Empty: a controller refuses to start unless `dev_signing_key` is on. Never logged."))
    gpu_prices: dict = field(default_factory=dict, metadata=_doc(
        "Hardware → $ per GPU-hour, added to or overriding the built-in price table."))
    cached_input_cost_share: float = field(default=0.1, metadata=_doc(
        "What a prompt token served from the prefix cache costs, as a share of an uncached one, when the "
        "fleet's cost is attributed to requests (`attempt_cost`) and the caches' saving is reported "
        "(`cache_savings`, `sluice report`). 0.1: a cache read skips the prefill's compute but not the "
        "memory it occupies (providers bill cache reads at 10–50% of input).", min=0, max=1))
    otel_topic: str = field(default="", metadata=_doc(
        "Kafka topic of OTLP/JSON spans (the OpenTelemetry Collector Kafka exporter's `traces::topic` with "
        "`encoding: otlp_json`, e.g. `otlp_spans`) that `sluice otel-bridge` turns into RequestEvents; taken as "
        "written, without `topic_namespace`. Empty: no bridge (docs/integrations.md).",
        pattern=r"[A-Za-z0-9._-]{0,249}"))
    otel_group: str = field(default="", metadata=_doc(
        "Consumer group of `sluice otel-bridge` on `otel_topic`. Empty: `<app_id>-otel`.",
        pattern=r"[A-Za-z0-9._-]*"))
    otel_span_kinds: str = field(default="client,server", metadata=_doc(
        "Span kinds the bridge maps (comma-separated: `client`, `server`, `internal`, `producer`, `consumer`, "
        "`unspecified`); GenAI spans of other kinds are skipped and counted. Keep one side when both the caller "
        "and the engine trace the same request into the topic, or each request counts twice.",
        pattern=r"(unspecified|internal|server|client|producer|consumer)"
                r"(,(unspecified|internal|server|client|producer|consumer))*"))
    litellm_max_priority: str = field(default="critical", metadata=_doc(
        "The highest class a LiteLLM proxy caller may claim (`x-sluice-priority`, `sluice_priority`) unless its "
        "team's metadata names another (`sluice_max_priority`; a key's own can only lower it): a claim above it is "
        "lowered to it. `critical` trusts every caller's claim; `standard` lets only teams an admin marks send "
        "critical work, the class shed last and never for a tenant's fair share (docs/integrations.md).",
        choices=PRIORITIES))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check(f, getattr(self, f.name))
        if self.cost_window_s < self.fast_window_s:
            raise SettingsError("setting cost_window_s must be at least fast_window_s")
        if self.cut_interval_s > self.tick_s:
            raise SettingsError(f"setting cut_interval_s={self.cut_interval_s} is longer than tick_s={self.tick_s}: "
                                "the policy would step on pictures that have not changed")
        if self.dev_signing_key and not _loopback(self.web_host):
            raise SettingsError(f"dev_signing_key is for a development machine: web_host={self.web_host} is not "
                                "a loopback address; set signing_keys")
        if not self.query_token and not _loopback(self.web_host):
            raise SettingsError(f"web_host={self.web_host} is not a loopback address: set query_token so that "
                                "the read-only /query endpoint is not open to the network")
        if self.topic_replication_factor > 1 and self.topic_min_insync_replicas > self.topic_replication_factor:
            raise SettingsError(f"setting topic_min_insync_replicas={self.topic_min_insync_replicas} is above "
                                f"topic_replication_factor={self.topic_replication_factor}: no write could succeed")
        _check_kafka_security(self)
        _check_clickhouse_tls(self)

    def __repr__(self) -> str:
        """Secrets masked: settings end up in logs and tracebacks."""
        return f"Settings({', '.join(f'{k}={v!r}' for k, v in self.redacted().items())})"

    @property
    def heartbeat_interval_s(self) -> float:
        """Consumer heartbeats (both paths and stage 2): a third of the session timeout, at most 3 s, because
        a member learns of a rebalance only at its next heartbeat (Kafka's defaults: 45 s and 3 s)."""
        return min(self.session_timeout_s / 3, 3.0)

    @property
    def kafka_dir(self) -> Path:
        return self.state_dir / "kafka"

    @property
    def chdb_dir(self) -> Path:
        return Path(os.path.expanduser(self.chdb_path)) if self.chdb_path else self.state_dir / "chdb"

    def redacted(self) -> dict[str, Any]:
        """Settings as a dict with secrets masked, safe to log or print."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = "***" if f.name in SECRET_SETTINGS and value else (
                str(value) if isinstance(value, Path) else value)
        return out


def _check_kafka_security(s: Settings) -> None:
    """Refuse a Kafka security configuration that would be ignored in part or cannot authenticate: a
    setting silently not applied is an operator believing a connection is encrypted when it is not."""
    protocol = s.kafka_security_protocol
    if protocol in KAFKA_SASL_PROTOCOLS:
        if not (s.kafka_sasl_username and s.kafka_sasl_password):
            raise SettingsError(f"kafka_security_protocol={protocol} needs kafka_sasl_username and "
                                "kafka_sasl_password")
    elif s.kafka_sasl_username or s.kafka_sasl_password:
        raise SettingsError(f"kafka_sasl_username/kafka_sasl_password are set but kafka_security_protocol="
                            f"{protocol} does not use them: choose SASL_SSL")
    tls_files = {"kafka_ssl_ca_file": s.kafka_ssl_ca_file, "kafka_ssl_cert_file": s.kafka_ssl_cert_file,
                 "kafka_ssl_key_file": s.kafka_ssl_key_file}
    if protocol not in KAFKA_TLS_PROTOCOLS:
        given = [name for name, value in tls_files.items() if value]
        if given:
            raise SettingsError(f"{', '.join(given)} set but kafka_security_protocol={protocol} uses no TLS: "
                                "choose SSL or SASL_SSL")
        return
    if bool(s.kafka_ssl_cert_file) != bool(s.kafka_ssl_key_file):
        raise SettingsError("kafka_ssl_cert_file and kafka_ssl_key_file go together (mutual TLS); name the "
                            "same file twice when one PEM holds both")
    for name, value in tls_files.items():
        _check_file(name, value)


def _check_clickhouse_tls(s: Settings) -> None:
    if s.clickhouse_url and not re.match(r"https?://", s.clickhouse_url):
        raise SettingsError("clickhouse_url must start with http:// or https://")
    if urllib.parse.urlsplit(s.clickhouse_url).query or "?" in s.clickhouse_url:
        # clickhouse-connect copies a DSN's query parameters into its client options, after Sluice's own:
        # `?verify=false` would switch certificate verification off behind clickhouse_verify's back
        raise SettingsError("clickhouse_url must not carry query parameters (the part after '?'): "
                            "clickhouse-connect would apply them as client options over Sluice's own "
                            "(e.g. ?verify=false silently disables TLS verification); use clickhouse_ca_file, "
                            "clickhouse_verify, clickhouse_user and clickhouse_password instead")
    if s.clickhouse_ca_file:
        if not s.clickhouse_url.startswith("https://"):
            raise SettingsError("clickhouse_ca_file is set but clickhouse_url is not an https:// URL")
        _check_file("clickhouse_ca_file", s.clickhouse_ca_file)


def _check_file(name: str, value: str) -> None:
    if value and not os.path.isfile(os.path.expanduser(value)):
        raise SettingsError(f"setting {name}={value!r}: no such file")


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check(f: dataclasses.Field, value: Any) -> None:
    meta = f.metadata
    if isinstance(value, float) and not math.isfinite(value):   # NaN passes every min and max test
        raise SettingsError(f"setting {f.name}={value!r} must be a finite number")
    if "min" in meta and value < meta["min"]:
        raise SettingsError(f"setting {f.name}={value!r} is below its minimum {meta['min']}")
    if "max" in meta and value > meta["max"]:
        raise SettingsError(f"setting {f.name}={value!r} is above its maximum {meta['max']}")
    if "choices" in meta and value not in meta["choices"]:
        raise SettingsError(f"setting {f.name}={value!r} is not one of {', '.join(meta['choices'])}")
    if "pattern" in meta and not re.fullmatch(meta["pattern"], value):
        raise SettingsError(f"setting {f.name}={value!r} must match {meta['pattern']}")


def _coerce(f: dataclasses.Field, raw: Any, source: str) -> Any:
    kind = f.type if isinstance(f.type, type) else {"str": str, "int": int, "float": float,
                                                      "bool": bool, "Path": Path, "dict": dict}[f.type]
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind is Path:
            return Path(os.path.expanduser(str(raw)))
        if kind is dict:
            value = json.loads(raw) if isinstance(raw, str) else raw
            if not isinstance(value, dict):
                raise ValueError(raw)
            return value
        if kind is int and isinstance(raw, float):
            raise ValueError(raw)
        return kind(raw)
    except (TypeError, ValueError, json.JSONDecodeError):
        raise SettingsError(f"setting {f.name} from {source}: {raw!r} is not a valid {kind.__name__}") from None


def load_settings(env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Build settings from defaults, the optional TOML file, the environment and overrides."""
    env = os.environ if env is None else env
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    values: dict[str, Any] = {}
    config_path = env.get(CONFIG_FILE_ENV, "")
    if config_path:
        try:
            with open(os.path.expanduser(config_path), "rb") as fh:
                from_file = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SettingsError(f"cannot read {CONFIG_FILE_ENV}={config_path}: {exc}") from None
        for name, raw in from_file.items():
            if name not in fields:
                raise SettingsError(f"unknown setting {name!r} in {config_path}")
            values[name] = _coerce(fields[name], raw, config_path)
    for name, f in fields.items():
        for var in (ENV_PREFIX + name.upper(), ALIASES.get(name)):
            if var and var in env:
                values[name] = _coerce(f, env[var], var)
                break
    for name, raw in overrides.items():
        if name not in fields:
            raise SettingsError(f"unknown setting {name!r}")
        values[name] = _coerce(fields[name], raw, "override")
    for name in ("cache_dir", "state_dir"):
        path = values.get(name, fields[name].default)
        values[name] = Path(os.path.expanduser(str(path)))
    return Settings(**values)


def settings_table() -> str:
    """Markdown table of every setting, for the README (kept true by a test)."""
    rows = ["| setting | environment | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(Settings):
        env = f"`{ENV_PREFIX}{f.name.upper()}`"
        if f.name in ALIASES:
            env += f" or `{ALIASES[f.name]}`"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append(f"| `{f.name}` | {env} | `{default}` | {f.metadata['doc']} |")
    return "\n".join(rows)
