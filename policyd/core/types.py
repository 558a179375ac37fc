"""The vocabulary every part of AgentKV speaks: keys, tiers, events, decisions, the wire codec.

Events are past-tense facts sent by a connector (or the simulator) to the daemon; decisions are
imperative and carry a short human ``reason``. Both are tagged, frozen msgspec structs, so one
decoder turns a frame back into the right type (``{"type": "BlocksStored", ...}``).

On the wire a frame is a msgpack array ``[protocol_version, payload]``. A frame that is not
msgpack, has the wrong version, the wrong types, or is larger than ``MAX_FRAME_BYTES`` raises
``CodecError`` and nothing else.

Block hashes are 64-bit integers. vLLM's own are 32-byte sha256 digests chained over the parent
hash and the block's tokens; the connector keeps their first 8 bytes (big-endian), which is
collision-free in practice at cache sizes and halves the bytes on the wire.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat
from typing import Final, Generic, Literal, NewType, TypeVar

import msgspec

PROTOCOL_VERSION: Final = 1
BLOCK_SIZE_TOKENS: Final = 16  # vLLM's default KV block size on GPUs
MAX_FRAME_BYTES: Final = 64 * 1024 * 1024

BlockHash = NewType("BlockHash", int)
RequestId = NewType("RequestId", str)
WorkflowId = NewType("WorkflowId", str)
AgentName = NewType("AgentName", str)

Tier = Literal["gpu", "host"]
TIERS: Final[tuple[Tier, ...]] = ("gpu", "host")
HintValue = str | int | float | bool | None


class _Fact(
    msgspec.Struct, frozen=True, kw_only=True, tag=True, forbid_unknown_fields=True, gc=False
):
    """Base of every event: ``ts`` is the source's monotonic clock in seconds.

    Events (and batches) are not tracked by the cyclic garbage collector (``gc=False``: they
    hold numbers, strings, tuples and a hints dict, never themselves): a daemon whose ingest
    queue holds a backlog of millions of them would otherwise walk them all, with the
    interpreter lock held, at every full collection."""

    ts: float


class RequestStarted(_Fact, frozen=True, kw_only=True, tag=True):
    """A request was admitted. ``block_hashes`` are its prompt's full blocks, in order."""

    request_id: str
    workflow_id: str
    agent: str
    workflow_type: str = ""
    block_hashes: tuple[int, ...] = ()
    prompt_tokens: int = 0
    hints: dict[str, HintValue] = {}
    session_id: str | None = None


class PrefixHit(_Fact, frozen=True, kw_only=True, tag=True):
    """How a request's prompt blocks were served: GPU prefix, then host prefix, then recomputed."""

    request_id: str
    gpu_blocks: int
    host_blocks: int
    recomputed_blocks: int


class BlocksStored(_Fact, frozen=True, kw_only=True, tag=True):
    """Blocks became resident (cached) in a tier."""

    tier: Tier
    block_hashes: tuple[int, ...]
    request_id: str | None = None


class BlocksRemoved(_Fact, frozen=True, kw_only=True, tag=True):
    """Blocks left a tier (evicted or dropped)."""

    tier: Tier
    block_hashes: tuple[int, ...]


class BlocksLoaded(_Fact, frozen=True, kw_only=True, tag=True):
    """Blocks were copied host -> GPU, for a request or as a prefetch (``request_id`` None)."""

    block_hashes: tuple[int, ...]
    request_id: str | None = None


class AllBlocksCleared(_Fact, frozen=True, kw_only=True, tag=True):
    """A tier was reset (vLLM's ``AllBlocksCleared``)."""

    tier: Tier


class RequestFinished(_Fact, frozen=True, kw_only=True, tag=True):
    request_id: str
    output_tokens: int = 0


class WorkflowFinished(_Fact, frozen=True, kw_only=True, tag=True):
    """A workflow ended: said by the client (``workflow_done``) or inferred after idling."""

    workflow_id: str
    reason: Literal["client", "idle"] = "client"


Event = (
    RequestStarted
    | PrefixHit
    | BlocksStored
    | BlocksRemoved
    | BlocksLoaded
    | AllBlocksCleared
    | RequestFinished
    | WorkflowFinished
)

# the events that name blocks on a tier (what ingest sheds and the history samples)
BLOCK_LEVEL: Final = (BlocksStored, BlocksRemoved, BlocksLoaded)


class EventBatch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Events from one source, numbered: a gap in ``seq`` is counted by the receiver, not fatal."""

    source: str
    seq: int
    events: tuple[Event, ...]


# ---- decisions ---------------------------------------------------------------------------------


class _Decision(msgspec.Struct, frozen=True, kw_only=True, tag=True, forbid_unknown_fields=True):
    reason: str = ""


class Evict(_Decision, frozen=True, kw_only=True, tag=True):
    tier: Tier
    block_hashes: tuple[int, ...]


class Admit(_Decision, frozen=True, kw_only=True, tag=True):
    """Which of a request's new blocks to write to the host tier; the rest are declined."""

    request_id: str
    block_hashes: tuple[int, ...]
    declined: tuple[int, ...] = ()


class Prefetch(_Decision, frozen=True, kw_only=True, tag=True):
    block_hashes: tuple[int, ...]


Decision = Evict | Admit | Prefetch

WriteFilterMode = Literal["none", "fixed", "conditioned"]


class ScoredBlocks(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A group of blocks sharing one score (lower = evict first)."""

    score: float
    block_hashes: tuple[int, ...]


def score_map(groups: Iterable[ScoredBlocks]) -> dict[int, float]:
    """Every block's score; a block named by two groups takes the later group's score, as a
    tier applying the groups in order would."""
    scores: dict[int, float] = {}
    update = scores.update
    for group in groups:
        update(zip(group.block_hashes, repeat(group.score)))  # (no dict per group)
    return scores


class WriteFilter(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Host-tier admission: ``none`` writes everything; ``fixed`` always declines requests adding
    more than ``max_new_blocks``; ``conditioned`` does so only while ``pressure`` holds."""

    mode: WriteFilterMode = "none"
    max_new_blocks: int = 0
    pressure: bool = False


class PolicySnapshot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The daemon's decisions, pushed to connectors and applied locally in O(1) per call.

    A connector treats a snapshot older than ``ttl_s`` as absent and falls back to LRU with
    store-everything. Blocks not named in ``scores`` rank by recency among themselves, after
    every scored block whose score is below ``default_score``.

    ``host_scores``, when given, orders the host tier instead of ``scores`` (same rules, same
    ``default_score``): what is worth a host copy is not what is worth a GPU slot (a block the
    GPU keeps needs no copy; one it drops next is the copy's use). ``None`` (the default):
    ``scores`` orders both tiers.

    ``inherit_scores``: a block stored after this snapshot that ``scores`` does not name (a
    call's output, the new part of a prompt) takes, until a snapshot names it, the score of the
    nearest named block before it in the request that stored it, instead of ``default_score``:
    the policy could not name a block that did not exist yet, and a call's new blocks are worth
    what its prompt is worth. No tier applies it today: vLLM's GPU tier (and the simulator's,
    which makes the same moves, ``policyd.tiers.gpu``) keeps its LRU among the blocks a
    snapshot did not rank, where fresh blocks are the most recent anyway.
    """

    version: int
    ts: float
    ttl_s: float
    policy: str
    scores: tuple[ScoredBlocks, ...] = ()
    default_score: float = 0.0
    retired_workflows: tuple[str, ...] = ()
    write_filter: WriteFilter = WriteFilter()
    pin: tuple[int, ...] = ()
    stage: tuple[int, ...] = ()
    host_scores: tuple[ScoredBlocks, ...] | None = None
    inherit_scores: bool = False


# ---- the codec ---------------------------------------------------------------------------------


class CodecError(ValueError):
    """A frame could not be decoded: not msgpack, wrong protocol version, wrong types, too large."""


class _Header(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    version: int
    payload: msgspec.Raw


T = TypeVar("T")


class Codec(Generic[T]):
    """Encodes one message type into versioned msgpack frames and back.

    >>> codec = Codec(EventBatch)
    >>> batch = EventBatch(source="a", seq=1, events=(WorkflowFinished(ts=1.0, workflow_id="w"),))
    >>> codec.decode(codec.encode(batch)) == batch
    True
    """

    def __init__(self, kind: type[T], *, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.kind = kind
        self.max_frame_bytes = max_frame_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._header = msgspec.msgpack.Decoder(_Header)
        self._payload = msgspec.msgpack.Decoder(kind)

    def encode(self, message: T) -> bytes:
        return self._encoder.encode((PROTOCOL_VERSION, message))

    def check_size(self, frame: bytes | bytearray | memoryview) -> None:
        """CodecError for a frame over ``max_frame_bytes`` (what ``decode`` refuses first)."""
        if len(frame) > self.max_frame_bytes:
            raise CodecError(
                f"frame of {len(frame)} bytes exceeds the limit of {self.max_frame_bytes} bytes"
            )

    def decode(self, frame: bytes | bytearray | memoryview) -> T:
        self.check_size(frame)
        try:
            header = self._header.decode(frame)
        except (msgspec.DecodeError, RecursionError) as exc:  # deep nesting: RecursionError
            raise CodecError(f"not a frame [version, payload]: {exc}") from exc
        if header.version != PROTOCOL_VERSION:
            raise CodecError(
                f"protocol version {header.version} is not supported (this side speaks "
                f"{PROTOCOL_VERSION})"
            )
        try:
            return self._payload.decode(header.payload)
        except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
            raise CodecError(f"invalid {self.kind.__name__}: {exc}") from exc


BATCH_CODEC: Final = Codec(EventBatch)
SNAPSHOT_CODEC: Final = Codec(PolicySnapshot)
