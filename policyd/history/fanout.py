"""From events to history rows: one flush's worth of pending rows, built on the writer thread.

An ``EventBatch`` fans out to ``requests`` (a row per request, filled in by its start, prefix hit
and finish) and ``block_accesses`` (a row per block, sampled deterministically by block hash so
that the same block is always kept or always dropped: its history stays whole).

Timestamps: events carry the source's monotonic clock, the tables wall-clock unix seconds, so
every row of a batch gets the batch's ``received_ts`` (its arrival at the daemon).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]

from policyd.history.schema import ARROW_SCHEMAS
from policyd.types import (
    BLOCK_LEVEL,
    BlocksLoaded,
    BlocksRemoved,
    BlocksStored,
    Event,
    EventBatch,
    PrefixHit,
    RequestFinished,
    RequestStarted,
)

_U64_MASK: Final = (1 << 64) - 1
# how many started requests' block hashes are kept to turn a later PrefixHit into 'hit' rows
RECENT_PROMPTS_MAX: Final = 4096


def block_keep_mask(hashes: np.ndarray, rate: float) -> np.ndarray:
    """Which blocks a sample at ``rate`` keeps: splitmix64(hash) < rate * 2^64.

    Deterministic per hash (the same block is kept in every event), uniform even when hashes
    are small sequential integers (tests, simulators), hence the mixing step.
    """
    if rate >= 1.0:
        return np.ones(len(hashes), dtype=bool)
    if rate <= 0.0:
        return np.zeros(len(hashes), dtype=bool)
    with np.errstate(over="ignore"):
        z = hashes.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z < np.uint64(int(rate * 2.0**64))


def hashes_u64(hashes: Sequence[int]) -> np.ndarray:
    """Block hashes as uint64 (a negative or oversized int is reduced modulo 2^64)."""
    try:
        return np.fromiter(hashes, dtype=np.uint64, count=len(hashes))
    except OverflowError:
        return np.fromiter((h & _U64_MASK for h in hashes), dtype=np.uint64, count=len(hashes))


@dataclass
class _BlockChunk:
    """Block rows of consecutive events of one batch: event ``i`` contributes ``counts[i]``
    rows (its kept hashes, in order, within ``hashes``) with its kind, tier and request."""

    ts: float
    kinds: list[str]
    tiers: list[str | None]
    request_ids: list[str | None]
    counts: np.ndarray  # int64, one per event
    hashes: np.ndarray  # uint64, already sampled
    rate: float  # the sample rate they were kept at


@dataclass
class Pending:
    """Rows waiting for the next write, grouped per table; ``rows`` counts them all."""

    chunks: dict[str, list[list[Mapping[str, object]]]] = field(default_factory=dict)
    requests_new: dict[str, dict[str, object]] = field(default_factory=dict)
    requests_update: dict[str, dict[str, object]] = field(default_factory=dict)
    blocks: list[_BlockChunk] = field(default_factory=list)
    rows: int = 0

    def add_rows(self, table: str, rows: Sequence[Mapping[str, object]]) -> None:
        self.chunks.setdefault(table, []).append(list(rows))
        self.rows += len(rows)

    def update_request(self, request_id: str, values: dict[str, object]) -> None:
        """Merge into the request's row when it is still pending, else into an UPDATE."""
        row = self.requests_new.get(request_id)
        if row is not None:
            row.update(values)
        else:
            self.requests_update.setdefault(request_id, {"request_id": request_id}).update(values)

    def block_table(self) -> pa.Table | None:
        """The pending block accesses as one Arrow table (None when there are none)."""
        chunks = [c for c in self.blocks if len(c.hashes)]
        if not chunks:
            return None
        counts = np.concatenate([c.counts for c in chunks])
        # one entry per event, repeated per block in C: dictionary-encode, then decode
        indices = pa.array(np.repeat(np.arange(len(counts), dtype=np.int32), counts))

        def repeat(values: list[str | None]) -> pa.Array:
            dictionary = pa.array(values, type=pa.string())
            return pa.DictionaryArray.from_arrays(indices, dictionary).dictionary_decode()

        ts = np.concatenate([np.full(len(c.counts), c.ts, dtype=np.float64) for c in chunks])
        rates = np.repeat([c.rate for c in chunks], [len(c.hashes) for c in chunks])
        return pa.table(
            {
                "ts": np.repeat(ts, counts),
                "kind": repeat([k for c in chunks for k in c.kinds]),
                "tier": repeat([t for c in chunks for t in c.tiers]),
                "block_hash": np.concatenate([c.hashes for c in chunks]).view(np.int64),
                "request_id": repeat([r for c in chunks for r in c.request_ids]),
                "sample_rate": rates,
            },
            schema=ARROW_SCHEMAS["block_accesses"],
        )


@dataclass
class FanOut:
    """Turns event batches into pending rows; keeps recent prompts to expand prefix hits."""

    block_sample_rate: float = 1.0
    recent_prompts: OrderedDict[str, np.ndarray] = field(default_factory=OrderedDict)

    def add(self, pending: Pending, batch: EventBatch, received_ts: float) -> None:
        """Fan a batch out. Runs of block-level events are sampled together (one hash
        conversion and one mask per run, not per event: an event's numpy calls cost more than
        its 16 hashes); rows keep the batch's event order."""
        run: list[_Access] = []
        for event in batch.events:
            access = _block_access(event)
            if access is not None:
                run.append(access)
                continue
            if run:
                self._block_run(pending, received_ts, run)
                run = []
            handler = _HANDLERS.get(type(event))
            if handler is not None:
                handler(self, pending, event, batch.source, received_ts)
        if run:
            self._block_run(pending, received_ts, run)

    def _block_run(self, pending: Pending, ts: float, run: list[_Access]) -> None:
        hashes = hashes_u64([h for a in run for h in a[3]])
        lengths = np.fromiter((len(a[3]) for a in run), dtype=np.int64, count=len(run))
        if self.block_sample_rate >= 1.0:
            kept, counts = hashes, lengths
        else:
            mask = block_keep_mask(hashes, self.block_sample_rate)
            kept = hashes[mask]
            ends = np.cumsum(lengths)
            kept_before = np.concatenate(([0], np.cumsum(mask, dtype=np.int64)))
            counts = kept_before[ends] - kept_before[ends - lengths]
        if len(kept):
            pending.blocks.append(
                _BlockChunk(ts, [a[0] for a in run], [a[1] for a in run],
                            [a[2] for a in run], counts, kept, self.block_sample_rate)
            )  # fmt: skip
            pending.rows += len(kept)

    def _blocks(
        self,
        pending: Pending,
        ts: float,
        *,
        kind: str,
        tier: str | None,
        hashes: np.ndarray,
        request_id: str | None,
    ) -> None:
        kept = hashes[block_keep_mask(hashes, self.block_sample_rate)]
        if len(kept):
            counts = np.array([len(kept)], dtype=np.int64)
            rate = self.block_sample_rate
            pending.blocks.append(_BlockChunk(ts, [kind], [tier], [request_id], counts, kept, rate))
            pending.rows += len(kept)

    def _started(self, pending: Pending, e: Event, source: str, ts: float) -> None:
        assert isinstance(e, RequestStarted)
        pending.requests_new[e.request_id] = {
            "ts": ts,
            "request_id": e.request_id,
            "source": source,
            "workflow_id": e.workflow_id,
            "workflow_type": e.workflow_type,
            "agent": e.agent,
            "prompt_tokens": e.prompt_tokens,
            "prompt_blocks": len(e.block_hashes),
        }
        pending.rows += 1
        self.recent_prompts[e.request_id] = hashes_u64(e.block_hashes)
        while len(self.recent_prompts) > RECENT_PROMPTS_MAX:
            self.recent_prompts.popitem(last=False)

    def _hit(self, pending: Pending, e: Event, source: str, ts: float) -> None:
        assert isinstance(e, PrefixHit)
        pending.update_request(
            e.request_id,
            {
                "gpu_hit_blocks": e.gpu_blocks,
                "host_hit_blocks": e.host_blocks,
                "recomputed_blocks": e.recomputed_blocks,
            },
        )
        prompt = self.recent_prompts.pop(e.request_id, None)
        if prompt is not None:
            gpu_end = min(e.gpu_blocks, len(prompt))
            host_end = min(gpu_end + e.host_blocks, len(prompt))
            self._blocks(
                pending,
                ts,
                kind="hit",
                tier="gpu",
                hashes=prompt[:gpu_end],
                request_id=e.request_id,
            )
            self._blocks(
                pending,
                ts,
                kind="hit",
                tier="host",
                hashes=prompt[gpu_end:host_end],
                request_id=e.request_id,
            )

    def _finished(self, pending: Pending, e: Event, source: str, ts: float) -> None:
        assert isinstance(e, RequestFinished)
        pending.update_request(e.request_id, {"finished_ts": ts, "output_tokens": e.output_tokens})
        self.recent_prompts.pop(e.request_id, None)


# (kind, tier, request_id, hashes) of a block-level event's rows
_Access = tuple[str, str | None, str | None, tuple[int, ...]]


def _block_access(e: Event) -> _Access | None:
    kind = type(e)
    if kind is BlocksStored:
        assert isinstance(e, BlocksStored)
        return ("stored", e.tier, e.request_id, e.block_hashes)
    if kind is BlocksRemoved:
        assert isinstance(e, BlocksRemoved)
        return ("removed", e.tier, None, e.block_hashes)
    if kind is BlocksLoaded:  # host -> GPU: the row names the tier that served the blocks
        assert isinstance(e, BlocksLoaded)
        return ("loaded", "host", e.request_id, e.block_hashes)
    return None


def requests_only(batch: EventBatch) -> EventBatch:
    """``batch`` without its block-level events (what is kept of it past the queue's bound)."""
    return EventBatch(
        source=batch.source,
        seq=batch.seq,
        events=tuple([e for e in batch.events if type(e) not in BLOCK_LEVEL]),
    )


_Handler = Callable[[FanOut, Pending, Event, str, float], None]
# block-level events go through _block_access (sampled per run); AllBlocksCleared and
# WorkflowFinished have no table: the daemon records what they cause
_HANDLERS: Final[dict[type, _Handler]] = {
    RequestStarted: FanOut._started,
    PrefixHit: FanOut._hit,
    RequestFinished: FanOut._finished,
}


def rows_estimate(batch: EventBatch, rate: float = 1.0) -> int:
    """The rows a batch becomes with block rows sampled at ``rate``: a request row per
    request-level event at most, and ``rate`` of the hashes the events name (the hash-chosen
    sample's expected size, rounded up; a prompt's hashes stand for its prefix hit's rows). At
    1.0 (every hash) it is also what the batch holds until it is fanned out: the queue's bound
    counts that."""
    n = hashes = 0
    for e in batch.events:
        if type(e) not in BLOCK_LEVEL:
            n += 1
        named = getattr(e, "block_hashes", None)
        if named:
            hashes += len(named)
    if rate <= 0.0:
        return n
    return n + (hashes if rate >= 1.0 else math.ceil(hashes * rate))
