"""Eviction queues over block ids: the free-block order of a cache tier, as plain data structures.

``LruQueue`` is vLLM's free-block queue (freed blocks to the tail, evicted from the head);
``KeyedQueue`` orders by a key evaluated when a block is pushed (a policy's score), recency
breaking ties. Both satisfy ``EvictionQueue``. No dependency on the rest of AgentKV: the
simulator's tiers (policyd.sim.cache) use them.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from itertools import repeat
from typing import Any, Protocol


class EvictionQueue(Protocol):
    """Cached, unreferenced blocks in eviction order."""

    def push(self, block: int) -> None: ...
    def push_many(self, blocks: list[int]) -> None: ...
    def discard(self, block: int) -> None: ...
    def discard_many(self, blocks: list[int]) -> None: ...
    def pop_head(self) -> int | None: ...
    def pop_many(self, n: int) -> list[int]: ...
    def peek(self) -> int | None: ...
    def evict(self, n: int, protected: Collection[int] = ()) -> list[int] | None: ...
    def __len__(self) -> int: ...
    def __contains__(self, block: object) -> bool: ...


class LruQueue(OrderedDict[int, None]):
    """vLLM's free-block queue: appended at the tail when freed, evicted from the head.

    It *is* the ordered dict, so membership and length stay C calls on the hot path.
    """

    def push(self, block: int) -> None:
        self[block] = None

    def push_many(self, blocks: list[int]) -> None:
        self.update(dict.fromkeys(blocks))

    def discard(self, block: int) -> None:
        self.pop(block, None)

    def discard_many(self, blocks: list[int]) -> None:
        deque(map(self.pop, blocks, repeat(None)), maxlen=0)

    def pop_head(self) -> int | None:
        return self.popitem(last=False)[0] if self else None

    def pop_many(self, n: int) -> list[int]:
        """The ``n`` least recent blocks (fewer if the queue is shorter)."""
        popitem = self.popitem
        return [popitem(False)[0] for _ in range(min(n, len(self)))]

    def peek(self) -> int | None:
        return next(iter(self)) if self else None

    def to_tail(self, blocks: Iterable[int]) -> None:
        """Move queued blocks to the tail in the order given (the last is evicted last)."""
        move = self.move_to_end
        for block in blocks:
            move(block)

    def evict(self, n: int, protected: Collection[int] = ()) -> list[int] | None:
        """vLLM's ``LRUCachePolicy.evict``: the ``n`` least recent blocks not ``protected``,
        removed; protected blocks keep their place; ``None`` and no change if there are fewer."""
        if n <= 0:
            return []
        chosen: list[int] = []
        for block in self:
            if block not in protected:
                chosen.append(block)
                if len(chosen) == n:
                    break
        if len(chosen) < n:
            return None
        self.discard_many(chosen)
        return chosen


class KeyedQueue(dict[int, int]):
    """A min-heap on ``key(block)`` (evaluated when the block is pushed), lazy deletion.

    The dict maps each queued block to the sequence number of its live heap entry; the
    sequence also breaks key ties by recency.
    """

    def __init__(self, keys: Callable[[Sequence[int]], list[Any]]) -> None:
        super().__init__()
        self._keys = keys  # keys of many blocks in one call: the hot path is bulk
        self._heap: list[tuple[Any, int, int]] = []
        self._seq = 0

    def push(self, block: int) -> None:
        self.push_many([block])

    def push_many(self, blocks: list[int]) -> None:
        if not blocks:
            return
        seqs = range(self._seq, self._seq + len(blocks))
        self._seq += len(blocks)
        self.update(zip(blocks, seqs, strict=True))
        entries = zip(self._keys(blocks), seqs, blocks, strict=True)
        deque(map(heapq.heappush, repeat(self._heap), entries), maxlen=0)

    def discard(self, block: int) -> None:
        self.pop(block, None)

    def discard_many(self, blocks: list[int]) -> None:
        deque(map(self.pop, blocks, repeat(None)), maxlen=0)

    def _top(self) -> tuple[Any, int, int] | None:
        heap = self._heap
        while heap:
            top = heap[0]
            if self.get(top[2]) == top[1]:
                return top
            heapq.heappop(heap)
        return None

    def pop_head(self) -> int | None:
        top = self._top()
        if top is None:
            return None
        heapq.heappop(self._heap)
        del self[top[2]]
        return top[2]

    def pop_many(self, n: int) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            block = self.pop_head()
            if block is None:
                break
            out.append(block)
        return out

    def peek(self) -> int | None:
        top = self._top()
        return None if top is None else top[2]

    def evict(self, n: int, protected: Collection[int] = ()) -> list[int] | None:
        """The ``n`` first blocks not ``protected``, removed (protected ones are re-queued
        behind); ``None`` and no change if there are fewer."""
        if n <= 0:
            return []
        if len(self) - len([b for b in protected if b in self]) < n:
            return None
        chosen: list[int] = []
        kept: list[int] = []
        while len(chosen) < n:
            block = self.pop_head()
            assert block is not None
            (kept if block in protected else chosen).append(block)
        self.push_many(kept)
        return chosen

    def rekey(self) -> None:
        """Re-evaluate every key (after the scores changed), keeping recency order for ties."""
        order = sorted(self, key=self.__getitem__)
        self._heap.clear()
        self.clear()
        self.push_many(order)
