"""The daemon's online sizing view and its LRU counterfactual (``cache_stats``)."""

from __future__ import annotations

from policyd.daemon.sizing import compute_sizing, learn_prompt, lru_recomputed_blocks
from policyd.models.shards import Shards
from policyd.workloads.calls import chain_hash


def _fed_estimator() -> Shards:
    """Scenario: 8 agents each re-send a growing conversation, so reuse grows with capacity."""
    shards = Shards(rate=1.0, max_tracked_blocks=None)
    for turn in range(1, 12):
        for agent in range(8):
            blocks: list[int] = []
            parent = agent + 1
            for i in range(turn * 8):
                parent = chain_hash(parent, f"{agent}:{i}".encode())
                blocks.append(parent)
            learn_prompt(shards, tuple(blocks), 16 * len(blocks))
    return shards


def test_the_lru_counterfactual_is_the_curve_at_the_larger_tier() -> None:
    shards = _fed_estimator()
    curve = shards.curve(kv_bytes_per_block=1 << 21)
    for gpu, host in ((64, 0), (64, 256), (512, 128)):
        view, _, _ = compute_sizing(
            shards,
            kv_bytes_per_block=1 << 21,
            gpu_blocks=gpu,
            host_blocks=host,
            agents=8,
            coverage=0.9,
            ts=0.0,
        )
        expected = float(curve.hit_ratio(max(gpu, host)))
        assert view["lru_hit_ratio_current"] == expected
        assert 0.0 <= expected <= curve.achievable_hit_ratio
    small = compute_sizing(
        shards, kv_bytes_per_block=1, gpu_blocks=32, host_blocks=0, agents=8, coverage=0.9, ts=0
    )[0]["lru_hit_ratio_current"]
    large = compute_sizing(
        shards, kv_bytes_per_block=1, gpu_blocks=32, host_blocks=4096, agents=8, coverage=0.9, ts=0
    )[0]["lru_hit_ratio_current"]
    assert small < large  # a bigger host tier serves more under LRU on this workload


def test_lru_recomputed_blocks_per_interval() -> None:
    assert lru_recomputed_blocks(0.25, 100) == 75
    assert lru_recomputed_blocks(None, 100) is None  # no curve yet
    assert lru_recomputed_blocks(0.5, None) is None
