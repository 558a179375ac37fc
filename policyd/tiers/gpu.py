"""A snapshot's GPU-tier decisions, as moves in a block pool with vLLM 0.32's free-queue semantics.

vLLM's GPU eviction order is its free-block queue: a block no running request holds waits there,
still cached; an allocation takes the head (slots without a hash first, then the cached block
freed longest ago). A connector cannot replace that order, but it can move blocks within it,
hold them, or drop their hash. ``GpuApplier`` turns a snapshot into exactly those moves:

1. **retire** - each free cached block that only retired workflows used loses its hash and goes
   to the head, so its slot is reused first (PBKV's lifecycle rule);
2. **rank** - the free blocks the snapshot scores above ``default_score`` (at most
   ``max_ranked_blocks``, the highest) move to the tail in ascending score: the queue then
   evicts unranked blocks by recency first, then ranked ones lowest score first;
3. **pin** - the snapshot's ``pin`` list, then the highest-ranked cached blocks (at most
   ``max_pinned_blocks`` in all) get a reference,
   so not even a burst of allocations takes them; the next plan releases those it no longer
   names, and a stale snapshot releases them all.

Blocks the snapshot scores at or below ``default_score`` keep their place: moving them ahead of
the unranked blocks would need an insertion in the middle of vLLM's queue (after its run of
slots without a hash), which the queue does not offer at bounded cost.

The pool is anything with the ``GpuPool`` interface: ``connector.vllm_adapter.VllmPool`` over
vLLM's ``BlockPool`` and ``policyd.sim.cache.GpuTier`` implement it, and both run this plan, so
the simulator credits exactly what the connector applies. A new view builds a plan;
``step(budget_ops)`` performs at most ``budget_ops`` pool operations of it, so the time vLLM's
thread spends stays bounded however large the snapshot is (``step(None)``: all of it). Both the
connector and the simulator step the plan at each prefix lookup, before the request's blocks
are allocated: the free queue's order matters when something is allocated. With no plan
pending, ``step`` costs O(1).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import islice
from typing import Final, Generic, Protocol, TypeVar

from policyd.tiers.view import SnapshotView, select_pins

H = TypeVar("H")

# The connector's default caps (kv_connector_extra_config agentkv_max_pinned_blocks /
# agentkv_max_ranked_blocks override them; the simulator's SimConfig takes the same two).
# Pins hold memory, so theirs is a share of the pool. Ranking costs a pool operation per block,
# so its cap is a count: what the step budget moves within about one snapshot interval
# (connector.bench_step: ~2 us an operation, 64 a step). Measured on fact-checking, 64 at once,
# 8,192 GPU blocks: 0 ranked 1.002x LRU's hit rate, 409 1.018x, 2,048 1.093x, all 8,192 1.118x;
# pins 0-5% of the pool change it by under 1% (docs/RESULTS.md).
DEFAULT_PIN_FRACTION: Final = 0.01
DEFAULT_MAX_RANKED_BLOCKS: Final = 2048
# Plan operations performed at each prefix lookup (just before vLLM allocates for a request,
# the moment the free queue's order is used): bounded work on vLLM's thread per request
# (agentkv_step_ops; the simulator's SimConfig.step_ops).
DEFAULT_STEP_OPS: Final = 64

NOOP, RETIRE, UNPIN, RANK, PIN = range(5)  # plan operations
CHUNK: Final = 4  # blocks looked at while planning cost about one move: one operation a CHUNK


def gpu_caps(
    pool_blocks: int, max_pinned_blocks: int | None = None, max_ranked_blocks: int | None = None
) -> tuple[int, int]:
    """(pinned, ranked) caps for a pool: the ones given, else the defaults."""
    pinned = (
        int(pool_blocks * DEFAULT_PIN_FRACTION) if max_pinned_blocks is None else max_pinned_blocks
    )
    ranked = (
        min(pool_blocks, DEFAULT_MAX_RANKED_BLOCKS)
        if max_ranked_blocks is None
        else max_ranked_blocks
    )
    return pinned, ranked


class GpuPool(Protocol[H]):
    """The block-pool operations the applier uses, named after vLLM's ``BlockPool``.

    ``H`` is the pool's handle for one cached block (vLLM: its ``KVCacheBlock`` per cache group;
    the simulator: the block hash itself).
    """

    def lookup(self, block: int) -> H | None:
        """The cached block with this wire hash, or None."""
        ...

    def is_free(self, handle: H) -> bool:
        """No running request (and no pin) holds it: it waits in the free queue."""
        ...

    def touch(self, handles: Sequence[H]) -> None:
        """Add a reference to each (a free one leaves the queue): ``BlockPool.touch``."""
        ...

    def free(self, handles: Sequence[H]) -> None:
        """Drop a reference from each; one left unreferenced goes to the queue's tail."""
        ...

    def evict(self, handles: Sequence[H]) -> None:
        """Free blocks lose their hash and their slots go to the queue's head."""
        ...

    def to_tail(self, handles: Sequence[H]) -> None:
        """Free blocks move to the queue's tail in the order given (the last is evicted last)."""
        ...


@dataclass(slots=True)
class GpuCounters:
    plans: int = 0
    retired_evicted_blocks: int = 0
    ranked_blocks: int = 0
    pinned_blocks: int = 0  # held now
    ops: int = 0
    yielded: int = 0  # times the pins were released for a request (make_room)


class GpuApplier(Generic[H]):
    """Applies views to one ``GpuPool``; remembers what it pinned (see module docstring)."""

    def __init__(
        self, pool: GpuPool[H], *, max_pinned_blocks: int = 0, max_ranked_blocks: int = 0
    ) -> None:
        if max_pinned_blocks < 0 or max_ranked_blocks < 0:
            raise ValueError("max_pinned_blocks and max_ranked_blocks must be >= 0")
        self.pool = pool
        self.max_pinned_blocks = max_pinned_blocks
        self.max_ranked_blocks = max_ranked_blocks
        self.pinned: dict[int, H] = {}
        self.counters = GpuCounters()
        self._plan: Iterator[tuple[int, int]] | None = None

    @property
    def busy(self) -> bool:
        """A plan is still being applied."""
        return self._plan is not None

    def adopt(self, view: SnapshotView | None, retired: AbstractSet[int]) -> None:
        """Plan the moves for a new view (``None``: no fresh snapshot - release every pin).
        O(1): the plan is built as ``step`` performs it. A plan not finished yet is dropped: the
        new view supersedes it."""
        self._plan = self._ops(view, retired)
        self.counters.plans += 1

    def _ops(
        self, view: SnapshotView | None, retired: AbstractSet[int]
    ) -> Iterator[tuple[int, int]]:
        """The plan, lazily: retire, unpin, rank (ascending), pin. Planning yields a ``NOOP``
        every ``CHUNK`` blocks it looks at, so that its work is budgeted like the moves.
        ``retired`` may change while the plan runs (a live view): the retire phase works on the
        blocks retired when it starts."""
        if view is not None:  # (each still retired when its turn comes)
            yield from ((RETIRE, b) for b in tuple(retired) if b in retired)
        limit = max(self.max_pinned_blocks, self.max_ranked_blocks)
        top: list[int] = []
        if view is not None and limit > 0:
            for block in view.ranked(retired):
                top.append(block)
                if len(top) >= limit:
                    break
                if len(top) % CHUNK == 0:
                    yield (NOOP, 0)
        pins: list[int] = []
        for i, block in enumerate(select_pins(view, retired, self.max_pinned_blocks, then=top)):
            pins.append(block)
            if i % CHUNK == 0:
                yield (NOOP, 0)
        wanted = set(pins)
        yield from ((UNPIN, b) for b in list(self.pinned) if b not in wanted)
        yield from ((RANK, b) for b in reversed(top[: self.max_ranked_blocks]) if b not in wanted)
        yield from ((PIN, b) for b in pins if b not in self.pinned)

    def make_room(self, need_blocks: int, available_blocks: int) -> bool:
        """Pins never make a request wait: when a request needs more blocks than the pool can
        give (free or evictable), every pin is released at once. True if any was."""
        if need_blocks <= available_blocks or not self.pinned:
            return False
        self.release_all()
        self.counters.yielded += 1
        return True

    def step(self, budget_ops: int | None = None, hit: AbstractSet[int] = frozenset()) -> list[int]:
        """Perform up to ``budget_ops`` operations of the current plan (all when None); returns
        the blocks evicted by the retire rule (the caller reports them as removed). ``hit``:
        the prefix hit of the request being looked up, which vLLM has counted already - the
        retire rule leaves those blocks alone. Without a plan it costs O(1)."""
        plan = self._plan
        if plan is None:
            return []
        batch = list(plan if budget_ops is None else islice(plan, budget_ops))
        if budget_ops is None or len(batch) < budget_ops:
            self._plan = None
        self.counters.ops += len(batch)
        return self._run(batch, hit)

    def _run(self, batch: Sequence[tuple[int, int]], hit: AbstractSet[int]) -> list[int]:
        pool = self.pool
        evicted: list[int] = []
        evict: list[H] = []
        tail: list[H] = []
        moved: set[int] = set()  # a block moves once a batch (evicted, or sent to the tail)
        for kind, block in batch:
            if kind == NOOP:
                continue
            if kind == UNPIN:
                handle = self.pinned.pop(block, None)
                if handle is not None:
                    pool.free([handle])
                continue
            if kind == PIN:
                if block in self.pinned or block in moved:
                    continue
                handle = pool.lookup(block)
                if handle is not None:
                    pool.touch([handle])
                    self.pinned[block] = handle
                continue
            if (kind == RETIRE and block in hit) or block in moved:
                continue  # the request being looked up counts on it; or moved already
            handle = pool.lookup(block)
            if handle is None or not pool.is_free(handle):
                continue  # gone, held by a request, or pinned: nothing to move
            moved.add(block)
            if kind == RETIRE:
                evict.append(handle)
                evicted.append(block)
            else:
                tail.append(handle)
        if evict:
            pool.evict(evict)
            self.counters.retired_evicted_blocks += len(evict)
        if tail:
            pool.to_tail(tail)
            self.counters.ranked_blocks += len(tail)
        self.counters.pinned_blocks = len(self.pinned)
        return evicted

    def release_all(self) -> None:
        """Drop every pin now (shutdown)."""
        self.pool.free(list(self.pinned.values()))
        self.pinned.clear()
        self._plan = None
        self.counters.pinned_blocks = 0
