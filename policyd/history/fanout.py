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
from itertools import chain
from typing import Final

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]

from policyd.core.types import (
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
from policyd.history.schema import ARROW_SCHEMAS

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
    _segments: list[_Segment] = field(default_factory=list)  # the batch's block rows, unsampled

    def add(self, pending: Pending, batch: EventBatch, received_ts: float) -> None:
        """Fan a batch out. Its block rows - its block-level events' and its prefix hits' -
        are sampled together, in event order, once its request-level events are handled: one
        hash conversion per run of block-level events and one mask per batch (an event's numpy
        calls cost more than its 16 hashes); below rate 1 only the segments that keep a row
        are looked at again."""
        segments = self._segments = []
        for event in batch.events:
            kind = type(event)
            if kind in BLOCK_LEVEL:
                segments.append(event)
                continue
            handler = _HANDLERS.get(kind)
            if handler is not None:
                handler(self, pending, event, batch.source, received_ts)
        if segments:
            self._block_rows(pending, received_ts, segments)

    def _block_rows(self, pending: Pending, ts: float, segments: list[_Segment]) -> None:
        """The block rows of ``segments`` (block-level events and prefix hits' blocks per
        tier), sampled at the rate."""
        rate = self.block_sample_rate
        parts: list[np.ndarray] = []
        run: list[tuple[int, ...]] = []
        lengths: list[int] = []
        for seg in segments:
            if isinstance(seg, tuple):  # a prefix hit's blocks, already uint64
                if run:
                    parts.append(hashes_u64(list(chain.from_iterable(run))))
                    run = []
                parts.append(seg[1])
                lengths.append(len(seg[1]))
            else:
                named = seg.block_hashes  # type: ignore[union-attr]
                run.append(named)
                lengths.append(len(named))
        if run:
            parts.append(hashes_u64(list(chain.from_iterable(run))))
        hashes = parts[0] if len(parts) == 1 else np.concatenate(parts)
        counts = np.array(lengths, dtype=np.int64)
        with_rows: list[int] | range = range(len(segments))
        if rate < 1.0:
            mask = block_keep_mask(hashes, rate)
            hashes = hashes[mask]
            ends = np.cumsum(counts)
            kept_before = np.concatenate(([0], np.cumsum(mask, dtype=np.int64)))
            counts = kept_before[ends] - kept_before[ends - counts]
            with_rows = np.flatnonzero(counts).tolist()
            counts = counts[with_rows]
        if not len(hashes):
            return
        labels = [_labels(segments[i]) for i in with_rows]
        pending.blocks.append(
            _BlockChunk(ts, [a[0] for a in labels], [a[1] for a in labels],
                        [a[2] for a in labels], counts, hashes, rate)
        )  # fmt: skip
        pending.rows += len(hashes)

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
        if prompt is not None:  # its rows are sampled with the batch's block rows
            gpu_end = min(e.gpu_blocks, len(prompt))
            host_end = min(gpu_end + e.host_blocks, len(prompt))
            for tier, hashes in (("gpu", prompt[:gpu_end]), ("host", prompt[gpu_end:host_end])):
                if len(hashes):
                    self._segments.append((("hit", tier, e.request_id), hashes))

    def _finished(self, pending: Pending, e: Event, source: str, ts: float) -> None:
        assert isinstance(e, RequestFinished)
        pending.update_request(e.request_id, {"finished_ts": ts, "output_tokens": e.output_tokens})
        self.recent_prompts.pop(e.request_id, None)


_Labels = tuple[str, str | None, str | None]  # (kind, tier, request_id) of some block rows
_Segment = Event | tuple[_Labels, np.ndarray]  # a block-level event, or a prefix hit's blocks


def _labels(segment: _Segment) -> _Labels:
    """(kind, tier, request_id) of a segment's rows."""
    if isinstance(segment, tuple):
        return segment[0]
    e = segment
    kind = type(e)
    if kind is BlocksStored:
        assert isinstance(e, BlocksStored)
        return ("stored", e.tier, e.request_id)
    if kind is BlocksRemoved:
        assert isinstance(e, BlocksRemoved)
        return ("removed", e.tier, None)
    assert isinstance(e, BlocksLoaded)  # host -> GPU: the row names the tier that served it
    return ("loaded", "host", e.request_id)


def requests_only(batch: EventBatch) -> EventBatch:
    """``batch`` without its block-level events (what is kept of it past the queue's bound)."""
    return EventBatch(
        source=batch.source,
        seq=batch.seq,
        events=tuple([e for e in batch.events if type(e) not in BLOCK_LEVEL]),
    )


_Handler = Callable[[FanOut, Pending, Event, str, float], None]
# block-level events go through _block_rows (sampled per batch); AllBlocksCleared and
# WorkflowFinished have no table: the daemon records what they cause
_HANDLERS: Final[dict[type, _Handler]] = {
    RequestStarted: FanOut._started,
    PrefixHit: FanOut._hit,
    RequestFinished: FanOut._finished,
}


@dataclass(frozen=True, slots=True)
class RowsEstimate:
    """What a batch holds, counted in one pass: ``requests`` request-level events (a row each
    at most), ``prompt_hashes`` the hashes they name (a prompt's hashes stand for its prefix
    hit's rows) and ``block_hashes`` those its block-level events name."""

    requests: int
    prompt_hashes: int
    block_hashes: int

    def rows(self, rate: float = 1.0, *, requests_only: bool = False) -> int:
        """Rows with block rows sampled at ``rate`` (the hash-chosen sample's expected size,
        rounded up); at 1.0 (every hash) also what the batch holds until it is fanned out: the
        queue's bound counts that. ``requests_only``: of the batch cut to its request-level
        events."""
        hashes = self.prompt_hashes + (0 if requests_only else self.block_hashes)
        if rate <= 0.0:
            return self.requests
        return self.requests + (hashes if rate >= 1.0 else math.ceil(hashes * rate))


def rows_estimate(batch: EventBatch) -> RowsEstimate:
    """``RowsEstimate`` of a batch."""
    requests = prompt = blocks = 0
    for e in batch.events:
        named = getattr(e, "block_hashes", None)
        if type(e) in BLOCK_LEVEL:
            blocks += len(named) if named else 0
        else:
            requests += 1
            prompt += len(named) if named else 0
    return RowsEstimate(requests, prompt, blocks)
