"""The daemon's settings: one declared table, read once (defaults < POLICYD_* env < flags).

Two kinds. ``DaemonSettings`` are fixed for the life of the process (endpoints, paths, the token).
``TUNABLES`` are the knobs the HTTP API and the dashboard change live; each is declared once
with its type, bounds and help, and ``validate_tunables`` checks a whole change set before any
of it is applied. Constructors elsewhere receive narrow values, never these objects.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final

from policyd.core.profiles import PROFILES
from policyd.core.ratelog import QUOTE_CHARS, quote
from policyd.core.wire import (
    DEFAULT_EVENTS_ENDPOINT,
    DEFAULT_HTTP_HOST,
    DEFAULT_HTTP_PORT,
    DEFAULT_SNAPSHOT_ENDPOINT,
)
from policyd.daemon.ingest import INGEST_MAX_FRAME_BYTES
from policyd.policies import POLICIES

ENV_PREFIX: Final = "POLICYD_"
HISTORY_WRITERS: Final = ("process", "thread")
MAX_SECONDS: Final = 366 * 86400.0  # the longest interval or timeout a setting may name
# settings in seconds that must be positive and at most MAX_SECONDS (0 or 1e308 would spin or
# overflow the thread that waits on them)
POSITIVE_SECONDS: Final = (
    "checkpoint_interval_s",
    "tick_interval_s",
    "idle_timeout_s",
    "request_timeout_s",
    "snapshot_ttl_s",
    "stats_interval_s",
    "sizing_interval_s",
    "history_flush_interval_s",
    "history_retention_s",
)


def _help(text: str, **extra: Any) -> Any:
    return field(metadata={"help": text, **extra})


@dataclass(frozen=True, slots=True)
class DaemonSettings:
    """Everything ``policyd serve`` is configured with; see ``describe()`` for the help text."""

    db: Path = field(
        default=Path("policyd-history.duckdb"),
        metadata={"help": "History DuckDB file (created and migrated when missing)."},
    )
    events: str = field(
        default=DEFAULT_EVENTS_ENDPOINT,
        metadata={"help": "ZeroMQ endpoint the daemon binds a PULL socket on for event batches."},
    )
    snapshots: str = field(
        default=DEFAULT_SNAPSHOT_ENDPOINT,
        metadata={"help": "ZeroMQ endpoint the daemon binds a PUB socket on for snapshots."},
    )
    http_host: str = field(
        default=DEFAULT_HTTP_HOST,
        metadata={"help": "HTTP API bind address (loopback by default)."},
    )
    http_port: int = field(
        default=DEFAULT_HTTP_PORT, metadata={"help": "HTTP API port (0: pick a free one)."}
    )
    token: str | None = field(
        default=None,
        metadata={
            "help": "Bearer token required on admin routes (settings writes, checkpoint) and "
            "on /api/sql.",
            "env": "POLICYD_API_TOKEN",
        },
    )
    token_file: Path | None = field(
        default=None,
        metadata={
            "help": "File holding the bearer token (read at start, surrounding whitespace "
            "dropped): unlike --token, the secret is not on the command line, where ps shows it."
        },
    )
    allow_open_http: bool = field(
        default=False,
        metadata={
            "help": "Serve the HTTP API on a non-loopback address without a token. Without "
            "this, `policyd serve` refuses to: anyone who reaches the address could change "
            "settings and read the history."
        },
    )
    sql_without_token: bool = field(
        default=False,
        metadata={
            "help": "Let POST /api/sql answer without the bearer token when a token is set "
            "(by default it needs it, as the admin routes do)."
        },
    )
    policy: str = field(default="pbkv", metadata={"help": "Policy at start (a tunable later)."})
    profile: str = field(
        default="h200-llama3.1-8b",
        metadata={"help": "Hardware/model profile: KV bytes per block, GPU and host sizes."},
    )
    gpu_blocks: int | None = field(
        default=None, metadata={"help": "GPU KV blocks for sizing (default: the profile's)."}
    )
    vllm_events: str | None = field(
        default=None,
        metadata={"help": "vLLM KV-events PUB endpoint to subscribe to (tcp://host:port)."},
    )
    vllm_replay: str | None = field(
        default=None, metadata={"help": "vLLM KV-events replay (ROUTER) endpoint for gaps."}
    )
    vllm_topic: str = field(default="", metadata={"help": "vLLM KV-events topic ('' = all)."})
    checkpoint_dir: Path | None = field(
        default=None,
        metadata={"help": "Directory for model checkpoints (default: next to the db)."},
    )
    checkpoint_interval_s: float = field(
        default=60.0, metadata={"help": "Seconds between periodic model checkpoints."}
    )
    ingest_queue_frames: int = field(
        default=4096,
        metadata={
            "help": "Queue between the PULL socket and the Engine, in frames of 256 events or "
            "block events (a frame of 4,096 block events weighs 16): block stores are shed "
            "above shed_above_frames, falling to none kept at this depth; past twice this, "
            "frames keep only their closing events (RequestFinished, WorkflowFinished, "
            "AllBlocksCleared), past four times they are dropped whole; all counted."
        },
    )
    shed_above_frames: int = field(
        default=256,
        metadata={
            "help": "Queue depth (weighted frames) above which block stores are sampled "
            "(removals never are)."
        },
    )
    max_frame_bytes: int = field(
        default=INGEST_MAX_FRAME_BYTES,
        metadata={"help": "Event frames larger than this are rejected as malformed."},
    )
    max_sources: int = field(
        default=4096,
        metadata={
            "help": "Event sources whose last sequence number is kept (least recently heard "
            "forgotten first, counted), so a flood of source names cannot grow the table."
        },
    )
    request_timeout_s: float = field(
        default=900.0,
        metadata={
            "help": "A request running this long without a RequestFinished is finished by the "
            "daemon (counted in requests_expired), even while others run."
        },
    )
    max_running_requests: int = field(
        default=4096,
        metadata={
            "help": "Running requests the Engine tracks; past this the oldest is finished at "
            "once (requests_evicted), so a flood of unfinished requests stays bounded."
        },
    )
    max_active_workflows: int = field(
        default=256,
        metadata={
            "help": "Active workflows the Engine tracks; past this one is finished at once "
            "(workflows_evicted): of those that made a single call the least recently seen, "
            "then of the others. What a snapshot and a decision walk stays bounded."
        },
    )
    tick_interval_s: float = field(
        default=1.0, metadata={"help": "Seconds between idle-workflow checks (engine.tick)."}
    )
    heap_trim_interval_s: float = field(
        default=30.0,
        metadata={
            "help": "Seconds between returns of freed heap to the OS (glibc malloc_trim), so "
            "RSS falls back after a burst; 0 turns it off."
        },
    )
    idle_timeout_s: float = field(
        default=600.0, metadata={"help": "A workflow idle this long is inferred finished."}
    )
    snapshot_ttl_s: float = field(
        default=5.0, metadata={"help": "TTL written into each published snapshot."}
    )
    stats_interval_s: float = field(
        default=5.0, metadata={"help": "Seconds per cache_stats row in the history."}
    )
    sizing_interval_s: float = field(
        default=10.0, metadata={"help": "Seconds between MRC + sizing rows in the history."}
    )
    shards_rate: float = field(
        default=0.1, metadata={"help": "SHARDS starting sampling rate of the MRC estimator."}
    )
    shards_max_tracked_blocks: int = field(
        default=8192, metadata={"help": "SHARDS fixed-size bound on tracked blocks."}
    )
    sizing_coverage: float = field(
        default=0.9, metadata={"help": "Share of achievable reuse the host-tier size targets."}
    )
    history_flush_interval_s: float = field(
        default=0.5, metadata={"help": "History writer flush interval."}
    )
    history_retention_s: float | None = field(
        default=None, metadata={"help": "Drop history rows older than this (None: keep)."}
    )
    history_cpu_budget: float = field(
        default=0.25,
        metadata={
            "help": "Share of a core the history writer may spend on rows before it samples "
            "fewer block rows (as when it falls behind); 0: no budget."
        },
    )
    history_writer: str = field(
        default="process",
        metadata={
            "help": "Where the history writer runs: 'process' (a child process with its own "
            "interpreter lock, so that turning events into rows and DuckDB's statements do "
            "not slow the Engine) or 'thread' (in the daemon's process)."
        },
    )

    @classmethod
    def load(cls, overrides: Mapping[str, object] | None = None) -> DaemonSettings:
        """Defaults, then ``POLICYD_<NAME>`` environment variables, then ``overrides`` (flags;
        ``None`` values are ignored). Raises ``ValueError`` naming the bad variable."""
        values: dict[str, object] = {}
        for f in fields(cls):
            env = f.metadata.get("env", ENV_PREFIX + f.name.upper())
            raw = os.environ.get(env)
            if raw is not None:
                try:
                    values[f.name] = _parse(f.type, raw)
                except ValueError as exc:
                    raise ValueError(f"{env}={quote(raw)}: {exc}") from None
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        token_file = values.get("token_file")
        if token_file is not None and not values.get("token"):
            values["token"] = _read_token(Path(str(token_file)))
        settings = cls(**values)  # type: ignore[arg-type]
        settings.check()
        return settings

    def check(self) -> None:
        if self.policy not in online_policies():
            raise ValueError(
                f"unknown policy {quote(self.policy)}; valid: {', '.join(online_policies())}"
            )
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {quote(self.profile)}; valid: {', '.join(PROFILES)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {quote(value)}")
        for name in POSITIVE_SECONDS:
            value = getattr(self, name)
            if value is not None and not 0 < value <= MAX_SECONDS:
                raise ValueError(f"{name} must be in (0, {MAX_SECONDS:g}] s, got {quote(value)}")
        for name in ("max_sources", "max_running_requests", "max_active_workflows"):
            if not 1 <= getattr(self, name) <= 10_000_000:
                raise ValueError(f"{name} must be in [1, 10000000], got {getattr(self, name)}")
        if self.heap_trim_interval_s < 0:
            raise ValueError("heap_trim_interval_s must be >= 0 (0 turns it off)")
        if self.shed_above_frames >= self.ingest_queue_frames:
            raise ValueError("shed_above_frames must be below ingest_queue_frames")
        if self.history_cpu_budget < 0:
            raise ValueError("history_cpu_budget must be >= 0 (0: no budget)")
        if self.token is not None and not self.token.strip():
            raise ValueError("token is empty")
        if not self.token and not self.allow_open_http and not is_loopback(self.http_host):
            raise ValueError(
                f"refusing to serve the HTTP API on {quote(self.http_host, 80)} without a token: "
                "anyone who reaches it could change settings and read the history. Set one "
                "(POLICYD_API_TOKEN, or --token-file / POLICYD_TOKEN_FILE), bind loopback, or "
                "say --allow-open-http (POLICYD_ALLOW_OPEN_HTTP=true)"
            )
        if self.history_writer not in HISTORY_WRITERS:
            raise ValueError(
                f"unknown history_writer {quote(self.history_writer)}; valid: "
                f"{', '.join(HISTORY_WRITERS)}"
            )

    @property
    def checkpoint_path(self) -> Path:
        base = self.checkpoint_dir if self.checkpoint_dir is not None else self.db.parent
        return base / (self.db.stem + ".model.ckpt")

    def replace(self, **changes: object) -> DaemonSettings:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def describe(cls) -> list[tuple[str, str, str]]:
        """(field, environment variable, help) for every setting: the documentation."""
        return [
            (f.name, f.metadata.get("env", ENV_PREFIX + f.name.upper()), f.metadata["help"])
            for f in fields(cls)
        ]


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the API on this machine: a loopback address or
    ``localhost`` (``0.0.0.0``, ``::`` and other names are not).

    >>> [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "10.0.0.2", "")]
    [True, True, True, False, False, False]
    """
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def _read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token


def _parse(kind: object, raw: str) -> object:
    text = str(kind)
    if text == "bool":
        if raw.strip().lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
            raise ValueError("expected true/false (1/0, yes/no, on/off)")
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if "Path" in text:
        return Path(raw)
    if text.startswith("int"):
        return int(raw)
    if text.startswith("float"):
        return float(raw)
    return raw


def online_policies() -> list[str]:
    """Registered policies the daemon can run (offline oracles need the future)."""
    return sorted(name for name, cls in POLICIES.items() if cls.ordering != "oracle")


# ---- live tunables -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tunable:
    key: str
    type: type
    default: object
    help: str
    choices: tuple[str, ...] | None = None
    min: float | None = None
    max: float | None = None
    min_exclusive: bool = False

    def range_text(self) -> str:
        """The declared range, as error messages and the docs show it: ``(0, 1]``."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        low = "(" if self.min_exclusive else "["
        return f"{low}{_number(self.min)}, {_number(self.max)}]"

    def check(self, value: object) -> object:
        """The value converted to ``type``, or ``ValueError`` saying what is wrong (the range
        named, the bad value quoted to at most ``QUOTE_CHARS`` characters)."""
        if self.type is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{self.key} must be an integer, got {quote(value)}")
        elif self.type is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{self.key} must be a number, got {quote(value)}")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(
                    f"{self.key} must be a finite number in {self.range_text()}, got {quote(value)}"
                )
        elif not isinstance(value, str):
            raise ValueError(f"{self.key} must be a string, got {quote(value)}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.key} must be {self.range_text()}, got {quote(value)}")
        if isinstance(value, int | float):
            assert self.min is not None and self.max is not None  # declared (tunables())
            below = value <= self.min if self.min_exclusive else value < self.min
            if below or value > self.max:
                raise ValueError(f"{self.key} must be in {self.range_text()}, got {quote(value)}")
        return value

    def describe(self, value: object) -> dict[str, object]:
        return {
            "key": self.key,
            "value": value,
            "type": self.type.__name__,
            "help": self.help,
            "choices": list(self.choices) if self.choices is not None else None,
            "min": self.min,
            "max": self.max,
            "min_exclusive": self.min_exclusive,
        }


MAX_BLOCKS_SETTING: Final = 1_000_000  # prefetch budget, write-filter kappa
MAX_HOST_TIER_GIB: Final = 1024.0 * 1024.0  # 1 PiB: host blocks stay a finite integer


def _number(value: float | None) -> str:
    """1048576.0 -> '1048576', 0.05 -> '0.05' (a range as people write it)."""
    if value is None:
        return "?"
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def tunables() -> dict[str, Tunable]:
    """The live knobs (names final; HTTP_API.md), in display order. Every number has a range
    (``min``..``max``) inside which the daemon keeps working: a sizing of 1e308 GiB or a
    snapshot every 1e-300 s are refused, not applied."""
    items = [
        Tunable("policy", str, "pbkv", "Eviction/admission/prefetch policy.",
                choices=tuple(online_policies())),
        Tunable("lookahead_k", int, 3, "Steps of next-agent lookahead (PBKV's K).", min=1, max=8),
        Tunable("discount", float, 0.8, "Weight of step k+1 relative to step k in the lookahead "
                "score (PBKV's gamma).", min=0.0, max=1.0, min_exclusive=True),
        Tunable("prefetch_budget_blocks", int, 0, "Blocks staged/prefetched per snapshot "
                "(0: no prefetch).", min=0, max=MAX_BLOCKS_SETTING),
        Tunable("write_filter_mode", str, "conditioned", "Host-tier write filter of policies "
                "that have one (efficientagent): none = write all, fixed = always decline large "
                "refills, conditioned = only under pressure.",
                choices=("none", "fixed", "conditioned")),
        Tunable("write_filter_kappa_chunks", int, 8, "A request adding more than this many new "
                "chunks (1024 tokens each) is a large refill the filter may decline "
                "(EfficientAgent's kappa).", min=1, max=MAX_BLOCKS_SETTING),
        Tunable("write_filter_theta", float, 0.95, "Host-tier occupancy at or above which the "
                "tier counts as under pressure (write filter).", min=0.0, max=1.0,
                min_exclusive=True),
        Tunable("recency_guard", str, "on", "agentkv: publish vLLM's default (LRU, store "
                "everything) while its learned decisions hit less than a shadow LRU estimates "
                "(policies/guard.py).", choices=("on", "off")),
        Tunable("host_tier_gib", float, 256.0, "Current host-tier size (sizing and pressure).",
                min=0.0, max=MAX_HOST_TIER_GIB),
        Tunable("block_sample_rate", float, 1.0,
                "Share of block-level rows the history keeps at most (halved while its writer "
                "is behind).", min=0.0, max=1.0, min_exclusive=True),
        Tunable("snapshot_interval_s", float, 0.5, "Seconds between published snapshots.",
                min=0.05, max=3600.0),
        Tunable("history_publish_interval_s", float, 30.0, "Seconds between published history "
                "snapshot files (what SQL reads).", min=1.0, max=86400.0),
    ]  # fmt: skip
    return {t.key: t for t in items}


def validate_tunables(changes: Mapping[str, object]) -> tuple[dict[str, object], dict[str, str]]:
    """(converted values, errors per key). Apply only when ``errors`` is empty."""
    known = tunables()
    good: dict[str, object] = {}
    errors: dict[str, str] = {}
    for key, value in changes.items():
        tunable = known.get(key)
        if tunable is None:
            errors[key[:QUOTE_CHARS]] = f"unknown setting {quote(key)}; valid: {', '.join(known)}"
            continue
        try:
            good[key] = tunable.check(value)
        except ValueError as exc:
            errors[key] = str(exc)
    return good, errors


def default_tunables(policy: str) -> dict[str, object]:
    values = {key: t.default for key, t in tunables().items()}
    values["policy"] = policy
    return values
