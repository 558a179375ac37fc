"""The host tier's eviction order: retired first, then by score, then least recently used.

The order vLLM's ``CachePolicy`` delegates to (connector/vllm_adapter.py). With a snapshot that
orders the host tier the priority of a key is ``(retired ? 0 : staged ? 2 : 1, score, recency
rank)``, the score from the snapshot's host order (``host_scores``) when it gives one, else its
``scores``. With no snapshot, or one that gives the host tier no order (no scores, nothing
retired or staged: vLLM's default, or a write filter alone), the order *is* LRU, identical to
vLLM's ``LRUCachePolicy`` (a request's keys are ranked tail first, so its head, the shared
prefix, stays longest) - from the moment the view is set: evictions then take the oldest keys
of the recency order (every key, in rank order, in one ordered dict), so no key keeps a score
from an earlier snapshot while the walk below has not reached it.

Evictable keys sit in a lazy min-heap keyed by that priority; every call is O(log n) but one:
a new snapshot changes every key's priority, and re-keying every key at once takes time in
proportion to the tier, more than a scheduler step can afford on a large one. So ``set_view``
is O(1) and the re-keying is a *walk* over the evictable keys, ``REKEY_CHUNK`` keys per unit of
work, performed by ``rekey(units)`` within the connector's per-step budget (the simulator calls
it at the same points). A key the walk has not reached keeps its previous priority; one
inserted or touched meanwhile gets the new one. Stale heap entries (a key re-keyed or touched
leaves its old one behind) are dropped by a compaction pass of the same kind, which builds a
fresh heap beside the live one and swaps it in; the old heap goes to ``release`` (the connector
frees it off vLLM's thread). ``evict`` is atomic: ``None`` and no change when it cannot take
exactly ``n`` unprotected keys.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, KeysView
from collections.abc import Set as AbstractSet
from typing import Any, Final, Generic, TypeVar

from policyd.tiers.view import SnapshotView

K = TypeVar("K", bound=Hashable)
Priority = tuple[int, float, int]

RETIRED, NORMAL, STAGED = 0, 1, 2
REKEY_CHUNK: Final = 2  # keys re-keyed per unit of work (about one GPU move's cost)
STALE_FACTOR: Final = 3  # a compaction pass starts once the heap holds this many entries a key


class HostOrder(Generic[K]):
    """Recency ranks and snapshot-driven priorities over a set of keys."""

    def __init__(self, block_of: Callable[[K], int]) -> None:
        self.block_of = block_of
        # every key -> its recency rank, in rank order (oldest first: a key given a new rank
        # moves to the end), so the oldest evictable keys are at the front
        self._rank: OrderedDict[K, int] = OrderedDict()
        self._prio: dict[K, Priority] = {}  # the evictable keys, at their current priority
        self._heap: list[tuple[Priority, K]] = []
        self._next_rank = 0
        self._view: SnapshotView | None = None
        self._retired: AbstractSet[int] = frozenset()
        self._plain = True  # the view gives the host tier no order: evict by rank alone
        # the evictable keys at stable positions, the walk's order (a freed slot is reused)
        self._slots: list[K | None] = []
        self._slot_of: dict[K, int] = {}
        self._free_slots: list[int] = []
        # the re-keying walk (or compaction: the fresh heap it builds), its next slot, and
        # whether another walk is owed (a view arrived during one)
        self._walking = False
        self._next_heap: list[tuple[Priority, K]] | None = None
        self._cursor = 0
        self._owed = False
        # what becomes of a heap a compaction replaced: freeing it is O(n), the costliest thing
        # here, so the connector hands it to a thread of its own
        # (``ConnectorRuntime.release``); by default it is dropped at once
        self.release: Callable[[list[Any]], None] = _drop
        # told of each eviction, the keys taken at the priorities they were taken by
        # (diagnostics: ``policyd host-losses``); by default nothing
        self.evicted: Callable[[list[tuple[Priority, K]]], None] = _drop

    def __len__(self) -> int:
        return len(self._rank)

    def __contains__(self, key: object) -> bool:
        return key in self._rank

    def __iter__(self) -> Iterator[K]:
        """Every key, in no particular order."""
        return iter(self._rank)

    @property
    def members(self) -> KeysView[K]:
        """Every key, as a live view (membership tests in C on a hot path)."""
        return self._rank.keys()

    @property
    def num_evictable(self) -> int:
        return len(self._prio)

    @property
    def rekeying(self) -> bool:
        """Work is pending: a walk under way or owed, or a compaction under way or due."""
        return self._owed or self._walking or self._next_heap is not None or self._compaction_due()

    def _compaction_due(self) -> bool:
        return len(self._heap) > STALE_FACTOR * len(self._prio) + 64

    # -- the snapshot -----------------------------------------------------------------------

    def set_view(self, view: SnapshotView | None, retired: AbstractSet[int] = frozenset()) -> None:
        """Adopt a new snapshot (or none: plain LRU); O(1). Keys are re-keyed by ``rekey``:
        a walk under way finishes under the new view and one more follows."""
        self._view = view
        self._retired = retired if view is not None else frozenset()
        self._plain = view is None or not (view.host_scores or view.stage or self._retired)
        self._owed = True

    def rekey(self, units: int | None = None) -> int:
        """Perform up to ``units`` units of pending work (all when None); the units used."""
        used = 0
        while units is None or used < units:
            if self._walking:
                self._walk_chunk()
            elif self._next_heap is not None:
                self._compact_chunk()
            elif self._owed:
                self._owed, self._walking, self._cursor = False, True, 0
                continue  # starting costs nothing
            elif self._compaction_due():
                self._next_heap, self._cursor = [], 0
                continue
            else:
                break
            used += 1
        return used

    def rekey_all(self) -> None:
        self.rekey(None)

    def _walk_chunk(self) -> None:
        """Re-key the next ``REKEY_CHUNK`` slots in place (a key whose priority is unchanged
        costs no heap entry)."""
        slots, prio, heap = self._slots, self._prio, self._heap
        end = min(self._cursor + REKEY_CHUNK, len(slots))
        for i in range(self._cursor, end):
            key = slots[i]
            if key is None:
                continue
            p = self._priority(key)
            if prio[key] != p:
                prio[key] = p
                heapq.heappush(heap, (p, key))
        self._cursor = end
        if end >= len(slots):
            self._walking = False

    def _compact_chunk(self) -> None:
        """Copy the next ``REKEY_CHUNK`` slots' current entries into the fresh heap; at the end
        it replaces the live one, which goes to ``release``."""
        nxt = self._next_heap
        assert nxt is not None
        slots, prio = self._slots, self._prio
        end = min(self._cursor + REKEY_CHUNK, len(slots))
        for i in range(self._cursor, end):
            key = slots[i]
            if key is not None:
                heapq.heappush(nxt, (prio[key], key))
        self._cursor = end
        if end >= len(slots):
            old, self._heap, self._next_heap = self._heap, nxt, None
            self.release(old)

    def _priority(self, key: K) -> Priority:
        view = self._view
        if view is None:
            return (NORMAL, 0.0, self._rank[key])
        return _priority_under(view, self._retired, self.block_of(key), self._rank[key])

    def _push(self, key: K) -> None:
        """``key`` became evictable or took a new rank: an entry in the heap."""
        self._prio[key] = p = self._priority(key)
        heapq.heappush(self._heap, (p, key))
        nxt = self._next_heap
        if nxt is not None and self._slot_of[key] < self._cursor:  # compaction has passed it
            heapq.heappush(nxt, (p, key))
        elif self._room() < 0:
            self._compact_now()

    def _room(self) -> int:
        """Entries the heap may still gain before, with nobody running ``rekey``, it is rebuilt
        at once (``_compact_now``)."""
        return 16 * len(self._prio) + 1024 - len(self._heap)

    def _compact_now(self) -> None:
        """Nobody runs ``rekey`` and the heap is mostly stale entries: rebuild it at once."""
        self._heap = [(q, k) for k, q in self._prio.items()]
        heapq.heapify(self._heap)

    # -- membership -------------------------------------------------------------------------

    def _add_evictable(self, key: K) -> None:
        if self._free_slots:
            slot = self._free_slots.pop()
            self._slots[slot] = key
        else:
            slot = len(self._slots)
            self._slots.append(key)
        self._slot_of[key] = slot
        self._push(key)

    def _drop_evictable(self, key: K) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._slots[slot] = None
            self._free_slots.append(slot)
            del self._prio[key]

    def insert(self, key: K, evictable: bool = False) -> None:
        self._next_rank += 1
        self._rank[key] = self._next_rank
        self._rank.move_to_end(key)
        if key in self._slot_of:
            self._push(key)  # inserted again: its rank, and so its priority, changed
        elif evictable:
            self._add_evictable(key)

    def insert_many(self, keys: Iterable[K]) -> None:
        """For each key in turn: ``touch([key])`` when it is held, else ``insert(key,
        evictable=True)`` - the same ranks, slots and heap entries as those calls, made in one
        loop (a request's blocks, on the simulator's and the manager's hot path)."""
        rank_of, slot_of, prio = self._rank, self._slot_of, self._prio
        slots, free_slots = self._slots, self._free_slots
        view, retired, block_of = self._view, self._retired, self.block_of
        heappush, to_end = heapq.heappush, rank_of.move_to_end
        rank = self._next_rank
        room = self._room()  # kept as the loop goes: a new key adds 16, an entry takes 1
        for key in keys:
            rank += 1
            held = key in rank_of
            rank_of[key] = rank
            if held:
                to_end(key)
                if key not in slot_of:
                    continue  # held, not evictable: a new rank only
            else:
                room += 16
                if free_slots:
                    slot = free_slots.pop()
                    slots[slot] = key
                    slot_of[key] = slot
                else:
                    slot_of[key] = len(slots)
                    slots.append(key)
            # _push, inlined
            p: Priority = (
                (NORMAL, 0.0, rank)
                if view is None
                else _priority_under(view, retired, block_of(key), rank)
            )
            prio[key] = p
            heappush(self._heap, (p, key))
            room -= 1
            nxt = self._next_heap
            if nxt is not None and slot_of[key] < self._cursor:
                heappush(nxt, (p, key))
            elif room < 0:
                self._next_rank = rank
                self._compact_now()
                room = self._room()
        self._next_rank = rank

    def remove_many(self, keys: Iterable[K]) -> None:
        """``remove`` of each key."""
        forget, drop = self._rank.pop, self._drop_evictable
        for key in keys:
            forget(key, None)
            drop(key)

    def remove(self, key: K) -> None:
        self._rank.pop(key, None)
        self._drop_evictable(key)

    def clear(self) -> None:
        self._rank.clear()
        self._prio.clear()
        self._heap = []
        self._slots.clear()
        self._slot_of.clear()
        self._free_slots.clear()
        self._next_heap, self._cursor, self._owed, self._walking = None, 0, False, False
        self._next_rank = 0

    def loaded(self, keys: Iterable[K]) -> None:
        """A load read these keys: vLLM's manager held each while it read it and let it go
        when the load completed (``mark_non_evictable``, then ``mark_evictable``), both taken
        here at once (the simulator's host tier). Each keeps its rank and takes a new place, so
        a re-keying walk reaches it where it reaches the connector's."""
        keys = list(keys)
        for key in keys:
            self.mark_non_evictable(key)
        for key in keys:
            self.mark_evictable(key)

    def mark_evictable(self, key: K) -> None:
        if key in self._rank and key not in self._slot_of:
            self._add_evictable(key)

    def mark_non_evictable(self, key: K) -> None:
        self._drop_evictable(key)

    def touch(self, keys_head_to_tail: Iterable[K]) -> None:
        """A request used these keys: the tail gets the older rank, so it is evicted first.
        (``insert_many`` of the held ones, tail first: it touches a held key.)"""
        held = self._rank
        self.insert_many([key for key in reversed(list(keys_head_to_tail)) if key in held])

    # -- eviction ---------------------------------------------------------------------------

    def _current(self, entry: tuple[Priority, K]) -> bool:
        prio, key = entry
        return self._prio.get(key) == prio

    def evict(self, n: int, protected: set[K] | frozenset[K] = frozenset()) -> list[K] | None:
        """Take exactly ``n`` evictable, unprotected keys in priority order (in rank order while
        the view gives the host tier no order), or None (no change)."""
        if n <= 0:
            return []
        if self._plain:
            oldest = self._oldest(n, protected)
            chosen = None if oldest is None else [(self._prio[key], key) for key in oldest]
        else:
            chosen = _take(self._heap, self._current, n, protected)
        if chosen is None:
            return None
        for _, key in chosen:
            self.remove(key)
        self.evicted(chosen)
        return [key for _, key in chosen]

    def _oldest(self, n: int, protected: AbstractSet[K]) -> list[K] | None:
        """The ``n`` evictable, unprotected keys of the oldest ranks, or None when there are
        fewer: a walk from the front of the recency order, past the keys held (a store or a
        load in flight) or protected, which are few."""
        prio = self._prio
        chosen: list[K] = []
        for key in self._rank:
            if key in prio and key not in protected:
                chosen.append(key)
                if len(chosen) == n:
                    return chosen
        return None

    @property
    def view(self) -> SnapshotView | None:
        """The snapshot the order follows (None: plain LRU)."""
        return self._view

    def priority(self, key: K) -> Priority | None:
        """An evictable key's priority as the heap holds it now (None: not evictable)."""
        return self._prio.get(key)

    def by_recency(self) -> list[K]:
        """Every key, least recently used first."""
        return list(self._rank)

    def peek_order(self) -> list[K]:
        """Every evictable key, first victim first (tests and debugging; O(n log n)): sorted by
        the ranks and priorities themselves, not read off the order ``evict`` walks."""
        if self._plain:
            return sorted(self._prio, key=self._rank.__getitem__)
        return [k for _, k in sorted((p, k) for k, p in self._prio.items())]


def _priority_under(
    view: SnapshotView, retired: AbstractSet[int], block: int, rank: int
) -> Priority:
    """A key's priority under ``view``: retired first, staged last, then the host score, then
    recency."""
    cls = RETIRED if block in retired else STAGED if block in view.stage else NORMAL
    return (cls, view.host_score(block), rank)


E = TypeVar("E", bound=tuple[Any, Any])


def _take(
    heap: list[E], current: Callable[[E], bool], n: int, protected: AbstractSet[Any]
) -> list[E] | None:
    """Pop the ``n`` first current entries whose key is not ``protected`` from ``heap``; when
    there are fewer, put back what was popped and return None."""
    chosen: list[E] = []
    chosen_keys: set[Any] = set()
    deferred: list[E] = []
    while heap and len(chosen) < n:
        entry = heapq.heappop(heap)
        if not current(entry) or entry[1] in chosen_keys:
            continue
        if entry[1] in protected:
            deferred.append(entry)
            continue
        chosen.append(entry)
        chosen_keys.add(entry[1])
    for entry in deferred:
        heapq.heappush(heap, entry)
    if len(chosen) < n:
        for entry in chosen:
            heapq.heappush(heap, entry)
        return None
    return chosen


def _drop(entries: list[Any]) -> None:
    """The default ``HostOrder.release`` and ``HostOrder.evicted``: let the caller's reference
    go."""
