"""Sampled shadows of the GPU and host tiers: what vLLM's default, or a policy's own snapshots,
would hit on the traffic the daemon sees.

``BlockSampler`` picks the blocks a shadow follows, SHARDS-style (Waldspurger et al., FAST
2015): a block takes part when a hash of it falls below ``rate``, so every shadow that uses the
same sampler follows the same blocks, and a shadow tier of ``rate`` times a real tier's size
estimates the real tier's hits on them.

``ShadowTiers`` is one sampled pair of tiers in vLLM's order:

* GPU (``ShadowPool``): vLLM's block pool - a running request holds its blocks; when it
  finishes they go to the free queue's tail, its first block last (vLLM frees a request's
  blocks tail first, so a prefix is evicted from its end); an allocation evicts the free
  queue's head.
* host: vLLM's offloading connector with its LRU manager, as the simulator replays it
  (``policyd.sim.host_writes``): a request offers every prompt block (after a host load, the
  blocks past the loaded run) and the ones not yet stored are written, all or none, evicting the
  least recent unoffered blocks; then the blocks it offered or loaded become the most recent, its
  first block last. A block the GPU hits is offered too (vLLM's store job starts at the prompt's
  first chunk), so a prefix the GPU keeps stays recent on the host. The host tier is the
  connector's own ``tiers.HostOrder`` where the arm's snapshots order it, else
  ``LruOrder``, which evicts what ``HostOrder`` evicts with no order, without its heaps
  (``host_ordered``). vLLM writes when the prefill ends and re-ranks when the
  request finishes; the shadow does both when it finishes, the last event the connector sends
  for it (written at the lookup, a running request's blocks were evicted by the requests
  starting during its prefill; while it runs its prompt is on the GPU anyway).
* prefix caching at the sample's resolution: in a request, the sampled blocks after the first
  sampled miss (GPU, then host) miss too.

A shadow that ``adopt``\\ s snapshots applies them with the connector's own parts
(``policyd.tiers``): the write filter per request (``write_allowed``, the request's new blocks
counted from its first sampled miss), the GPU plan (``GpuApplier``: retire, rank, pin) and the
host order's re-keying (``HostOrder``) within the connector's budget of operations per
scheduler step (``StepBudget``). Everything is scaled by the sample rate: the plan's caps, the
adoption's cost, and the budget - a step's whole budget is spent once every ``1 / rate``
requests (at their prefix lookups, before their blocks are allocated, as the connector does),
so the shadow does ``rate`` times the connector's work on ``rate`` times its blocks. Where it
differs: one request is one scheduler step, the plan's ranking (``SnapshotView.top``) names
only blocks cached in the shadow when the snapshot arrives, and a host load leaves its keys'
places in the order's re-keying walk, where vLLM's manager, and the simulator, give them new
ones (``HostOrder.loaded``): measured both ways, the shadow that keeps them ranks the arms as
its real tiers do more often (docs/RESULTS.md, *The recency guard*).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Final

import numpy as np

from policyd.core.queues import LruQueue
from policyd.core.types import PolicySnapshot
from policyd.policies.lifecycle import RETIRED_SCORE
from policyd.policies.rankings import ScoreMap
from policyd.tiers.budget import ADOPT_COST_OPS, StepBudget
from policyd.tiers.gpu import (
    DEFAULT_MAX_RANKED_BLOCKS,
    DEFAULT_PIN_FRACTION,
    DEFAULT_STEP_OPS,
    GpuApplier,
)
from policyd.tiers.host_order import HostOrder
from policyd.tiers.view import DEFAULT_TOP_BLOCKS, Ownership, SnapshotView, write_allowed

# Fibonacci hashing (multiplication modulo 2**64, numpy's uint64 wraps): spreads sequential
# ids over 64 bits
_MIX_U64: Final = np.uint64(0x9E3779B97F4A7C15)
_ALL: Final = 1 << 64


class BlockSampler:
    """Which blocks the shadows follow: those whose hash falls below ``rate``."""

    def __init__(self) -> None:
        self._threshold = _ALL

    def configure(self, rate: float) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"a sample rate is in (0, 1], got {rate}")
        self._threshold = _ALL if rate >= 1.0 else int(rate * _ALL)

    @property
    def rate(self) -> float:
        return self._threshold / _ALL

    def positions(self, blocks: tuple[int, ...]) -> tuple[int, ...]:
        """The indexes of the sampled blocks of a request."""
        if self._threshold >= _ALL:
            return tuple(range(len(blocks)))
        mixed = np.fromiter(blocks, dtype=np.uint64, count=len(blocks)) * _MIX_U64
        return tuple(np.flatnonzero(mixed < np.uint64(self._threshold)).tolist())


class ShadowPool:
    """A sampled GPU block pool with vLLM's free-queue semantics, and the ``tiers.GpuPool``
    operations the connector's plan uses (a block's handle is its hash)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.refs: dict[int, int] = {}  # held blocks (running requests, pins) -> references
        self.free_queue: OrderedDict[int, None] = OrderedDict()  # head: evicted first

    def __contains__(self, block: object) -> bool:
        return block in self.refs or block in self.free_queue

    def __len__(self) -> int:
        return len(self.refs) + len(self.free_queue)

    def trim(self) -> None:
        """Evict from the free queue's head until the pool fits (held blocks stay)."""
        queue = self.free_queue
        popitem = queue.popitem
        for _ in range(min(len(self.refs) + len(queue) - self.capacity, len(queue))):
            popitem(last=False)

    # -- tiers.GpuPool ---------------------------------------------------------------------

    def lookup(self, block: int) -> int | None:
        return block if block in self else None

    def is_free(self, handle: int) -> bool:
        return handle in self.free_queue

    def touch(self, handles: Iterable[int]) -> None:
        refs, queue = self.refs, self.free_queue
        for h in handles:
            queue.pop(h, None)
            refs[h] = refs.get(h, 0) + 1

    def free(self, handles: Iterable[int]) -> None:
        refs, queue = self.refs, self.free_queue
        for h in handles:
            left = refs.get(h, 0) - 1
            if left > 0:
                refs[h] = left
            elif h in refs:
                del refs[h]
                queue[h] = None

    def evict(self, handles: Iterable[int]) -> None:
        for h in handles:
            self.free_queue.pop(h, None)

    def to_tail(self, handles: Iterable[int]) -> None:
        queue = self.free_queue
        for h in handles:
            if h in queue:
                queue.move_to_end(h)


class LruOrder(LruQueue):
    """The order of a tier that no snapshot orders (vLLM's default, or a write filter alone):
    vLLM's LRU (``core.queues.LruQueue``, one ordered dict) under ``HostOrder``'s calls, the
    evictions ``HostOrder`` makes with no view, without its priority heap and slots. Every key
    is evictable: for the guard's shadows, which write a request's blocks when it finishes
    (``ShadowTiers``), with nothing in flight.

    >>> order = LruOrder()
    >>> for key in (1, 2, 3):
    ...     order.insert(key)
    >>> order.touch([2, 1])  # a request used 2 then 1: 1 (its tail) is ranked older than 2
    >>> order.evict(2, protected={3})
    [1, 2]
    """

    def insert(self, key: int, evictable: bool = True) -> None:
        """``key`` stored (again): the most recent (``HostOrder.insert``; a key held by a store
        in flight is not kept here)."""
        if not evictable:
            raise ValueError("LruOrder keeps evictable keys only")
        self[key] = None
        self.move_to_end(key)

    def insert_many(self, keys: Iterable[int]) -> None:
        """``insert`` of each key in turn (``HostOrder.insert_many``: a held key is touched)."""
        move = self.move_to_end
        for key in keys:
            self[key] = None
            move(key)

    def touch(self, keys_head_to_tail: Iterable[int]) -> None:
        """A request used these keys: the tail gets the older rank, so it is evicted first."""
        self.to_tail([key for key in reversed(list(keys_head_to_tail)) if key in self])


def _same(block: int) -> int:
    return block


class ShadowTiers:
    """One sampled GPU tier and host tier, in vLLM's order or, once it ``adopt``\\ s them, a
    policy's snapshots' (module doc). ``host_ordered``: its snapshots may order the host tier
    (``HostOrder``); an arm whose snapshots never do (vLLM's default, a write filter alone)
    keeps its host tier in ``LruOrder``, the same evictions at a fraction of the cost, and a
    snapshot that orders the host tier is refused there."""

    def __init__(self, *, host_ordered: bool = True) -> None:
        self.rate = 1.0
        self.host_ordered = host_ordered
        self.gpu = ShadowPool(0)
        self.host: HostOrder[int] | LruOrder = self._new_host()
        self.host_capacity = 0
        self.ownership = Ownership()
        self.applier = GpuApplier(self.gpu)
        self.budget = StepBudget(self.applier, self._ordered_host(), DEFAULT_STEP_OPS)
        self.view: SnapshotView | None = None
        self._credit = 0.0  # steps' budgets owed: ``rate`` a request
        # request -> the host blocks it offered (None: its writes declined), and those it offered
        # or loaded: written and re-ranked when it finishes
        self._host_writes: dict[str, tuple[tuple[int, ...] | None, tuple[int, ...]]] = {}

    def configure(self, *, gpu_capacity: int, host_capacity: int, rate: float) -> None:
        """The shadow tiers' sizes (sampled blocks) and the sample rate; they start empty, in
        vLLM's default."""
        self.rate = rate
        self.gpu = ShadowPool(max(gpu_capacity, 0))
        self.host = self._new_host()
        self.host_capacity = max(host_capacity, 0)
        self.ownership = Ownership()
        self.applier = GpuApplier(
            self.gpu,
            max_pinned_blocks=int(self.gpu.capacity * DEFAULT_PIN_FRACTION),
            max_ranked_blocks=round(DEFAULT_MAX_RANKED_BLOCKS * rate),
        )
        self.budget = StepBudget(
            self.applier,
            self._ordered_host(),
            DEFAULT_STEP_OPS,
            adopt_cost_ops=round(ADOPT_COST_OPS * rate),
        )
        self.view = None
        self._credit = 0.0
        self._host_writes = {}

    @classmethod
    def forked(cls, source: ShadowTiers, *, host_ordered: bool) -> ShadowTiers:
        """A shadow holding what ``source`` holds now - its tiers' blocks in their order, the
        running requests' blocks and their pending host writes - with no snapshot and no pins:
        the real tiers as a switch to another arm would find them."""
        new = cls(host_ordered=host_ordered)
        new.configure(
            gpu_capacity=source.gpu.capacity, host_capacity=source.host_capacity, rate=source.rate
        )
        pool = new.gpu
        pool.refs = dict(source.gpu.refs)
        pool.free_queue = OrderedDict(source.gpu.free_queue)
        pool.free(list(source.applier.pinned))  # its pins let go, as the connector would
        host = source.host  # its blocks from least to most recent, as ``insert_many`` takes them
        new.host.insert_many(host.by_recency() if isinstance(host, HostOrder) else list(host))
        new.ownership = source.ownership.copy()
        new._credit = source._credit
        new._host_writes = dict(source._host_writes)
        return new

    def _new_host(self) -> HostOrder[int] | LruOrder:
        return HostOrder(_same) if self.host_ordered else LruOrder()

    def _ordered_host(self) -> HostOrder[int] | None:
        """The host order the budget re-keys (None: an LRU tier has nothing to re-key)."""
        return self.host if isinstance(self.host, HostOrder) else None

    def adopt(
        self,
        snapshot: PolicySnapshot | None,
        scores: Mapping[int, float],
        host_scores: Mapping[int, float] | None = None,
    ) -> None:
        """A snapshot for the connector's parts to apply from now on (None: vLLM's default);
        ``scores`` and ``host_scores`` are its two orders as maps (the policy has them: a view
        shares them rather than copying; ``host_scores`` None: ``scores`` orders both)."""
        view = None if snapshot is None else self._view(snapshot, scores, host_scores)
        if view is not None and not self.host_ordered and view.orders_host:
            raise ValueError("this shadow's arm does not order the host tier")
        self.view = view
        retired = view.retired_workflows if view is not None else frozenset()
        self.budget.adopt(view, self.ownership.retire(retired))

    def _view(
        self,
        snapshot: PolicySnapshot,
        scores: Mapping[int, float],
        host_scores: Mapping[int, float] | None,
    ) -> SnapshotView:
        """``snapshot`` as the connector indexes it, its ranking (``top``) over the blocks
        cached in the shadow GPU, highest first, at most the connector's list scaled."""
        floor = snapshot.default_score
        # the ranking lists blocks scored above the floor: retired ones never are. It is
        # sorted whole, so it is gathered from the smaller side: the scores or the shadow GPU
        above = scores.live if isinstance(scores, ScoreMap) and floor >= RETIRED_SCORE else scores
        free, held = self.gpu.free_queue, self.gpu.refs
        if len(above) < len(free) + len(held):
            ranked = [(s, b) for b, s in above.items() if s > floor and (b in free or b in held)]
        else:
            ranked = [(s, b) for b in free if (s := above.get(b, floor)) > floor]
            ranked += [(s, b) for b in held if (s := above.get(b, floor)) > floor]
        ranked.sort(reverse=True)
        limit = max(1, round(DEFAULT_TOP_BLOCKS * self.rate))
        return SnapshotView(
            version=snapshot.version,
            policy=snapshot.policy,
            scores=scores,
            host_scores=scores if host_scores is None else host_scores,
            default_score=floor,
            retired_workflows=frozenset(snapshot.retired_workflows),
            write_filter=snapshot.write_filter,
            pin=snapshot.pin,
            stage=frozenset(snapshot.stage),
            top=tuple(b for _, b in ranked[:limit]),
        )

    def start(
        self,
        request_id: str,
        workflow_id: str,
        sampled: tuple[int, ...],
        positions: tuple[int, ...],
        blocks: int,
    ) -> int:
        """A request of ``blocks`` blocks whose blocks at ``positions`` (``sampled``) are
        followed: its prefix lookup, the write filter's decision on its host writes (made when
        it finishes), its blocks held on the GPU. Returns the sampled blocks it hits. The write
        filter counts the request's new blocks from its first sampled miss on."""
        gpu, host = self.gpu, self.host
        n = len(sampled)
        on_gpu = 0  # prefix caching: the GPU prefix, then the host's continuation of it
        while on_gpu < n and sampled[on_gpu] in gpu:
            on_gpu += 1
        self._step(frozenset(sampled[:on_gpu]))
        hits = on_gpu
        while hits < n and sampled[hits] in host:
            hits += 1
        if self.host_capacity:
            loaded = hits > on_gpu
            offered = sampled[hits:] if loaded else sampled
            new_blocks = blocks - (positions[hits] if hits < n else blocks)
            allowed = write_allowed(self.view, new_blocks)  # decided at the lookup
            used = sampled[on_gpu:] if loaded else offered
            self._host_writes[request_id] = (offered if allowed else None, used)
        self.ownership.record(workflow_id, sampled)
        held = len(gpu.refs)
        self.applier.make_room(sum(1 for b in sampled if b not in gpu), gpu.capacity - held)
        gpu.touch(sampled)
        gpu.trim()
        return hits

    def _store(self, offered: tuple[int, ...]) -> None:
        """vLLM's ``prepare_store``: the offered blocks not yet stored, all or none, evicting
        blocks the request does not offer."""
        host = self.host
        new = [b for b in dict.fromkeys(offered) if b not in host]
        if not new:
            return
        excess = len(host) + len(new) - self.host_capacity
        if excess > 0:
            protected = {b for b in offered if b in host}
            if host.evict(excess, protected) is None:
                return  # not enough to evict: nothing is stored
        host.insert_many(new)  # (none of them held: each inserted, evictable)

    def hold(self, sampled: tuple[int, ...]) -> None:
        """A running request cached these blocks (its output): held until it finishes."""
        self.gpu.touch(sampled)
        self.gpu.trim()

    def finish(self, request_id: str, sampled: tuple[int, ...]) -> None:
        """The request's blocks go to the GPU's free queue, its tail first; its host writes
        are made, and the host blocks it offered or loaded become the most recent, its first
        block last."""
        self.gpu.free(reversed(sampled))
        self.gpu.trim()
        writes = self._host_writes.pop(request_id, None)
        if writes is not None:
            offered, used = writes
            if offered:
                self._store(offered)
            self.host.touch(used)

    def _step(self, hit: frozenset[int]) -> None:
        """The connector's budget at a prefix lookup: a whole step's once every ``1 / rate``
        lookups."""
        self._credit += self.rate
        while self._credit >= 1.0:
            self._credit -= 1.0
            self.budget.new_step()
            self.budget.run(hit)
