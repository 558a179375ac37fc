"""The host tier's eviction order: retired first, then by score, then least recently used.

The order vLLM's ``CachePolicy`` delegates to (connector/vllm_adapter.py). With no snapshot every
key has the same class and score, so the order *is* LRU, identical to vLLM's ``LRUCachePolicy``:
a request's keys are ranked tail first, so its head (the shared prefix) stays longest. With a
snapshot the priority of a key is ``(retired ? 0 : staged ? 2 : 1, score, recency rank)``, the
score from the snapshot's host order (``host_scores``) when it gives one, else its ``scores``.

Evictable keys sit in a lazy min-heap keyed by that priority; a new snapshot re-keys the heap in
one O(n) pass, every other call is O(log n). ``evict`` is atomic: ``None`` and no change when it
cannot take exactly ``n`` unprotected keys.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from typing import Generic, TypeVar

from policyd.tiers.view import SnapshotView

K = TypeVar("K", bound=Hashable)
Priority = tuple[int, float, int]

RETIRED, NORMAL, STAGED = 0, 1, 2


class HostOrder(Generic[K]):
    """Recency ranks and snapshot-driven priorities over a set of keys."""

    def __init__(self, block_of: Callable[[K], int]) -> None:
        self.block_of = block_of
        self._rank: dict[K, int] = {}
        self._evictable: set[K] = set()
        self._prio: dict[K, Priority] = {}
        self._heap: list[tuple[Priority, K]] = []
        self._next_rank = 0
        self._view: SnapshotView | None = None
        self._retired: AbstractSet[int] = frozenset()

    def __len__(self) -> int:
        return len(self._rank)

    def __contains__(self, key: object) -> bool:
        return key in self._rank

    def __iter__(self) -> Iterator[K]:
        """Every key, in no particular order."""
        return iter(self._rank)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    # -- the snapshot -----------------------------------------------------------------------

    def set_view(self, view: SnapshotView | None, retired: AbstractSet[int] = frozenset()) -> None:
        """Adopt a new snapshot (or none: plain LRU) and re-key every evictable key."""
        self._view = view
        self._retired = retired if view is not None else frozenset()
        self._heap = []
        for key in self._evictable:
            self._prio[key] = p = self._priority(key)
            self._heap.append((p, key))
        heapq.heapify(self._heap)

    def _priority(self, key: K) -> Priority:
        view = self._view
        if view is None:
            return (NORMAL, 0.0, self._rank[key])
        block = self.block_of(key)
        if block in self._retired:
            cls = RETIRED
        elif block in view.stage:
            cls = STAGED
        else:
            cls = NORMAL
        return (cls, view.host_score(block), self._rank[key])

    def _push(self, key: K) -> None:
        self._prio[key] = p = self._priority(key)
        heapq.heappush(self._heap, (p, key))
        if len(self._heap) > max(64, 4 * len(self._evictable)):
            self._heap = [(self._prio[k], k) for k in self._evictable]
            heapq.heapify(self._heap)

    # -- membership -------------------------------------------------------------------------

    def insert(self, key: K, evictable: bool = False) -> None:
        self._next_rank += 1
        self._rank[key] = self._next_rank
        if evictable:
            self._evictable.add(key)
            self._push(key)

    def remove(self, key: K) -> None:
        self._rank.pop(key, None)
        self._evictable.discard(key)
        self._prio.pop(key, None)

    def clear(self) -> None:
        self._rank.clear()
        self._evictable.clear()
        self._prio.clear()
        self._heap.clear()
        self._next_rank = 0

    def mark_evictable(self, key: K) -> None:
        if key in self._rank and key not in self._evictable:
            self._evictable.add(key)
            self._push(key)

    def mark_non_evictable(self, key: K) -> None:
        self._evictable.discard(key)
        self._prio.pop(key, None)

    def touch(self, keys_head_to_tail: Iterable[K]) -> None:
        """A request used these keys: the tail gets the older rank, so it is evicted first."""
        for key in reversed(list(keys_head_to_tail)):
            if key not in self._rank:
                continue
            self._next_rank += 1
            self._rank[key] = self._next_rank
            if key in self._evictable:
                self._push(key)

    # -- eviction ---------------------------------------------------------------------------

    def _current(self, entry: tuple[Priority, K]) -> bool:
        prio, key = entry
        return key in self._evictable and self._prio.get(key) == prio

    def evict(self, n: int, protected: set[K] | frozenset[K] = frozenset()) -> list[K] | None:
        """Take exactly ``n`` evictable, unprotected keys in priority order, or None (no change)."""
        if n <= 0:
            return []
        chosen: list[tuple[Priority, K]] = []
        chosen_keys: set[K] = set()
        deferred: list[tuple[Priority, K]] = []
        while self._heap and len(chosen) < n:
            entry = heapq.heappop(self._heap)
            if not self._current(entry) or entry[1] in chosen_keys:
                continue
            if entry[1] in protected:
                deferred.append(entry)
                continue
            chosen.append(entry)
            chosen_keys.add(entry[1])
        for entry in deferred:
            heapq.heappush(self._heap, entry)
        if len(chosen) < n:
            for entry in chosen:
                heapq.heappush(self._heap, entry)
            return None
        for _, key in chosen:
            self.remove(key)
        return [key for _, key in chosen]

    def peek_order(self) -> list[K]:
        """Every evictable key, first victim first (tests and debugging; O(n log n))."""
        return [k for _, k in sorted((self._prio[k], k) for k in self._evictable)]
