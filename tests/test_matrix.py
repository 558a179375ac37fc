"""The evaluation matrix (policyd matrix): its points, its bound, its verdicts."""

from __future__ import annotations

import pytest

from experiments.matrix import (
    OURS,
    Point,
    PointResult,
    Source,
    largest_request,
    points_of,
    run_point,
    verdicts,
    versus_best,
)
from policyd.sim.replay import SimConfig, simulate
from policyd.workloads import make_workload


def test_points_span_three_concurrencies_three_tiers_and_the_host_tier_off_and_on() -> None:
    works = [make_workload("code-writing", seed=s, workflows=8) for s in (0, 1)]
    points = points_of(Source("code-writing"), works, seeds=[0, 1])
    largest = max(largest_request(w) for w in works)
    assert largest_request(works[0]) != largest_request(works[1])  # the seeds' tiers would differ
    assert {p.concurrency for p in points} == {4, 8}  # 16 and 64 capped at the 8 streams
    assert {p.gpu_blocks for p in points} == {largest, 2 * largest, 4 * largest}
    assert {p.host_blocks in (p.gpu_blocks, 0) for p in points} == {True}
    assert len(points) == 2 * 3 * 2 * 2  # and each point at both seeds


def test_the_tightest_tier_is_exactly_what_the_largest_request_needs() -> None:
    work = make_workload("code-writing", seed=0, workflows=4)
    largest = largest_request(work)
    simulate(work, "lru", SimConfig(concurrency=1, gpu_blocks=largest, host_blocks=0))
    with pytest.raises(ValueError, match="raise the GPU capacity"):
        simulate(work, "lru", SimConfig(concurrency=1, gpu_blocks=largest - 1, host_blocks=0))


def test_one_tier_of_both_capacities_bounds_every_policy_with_a_host_tier() -> None:
    source = Source("code-writing")
    work = make_workload("code-writing", seed=0, workflows=6)
    largest = largest_request(work)
    result = run_point(Point(source, 0, 4, largest, largest), streams=6, profile="h200-llama3.1-8b")
    policies = ("lru", "kvflow", "pbkv", "efficientagent", OURS)
    assert all(result.hit_rate[p] <= result.bound + 1e-9 for p in policies), result.hit_rate
    gpu_only = run_point(Point(source, 0, 4, largest, 0), streams=6, profile="h200-llama3.1-8b")
    assert gpu_only.bound == gpu_only.hit_rate["belady"] >= gpu_only.hit_rate["lru"]


def _result(name: str, seed: int, c: int, gpu: int, host: int, **hits: float) -> PointResult:
    r = PointResult(Point(Source(name), seed, c, gpu, host))
    r.hit_rate.update({"lru": 0.5, "kvflow": 0.5, "pbkv": 0.5, "efficientagent": 0.5})
    r.hit_rate.update(hits)
    return r


def test_verdicts_count_points_over_seeds() -> None:
    results = [
        # level with LRU at a roomy point, both seeds
        _result("w", 0, 4, 200, 0, agentkv=0.5, belady=0.6),
        _result("w", 1, 4, 200, 0, agentkv=0.499, belady=0.6),
        # the most contended GPU-only point: one seed 2% behind LRU
        _result("w", 0, 8, 100, 0, agentkv=0.49, belady=0.52),
        _result("w", 1, 8, 100, 0, agentkv=0.55, belady=0.6),
        # with a host tier: ahead of every baseline on both seeds, 0.8 of the bound
        _result("w", 0, 8, 100, 100, agentkv=0.56, belady=0.5, bound=0.7),
        _result("w", 1, 8, 100, 100, agentkv=0.56, belady=0.5, bound=0.7),
    ]
    v = verdicts(results)
    assert v.points == 3
    assert v.at_or_above_lru == 2  # the worst seed decides: 0.98x at C=8
    assert v.worst_vs_lru[0] == pytest.approx(0.98) and "C=8" in v.worst_vs_lru[1]
    assert v.above_best == 1 and v.below_best == 0 and v.no_verdict_best == 2
    assert v.contended == 2 and v.contended_at_goal == 1  # GPU-only: (0.94+0.92)/2; host: 0.8


def test_a_spread_between_seeds_wider_than_the_gap_gives_no_verdict() -> None:
    results = [_result("w", 0, 4, 100, 0, agentkv=0.53), _result("w", 1, 4, 100, 0, agentkv=0.48)]
    mean, sd, verdict = versus_best(results)
    assert mean == pytest.approx(1.01) and sd > 0.03 and verdict == "level"
