"""Miss-ratio curves of EfficientAgent's host tier, and host-tier sizing from them.

*The curve.* With the reference stream and effective distances of ``policyd.models.stackdist``, an
LRU tier of ``C`` blocks serves ``hits(C)`` = the references whose effective distance is ``< C``
(each prompt's leading run). EfficientAgent's two tiers: a GPU tier of ``G`` blocks and an
inclusive, write-through host tier of ``H`` blocks, both LRU, so a block is host-resident iff its
distance is ``< H``; a prompt's host hit is its leading run for ``max(G, H)`` minus its leading
run for ``G``. ``MissRatioCurve`` answers both, as block hit ratios and recomputed prompt tokens
(prompt tokens minus 16 x hit blocks), for capacities in blocks or GiB. It is built exactly from
distances (``MissRatioCurve.exact``) or from a histogram (``from_histogram``: the online estimate
of ``policyd.models.shards``).

*Sizing* (``recommend``): the achievable reuse (hits at infinite capacity), the working set (the
smallest capacity reaching it), the capacities reaching 50/80/90/95% of it, the closed-form check
``(A - 1) x mean prompt tokens x KV bytes/token``, and a host-tier size for a coverage target
with the recomputed tokens at the current and at the recommended size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

from policyd.core.types import BLOCK_SIZE_TOKENS
from policyd.models.stackdist import COLD, ReferenceStream, effective_distances, stack_distances

GiB: Final = 1024**3
COVERAGE_LEVELS: Final = (0.5, 0.8, 0.9, 0.95)


@dataclass(frozen=True, slots=True)
class MissRatioCurve:
    """Hit blocks of an LRU tier as a function of its capacity (prefix semantics).

    ``hits`` at ``knots_blocks`` (increasing, from 0) with linear interpolation between knots,
    constant after the last; exact curves have a knot at every integer capacity, estimated ones at
    histogram bucket edges (weight spread evenly over a bucket). Counts are in references.

    >>> from policyd.models.stackdist import ReferenceStream
    >>> stream = ReferenceStream.from_prompts([((1, 2, 3), 50), ((1, 2, 3, 4), 70)])
    >>> curve = MissRatioCurve.of_stream(stream, kv_bytes_per_block=2**21)
    >>> curve.hit_ratio([3, 4]).round(3).tolist()  # the second prompt's 3 blocks, at distance 3
    [0.0, 0.429]
    >>> float(curve.recomputed_tokens(host_blocks=4)), curve.capacity_for(0.9), curve.gib(4)
    (72.0, 4, 0.0078125)
    """

    knots_blocks: NDArray[np.float64]
    hit_counts: NDArray[np.float64]
    references: float
    prompt_tokens: float
    prompts: int
    kv_bytes_per_block: int
    label: str = ""

    @classmethod
    def from_histogram(
        cls,
        lower: NDArray[np.float64],
        width: NDArray[np.float64],
        weight: NDArray[np.float64],
        *,
        references: float,
        prompt_tokens: float,
        prompts: int,
        kv_bytes_per_block: int,
        first_bucket_correction: float = 0.0,
        label: str = "",
    ) -> MissRatioCurve:
        """From disjoint buckets ``[lower, lower + width)`` of effective distances (sorted) and
        their weights; ``first_bucket_correction`` is added at distance 0 (SHARDS count
        correction, possibly negative)."""
        if first_bucket_correction:
            if len(lower) and lower[0] == 0.0:
                weight = weight.copy()
                weight[0] += first_bucket_correction
            else:
                lower = np.concatenate(([0.0], lower))
                width = np.concatenate(([1.0], width))
                weight = np.concatenate(([first_bucket_correction], weight))
        cumulative = np.cumsum(weight)
        # a bucket's weight enters evenly between its lower edge and its upper edge: a distance
        # d counts for capacities > d
        x = np.empty(2 * len(lower) + 1)
        y = np.empty_like(x)
        x[0], y[0] = 0.0, 0.0
        x[1::2], y[1::2] = lower, cumulative - weight
        x[2::2], y[2::2] = lower + width, cumulative
        keep = np.concatenate(([True], np.diff(x) > 0))
        return cls(
            x[keep],
            np.maximum.accumulate(np.maximum(y[keep], 0.0)),
            references=references,
            prompt_tokens=prompt_tokens,
            prompts=prompts,
            kv_bytes_per_block=kv_bytes_per_block,
            label=label,
        )

    @classmethod
    def exact(
        cls,
        effective: NDArray[np.int64],
        *,
        prompt_tokens: float,
        prompts: int,
        kv_bytes_per_block: int,
        label: str = "exact",
    ) -> MissRatioCurve:
        """From every reference's effective distance (``policyd.models.stackdist``)."""
        finite = effective[effective != COLD]
        counts = np.bincount(finite) if finite.size else np.zeros(0, dtype=np.int64)
        hit_counts = np.concatenate(([0.0], np.cumsum(counts, dtype=np.float64)))
        return cls(
            np.arange(len(hit_counts), dtype=np.float64),
            hit_counts,
            references=float(len(effective)),
            prompt_tokens=prompt_tokens,
            prompts=prompts,
            kv_bytes_per_block=kv_bytes_per_block,
            label=label,
        )

    @classmethod
    def of_stream(cls, stream: ReferenceStream, kv_bytes_per_block: int) -> MissRatioCurve:
        """The exact curve of a reference stream (Mattson, compiled)."""
        effective = effective_distances(stack_distances(stream.blocks), stream.starts)
        return cls.exact(
            effective,
            prompt_tokens=float(stream.prompt_tokens.sum()),
            prompts=stream.prompts,
            kv_bytes_per_block=kv_bytes_per_block,
        )

    # -- reading the curve ---------------------------------------------------------------------

    def hits(self, capacity_blocks: ArrayLike) -> NDArray[np.float64]:
        """Hit blocks of an LRU tier of ``capacity_blocks`` (vectorised)."""
        return np.interp(
            np.asarray(capacity_blocks, np.float64), self.knots_blocks, self.hit_counts
        )

    def hit_ratio(self, capacity_blocks: ArrayLike) -> NDArray[np.float64]:
        return self.hits(capacity_blocks) / max(self.references, 1.0)

    def host_hit_ratio(self, host_blocks: ArrayLike, gpu_blocks: float) -> NDArray[np.float64]:
        """Share of references served by an inclusive host tier behind a GPU tier."""
        total = self.hits(np.maximum(np.asarray(host_blocks, np.float64), gpu_blocks))
        return (total - self.hits(gpu_blocks)) / max(self.references, 1.0)

    def recomputed_tokens(
        self, host_blocks: ArrayLike, gpu_blocks: float = 0.0
    ) -> NDArray[np.float64]:
        """Prompt tokens recomputed with both tiers: prompt tokens minus hit tokens."""
        served = self.hits(np.maximum(np.asarray(host_blocks, np.float64), gpu_blocks))
        return self.prompt_tokens - BLOCK_SIZE_TOKENS * served

    @property
    def achievable_hits(self) -> float:
        return float(self.hit_counts[-1])

    @property
    def achievable_hit_ratio(self) -> float:
        return self.achievable_hits / max(self.references, 1.0)

    def capacity_for(self, coverage: float) -> int:
        """The smallest capacity (blocks) whose hits reach ``coverage`` of the achievable."""
        if not 0.0 < coverage <= 1.0:
            raise ValueError(f"coverage must be in (0, 1], got {coverage}")
        target = coverage * self.achievable_hits
        if target <= 0.0:
            return 0
        k = int(np.searchsorted(self.hit_counts, target * (1 - 1e-12), side="left"))
        k = min(max(k, 1), len(self.hit_counts) - 1)
        x0, x1 = float(self.knots_blocks[k - 1]), float(self.knots_blocks[k])
        y0, y1 = float(self.hit_counts[k - 1]), float(self.hit_counts[k])
        x = x1 if y1 <= y0 else x0 + (min(target, y1) - y0) / (y1 - y0) * (x1 - x0)
        return max(0, math.ceil(x - 1e-9))

    @property
    def working_set_blocks(self) -> int:
        """The smallest capacity that reaches the achievable reuse."""
        return self.capacity_for(1.0)

    def gib(self, blocks: float) -> float:
        return blocks * self.kv_bytes_per_block / GiB

    def blocks(self, gib: float) -> int:
        return int(gib * GiB // self.kv_bytes_per_block)


def mean_absolute_error(
    estimate: MissRatioCurve, exact: MissRatioCurve, capacities: ArrayLike
) -> float:
    """Mean absolute difference of the hit ratios over ``capacities`` (blocks)."""
    return float(np.mean(np.abs(estimate.hit_ratio(capacities) - exact.hit_ratio(capacities))))


# ---- sizing -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sizing:
    """What the MRC says about the host tier. Capacities in blocks; ``gib`` converts."""

    coverage: float
    achievable_hit_ratio: float
    working_set_blocks: int
    coverage_blocks: dict[float, int]  # coverage level -> smallest capacity reaching it
    closed_form_blocks: float  # (A - 1) x mean prompt tokens, in blocks
    gpu_blocks: int
    current_host_blocks: int
    recommended_host_blocks: int  # 0 when the GPU tier alone reaches the coverage target
    recomputed_tokens_current: float
    recomputed_tokens_recommended: float
    kv_bytes_per_block: int
    reason: str = field(default="")

    def gib(self, blocks: float) -> float:
        return blocks * self.kv_bytes_per_block / GiB

    @property
    def target_blocks(self) -> int:
        """The capacity reaching the coverage target (what the recommendation is made of)."""
        return self.coverage_blocks[self.coverage]


def recommend(
    curve: MissRatioCurve,
    *,
    agents: int,
    gpu_blocks: int,
    host_blocks: int,
    coverage: float = 0.9,
    levels: Sequence[float] = COVERAGE_LEVELS,
) -> Sizing:
    """Host-tier size for ``coverage`` of the achievable reuse, with the figures behind it.

    The host tier is inclusive, so it must hold the capacity that reaches the target; a host
    tier no larger than the GPU tier adds no hit, hence 0 when the GPU tier alone suffices.
    """
    coverage_blocks = {c: curve.capacity_for(c) for c in sorted({*levels, coverage})}
    target = coverage_blocks[coverage]
    mean_prompt_tokens = curve.prompt_tokens / max(curve.prompts, 1)
    closed_form = (agents - 1) * mean_prompt_tokens / BLOCK_SIZE_TOKENS
    if target > gpu_blocks:
        recommended = target
        reason = f"{coverage:.0%} of the achievable reuse needs {target} blocks"
    else:
        recommended = 0
        reason = f"the GPU tier ({gpu_blocks} blocks) already reaches {coverage:.0%} ({target})"
    return Sizing(
        coverage=coverage,
        achievable_hit_ratio=curve.achievable_hit_ratio,
        working_set_blocks=curve.working_set_blocks,
        coverage_blocks=coverage_blocks,
        closed_form_blocks=closed_form,
        gpu_blocks=gpu_blocks,
        current_host_blocks=host_blocks,
        recommended_host_blocks=recommended,
        recomputed_tokens_current=float(curve.recomputed_tokens(host_blocks, gpu_blocks)),
        recomputed_tokens_recommended=float(curve.recomputed_tokens(recommended, gpu_blocks)),
        kv_bytes_per_block=curve.kv_bytes_per_block,
        reason=reason,
    )
