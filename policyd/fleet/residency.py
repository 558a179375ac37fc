"""A daemon's block residency as compact updates for the fleet's routing index.

Every replica's daemon feeds its ``ResidencyFeed`` each event its engine applies; the fleet link
publishes ``drain()`` (a ``ResidencyUpdate``: what changed since the previous drain) about every
100-250 ms and ``full()`` (a ``ResidencyState``: everything a router needs) every few seconds on
core NATS subject ``agentkv.residency.<replica>`` (``subject(replica)``). A router
(``policyd.fleet.routing.PrefixIndex``) applies them in ``seq`` order; a gap (a lost update, a
router that joined late, a daemon that restarted with a new ``epoch``) is healed by the next full
state.

What travels, and what does not:

* blocks stored / removed per tier (``gpu``, ``host``) as the **net** change over the window
  (a block stored then removed within one window travels as removed only), and the tiers
  cleared during the window (the receiver clears first, then removes, then stores: the same
  end state as the events in order);
* per workflow, its **last** call in the window: agent and the prompt's block hashes once (not
  per tier), and the workflows that finished;
* ``running``: the replica's requests started and not finished (its load, as the engine sees it).

Applying an update is idempotent over a state that already includes it (a full state taken
between two drains includes the pending changes and carries the previous drain's ``seq``; the
next update then changes nothing), so a router may apply a full state and then the update that
follows it in any interleaving the link produces.

Size: a block costs about 9 bytes in a frame, so a full state of more than about 110,000
resident blocks (GPU and host together) exceeds NATS's default ``max_payload`` of 1 MiB; a
fleet with larger tiers raises the servers' ``max_payload`` (up to 64 MiB) until full states
are sent in parts (not done yet).

Block-level events (``BlocksStored``, ``BlocksRemoved``, ``BlocksLoaded``) cost the feed a few
set operations in C (no per-block Python loop); ``RequestStarted`` a dict update.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Final, TypeVar

import msgspec

from policyd.core.types import (
    AllBlocksCleared,
    BlocksLoaded,
    BlocksRemoved,
    BlocksStored,
    Event,
    RequestFinished,
    RequestStarted,
    Tier,
    WorkflowFinished,
)

T = TypeVar("T")

SUBJECT_PREFIX: Final = "agentkv.residency"
MAX_WORKFLOWS: Final = 65_536  # active workflows a feed remembers (oldest call forgotten first)
MAX_PROMPT_BLOCKS: Final = 65_536  # a prompt's leading blocks kept (about 1M tokens)
MAX_RUNNING: Final = 262_144  # running requests counted (a lost finish is forgotten oldest first)
FULL_INTERVAL_S: Final = 3.0
# a message's size at most: NATS servers' default max_payload (1 MiB), less room for headers
MAX_MESSAGE_BYTES: Final = 1_000_000
MAX_PARTS: Final = 4096
RESIDENCY_VERSION: Final = 1


def subject(replica: str) -> str:
    """The core NATS subject a replica's residency is published on."""
    return f"{SUBJECT_PREFIX}.{replica}"


def new_epoch() -> int:
    """A random 63-bit number naming one run of a feed (a restarted daemon starts a new one)."""
    return int.from_bytes(os.urandom(8), "big") >> 1


class _Row(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True, gc=False):
    """Base of the messages' parts: encoded as arrays, untracked by the cyclic GC."""


class WorkflowCall(_Row, frozen=True):
    """A workflow's last call on a replica: its agent and its prompt's full blocks, in order."""

    workflow_id: str
    agent: str
    block_hashes: tuple[int, ...]


class TierChange(_Row, frozen=True):
    """One tier's net change over a window: cleared first, then removed, then stored."""

    tier: Tier
    cleared: bool = False
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()


class _Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Base of the two messages (tagged: a frame says which it is)."""


class ResidencyUpdate(_Message, frozen=True, tag="update"):
    """What changed on ``replica`` since update ``seq - 1`` of the same ``epoch``."""

    replica: str
    epoch: int
    seq: int
    ts: float
    running: int = 0
    tiers: tuple[TierChange, ...] = ()
    calls: tuple[WorkflowCall, ...] = ()
    finished: tuple[str, ...] = ()


class ResidencyState(_Message, frozen=True, tag="state"):
    """Everything routing needs from ``replica``, as of update ``seq`` of ``epoch`` (and any
    change observed after it: see the module's note on idempotence). ``endpoint`` is the
    replica's vLLM base URL (``http://host:8000``), where a proxy sends its requests."""

    replica: str
    epoch: int
    seq: int
    ts: float
    endpoint: str = ""
    running: int = 0
    gpu: tuple[int, ...] = ()
    host: tuple[int, ...] = ()
    workflows: tuple[WorkflowCall, ...] = ()
    # a state too large for one NATS message travels in ``parts`` messages (``part`` 0..n-1)
    # of the same epoch and seq, each with a slice of gpu, host and workflows
    part: int = 0
    parts: int = 1


Residency = ResidencyUpdate | ResidencyState


class _Envelope(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    version: int
    message: Residency


class ResidencyError(ValueError):
    """A residency message could not be decoded (not msgpack, wrong version, wrong types)."""


_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(_Envelope)


def encode(message: Residency) -> bytes:
    """``message`` as a versioned msgpack frame."""
    return _ENCODER.encode(_Envelope(RESIDENCY_VERSION, message))


def decode(frame: bytes | bytearray | memoryview) -> Residency:
    """The message in ``frame``; ``ResidencyError`` for anything else."""
    try:
        envelope = _DECODER.decode(frame)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ResidencyError(f"not a residency frame: {exc}") from exc
    if envelope.version != RESIDENCY_VERSION:
        raise ResidencyError(f"residency version {envelope.version} is not supported")
    return envelope.message


class _Pending:
    """One tier's changes since the last drain (the net effect, as sets)."""

    __slots__ = ("cleared", "removed", "stored")

    def __init__(self) -> None:
        self.cleared = False
        self.stored: set[int] = set()
        self.removed: set[int] = set()

    def __bool__(self) -> bool:
        return self.cleared or bool(self.stored) or bool(self.removed)

    def change(self, tier: Tier) -> TierChange:
        return TierChange(tier, self.cleared, tuple(self.stored), tuple(self.removed))


class ResidencyFeed:
    """One replica's residency, kept from the events its engine applies.

    Thread safety: ``observe`` (the engine's thread), ``drain`` and ``full`` (the link's thread
    or event loop) may run concurrently; one lock guards the state, held by ``observe`` for a
    few set operations and by ``full`` while it copies the resident sets (O(resident blocks),
    every few seconds). Encoding runs outside the lock.

    Lossy by design: only the last call of each workflow in a window travels, a prompt keeps
    its first ``max_prompt_blocks`` blocks, and at most ``max_workflows`` active workflows are
    remembered (the one whose last call is oldest is forgotten first, without a finish).
    """

    def __init__(
        self,
        replica: str,
        *,
        endpoint: str = "",
        epoch: int | None = None,
        clock: Callable[[], float] = time.time,
        max_workflows: int = MAX_WORKFLOWS,
        max_prompt_blocks: int = MAX_PROMPT_BLOCKS,
    ) -> None:
        if "." in replica or not replica or any(c in replica for c in " *>\t\r\n"):
            raise ValueError(f"replica name {replica!r} is not a single NATS subject token")
        self.replica = replica
        self.endpoint = endpoint
        self.epoch = new_epoch() if epoch is None else epoch
        self._clock = clock
        self._max_workflows = max_workflows
        self._max_prompt_blocks = max_prompt_blocks
        self._lock = threading.Lock()
        self._seq = 0
        self._resident: dict[Tier, set[int]] = {"gpu": set(), "host": set()}
        self._pending: dict[Tier, _Pending] = {"gpu": _Pending(), "host": _Pending()}
        self._workflows: dict[str, WorkflowCall] = {}
        self._calls: dict[str, WorkflowCall] = {}
        self._finished: set[str] = set()
        self._running: dict[str, None] = {}
        self._running_changed = False
        self._handlers: dict[type, Callable[[Event], None]] = {
            BlocksStored: self._stored,
            BlocksLoaded: self._loaded,
            BlocksRemoved: self._removed,
            AllBlocksCleared: self._cleared,
            RequestStarted: self._started,
            RequestFinished: self._request_finished,
            WorkflowFinished: self._workflow_finished,
        }

    @property
    def seq(self) -> int:
        """The number of the last update drained (0: none yet)."""
        return self._seq

    def observe(self, event: Event) -> None:
        """Take one applied event into account; events that do not change residency are
        ignored. Cheap: a dict lookup, a lock, a few C-level set operations."""
        handler = self._handlers.get(type(event))
        if handler is not None:
            with self._lock:
                handler(event)

    def observe_all(self, events: tuple[Event, ...] | list[Event]) -> None:
        """``observe`` for each event of a batch, taking the lock once."""
        handlers = self._handlers
        with self._lock:
            for event in events:
                handler = handlers.get(type(event))
                if handler is not None:
                    handler(event)

    def drain(self) -> bytes | None:
        """The changes since the last drain as an encoded ``ResidencyUpdate`` numbered
        ``seq + 1``, or None when nothing changed (no number is used then)."""
        with self._lock:
            tiers = tuple(p.change(t) for t, p in self._pending.items() if p)
            calls = tuple(self._calls.values())
            finished = tuple(self._finished)
            if not (tiers or calls or finished or self._running_changed):
                return None
            self._pending = {"gpu": _Pending(), "host": _Pending()}
            self._calls = {}
            self._finished = set()
            self._running_changed = False
            self._seq += 1
            update = ResidencyUpdate(
                replica=self.replica,
                epoch=self.epoch,
                seq=self._seq,
                ts=self._clock(),
                running=len(self._running),
                tiers=tiers,
                calls=calls,
                finished=finished,
            )
        return encode(update)

    def state(self) -> ResidencyState:
        """The whole residency now (as of ``seq``, plus any change not drained yet)."""
        with self._lock:
            return ResidencyState(
                replica=self.replica,
                epoch=self.epoch,
                seq=self._seq,
                ts=self._clock(),
                endpoint=self.endpoint,
                running=len(self._running),
                gpu=tuple(self._resident["gpu"]),
                host=tuple(self._resident["host"]),
                workflows=tuple(self._workflows.values()),
            )

    def full(self) -> bytes:
        """``state()`` encoded: what the link republishes every few seconds."""
        return encode(self.state())

    def full_parts(self, max_bytes: int = MAX_MESSAGE_BYTES) -> list[bytes]:
        """``state()`` encoded in as few parts as keep each under ``max_bytes`` (a NATS
        server's ``max_payload``): one part for a state that fits."""
        state = self.state()
        parts = 1
        while True:
            frames = [encode(p) for p in split_state(state, parts)]
            if all(len(f) <= max_bytes for f in frames) or parts >= MAX_PARTS:
                return frames
            parts = max(parts * 2, -(-sum(map(len, frames)) // max_bytes) + 1)

    # ---- handlers (called with the lock held) ----

    def _store(self, tier: Tier, hashes: tuple[int, ...]) -> None:
        self._resident[tier].update(hashes)
        pending = self._pending[tier]
        pending.stored.update(hashes)
        pending.removed.difference_update(hashes)

    def _stored(self, event: Event) -> None:
        assert isinstance(event, BlocksStored)
        self._store(event.tier, event.block_hashes)

    def _loaded(self, event: Event) -> None:
        assert isinstance(event, BlocksLoaded)
        self._store("gpu", event.block_hashes)

    def _removed(self, event: Event) -> None:
        assert isinstance(event, BlocksRemoved)
        self._resident[event.tier].difference_update(event.block_hashes)
        pending = self._pending[event.tier]
        pending.removed.update(event.block_hashes)
        pending.stored.difference_update(event.block_hashes)

    def _cleared(self, event: Event) -> None:
        assert isinstance(event, AllBlocksCleared)
        self._resident[event.tier].clear()
        pending = self._pending[event.tier]
        pending.cleared = True
        pending.stored.clear()
        pending.removed.clear()

    def _started(self, event: Event) -> None:
        assert isinstance(event, RequestStarted)
        running = self._running
        running[event.request_id] = None
        if len(running) > MAX_RUNNING:
            del running[next(iter(running))]
        self._running_changed = True
        hashes = event.block_hashes
        if len(hashes) > self._max_prompt_blocks:
            hashes = hashes[: self._max_prompt_blocks]
        call = WorkflowCall(event.workflow_id, event.agent, hashes)
        workflows = self._workflows
        workflows.pop(event.workflow_id, None)  # the newest call goes to the end
        workflows[event.workflow_id] = call
        if len(workflows) > self._max_workflows:
            del workflows[next(iter(workflows))]
        self._calls[event.workflow_id] = call
        self._finished.discard(event.workflow_id)

    def _request_finished(self, event: Event) -> None:
        assert isinstance(event, RequestFinished)
        if self._running.pop(event.request_id, 0) is None:
            self._running_changed = True

    def _workflow_finished(self, event: Event) -> None:
        assert isinstance(event, WorkflowFinished)
        self._workflows.pop(event.workflow_id, None)
        self._calls.pop(event.workflow_id, None)
        self._finished.add(event.workflow_id)


def _slice(items: tuple[T, ...], part: int, parts: int) -> tuple[T, ...]:
    size = -(-len(items) // parts)
    return items[part * size : (part + 1) * size]


def split_state(state: ResidencyState, parts: int) -> list[ResidencyState]:
    """``state`` as ``parts`` states of the same epoch and seq, each a slice of its blocks and
    workflows (``join_parts`` puts them back together)."""
    if parts <= 1:
        return [state]
    return [
        msgspec.structs.replace(
            state,
            gpu=_slice(state.gpu, i, parts),
            host=_slice(state.host, i, parts),
            workflows=_slice(state.workflows, i, parts),
            part=i,
            parts=parts,
        )
        for i in range(parts)
    ]


def join_parts(parts: list[ResidencyState]) -> ResidencyState:
    """The state the ``parts`` of one split carry (every part, any order)."""
    ordered = sorted(parts, key=lambda p: p.part)
    return msgspec.structs.replace(
        ordered[0],
        gpu=tuple(b for p in ordered for b in p.gpu),
        host=tuple(b for p in ordered for b in p.host),
        workflows=tuple(w for p in ordered for w in p.workflows),
        part=0,
        parts=1,
    )


class ResidencyPublisher:
    """What a link publishes each tick for one feed: the drained update (if any) and, every
    ``full_interval_s``, the full state, as ``(subject, payload)`` pairs (the shape of
    ``policyd.fleet.link.FleetLink``'s ``extra_publish``). Call it from one thread."""

    def __init__(
        self,
        feed: ResidencyFeed,
        *,
        full_interval_s: float = FULL_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self.feed = feed
        self.max_bytes = max_bytes
        self.subject = subject(feed.replica)
        self.full_interval_s = full_interval_s
        self._clock = clock
        self._last_full: float | None = None

    def __call__(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        update = self.feed.drain()
        if update is not None:
            out.append((self.subject, update))
        now = self._clock()
        if self._last_full is None or now - self._last_full >= self.full_interval_s:
            self._last_full = now
            out.extend((self.subject, frame) for frame in self.feed.full_parts(self.max_bytes))
        return out
