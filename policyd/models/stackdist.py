"""Exact LRU stack distances (Mattson et al., 1970) over a stream of KV-block references.

*Reference stream* (EfficientAgent): every block of every prompt, prompts in request order, each
prompt's blocks **tail first**. A reference's *stack distance* is the number of distinct blocks
referenced since the previous reference to the same block (``COLD`` for a first reference); the
block hits an LRU tier of ``C`` blocks iff its distance ``< C``.

*Algorithm.* One slot per reference time in a Fenwick tree, marked while it holds the latest
reference of its block; a reference's distance is the number of marks after its block's previous
slot. When the slots run out, the live marks are renumbered in order (compaction), and the
timeline doubles only if more than half of it is live, so it has at most ``4 x M`` slots for ``M``
distinct blocks: O(log M) per reference, O(M) memory, O(N log M) for a trace. ``stack_distances``
runs it compiled (numba, an open-addressing table from block to slot: no sort of the trace) over
whole traces; ``StackDistance`` is the same algorithm, incremental (a dict from block to slot),
for the live daemon, and ``remove`` lets a sampler drop blocks.

*Prefix semantics.* vLLM uses a block only if every earlier block of its prompt is usable, so a
prompt's hit in a tier of ``C`` blocks is the *leading run* (from the head) of blocks with
distance ``< C``. Equivalently each reference has an *effective distance*: the largest distance
among its prompt's blocks from the head up to it (``effective_distances``); the leading run for
``C`` is the number of the prompt's blocks whose effective distance is ``< C``, for every ``C`` at
once, so the histogram of effective distances is the exact prompt-level miss-ratio curve.

*Chained prompts are monotone.* When block hashes are chained (a hash covers its whole prefix, as
in vLLM), distances never decrease from a prompt's head toward its tail, and effective distances
equal distances. Proof: take blocks ``a`` before ``b`` in a prompt. Every earlier prompt holding
``b`` also held ``a`` and, tail first, referenced it after ``b``, so ``b``'s previous reference is
older than ``a``'s; now ``b`` is referenced before ``a``. The window since ``a``'s previous
reference adds ``b`` and the blocks between them to the window of ``b`` minus ``a``, all of which
``b``'s window already counts (with ``a`` itself). The same argument holds for the distances among
any subset of blocks, hence for a spatially sampled stream (``policyd.models.mrc``).
``monotone_violations`` counts the exceptions in a trace (0 for every chained workload).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

from policyd.core.jit import compiled as _compiled
from policyd.workloads.calls import Call

COLD: Final = int(np.iinfo(np.int64).max)  # distance of a first reference: misses at any size


# ---- the reference stream -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReferenceStream:
    """Prompts as one flat stream of block references, each prompt tail first.

    ``blocks[starts[p]:starts[p + 1]]`` are prompt ``p``'s blocks, tail first (its head block is
    the last one); ``prompt_tokens[p]`` its token count (a partial tail block included).
    """

    blocks: NDArray[np.uint64]
    starts: NDArray[np.int64]
    prompt_tokens: NDArray[np.int64]

    @classmethod
    def from_prompts(cls, prompts: Iterable[tuple[Sequence[int], int]]) -> ReferenceStream:
        """From ``(block_hashes head first, prompt_tokens)`` pairs in request order."""
        lengths: list[int] = []
        tokens: list[int] = []
        chunks: list[NDArray[np.uint64]] = []
        for block_hashes, prompt_tokens in prompts:
            lengths.append(len(block_hashes))
            tokens.append(prompt_tokens)
            chunks.append(np.asarray(block_hashes, dtype=np.uint64)[::-1])
        starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        blocks = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint64)
        return cls(blocks.astype(np.uint64, copy=False), starts, np.asarray(tokens, np.int64))

    @classmethod
    def from_calls(cls, calls: Iterable[Call]) -> ReferenceStream:
        """The prompts of ``calls`` (in the order given: an interleaving of streams)."""
        return cls.from_prompts((c.block_hashes, c.prompt_tokens) for c in calls)

    @property
    def prompts(self) -> int:
        return len(self.starts) - 1

    def __len__(self) -> int:
        return len(self.blocks)


# ---- offline (compiled) path --------------------------------------------------------------------


@_compiled
def _rebuild(tree: NDArray[np.int64], live: int) -> None:
    """A Fenwick tree whose first ``live`` slots are marked: node i covers (i - lowbit(i), i]."""
    for i in range(1, tree.shape[0]):
        tree[i] = max(0, min(i, live) - (i - (i & -i)))


@_compiled
def _distances_kernel(blocks: NDArray[np.uint64]) -> NDArray[np.int64]:
    n = blocks.shape[0]
    out = np.empty(n, np.int64)
    # open-addressing hash table: block -> slot of its latest reference (-1: empty entry)
    table = 1024
    keys = np.zeros(table, np.uint64)
    slot_of = np.full(table, -1, np.int64)
    size = 1024  # timeline slots; compaction keeps at most half of them live
    tree = np.zeros(size + 1, np.int64)  # Fenwick tree over slots, 1-based
    owner = np.full(size, -1, np.int64)  # slot -> table entry of the block it holds
    live = 0
    nxt = 0
    for t in range(n):
        key = blocks[t]
        mask = table - 1
        h = np.int64((key * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)) & mask
        while slot_of[h] != -1 and keys[h] != key:
            h = (h + 1) & mask
        p = slot_of[h]
        if p >= 0:
            marks = 0  # marks at slots <= p
            i = p + 1
            while i > 0:
                marks += tree[i]
                i -= i & -i
            out[t] = live - marks
            i = p + 1
            while i <= size:
                tree[i] -= 1
                i += i & -i
            owner[p] = -1
        else:
            out[t] = COLD
            live += 1
            keys[h] = key
            slot_of[h] = size  # a placeholder >= 0 until the slot is assigned below
            if 2 * live > table:  # grow the table; entries move, so owners are rewritten
                old_keys, old_slots = keys, slot_of
                table *= 2
                mask = table - 1
                keys = np.zeros(table, np.uint64)
                slot_of = np.full(table, -1, np.int64)
                for e in range(old_keys.shape[0]):
                    if old_slots[e] >= 0:
                        k = old_keys[e]
                        g = np.int64((k * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)) & mask
                        while slot_of[g] != -1:
                            g = (g + 1) & mask
                        keys[g] = k
                        slot_of[g] = old_slots[e]
                        if k == key:
                            h = g
                        elif old_slots[e] < size:
                            owner[old_slots[e]] = g
        if nxt == size:  # compaction: renumber the live marks 0..live-1, growing if crowded
            new_size = 2 * size if 2 * live > size else size
            new_owner = np.full(new_size, -1, np.int64)
            k = 0
            for s in range(size):
                e = owner[s]
                if e >= 0:
                    slot_of[e] = k
                    new_owner[k] = e
                    k += 1
            size = new_size
            owner = new_owner
            tree = np.zeros(size + 1, np.int64)
            _rebuild(tree, k)
            nxt = k
        slot_of[h] = nxt
        owner[nxt] = h
        i = nxt + 1
        while i <= size:
            tree[i] += 1
            i += i & -i
        nxt += 1
    return out


def stack_distances(blocks: ArrayLike) -> NDArray[np.int64]:
    """The LRU stack distance of every reference of ``blocks`` (``COLD`` for first ones):
    unsigned 64-bit block ids (hashes), any other integers are reinterpreted as such."""
    keys = np.ascontiguousarray(np.asarray(blocks).astype(np.uint64, copy=False).ravel())
    return _distances_kernel(keys)


@_compiled
def _effective_kernel(distances: NDArray[np.int64], starts: NDArray[np.int64]) -> NDArray[np.int64]:
    out = np.empty_like(distances)
    for p in range(starts.shape[0] - 1):
        running = 0
        for i in range(starts[p + 1] - 1, starts[p] - 1, -1):  # head (last) to tail (first)
            running = max(running, distances[i])
            out[i] = running
    return out


def effective_distances(
    distances: NDArray[np.int64], starts: NDArray[np.int64]
) -> NDArray[np.int64]:
    """Per reference, the largest distance among its prompt's blocks from the head up to it:
    the block is in its prompt's leading run for a tier of ``C`` blocks iff this is ``< C``."""
    return _effective_kernel(np.ascontiguousarray(distances, np.int64), starts)


def leading_runs(
    distances: NDArray[np.int64], starts: NDArray[np.int64], capacity_blocks: int
) -> NDArray[np.int64]:
    """Per prompt, the largest ``j`` such that its head blocks ``0..j-1`` all have distance
    ``< capacity_blocks``: its prefix hit in an LRU tier of that size."""
    hit = effective_distances(distances, starts) < capacity_blocks
    cumulative = np.concatenate(([0], np.cumsum(hit, dtype=np.int64)))
    return cumulative[starts[1:]] - cumulative[starts[:-1]]


def monotone_violations(distances: NDArray[np.int64], starts: NDArray[np.int64]) -> int:
    """References whose distance is below that of the block before them in their prompt (head
    first order): 0 for chained prompts, where effective distances equal distances."""
    if len(distances) < 2:
        return 0
    n = len(distances)
    toward_head = distances[1:]  # in a tail-first stream the next reference is nearer the head
    same_prompt = np.ones(n - 1, dtype=bool)
    same_prompt[starts[(starts > 0) & (starts < n)] - 1] = False  # pairs across prompts
    return int(np.count_nonzero(same_prompt & (distances[:-1] < toward_head)))


# ---- incremental path ---------------------------------------------------------------------------


class StackDistance:
    """Mattson's algorithm one reference at a time, for the live daemon.

    ``access(block)`` returns the block's stack distance (``None`` for a first reference) and
    makes it the most recent; ``remove(block)`` forgets it (a sampler dropping a block). Memory
    is O(tracked blocks): the timeline is compacted when full and grows only while more than half
    of it is live.

    >>> sd = StackDistance()
    >>> [sd.access(b) for b in "abcab"]
    [None, None, None, 2, 2]
    """

    __slots__ = ("_live", "_next", "_owner", "_size", "_slot", "_tree")

    def __init__(self, initial_slots: int = 64) -> None:
        self._size = max(2, initial_slots)
        self._tree = [0] * (self._size + 1)
        self._owner: list[object] = [None] * self._size
        self._slot: dict[object, int] = {}
        self._live = 0
        self._next = 0

    def __len__(self) -> int:
        return self._live

    def __contains__(self, block: object) -> bool:
        return block in self._slot

    @property
    def slots(self) -> int:
        """Timeline slots allocated (the structure's memory, in entries)."""
        return self._size

    def _add(self, pos: int, delta: int) -> None:
        tree, size = self._tree, self._size
        i = pos + 1
        while i <= size:
            tree[i] += delta
            i += i & -i

    def _compact(self, shrink: bool = False) -> None:
        """Renumber the live marks in order; the timeline doubles when more than half of it is
        live, or (``shrink``) is cut to twice the live marks."""
        live = [b for b in self._owner if b is not None]
        if shrink:
            self._size = max(2, 2 * len(live))
        elif 2 * len(live) > self._size:
            self._size *= 2
        size = self._size
        self._owner = live + [None] * (size - len(live))
        self._slot = {b: i for i, b in enumerate(live)}
        k = len(live)  # a tree of k ones: node i covers slots (i - lowbit(i), i]
        self._tree = [0] + [max(0, min(i, k) - (i - (i & -i))) for i in range(1, size + 1)]
        self._next = len(live)

    def access(self, block: object) -> int | None:
        if self._next == self._size:
            self._compact()
        pos = self._slot.get(block)
        distance: int | None = None
        if pos is None:
            self._live += 1
        else:
            tree = self._tree
            marks = 0
            i = pos + 1
            while i > 0:
                marks += tree[i]
                i -= i & -i
            distance = self._live - marks
            self._add(pos, -1)
            self._owner[pos] = None
        nxt = self._next
        self._slot[block] = nxt
        self._owner[nxt] = block
        self._add(nxt, 1)
        self._next = nxt + 1
        return distance

    def remove(self, block: object) -> bool:
        """Forget ``block``: later distances no longer count it. False if it was not tracked."""
        pos = self._slot.pop(block, None)
        if pos is None:
            return False
        self._add(pos, -1)
        self._owner[pos] = None
        self._live -= 1
        if 4 * self._live + 4 < self._size:  # removals emptied it: memory follows the live set
            self._compact(shrink=True)
        return True
