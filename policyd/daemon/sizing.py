"""The daemon's online host-tier sizing: the SHARDS miss-ratio curve of every prompt seen so far
(``policyd.models.shards.Shards``, fed by RequestStarted block hashes) read through
``policyd.models.mrc.recommend`` (EfficientAgent's sizing), as API rows and history rows."""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from policyd.models.mrc import GiB, recommend
from policyd.models.shards import Shards

MRC_POINTS: Final = 64
_MASK: Final = (1 << 64) - 1


def learn_prompt(shards: Shards, block_hashes: tuple[int, ...], prompt_tokens: int) -> None:
    """Feed one prompt; hashes outside 0..2^64-1 (a sender's bug) are reduced modulo 2^64."""
    try:
        shards.learn_prompt(block_hashes, prompt_tokens)
    except OverflowError:
        shards.learn_prompt([h & _MASK for h in block_hashes], prompt_tokens)


def empty_sizing(shards: Shards, gpu_blocks: int, host_blocks: int, kvb: int) -> dict[str, Any]:
    return {
        "mrc": [],
        "gpu_blocks": gpu_blocks,
        "current_host_blocks": host_blocks,
        "current_host_gib": host_blocks * kvb / GiB,
        "recommended_host_gib": None,
        "lru_hit_ratio_current": None,
        "working_set_blocks": None,
        "working_set_gib": None,
        "achievable_hit_ratio": None,
        "coverage": None,
        "coverage_gib": {},
        "closed_form_gib": None,
        "recomputed_tokens_current": None,
        "recomputed_tokens_recommended": None,
        "reason": "no request seen yet",
        "ts": None,
        "estimator": estimator_view(shards),
    }


def estimator_view(shards: Shards) -> dict[str, Any]:
    return {
        "rate": shards.rate,
        "tracked_blocks": shards.tracked_blocks,
        "max_tracked_blocks": shards.max_tracked_blocks,
        "accesses": shards.references,
    }


def compute_sizing(
    shards: Shards,
    *,
    kv_bytes_per_block: int,
    gpu_blocks: int,
    host_blocks: int,
    agents: int,
    coverage: float,
    ts: float,
) -> tuple[dict[str, Any], list[dict[str, object]], dict[str, object]]:
    """(API view, ``mrc_points`` rows, ``sizing`` row) from the estimator's current curve."""
    if shards.prompts == 0:
        return empty_sizing(shards, gpu_blocks, host_blocks, kv_bytes_per_block), [], {}
    curve = shards.curve(kv_bytes_per_block)
    sizing = recommend(
        curve,
        agents=max(agents, 1),
        gpu_blocks=gpu_blocks,
        host_blocks=host_blocks,
        coverage=coverage,
    )
    ws = sizing.working_set_blocks
    top = 1.5 * max(ws, sizing.recommended_host_blocks, min(host_blocks, 4 * max(ws, 1)), 1)
    caps = np.unique(np.linspace(0, top, MRC_POINTS).round().astype(np.int64))
    hit = curve.hit_ratio(caps)
    host_hit = curve.host_hit_ratio(caps, gpu_blocks)
    gib = sizing.gib
    mrc = [
        {
            "capacity_blocks": int(c),
            "capacity_gib": gib(int(c)),
            "hit_ratio": float(h),
            "host_hit_ratio": float(hh),
        }
        for c, h, hh in zip(caps, hit, host_hit, strict=True)
    ]
    # What plain LRU would hit with the same two tiers (inclusive host tier behind the GPU):
    # the counterfactual the dashboard compares the live policy's recomputation against.
    lru_hit = float(curve.hit_ratio(max(host_blocks, gpu_blocks)))
    view = {
        "mrc": mrc,
        "lru_hit_ratio_current": lru_hit,
        "gpu_blocks": gpu_blocks,
        "current_host_blocks": host_blocks,
        "current_host_gib": gib(host_blocks),
        "recommended_host_gib": gib(sizing.recommended_host_blocks),
        "recommended_host_blocks": sizing.recommended_host_blocks,
        "working_set_blocks": ws,
        "working_set_gib": gib(ws),
        "achievable_hit_ratio": sizing.achievable_hit_ratio,
        "coverage": sizing.coverage,
        "coverage_gib": {f"{c:g}": gib(b) for c, b in sizing.coverage_blocks.items()},
        "closed_form_gib": gib(sizing.closed_form_blocks),
        "recomputed_tokens_current": sizing.recomputed_tokens_current,
        "recomputed_tokens_recommended": sizing.recomputed_tokens_recommended,
        "reason": sizing.reason,
        "ts": ts,
        "estimator": estimator_view(shards),
    }
    mrc_rows: list[dict[str, object]] = [{"ts": ts, **p, "source": "shards"} for p in mrc]
    sizing_row: dict[str, object] = {
        "ts": ts,
        "working_set_blocks": ws,
        "achievable_hit_ratio": sizing.achievable_hit_ratio,
        "coverage": sizing.coverage,
        "current_host_gib": gib(host_blocks),
        "recommended_host_gib": gib(sizing.recommended_host_blocks),
        "closed_form_gib": gib(sizing.closed_form_blocks),
        "recomputed_tokens_current": round(sizing.recomputed_tokens_current),
        "recomputed_tokens_recommended": round(sizing.recomputed_tokens_recommended),
        "reason": sizing.reason,
    }
    return view, mrc_rows, sizing_row


def lru_recomputed_blocks(lru_hit_ratio: object, prompt_blocks: object) -> int | None:
    """Blocks plain LRU would have recomputed in an interval, from the online MRC's hit ratio at
    the current capacities; None until the estimator has a curve."""
    if not isinstance(lru_hit_ratio, float) or not isinstance(prompt_blocks, int):
        return None
    return round(prompt_blocks * (1.0 - lru_hit_ratio))
