"""Online estimate of the miss-ratio curve: spatially hashed sampling (SHARDS, Waldspurger et al.,
FAST'15) of block references, affordable on every access of the live daemon.

A block is tracked iff ``mix(hash) < T`` (rate ``R = T / 2^64``); its references go through an
exact ``StackDistance`` of the tracked blocks, and a sampled distance ``d`` estimates ``d / R``.
Fixed-rate keeps ``T``; fixed-size (``max_tracked_blocks`` = s_max) lowers ``T`` to the largest
tracked hash and drops that block whenever the set overflows, so memory is bounded. Each sampled
reference weighs ``1 / R`` at its rate when seen (the paper's rescaling of the histogram on every
threshold drop). The hash filter is vectorised per prompt: only sampled blocks reach Python code.

*Count correction* (SHARDS_adj): the weights sum to a sampled estimate of the reference count,
which misses the true count ``N`` when a few hot blocks (the shared system prompt) are over- or
under-sampled; the difference is added to the first bucket (distance 0). Without it the histogram
is normalised by its own total, as plain SHARDS does (``count_correction=False``).

*Prefix hits from sampled blocks.* The curve needs each reference's effective (leading-run)
distance, but the estimator sees only a prompt's sampled blocks: it takes the running maximum of
their scaled distances from the prompt's head. That is exact when distances never decrease toward
the tail, which holds for chained block hashes, for the sampled distances too (proof in
``policyd.models.stackdist``), and is checked on every benchmark trace (0 violations). Where it
fails (ids that are not chained prefixes), unsampled blocks between two sampled ones may cut a
leading run earlier than the estimate sees.

*The histogram* is ``DistanceHistogram``, ours rather than River's ``sketch.Histogram``: SHARDS
needs weighted updates (``1 / R``) and a signed correction of the first bucket, which River's
(unweighted, Ben-Haim/Tom-Tov bin merging with data-dependent error) does not offer. Ours has
log-linear buckets of bounded relative width (``1 / sub_buckets``), O(1) updates and at most
``(65 - log2 sub_buckets) x sub_buckets`` buckets (3,776 for 64): bounded memory, known error.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from typing import Final

import numpy as np
from numpy.typing import NDArray

from policyd.models.mrc import MissRatioCurve
from policyd.models.stackdist import StackDistance

_HASH_SPACE: Final = 2**64
_U64: Final = _HASH_SPACE - 1
SMALL_PROMPT_BLOCKS: Final = 32  # prompts up to this many blocks are sampled without numpy
_MIX_1: Final = 0xBF58476D1CE4E5B9  # splitmix64's finaliser multipliers, for both versions
_MIX_2: Final = 0x94D049BB133111EB


class DistanceHistogram:
    """Weighted histogram of non-negative distances in log-linear buckets, plus a cold count.

    Distances below ``2 x sub_buckets`` have buckets of width 1 (exact); above, each power of two
    is split into ``sub_buckets`` equal buckets, so a bucket is at most ``1 / sub_buckets`` of its
    lower edge wide.

    >>> h = DistanceHistogram(sub_buckets=4)
    >>> h.add(3, 2.0); h.add(100.5, 1.0); h.add_cold(1.0)
    >>> h.buckets()
    (array([ 3., 96.]), array([ 1., 16.]), array([2., 1.]))
    """

    __slots__ = ("_shift", "_sub", "cold", "weights")

    def __init__(self, sub_buckets: int = 64) -> None:
        if sub_buckets < 1 or sub_buckets & (sub_buckets - 1):
            raise ValueError(f"sub_buckets must be a power of two, got {sub_buckets}")
        self._sub = sub_buckets
        self._shift = sub_buckets.bit_length()  # log2(sub_buckets) + 1
        self.weights: dict[int, float] = {}
        self.cold = 0.0

    @property
    def max_buckets(self) -> int:
        """The bound on the number of buckets, for 64-bit distances."""
        return (65 - self._shift) * self._sub + self._sub

    def _index(self, value: int) -> int:
        exponent = value.bit_length() - self._shift
        if exponent <= 0:
            return value
        return exponent * self._sub + (value >> exponent)

    def _edges(self, index: int) -> tuple[int, int]:
        if index < 2 * self._sub:
            return index, 1
        exponent = index // self._sub - 1
        return (index - exponent * self._sub) << exponent, 1 << exponent

    def add(self, distance: float, weight: float = 1.0) -> None:
        index = self._index(int(distance))
        self.weights[index] = self.weights.get(index, 0.0) + weight

    def add_cold(self, weight: float = 1.0) -> None:
        self.cold += weight

    @property
    def total(self) -> float:
        return sum(self.weights.values()) + self.cold

    def __len__(self) -> int:
        return len(self.weights)

    def buckets(self) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
        """Lower edges, widths and weights of the non-empty buckets, by distance."""
        indices = sorted(self.weights)
        edges = [self._edges(i) for i in indices]
        return (
            np.array([lo for lo, _ in edges], dtype=np.float64),
            np.array([w for _, w in edges], dtype=np.float64),
            np.array([self.weights[i] for i in indices], dtype=np.float64),
        )


def _mix(keys: NDArray[np.uint64], salt: int) -> NDArray[np.uint64]:
    """splitmix64's finaliser: spreads any 64-bit ids (chained hashes or small integers)."""
    z = keys ^ np.uint64(salt)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX_1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX_2)
    return z ^ (z >> np.uint64(31))


def _mix_one(key: int, salt: int) -> int:
    """``_mix`` of one key, in Python integers (the same bits: products wrap modulo 2^64)."""
    z = key ^ salt
    z = ((z ^ (z >> 30)) * _MIX_1) & _U64
    z = ((z ^ (z >> 27)) * _MIX_2) & _U64
    return z ^ (z >> 31)


def _sampled(block_hashes: Sequence[int], salt: int, threshold: int) -> tuple[list[int], list[int]]:
    """The blocks of a prompt that spatial sampling keeps (mixed hash below ``threshold``) and
    their mixed hashes, tail first."""
    keys = np.asarray(block_hashes, dtype=np.uint64)
    spatial = _mix(keys, salt)
    picked = np.flatnonzero(spatial < np.uint64(threshold))[::-1]
    blocks: list[int] = keys[picked].tolist()
    hashes: list[int] = spatial[picked].tolist()
    return blocks, hashes


def _sampled_small(
    block_hashes: Sequence[int], salt: int, threshold: int
) -> tuple[list[int], list[int]]:
    """``_sampled`` per key in Python integers, for short prompts (a hash outside 0..2^64-1
    raises ``OverflowError``, as numpy's conversion does)."""
    blocks: list[int] = []
    hashes: list[int] = []
    for key in reversed(block_hashes):
        if not 0 <= key <= _U64:
            raise OverflowError(f"block hash {key} is outside 0..2^64-1")
        h = _mix_one(key, salt)
        if h < threshold:
            blocks.append(key)
            hashes.append(h)
    return blocks, hashes


class Shards:
    """Online MRC estimator: spatially hashed sampling of block references (SHARDS).

    Fixed-size by default (``max_tracked_blocks``, starting at ``rate`` and lowering it whenever
    more blocks would be tracked); ``max_tracked_blocks=None`` is fixed-rate SHARDS at ``rate``.
    ``seed`` salts the spatial hash. ``learn_prompt`` takes a prompt's blocks head first (as
    requests carry them) and visits them tail first; ``curve()`` is the current estimate.

    Memory: at most ``max_tracked_blocks`` tracked blocks (a dict entry and a heap entry each),
    ``timeline_slots`` <= max(64, 4 x that), and ``histogram.max_buckets`` buckets. Fixed-rate
    memory grows as ``rate`` x the distinct blocks ever seen; fixed-size keeps its bound by
    lowering the rate as they accumulate. Both describe the whole history since construction:
    to follow a changing workload, start a fresh estimator per window.

    >>> est = Shards(rate=1.0)
    >>> for _ in range(3):
    ...     est.learn_prompt([1, 2, 3], prompt_tokens=50)
    >>> est.curve(kv_bytes_per_block=1).hit_ratio([2, 3]).round(3).tolist()
    [0.0, 0.667]
    """

    def __init__(
        self,
        *,
        rate: float = 0.1,
        max_tracked_blocks: int | None = 8192,
        count_correction: bool = True,
        seed: int = 0,
        sub_buckets: int = 64,
    ) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"rate must be in (0, 1], got {rate}")
        if max_tracked_blocks is not None and max_tracked_blocks < 1:
            raise ValueError(f"max_tracked_blocks must be >= 1, got {max_tracked_blocks}")
        self.max_tracked_blocks = max_tracked_blocks
        self.count_correction = count_correction
        self._threshold = min(_HASH_SPACE - 1, round(rate * _HASH_SPACE))
        self._salt = int(_mix(np.array([seed], dtype=np.uint64), 0x5EED)[0])
        self._stack = StackDistance()
        self._heap: list[tuple[int, int]] = []  # (-spatial hash, block) of tracked blocks
        self.histogram = DistanceHistogram(sub_buckets)
        self.references = 0
        self.sampled_references = 0
        self.prompt_tokens = 0
        self.prompts = 0

    @property
    def rate(self) -> float:
        return self._threshold / _HASH_SPACE

    @property
    def tracked_blocks(self) -> int:
        """Blocks whose references are followed now (the estimator's memory, in entries)."""
        return len(self._stack)

    @property
    def timeline_slots(self) -> int:
        """Slots of the stack-distance timeline (its Fenwick tree and owner list)."""
        return self._stack.slots

    def tracks(self, block_hash: int) -> bool:
        """Whether references to ``block_hash`` are sampled at the current threshold."""
        key = np.array([block_hash], dtype=np.uint64)
        return bool(_mix(key, self._salt)[0] < np.uint64(self._threshold))

    def learn_prompt(self, block_hashes: Sequence[int], prompt_tokens: int) -> None:
        """One request: its prompt's full blocks, head first, and its prompt tokens."""
        n = len(block_hashes)
        self.references += n
        self.prompt_tokens += prompt_tokens
        self.prompts += 1
        if n == 0:
            return
        # short prompts in Python: numpy's per-call overhead exceeds their work
        sample = _sampled_small if n <= SMALL_PROMPT_BLOCKS else _sampled
        blocks, hashes = sample(block_hashes, self._salt, self._threshold)
        if not blocks:
            return
        scaled: list[float] = []
        weights: list[float] = []
        stack = self._stack
        for block, h in zip(blocks, hashes, strict=True):
            if h >= self._threshold:  # the fixed-size threshold dropped inside this prompt
                continue
            rate = self._threshold / _HASH_SPACE
            distance = stack.access(block)
            scaled.append(math.inf if distance is None else distance / rate)
            weights.append(1.0 / rate)
            if distance is None and self.max_tracked_blocks is not None:
                heapq.heappush(self._heap, (-h, block))
                if len(stack) > self.max_tracked_blocks:
                    top, evicted = heapq.heappop(self._heap)
                    stack.remove(evicted)
                    self._threshold = -top
        self.sampled_references += len(scaled)
        running = 0.0  # leading-run (effective) distance: running max from the head
        histogram = self.histogram
        for value, weight in zip(reversed(scaled), reversed(weights), strict=True):
            running = max(running, value)
            if running == math.inf:
                histogram.add_cold(weight)
            else:
                histogram.add(running, weight)

    def learn(self, prompts: Iterable[tuple[Sequence[int], int]]) -> None:
        for block_hashes, prompt_tokens in prompts:
            self.learn_prompt(block_hashes, prompt_tokens)

    def curve(self, kv_bytes_per_block: int, label: str = "shards") -> MissRatioCurve:
        lower, width, weight = self.histogram.buckets()
        sampled_total = self.histogram.total
        correction = 0.0
        if self.count_correction:
            correction = self.references - sampled_total
        elif sampled_total > 0:  # spread what was not seen like what was
            weight = weight * (self.references / sampled_total)
        return MissRatioCurve.from_histogram(
            lower,
            width,
            weight,
            references=float(self.references),
            prompt_tokens=float(self.prompt_tokens),
            prompts=self.prompts,
            kv_bytes_per_block=kv_bytes_per_block,
            first_bucket_correction=correction,
            label=label,
        )
