"""A model of vLLM's two KV tiers at block-hash granularity.

``GpuTier`` is vLLM's block pool: a fixed number of physical blocks; blocks of running requests
are referenced and cannot be evicted; freed blocks stay cached in an eviction queue until they
are reused (touched: leave the queue) or evicted. ``HostTier`` is the offloading tier: every
cached block is evictable.

The GPU tier's queue is ``LruQueue``, vLLM's free-queue order, for every policy the connector
serves: a snapshot changes it only through the moves ``policyd.tiers.gpu.GpuApplier`` makes,
which ``GpuTier`` offers with the names of vLLM's ``BlockPool`` (``lookup``, ``touch``,
``free``, ``evict``, ``to_tail``). Free space stands for vLLM's slots without a hash, which sit at
the head of its queue and are taken first. The host tier's queue is ``HostOrderQueue``, the
connector's own host order, or ``LruQueue``. ``KeyedQueue`` (by a key such as an oracle's next
use) is for the offline bound only, which no connector applies.

Simplification, stated: vLLM may hold two physical blocks under one hash (two running requests
computing the same block); here the second copy is scratch space of its request, freed when the
request ends, so only one copy is ever cached.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Sequence
from typing import Literal

from policyd.core.queues import EvictionQueue, LruQueue
from policyd.tiers.host_order import HostOrder

RunningSpace = Literal["shared", "separate"]


class HostOrderQueue:
    """The connector's host-tier order (``policyd.tiers.host_order.HostOrder``) as an eviction
    queue: blocks of retired workflows first, then by the snapshot's host score, then least
    recently used; exactly vLLM's LRU while no view is set."""

    def __init__(self) -> None:
        self.order: HostOrder[int] = HostOrder(int)

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, block: object) -> bool:
        return block in self.order

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def push(self, block: int) -> None:
        if block in self.order:
            self.order.touch([block])
        else:
            self.order.insert(block, evictable=True)

    def push_many(self, blocks: list[int]) -> None:
        self.order.insert_many(blocks)

    def discard(self, block: int) -> None:
        self.order.remove(block)

    def discard_many(self, blocks: list[int]) -> None:
        self.order.remove_many(blocks)

    def pop_head(self) -> int | None:
        out = self.order.evict(1)
        return out[0] if out else None

    def pop_many(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n and (block := self.pop_head()) is not None:
            out.append(block)
        return out

    def peek(self) -> int | None:
        order = self.order.peek_order()
        return order[0] if order else None

    def evict(self, n: int, protected: Collection[int] = ()) -> list[int] | None:
        return self.order.evict(n, frozenset(protected))


Admits = Callable[[int, int], bool]  # (candidate, victim) -> cache candidate by evicting victim?


class GpuTier:
    """vLLM's GPU block pool.

    ``running_space="shared"`` (vLLM): a running request's blocks occupy the pool, so admitting
    it evicts cached blocks to make room. ``"separate"``: the textbook cache abstraction the
    reference simulators use - capacity counts cached blocks only, and a computed block is
    inserted one at a time, possibly bypassed (``admits``).
    """

    def __init__(
        self,
        capacity_blocks: int,
        queue: EvictionQueue,
        *,
        running_space: RunningSpace = "shared",
        admits: Admits | None = None,
    ) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.queue = queue
        self.running_space = running_space
        self.admits = admits
        self.refs: dict[int, int] = {}  # cached block -> references by running requests
        self.scratch_blocks = 0  # allocated to running requests, not (yet) cached

    # -- queries -------------------------------------------------------------------------------

    def __contains__(self, block: object) -> bool:
        return block in self.refs

    def __len__(self) -> int:
        return len(self.refs)

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - len(self.refs) - self.scratch_blocks

    def prefix_hits(self, blocks: Sequence[int], limit: int) -> int:
        """Length of the leading run of cached blocks, at most ``limit``."""
        refs = self.refs
        n = 0
        while n < limit and blocks[n] in refs:
            n += 1
        return n

    def can_allocate(self, n_blocks: int) -> bool:
        if self.running_space == "separate":
            return True
        return self.free_blocks + len(self.queue) >= n_blocks

    # -- updates -------------------------------------------------------------------------------

    def acquire(self, blocks: Sequence[int]) -> None:
        """A request references cached blocks: they leave the eviction queue."""
        refs = self.refs
        self.queue.discard_many([b for b in blocks if refs[b] == 0])
        refs.update({b: refs[b] + 1 for b in blocks})

    def allocate(self, n_blocks: int) -> list[int]:
        """Reserve ``n_blocks`` for a request; returns the cached blocks evicted for them."""
        if self.running_space == "separate":
            return []
        evicted = self._evict(n_blocks - self.free_blocks)
        self.scratch_blocks += n_blocks
        return evicted

    def _evict(self, n_blocks: int) -> list[int]:
        if n_blocks <= 0:
            return []
        evicted = self.queue.pop_many(n_blocks)
        if len(evicted) < n_blocks:
            raise RuntimeError("GPU tier: no evictable block (caller must check can_allocate)")
        deque(map(self.refs.pop, evicted), maxlen=0)
        return evicted

    def commit(self, blocks: Sequence[int], held: list[int]) -> tuple[list[int], list[int]]:
        """Computed blocks become cached and referenced by their request (appended to ``held``).

        Returns ``(cached, evicted)``. Shared space: the blocks were allocated; one already
        cached (computed concurrently) stays scratch. Separate space: each is inserted, evicting
        or bypassing; after the first block not cached the rest are not either (no prefix).
        """
        refs = self.refs
        cached: list[int] = []
        evicted: list[int] = []
        if self.running_space == "shared":
            cached = [b for b in dict.fromkeys(blocks) if b not in refs]
            refs.update(dict.fromkeys(cached, 1))
            self.scratch_blocks -= len(cached)
            held.extend(cached)
            return cached, evicted
        queue, admits = self.queue, self.admits
        for block in blocks:
            if block in refs:
                continue
            if len(refs) >= self.capacity_blocks:
                victim = queue.peek()
                if victim is None or (admits is not None and not admits(block, victim)):
                    break
                queue.pop_head()
                del refs[victim]
                evicted.append(victim)
            refs[block] = 1
            held.append(block)
            cached.append(block)
        return cached, evicted

    def insert_unreferenced(self, blocks: Iterable[int]) -> list[int]:
        """Prefetched blocks: cached into free space only (never evicting), unreferenced."""
        refs, queue = self.refs, self.queue
        inserted: list[int] = []
        for block in blocks:
            if self.free_blocks <= 0:
                break
            if block in refs:
                continue
            refs[block] = 0
            queue.push(block)
            inserted.append(block)
        return inserted

    # -- policyd.tiers.gpu.GpuPool: the moves a snapshot makes (handle = the block hash) ------

    def lookup(self, block: int) -> int | None:
        return block if block in self.refs else None

    def is_free(self, handle: int) -> bool:
        return self.refs.get(handle) == 0

    def touch(self, handles: Sequence[int]) -> None:
        self.acquire(handles)

    def free(self, handles: Sequence[int]) -> None:
        refs = self.refs
        for block in handles:
            refs[block] -= 1
            if not refs[block]:
                self.queue.push(block)

    def evict(self, handles: Sequence[int]) -> None:
        """The slots become free space (vLLM: no hash, at the queue's head: reused first)."""
        self.queue.discard_many(list(handles))
        deque(map(self.refs.pop, handles), maxlen=0)

    def to_tail(self, handles: Sequence[int]) -> None:
        queue = self.queue
        if not isinstance(queue, LruQueue):
            raise TypeError("queue moves need vLLM's free-queue order (LruQueue)")
        queue.to_tail(handles)

    def release(self, held: Sequence[int], scratch_blocks: int) -> None:
        """A request ended: its blocks are freed tail first (vLLM's order), so a prefix's
        deepest block is evicted before its parents; its scratch space is returned."""
        refs = self.refs
        left = {b: refs[b] - 1 for b in held}  # held blocks are distinct
        refs.update(left)
        self.queue.push_many([b for b in reversed(held) if not left[b]])
        self.scratch_blocks -= scratch_blocks


class HostTier:
    """The host (CPU) tier of vLLM's offloading connector: store, look up, evict."""

    def __init__(self, capacity_blocks: int, queue: EvictionQueue, *, admits: Admits | None = None):
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.queue = queue
        self.admits = admits
        # the resident blocks, for membership tests (the connector's order: its live key view)
        self._resident: Container[object] = (
            queue.order.members if isinstance(queue, HostOrderQueue) else queue
        )

    def __contains__(self, block: object) -> bool:
        return block in self._resident

    def __len__(self) -> int:
        return len(self.queue)

    def prefix_hits(self, blocks: Sequence[int], start: int, limit: int) -> int:
        """Length of the run of host-resident blocks from ``start``, at most ``limit`` in all."""
        resident = self._resident
        n = start
        while n < limit and blocks[n] in resident:
            n += 1
        return n - start

    def touch(self, blocks: Iterable[int]) -> None:
        """Make resident ``blocks`` the most recent, in the order given. Each keeps its place
        in the connector's order, re-ranked as its ``HostOrder.touch`` re-ranks it (a held key
        pushed again is touched); vLLM's LRU moves them to its tail."""
        queue, resident = self.queue, self._resident
        present = [b for b in blocks if b in resident]
        if isinstance(queue, LruQueue):
            queue.to_tail(present)
        else:
            queue.push_many(present)

    def loaded(self, blocks: Sequence[int]) -> None:
        """A request loads these resident blocks: in the connector's order each takes a new
        place (``HostOrder.loaded``); vLLM's LRU is unchanged by a load."""
        if isinstance(self.queue, HostOrderQueue):
            self.queue.order.loaded(blocks)

    def store(
        self, blocks: Sequence[int], protected: Collection[int] = ()
    ) -> tuple[list[int], list[int]]:
        """Write blocks not yet resident, evicting others; ``protected`` (the request's own
        keys) are never evicted for it. Returns ``(stored, evicted)``.

        Without ``admits`` this is vLLM's ``prepare_store``: all or nothing - when not enough
        unprotected blocks can be evicted nothing is stored. With ``admits`` (an oracle) each
        block is decided alone and may be bypassed.
        """
        queue, admits, resident = self.queue, self.admits, self._resident
        new = [b for b in dict.fromkeys(blocks) if b not in resident]
        stored: list[int] = []
        evicted: list[int] = []
        if not new or self.capacity_blocks == 0:
            return stored, evicted
        guard = {b for b in protected if b in resident}
        if admits is None:
            n_evict = len(queue) + len(new) - self.capacity_blocks
            if n_evict > 0:
                victims = queue.evict(n_evict, guard)
                if victims is None:  # not enough unprotected blocks: vLLM stores nothing
                    return stored, evicted
                evicted = victims
            queue.push_many(new)
            return new, evicted
        for block in new:
            if len(queue) >= self.capacity_blocks:
                victim = queue.peek()
                if victim is None or victim in guard or not admits(block, victim):
                    continue
                queue.pop_head()
                evicted.append(victim)
            queue.push(block)
            stored.append(block)
        return stored, evicted

    def clear(self) -> list[int]:
        dropped: list[int] = []
        while (block := self.queue.pop_head()) is not None:
            dropped.append(block)
        return dropped
