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
``step(budget_ops)`` performs at most ``budget_ops`` operations of it, so the time vLLM's
thread spends stays bounded however large the snapshot is (``step(None)``: all of it). The
plan's first work is the retired set's recount (``Ownership.retire``), a few blocks an
operation; the retire phase then walks only the blocks retired since the last plan, and the
ranking comes ready-made in the view (``SnapshotView.top``, built on the client's thread). Both
the connector and the simulator step the plan at prefix lookups, before the request's blocks
are allocated (the free queue's order matters when something is allocated), within one budget
per scheduler step. With no plan pending, ``step`` costs O(1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import islice
from typing import Final, Generic, Protocol, TypeVar

from policyd.tiers.view import Retirement, SnapshotView, select_pins

H = TypeVar("H")

# The connector's default caps (kv_connector_extra_config agentkv_max_pinned_blocks /
# agentkv_max_ranked_blocks override them; the simulator's SimConfig takes the same two).
# Pins hold memory, so theirs is a share of the pool. Ranking costs a pool operation per block, so
# its cap is a count; how much of it lands before the next snapshot is the step budget's business
# (docs/RESULTS.md, *The GPU mechanism, chosen by measurement*).
DEFAULT_PIN_FRACTION: Final = 0.01
DEFAULT_MAX_RANKED_BLOCKS: Final = 2048
# Plan operations per vLLM scheduler step, performed at its prefix lookups (just before vLLM
# allocates for a request, the moment the free queue's order is used; agentkv_step_ops, the
# simulator's SimConfig.step_ops, per scheduling round), shared with the host order's re-keying
# (policyd.tiers.budget). The default is the most operations a step can take with its p99 within
# the connector's 200 us budget (connector.bench_step checks it; docs/RESULTS.md, *The
# connector's time per scheduler step*).
DEFAULT_STEP_OPS: Final = 12

MAX_HELD_RETIRED: Final = 4096  # retired blocks kept for the next plan while a request holds them

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
        self._held_retired: list[int] = []  # retired blocks a request held when their turn came

    @property
    def busy(self) -> bool:
        """A plan is still being applied."""
        return self._plan is not None

    def adopt(
        self,
        view: SnapshotView | None,
        retired: Retirement | AbstractSet[int],
        on_settled: Callable[[], None] | None = None,
    ) -> None:
        """Plan the moves for a new view (``None``: no fresh snapshot - release every pin).
        O(1): the plan is built as ``step`` performs it. A plan not finished yet is dropped: the
        new view supersedes it. ``retired``: the ``Ownership.retire`` of the view's retired list
        (its recount is the plan's first work; ``on_settled`` is called once it is done, so that
        the host tier's order is re-keyed on a settled set), or a plain set (every block fresh).
        """
        if not isinstance(retired, Retirement):
            retired = Retirement.settled(retired)
        self._plan = self._ops(view, retired, on_settled)
        self.counters.plans += 1

    def _ops(
        self,
        view: SnapshotView | None,
        retirement: Retirement,
        on_settled: Callable[[], None] | None,
    ) -> Iterator[tuple[int, int]]:
        """The plan, lazily: recount, retire, unpin, rank (ascending), pin. Recounting and
        planning yield a ``NOOP`` per unit of work, so that it is budgeted like the moves. The
        retire phase walks the blocks retired since the last plan (and those a request held
        then), each still retired when its turn comes."""
        if view is not None:
            for _ in retirement.work:
                yield (NOOP, 0)
        if on_settled is not None:
            on_settled()
        retired = retirement.blocks
        if view is not None:
            retry, self._held_retired = self._held_retired, []
            fresh = retirement.fresh
            yield from ((RETIRE, b) for b in retry if b in retired)
            while fresh:
                block = fresh.popleft()
                if block in retired:
                    yield (RETIRE, block)
        top = view.top if view is not None else ()
        pins: list[int] = []
        for i, block in enumerate(select_pins(view, retired, self.max_pinned_blocks, then=top)):
            pins.append(block)
            if i % CHUNK == 0:
                yield (NOOP, 0)
        wanted = set(pins)
        yield from ((UNPIN, b) for b in list(self.pinned) if b not in wanted)
        for i in range(min(len(top), self.max_ranked_blocks) - 1, -1, -1):  # ascending score
            block = top[i]  # (indexing, not a slice: dropping a superseded plan stays O(1))
            if block not in wanted and block not in retired:
                yield (RANK, block)
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
            if handle is None:
                continue  # gone: nothing to move
            if not pool.is_free(handle):
                if kind == RETIRE and len(self._held_retired) < MAX_HELD_RETIRED:
                    self._held_retired.append(block)  # held now: the next plan tries again
                continue  # held by a request, or pinned
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
