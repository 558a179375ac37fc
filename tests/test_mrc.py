"""Miss-ratio curves, the SHARDS estimator and host-tier sizing."""

from __future__ import annotations

import doctest
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policyd.models.mrc
import policyd.models.shards
from experiments.mrc_eval import interleave
from policyd.models.mrc import (
    GiB,
    MissRatioCurve,
    mean_absolute_error,
    recommend,
)
from policyd.models.shards import DistanceHistogram, Shards
from policyd.models.stackdist import ReferenceStream, leading_runs, stack_distances
from policyd.traces.location import SWE_TRAJECTORIES, TRACES_ENV, local_trace
from policyd.workloads.calls import Call
from policyd.workloads.pool import coding_pool

Prompts = list[tuple[Sequence[int], int]]

SWE_ARCHIVE = local_trace(SWE_TRAJECTORIES)  # the public trace, when $AGENTKV_TRACES holds it

prompt_lists = st.lists(st.lists(st.integers(0, 12), max_size=6), max_size=25)


def _prompts(calls: Sequence[Call]) -> Prompts:
    return [(c.block_hashes, c.prompt_tokens) for c in calls]


def _pool_prompts(seed: int = 5, tasks: int = 24, agents: int = 6) -> Prompts:
    pool = coding_pool(seed=seed, tasks=tasks, min_calls=4, max_calls=10)
    return _prompts(interleave(pool, agents, decode_s_per_token=0.01))


def _exact(prompts: Prompts, kv_bytes_per_block: int = 1) -> MissRatioCurve:
    return MissRatioCurve.of_stream(ReferenceStream.from_prompts(prompts), kv_bytes_per_block)


def _estimate(
    prompts: Prompts, kv_bytes_per_block: int = 1, **params: Any
) -> tuple[Shards, MissRatioCurve]:
    shards = Shards(**params)
    shards.learn(prompts)
    return shards, shards.curve(kv_bytes_per_block)


def test_doctests():
    assert doctest.testmod(policyd.models.mrc).failed == 0
    assert doctest.testmod(policyd.models.shards).failed == 0


@given(st.integers(0, 2**63))
def test_histogram_bucket_holds_its_value_within_relative_width(value):
    histogram = DistanceHistogram(sub_buckets=64)
    histogram.add(value, 2.0)
    (lower_edge,), (width_edge,), (weight,) = histogram.buckets()
    lower, width = int(lower_edge), int(width_edge)  # exact: a few significant bits each
    assert lower <= value < lower + width
    assert width == 1 or width <= lower / 64
    assert weight == 2.0
    assert max(histogram.weights) < histogram.max_buckets


def test_histogram_rejects_other_than_powers_of_two():
    with pytest.raises(ValueError, match="power of two"):
        DistanceHistogram(sub_buckets=48)


@given(prompt_lists)
@settings(max_examples=100, deadline=None)
def test_full_rate_estimate_is_the_exact_curve(prompts):
    """Sampling every block (rate 1, width-1 buckets) must reproduce the exact curve at every
    capacity, leading runs included (the running max over sampled blocks is then exact)."""
    prompts = [(p, 16 * len(p)) for p in prompts]
    exact = _exact(prompts)
    _, estimate = _estimate(prompts, rate=1.0, max_tracked_blocks=None, sub_buckets=64)
    capacities = np.arange(0, 30)
    assert np.allclose(estimate.hits(capacities), exact.hits(capacities))


def test_full_rate_estimate_on_a_chained_pool():
    prompts = _pool_prompts()
    exact = _exact(prompts)
    _, estimate = _estimate(prompts, rate=1.0, max_tracked_blocks=None, sub_buckets=2**15)
    capacities = np.arange(0, exact.working_set_blocks + 2)
    assert exact.working_set_blocks < 2**16  # every distance in a width-1 bucket
    assert np.allclose(estimate.hits(capacities), exact.hits(capacities))


def test_fixed_rate_estimates_are_unbiased():
    """Over 40 hash salts the mean estimated curve is much closer to the exact one than a
    single estimate is: the error is variance, not bias."""
    prompts = _pool_prompts()
    exact = _exact(prompts)
    grid = np.linspace(0, exact.working_set_blocks, 128)
    curves, errors = [], []
    for seed in range(40):
        _, estimate = _estimate(prompts, rate=0.1, max_tracked_blocks=None, seed=seed)
        curves.append(estimate.hit_ratio(grid))
        errors.append(mean_absolute_error(estimate, exact, grid))
    bias = float(np.mean(np.abs(np.mean(curves, axis=0) - exact.hit_ratio(grid))))
    assert bias < 0.01
    assert bias < 0.5 * float(np.mean(errors))


def _hot_prompts() -> Prompts:
    """200 prompts: a 20-block shared system prompt, then 5 blocks used once."""
    return [((*range(20), *range(1000 + 5 * i, 1005 + 5 * i)), 25 * 16) for i in range(200)]


@pytest.mark.parametrize("hot_sampled", ["none", "many"])
def test_count_correction_repairs_a_missampled_hot_prefix(hot_sampled):
    """Scenario (SHARDS_adj): 80% of the references go to 20 hot blocks. A salt that samples
    none of them (or 5+ of 20 at rate 0.1) skews the sampled reference count. Adding the
    difference to the first bucket restores the achievable reuse (hits at infinite size);
    normalising by the sampled count alone cannot. When none is sampled, it also repairs the
    curve (the hot blocks' distances are small); when too many are, their scaled distances
    are too large and only the total is repaired."""
    prompts = _hot_prompts()
    exact = _exact(prompts)

    def wanted(seed: int) -> bool:
        shards = Shards(rate=0.1, max_tracked_blocks=None, seed=seed)
        hot = sum(shards.tracks(b) for b in range(20))
        return hot == 0 if hot_sampled == "none" else hot >= 5

    seed = next(s for s in range(1000) if wanted(s))
    grid = np.arange(0, 100)
    mae, reuse_error = {}, {}
    for corrected in (True, False):
        _, estimate = _estimate(
            prompts, rate=0.1, max_tracked_blocks=None, seed=seed, count_correction=corrected
        )
        mae[corrected] = mean_absolute_error(estimate, exact, grid)
        reuse_error[corrected] = abs(estimate.achievable_hit_ratio - exact.achievable_hit_ratio)
    assert reuse_error[True] < 0.5 * reuse_error[False]
    if hot_sampled == "none":
        assert mae[True] < 0.5 * mae[False]


@given(
    st.lists(st.lists(st.integers(0, 200), max_size=12), max_size=40),
    st.integers(1, 30),
    st.sampled_from([1.0, 0.5]),
)
@settings(max_examples=120, deadline=None)
def test_fixed_size_memory_bound_is_never_exceeded(prompts, s_max, rate):
    shards = Shards(rate=rate, max_tracked_blocks=s_max, seed=3)
    previous_rate = shards.rate
    for prompt in prompts:
        shards.learn_prompt(prompt, 16 * len(prompt))
        assert shards.tracked_blocks <= s_max
        assert shards.timeline_slots <= max(64, 4 * s_max)
        assert shards.rate <= previous_rate
        previous_rate = shards.rate
    assert len(shards.histogram) <= shards.histogram.max_buckets


def test_fixed_size_on_a_pool_stays_bounded_and_close():
    prompts = _pool_prompts()
    exact = _exact(prompts)
    shards, estimate = _estimate(prompts, rate=1.0, max_tracked_blocks=256)
    assert shards.tracked_blocks == 256
    assert shards.rate < 1.0
    grid = np.linspace(0, exact.working_set_blocks, 128)
    assert mean_absolute_error(estimate, exact, grid) < 0.05


@given(prompt_lists, st.lists(st.floats(0.01, 1.0), min_size=2, max_size=6))
@settings(max_examples=100, deadline=None)
def test_recommendation_is_monotone_in_coverage(prompts, coverages):
    prompts = [(p, 16 * len(p) + 3) for p in prompts]
    for curve in (_exact(prompts), _estimate(prompts, rate=0.5, max_tracked_blocks=None)[1]):
        sizings = [
            recommend(curve, agents=4, gpu_blocks=0, host_blocks=0, coverage=c)
            for c in sorted(coverages)
        ]
        for a, b in itertools.pairwise(sizings):
            assert a.target_blocks <= b.target_blocks
            assert a.recommended_host_blocks <= b.recommended_host_blocks
            assert a.recomputed_tokens_recommended >= b.recomputed_tokens_recommended - 1e-6


@given(prompt_lists, st.floats(0.05, 1.0))
@settings(max_examples=100, deadline=None)
def test_capacity_for_is_the_smallest_reaching_the_target(prompts, coverage):
    curve = _exact([(p, 16 * len(p)) for p in prompts])
    capacity = curve.capacity_for(coverage)
    target = coverage * curve.achievable_hits
    assert curve.hits(capacity) >= target - 1e-9
    if capacity > 0:
        assert curve.hits(capacity - 1) < target


@given(prompt_lists, st.integers(0, 20), st.integers(0, 20))
@settings(max_examples=100, deadline=None)
def test_host_hits_are_the_leading_run_after_the_gpu_prefix(prompts, gpu, host):
    """EfficientAgent's model: host hit = leading run for max(G, H) minus leading run for G."""
    stream = ReferenceStream.from_prompts((p, 16 * len(p) + 7) for p in prompts)
    distances = stack_distances(stream.blocks)
    curve = MissRatioCurve.of_stream(stream, kv_bytes_per_block=1)
    both = leading_runs(distances, stream.starts, max(gpu, host)).sum()
    gpu_only = leading_runs(distances, stream.starts, gpu).sum()
    assert curve.host_hit_ratio(host, gpu) * max(len(stream), 1) == pytest.approx(both - gpu_only)
    assert curve.recomputed_tokens(host, gpu) == pytest.approx(
        stream.prompt_tokens.sum() - 16 * both
    )


def test_sizing_figures():
    prompts = _pool_prompts()
    kv_bytes_per_block = 16 * 131_072
    curve = _exact(prompts, kv_bytes_per_block)
    mean_prompt_tokens = sum(t for _, t in prompts) / len(prompts)
    sizing = recommend(curve, agents=6, gpu_blocks=10, host_blocks=20)
    assert sizing.closed_form_blocks == pytest.approx(5 * mean_prompt_tokens / 16)
    assert sizing.coverage_blocks[0.5] <= sizing.coverage_blocks[0.95] <= sizing.working_set_blocks
    assert sizing.recommended_host_blocks == sizing.target_blocks == curve.capacity_for(0.9)
    assert sizing.recomputed_tokens_current == pytest.approx(
        curve.prompt_tokens - 16 * curve.hits(20)
    )
    assert sizing.recomputed_tokens_recommended < sizing.recomputed_tokens_current
    assert sizing.gib(curve.blocks(3.0)) == pytest.approx(3.0)
    assert curve.gib(512) == 512 * kv_bytes_per_block / GiB
    # a GPU tier that already reaches the target: no host tier is recommended
    roomy = recommend(curve, agents=6, gpu_blocks=sizing.target_blocks, host_blocks=0)
    assert roomy.recommended_host_blocks == 0
    assert roomy.recomputed_tokens_recommended == roomy.recomputed_tokens_current
    with pytest.raises(ValueError, match="coverage"):
        curve.capacity_for(0.0)


def test_estimator_rejects_bad_parameters():
    with pytest.raises(ValueError, match="rate"):
        Shards(rate=0.0)
    with pytest.raises(ValueError, match="max_tracked_blocks"):
        Shards(max_tracked_blocks=0)


@pytest.mark.slow
@pytest.mark.skipif(
    SWE_ARCHIVE is None or not SWE_ARCHIVE.exists(),
    reason=f"the SWE-bench trajectories are not here (${TRACES_ENV}/{SWE_TRAJECTORIES})",
)
def test_swe_pool_estimate_meets_the_targets():
    """40 real trajectories as a pool of 16: chained (no violation), and the default
    fixed-size estimator within 0.01 MAE and 10% on the 90% capacity."""
    from policyd.models.stackdist import effective_distances, monotone_violations  # noqa: PLC0415
    from policyd.traces.swe import swe_workload  # noqa: PLC0415

    assert SWE_ARCHIVE is not None
    workload = swe_workload(SWE_ARCHIVE, limit=40, decode_tokens_per_s=125.0)
    calls = interleave(workload, 16, decode_s_per_token=0.008)
    stream = ReferenceStream.from_calls(calls)
    distances = stack_distances(stream.blocks)
    assert monotone_violations(distances, stream.starts) == 0
    assert np.array_equal(effective_distances(distances, stream.starts), distances)
    exact = MissRatioCurve.of_stream(stream, kv_bytes_per_block=1)
    _, estimate = _estimate(_prompts(calls))
    grid = np.linspace(0, exact.working_set_blocks, 256)
    assert mean_absolute_error(estimate, exact, grid) <= 0.01
    assert abs(estimate.capacity_for(0.9) / exact.capacity_for(0.9) - 1) <= 0.10


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 40), max_size=40),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1) | st.sampled_from([0, 2**63, 2**64 - 1]),
)
def test_short_prompts_sample_as_the_numpy_path_does(prompt, salt, threshold):
    """Prompts up to SMALL_PROMPT_BLOCKS blocks are sampled in Python integers: the same
    blocks and mixed hashes, in the same order, as the numpy path."""
    assert policyd.models.shards._sampled_small(
        prompt, salt, threshold
    ) == policyd.models.shards._sampled(prompt, salt, threshold)


def test_short_prompt_hash_outside_uint64_is_an_overflow():
    with pytest.raises(OverflowError):
        Shards().learn_prompt([1, 2**64], 32)
    with pytest.raises(OverflowError):
        Shards().learn_prompt([-1], 16)
