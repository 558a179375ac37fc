"""The daemon's settings, each declared once: a pydantic field with its type, bounds and help.

Two kinds. ``DaemonSettings`` (pydantic-settings) are fixed for the life of the process
(endpoints, paths, the token, bounds on queues and tables); ``DaemonSettings.load(flags)``
reads them once with precedence defaults < settings file (``config``: ``--config`` /
``POLICYD_CONFIG``, TOML or JSON) < ``POLICYD_<NAME>`` environment variables < flags, and
raises ``ValueError`` naming each bad setting and where its value came from. ``policyd serve``
builds its flags from ``DaemonSettings.setting_fields()``.

``Tunables`` are the knobs the HTTP API and the dashboard change live. ``TunablesChange`` (the
same fields, none required, no others allowed) is the API's request schema; the JSON Schema of
``Tunables`` (``tunables_schema()``) is what the dashboard builds its form from.
``validate_tunables`` checks a whole change set before any of it is applied. Constructors
elsewhere receive narrow values, never these objects.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, Self, TypeAlias

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from policyd.core.names import ONLINE_POLICY_NAMES
from policyd.core.profiles import PROFILES
from policyd.core.ratelog import QUOTE_CHARS, quote
from policyd.core.wire import (
    DEFAULT_EVENTS_ENDPOINT,
    DEFAULT_HTTP_HOST,
    DEFAULT_HTTP_PORT,
    DEFAULT_SNAPSHOT_ENDPOINT,
)
from policyd.daemon.ingest import INGEST_MAX_FRAME_BYTES
from policyd.daemon.settings_fields import ErrorWording, FieldFacts, facts_of, number_text
from policyd.daemon.settings_file import CONFIG_FIELD, SettingsFileSource, read_settings_file

if TYPE_CHECKING:
    PolicyName: TypeAlias = str
    ProfileName: TypeAlias = str
else:  # the registries' names as Literal types: JSON Schema enums, argparse choices
    PolicyName = Literal[ONLINE_POLICY_NAMES]
    ProfileName = Literal[tuple(PROFILES)]

ENV_PREFIX: Final = "POLICYD_"
MAX_SECONDS: Final = 366 * 86400.0  # the longest interval or timeout a setting may name
MAX_TABLE_ENTRIES: Final = 10_000_000  # sources, running requests, active workflows
MAX_BLOCKS_SETTING: Final = 1_000_000  # prefetch budget, write-filter kappa
MAX_HOST_TIER_GIB: Final = 1024.0 * 1024.0  # 1 PiB: host blocks stay a finite integer
ZMQ_ENDPOINT: Final = re.compile(r"[a-z]+://\S+")


def _zmq_endpoint(value: str) -> str:
    if not ZMQ_ENDPOINT.fullmatch(value):
        raise ValueError(
            f"must be a ZeroMQ endpoint transport://address (tcp://127.0.0.1:5557, "
            f"ipc:///run/policyd.sock), got {quote(value)}"
        )
    return value


def _not_blank(value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise ValueError("is empty")
    return value


def _empty_is_none(value: object) -> object:
    """An environment variable set to '' reads as unset."""
    return None if isinstance(value, str) and not value.strip() else value


def _empty_is_false(value: object) -> object:
    """An environment variable set to '' reads as false (as unset would)."""
    return False if isinstance(value, str) and not value.strip() else value


# 0 s or 1e308 s would spin or overflow the thread that waits on them
Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS)]
Endpoint = Annotated[str, AfterValidator(_zmq_endpoint)]
OptionalEndpoint = Annotated[Endpoint | None, BeforeValidator(_empty_is_none)]
Switch = Annotated[bool, BeforeValidator(_empty_is_false)]
TableSize = Annotated[int, Field(ge=1, le=MAX_TABLE_ENTRIES)]


class DaemonSettings(BaseSettings):
    """Everything ``policyd serve`` is configured with; ``describe()`` lists the help text.

    Built by ``load()`` (which also reads the token file and checks the whole set);
    ``DaemonSettings(**values)`` reads the environment and the settings file too, as any
    pydantic-settings class does. Instances are immutable; ``replace()`` copies without
    validating, so whoever serves from a copy calls ``check()`` (``start_daemon`` does)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        frozen=True,
        allow_inf_nan=False,
        validate_by_name=True,
    )

    config: Path | None = Field(
        default=None,
        description="Settings file (TOML or JSON; its keys are these settings' names): under "
        "the environment and the flags in precedence.",
    )
    db: Path = Field(
        default=Path("policyd-history.duckdb"),
        description="History DuckDB file (created and migrated when missing).",
    )
    events: Endpoint = Field(
        default=DEFAULT_EVENTS_ENDPOINT,
        description="ZeroMQ endpoint the daemon binds a PULL socket on for event batches.",
    )
    snapshots: Endpoint = Field(
        default=DEFAULT_SNAPSHOT_ENDPOINT,
        description="ZeroMQ endpoint the daemon binds a PUB socket on for snapshots.",
    )
    http_host: str = Field(
        default=DEFAULT_HTTP_HOST, description="HTTP API bind address (loopback by default)."
    )
    http_port: int = Field(
        default=DEFAULT_HTTP_PORT, ge=0, le=65535, description="HTTP API port (0: pick a free one)."
    )
    token: Annotated[str | None, AfterValidator(_not_blank)] = Field(
        default=None,
        validation_alias="POLICYD_API_TOKEN",
        description="Bearer token required on admin routes (settings writes, checkpoint) and "
        "on /api/sql. On the command line (--token) every local user sees it in ps: prefer "
        "--token-file or POLICYD_API_TOKEN.",
    )
    token_file: Path | None = Field(
        default=None,
        description="File holding the bearer token (read at start, surrounding whitespace "
        "dropped): unlike --token, the secret is not on the command line, where ps shows it.",
    )
    allow_open_http: Switch = Field(
        default=False,
        description="Serve the HTTP API on a non-loopback address without a token. Without "
        "this, `policyd serve` refuses to: anyone who reaches the address could change "
        "settings and read the history.",
    )
    sql_without_token: Switch = Field(
        default=False,
        description="Let POST /api/sql answer without the bearer token when a token is set "
        "(by default it needs it, as the admin routes do).",
    )
    policy: PolicyName = Field(default="agentkv", description="Policy at start (a tunable later).")
    profile: ProfileName = Field(
        default="h200-llama3.1-8b",
        description="Hardware/model profile: KV bytes per block, GPU and host sizes.",
    )
    gpu_blocks: int | None = Field(
        default=None, ge=1, description="GPU KV blocks for sizing (default: the profile's)."
    )
    vllm_events: OptionalEndpoint = Field(
        default=None, description="vLLM KV-events PUB endpoint to subscribe to (tcp://host:port)."
    )
    vllm_replay: OptionalEndpoint = Field(
        default=None, description="vLLM KV-events replay (ROUTER) endpoint for gaps."
    )
    vllm_topic: str = Field(default="", description="vLLM KV-events topic ('' = all).")
    fleet: str | None = Field(
        default=None,
        description="NATS servers of the fleet (nats://host:4222[,nats://host2:4222...]): share "
        "what the models learn with the other replicas over JetStream (docs/FLEET.md).",
    )
    replica: str = Field(
        default_factory=lambda: (
            re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:64] or "replica"
        ),
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$",
        description="This replica's name in the fleet (a letter or digit, then letters, "
        "digits, - and _; default: the host name).",
    )
    fleet_stream_replicas: int = Field(
        default=1,
        ge=1,
        le=5,
        description="Replication of the fleet's JetStream stream (3 on a 3-node NATS cluster).",
    )
    fleet_interval_s: Seconds = Field(
        default=0.25,
        description="Seconds between publishing this replica's learning and block residency "
        "(what the fleet's router reads).",
    )
    fleet_endpoint: str = Field(
        default="",
        max_length=2048,
        description="This replica's vLLM base URL, announced to the fleet's router "
        "(http://host:8000).",
    )
    fleet_history: str | None = Field(
        default=None,
        max_length=4096,
        description="Where this replica exports its history as Parquet segments for fleet SQL: "
        "a shared directory (/dir, file:///dir) or a JetStream object store "
        "(nats://host:4222/bucket).",
    )
    fleet_history_interval_s: Seconds = Field(
        default=60.0, description="Seconds between two exports of history segments."
    )
    checkpoint_dir: Path | None = Field(
        default=None, description="Directory for model checkpoints (default: next to the db)."
    )
    checkpoint_interval_s: Seconds = Field(
        default=60.0, description="Seconds between periodic model checkpoints."
    )
    ingest_queue_frames: int = Field(
        default=4096,
        ge=1,
        description="Queue between the PULL socket and the Engine, in frames of 256 events or "
        "block events (a frame of 4,096 block events weighs 16): block stores are shed above "
        "shed_above_frames, falling to none kept at this depth; past twice this, frames keep "
        "only their closing events (RequestFinished, WorkflowFinished, AllBlocksCleared), past "
        "four times they are dropped whole; all counted.",
    )
    shed_above_frames: int = Field(
        default=256,
        ge=0,
        description="Queue depth (weighted frames) above which block stores are sampled "
        "(removals never are); below ingest_queue_frames.",
    )
    max_frame_bytes: int = Field(
        default=INGEST_MAX_FRAME_BYTES,
        ge=1,
        description="Event frames larger than this are rejected as malformed.",
    )
    max_sources: TableSize = Field(
        default=4096,
        description="Event sources whose last sequence number is kept (least recently heard "
        "forgotten first, counted), so a flood of source names cannot grow the table.",
    )
    request_timeout_s: Seconds = Field(
        default=900.0,
        description="A request running this long without a RequestFinished is finished by the "
        "daemon (counted in requests_expired), even while others run.",
    )
    max_running_requests: TableSize = Field(
        default=4096,
        description="Running requests the Engine tracks; past this the oldest is finished at "
        "once (requests_evicted), so a flood of unfinished requests stays bounded.",
    )
    max_active_workflows: TableSize = Field(
        default=256,
        description="Active workflows the Engine tracks; past this one is finished at once "
        "(workflows_evicted): of those that made a single call the least recently seen, then "
        "of the others. What a snapshot and a decision walk stays bounded.",
    )
    tick_interval_s: Seconds = Field(
        default=1.0, description="Seconds between idle-workflow checks (engine.tick)."
    )
    heap_trim_interval_s: float = Field(
        default=30.0,
        ge=0,
        le=MAX_SECONDS,
        description="Seconds between returns of freed heap to the OS (glibc malloc_trim), so "
        "RSS falls back after a burst; 0 turns it off.",
    )
    idle_timeout_s: Seconds = Field(
        default=600.0, description="A workflow idle this long is inferred finished."
    )
    snapshot_ttl_s: Seconds = Field(
        default=5.0, description="TTL written into each published snapshot."
    )
    stats_interval_s: Seconds = Field(
        default=5.0, description="Seconds per cache_stats row in the history."
    )
    sizing_interval_s: Seconds = Field(
        default=10.0, description="Seconds between MRC + sizing rows in the history."
    )
    shards_rate: float = Field(
        default=0.1, gt=0, le=1, description="SHARDS starting sampling rate of the MRC estimator."
    )
    shards_max_tracked_blocks: int = Field(
        default=8192, ge=1, description="SHARDS fixed-size bound on tracked blocks."
    )
    sizing_coverage: float = Field(
        default=0.9, gt=0, le=1, description="Share of achievable reuse the host-tier size targets."
    )
    history_flush_interval_s: Seconds = Field(
        default=0.5, description="History writer flush interval."
    )
    history_retention_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_SECONDS,
        description="Drop history rows older than this (default: keep them).",
    )
    history_cpu_budget: float = Field(
        default=0.25,
        ge=0,
        description="Share of a core the history writer may spend on rows before it samples "
        "fewer block rows (as when it falls behind); 0: no budget.",
    )
    history_writer: Literal["process", "thread"] = Field(
        default="process",
        description="Where the history writer runs: 'process' (a child process with its own "
        "interpreter lock, so that turning events into rows and DuckDB's statements do not "
        "slow the Engine) or 'thread' (in the daemon's process).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.shed_above_frames >= self.ingest_queue_frames:
            raise ValueError("shed_above_frames must be below ingest_queue_frames")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags (init arguments) > environment > settings file > defaults."""
        return init_settings, env_settings, SettingsFileSource(settings_cls)

    @classmethod
    def load(cls, overrides: Mapping[str, object] | None = None) -> DaemonSettings:
        """Defaults, then the settings file, then ``POLICYD_<NAME>`` environment variables,
        then ``overrides`` (flags; ``None`` values are ignored); the token read from
        ``token_file`` unless given; the whole set checked (``check()``). Raises
        ``ValueError`` naming each bad setting and where its value came from."""
        flags: dict[str, Any] = {k: v for k, v in (overrides or {}).items() if v is not None}
        try:
            settings = cls(**flags)
        except ValidationError as exc:
            raise ValueError(Provenance(cls, flags).explain(exc)) from None
        if settings.token_file is not None and not settings.token:
            settings = settings.replace(token=_read_token(settings.token_file))
        settings.check()
        return settings

    def check(self) -> None:
        """Raise ``ValueError`` unless every value is valid (a copy made by ``replace()`` was
        not validated) and the HTTP API stays on loopback or has a token (or is told
        ``allow_open_http``)."""
        probe = self.model_copy()
        try:
            self.__pydantic_validator__.validate_python(self.model_dump(), self_instance=probe)
        except ValidationError as exc:
            raise ValueError(_explain(FIXED_WORDS, exc)) from None
        if not self.token and not self.allow_open_http and not is_loopback(self.http_host):
            raise ValueError(
                f"refusing to serve the HTTP API on {quote(self.http_host, 80)} without a token: "
                "anyone who reaches it could change settings and read the history. Set one "
                "(POLICYD_API_TOKEN, or --token-file / POLICYD_TOKEN_FILE), bind loopback, or "
                "say --allow-open-http (POLICYD_ALLOW_OPEN_HTTP=true)"
            )

    @property
    def checkpoint_path(self) -> Path:
        base = self.checkpoint_dir if self.checkpoint_dir is not None else self.db.parent
        return base / (self.db.stem + ".model.ckpt")

    def replace(self, **changes: object) -> DaemonSettings:
        """A copy with ``changes`` (field names), not validated: see ``check()``."""
        return self.model_copy(update=changes)

    @classmethod
    def env_name(cls, name: str) -> str:
        """The environment variable that sets field ``name``."""
        alias = cls.model_fields[name].validation_alias
        return alias if isinstance(alias, str) else ENV_PREFIX + name.upper()

    @classmethod
    def setting_fields(cls) -> list[FieldFacts]:
        """Every setting's type, choices, bounds, help and default, in declaration order."""
        return list(FIXED_FACTS.values())

    @classmethod
    def describe(cls) -> list[tuple[str, str, str]]:
        """(field, environment variable, help) for every setting: the documentation."""
        return [(f.name, cls.env_name(f.name), f.help) for f in cls.setting_fields()]


FIXED_FACTS: Final = facts_of(DaemonSettings.model_fields)
FIXED_WORDS: Final = ErrorWording(
    FIXED_FACTS,
    {DaemonSettings.env_name(name): name for name in FIXED_FACTS},
    unknown_choice=True,
)


def _explain(words: ErrorWording, exc: ValidationError) -> str:
    return "; ".join(words.explain_all(exc.errors()).values())


@dataclass(frozen=True, slots=True)
class Provenance:
    """Where each setting's value came from when ``DaemonSettings`` refused it: the flag
    (named plainly), the environment variable (``POLICYD_X='bad': ...``) or the settings file
    (``settings file PATH: ...``)."""

    settings_cls: type[DaemonSettings]
    flags: Mapping[str, object]

    def explain(self, exc: ValidationError) -> str:
        messages = []
        for error in exc.errors():
            name = FIXED_WORDS.field_name(error)
            messages.append(self.origin(name) + FIXED_WORDS.explain(error))
        return "; ".join(dict.fromkeys(messages))

    def origin(self, name: str) -> str:
        if not name or name in self.flags:
            return ""
        if name in self.settings_cls.model_fields:
            env = self.settings_cls.env_name(name)
            raw = _environ_lower().get(env.lower())
            if raw is not None:
                return f"{env}={quote(raw)}: "
        path = self.flags.get(CONFIG_FIELD) or _environ_lower().get(
            self.settings_cls.env_name(CONFIG_FIELD).lower()
        )
        if path and name in read_settings_file(Path(str(path)), self.settings_cls.model_fields):
            return f"settings file {path}: "
        return ""


def _environ_lower() -> dict[str, str]:
    """The environment as pydantic-settings reads it (names case-insensitive)."""
    return {key.lower(): value for key, value in os.environ.items()}


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


def online_policies() -> list[str]:
    """Registered policies the daemon can run (offline oracles need the future): the names
    the settings declare (``policyd.core.names.ONLINE_POLICY_NAMES``), read from the registry
    itself, which costs seconds to import."""
    from policyd.policies import POLICIES  # noqa: PLC0415 - see the docstring

    return sorted(name for name, cls in POLICIES.items() if cls.ordering != "oracle")


# ---- live tunables -------------------------------------------------------------------------------


class Tunables(BaseModel):
    """The live knobs (names final; docs/API.md), in display order, with their defaults.

    Values are taken as they are (no conversion but int -> float): ``true`` is no integer and
    ``"3"`` no number. Every number has a range inside which the daemon keeps working: a sizing
    of 1e308 GiB or a snapshot every 1e-300 s are refused, not applied."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)

    policy: PolicyName = Field(default="agentkv", description="Eviction/admission/prefetch policy.")
    lookahead_k: int = Field(
        default=3, ge=1, le=8, description="Steps of next-agent lookahead (PBKV's K)."
    )
    discount: float = Field(
        default=0.8,
        gt=0.0,
        le=1.0,
        description="Weight of step k+1 relative to step k in the lookahead score (PBKV's gamma).",
    )
    prefetch_budget_blocks: int = Field(
        default=0,
        ge=0,
        le=MAX_BLOCKS_SETTING,
        description="Blocks staged/prefetched per snapshot (0: no prefetch).",
    )
    write_filter_mode: Literal["none", "fixed", "conditioned"] = Field(
        default="conditioned",
        description="Host-tier write filter of policies that have one (efficientagent): none = "
        "write all, fixed = always decline large refills, conditioned = only under pressure.",
    )
    write_filter_kappa_chunks: int = Field(
        default=8,
        ge=1,
        le=MAX_BLOCKS_SETTING,
        description="A request adding more than this many new chunks (1024 tokens each) is a "
        "large refill the filter may decline (EfficientAgent's kappa).",
    )
    write_filter_theta: float = Field(
        default=0.95,
        gt=0.0,
        le=1.0,
        description="Host-tier occupancy at or above which the tier counts as under pressure "
        "(write filter).",
    )
    recency_guard: Literal["on", "off"] = Field(
        default="on",
        description="agentkv: publish vLLM's default (LRU, store everything) unless a sampled "
        "shadow of its learned decisions, or of its write filter alone, hits more than a shadow "
        "of vLLM's default on the same traffic (policies/guard.py).",
    )
    host_tier_gib: float = Field(
        default=256.0,
        ge=0.0,
        le=MAX_HOST_TIER_GIB,
        description="Current host-tier size (sizing and pressure).",
    )
    block_sample_rate: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        description="Share of block-level rows the history keeps at most (halved while its "
        "writer is behind).",
    )
    snapshot_interval_s: float = Field(
        default=0.5, ge=0.05, le=3600.0, description="Seconds between published snapshots."
    )
    history_publish_interval_s: float = Field(
        default=30.0,
        ge=1.0,
        le=86400.0,
        description="Seconds between published history snapshot files (what SQL reads).",
    )


def _unset() -> None:
    return None


def _none_required(model: type[BaseModel], name: str, doc: str) -> type[BaseModel]:
    """``model``'s fields with the same types, bounds and help, none required and no others
    allowed: a change set. A key given must hold a valid value (``null`` is none); read the
    keys given with ``model_dump(exclude_unset=True)``."""
    fields: dict[str, Any] = {
        key: (
            Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation,
            Field(default_factory=_unset, description=info.description),
        )
        for key, info in model.model_fields.items()
    }
    return create_model(name, __config__=model.model_config, __doc__=doc, **fields)


TunablesChange: Final = _none_required(
    Tunables,
    "TunablesChange",
    "A change of some tunables: each key given is validated as in Tunables; all or none apply.",
)
TUNABLE_FACTS: Final = facts_of(Tunables.model_fields)
TUNABLE_WORDS: Final = ErrorWording(TUNABLE_FACTS, {})


@dataclass(frozen=True, slots=True)
class Tunable:
    """One tunable as the API lists it (``describe``), read from the ``Tunables`` field."""

    key: str
    type: type
    default: object
    help: str
    choices: tuple[str, ...] | None
    min: float | None
    max: float | None
    min_exclusive: bool

    @classmethod
    def of(cls, facts: FieldFacts) -> Tunable:
        return cls(
            key=facts.name,
            type=facts.type,
            default=facts.default,
            help=facts.help,
            choices=facts.choices,
            min=facts.bounds.low,
            max=facts.bounds.high,
            min_exclusive=facts.bounds.low_exclusive,
        )

    def range_text(self) -> str:
        """The declared range, as error messages and the docs show it: ``(0, 1]``."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        low = "(" if self.min_exclusive else "["
        return f"{low}{_number(self.min)}, {_number(self.max)}]"

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


def _number(value: float | None) -> str:
    return "?" if value is None else number_text(value)


def tunables() -> dict[str, Tunable]:
    """The live knobs in display order (``Tunables``' fields)."""
    return {key: Tunable.of(facts) for key, facts in TUNABLE_FACTS.items()}


def tunables_schema() -> dict[str, Any]:
    """The JSON Schema of ``Tunables``: per key its type, bounds (``minimum`` or
    ``exclusiveMinimum``, ``maximum``), choices (``enum``), help (``description``), default."""
    return Tunables.model_json_schema()


def validate_tunables(changes: Mapping[str, object]) -> tuple[dict[str, object], dict[str, str]]:
    """(converted values, errors per key). Apply only when ``errors`` is empty. Each key is
    judged on its own: the good ones are converted even when others are refused."""
    errors: dict[str, str] = {}
    bad: set[object] = set()
    for key in changes:
        if not isinstance(key, str):
            errors[quote(key)] = f"unknown setting {quote(key)}; valid: {', '.join(TUNABLE_FACTS)}"
            bad.add(key)
    try:
        TunablesChange.model_validate({k: v for k, v in changes.items() if k not in bad})
    except ValidationError as exc:
        for error in exc.errors():
            if error["loc"]:
                bad.add(error["loc"][0])
        errors.update(TUNABLE_WORDS.explain_all(exc.errors()))
    valid = TunablesChange.model_validate({k: v for k, v in changes.items() if k not in bad})
    good: dict[str, object] = valid.model_dump(exclude_unset=True)
    return good, {key[:QUOTE_CHARS]: message for key, message in errors.items()}


def default_tunables(policy: str) -> dict[str, object]:
    values: dict[str, object] = Tunables().model_dump()
    values["policy"] = policy
    return values
