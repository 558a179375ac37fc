"""Exact stack distances: the compiled and incremental Mattson paths against a naive LRU stack,
leading-run (prefix) semantics, and the monotonicity of chained prompts."""

from __future__ import annotations

import doctest
import random
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import policyd.models.stackdist
from experiments.mrc_eval import interleave
from policyd.models.mrc import MissRatioCurve
from policyd.models.stackdist import (
    COLD,
    ReferenceStream,
    StackDistance,
    effective_distances,
    leading_runs,
    monotone_violations,
    stack_distances,
)
from policyd.workloads.calls import Call
from policyd.workloads.pool import coding_pool
from policyd.workloads.synthetic import synthetic_agents


def naive_distances(blocks: Sequence[int]) -> list[int | None]:
    """O(N x M) reference: a block's distance is its depth in an MRU-first LRU stack."""
    stack: list[int] = []
    out: list[int | None] = []
    for block in blocks:
        if block in stack:
            depth = stack.index(block)
            out.append(depth)
            stack.pop(depth)
        else:
            out.append(None)
        stack.insert(0, block)
    return out


def naive_leading_runs(prompts: Sequence[Sequence[int]], capacity: int) -> list[int]:
    """Per prompt: replay the stream tail first through naive distances, then count the head
    blocks that hit before the first miss."""
    flat = [b for prompt in prompts for b in reversed(prompt)]
    distances = naive_distances(flat)
    runs, start = [], 0
    for prompt in prompts:
        head_first = list(reversed(distances[start : start + len(prompt)]))
        run = 0
        for d in head_first:
            if d is None or d >= capacity:
                break
            run += 1
        runs.append(run)
        start += len(prompt)
    return runs


def as_cold(distances: Sequence[int | None]) -> list[int]:
    return [COLD if d is None else d for d in distances]


traces = st.lists(st.integers(0, 40), max_size=300) | st.lists(st.integers(0, 3), max_size=60)
prompt_lists = st.lists(st.lists(st.integers(0, 12), max_size=6), max_size=25)


@given(traces)
@settings(max_examples=200, deadline=None)
def test_compiled_and_incremental_agree_with_naive(blocks):
    expected = naive_distances(blocks)
    assert stack_distances(np.array(blocks, dtype=np.uint64)).tolist() == as_cold(expected)
    incremental = StackDistance(initial_slots=2)  # compaction and growth from the start
    assert [incremental.access(b) for b in blocks] == expected
    assert len(incremental) == len(set(blocks))


def test_compiled_path_grows_its_table_and_timeline():
    """Scenario: 60k references over 5k distinct 64-bit keys (0 and values >= 2^63 included)
    make the compiled kernel rehash and compact many times; the incremental path (itself
    checked against the naive stack above) must agree on every reference."""
    rng = np.random.default_rng(7)
    keys = rng.integers(0, 2**64 - 1, size=5000, dtype=np.uint64)
    keys[:2] = [0, 2**64 - 1]
    blocks = keys[np.minimum(rng.zipf(1.3, size=60_000), 5000) - 1]
    incremental = StackDistance()
    expected = [incremental.access(b) for b in blocks.tolist()]
    assert stack_distances(blocks).tolist() == as_cold(expected)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 15)), max_size=200))
@example(  # five blocks, then removals down to two: the timeline shrinks with them
    [
        *[(True, b) for b in (0, 2, 3, 4, 0, 0, 0, 1, 0)],
        *[(False, b) for b in (0, 1, 2)],
    ]
)
@settings(max_examples=150, deadline=None)
def test_remove_forgets_a_block(ops):
    sd = StackDistance(initial_slots=2)
    stack: list[int] = []
    for is_access, block in ops:
        if is_access:
            expected = stack.index(block) if block in stack else None
            if block in stack:
                stack.remove(block)
            stack.insert(0, block)
            assert sd.access(block) == expected
        else:
            assert sd.remove(block) == (block in stack)
            if block in stack:
                stack.remove(block)
        assert len(sd) == len(stack)
        assert sd.slots <= max(2, 4 * len(stack) + 4)


def test_reference_stream_is_tail_first():
    stream = ReferenceStream.from_prompts([((1, 2, 3), 50), ((), 3), ((1, 4), 40)])
    assert stream.blocks.tolist() == [3, 2, 1, 4, 1]
    assert stream.starts.tolist() == [0, 3, 3, 5]
    assert stream.prompt_tokens.tolist() == [50, 3, 40]
    assert stream.prompts == 3
    assert len(stream) == 5


def test_leading_run_stops_at_the_first_miss():
    """Scenario: prompt 2 = (1, 4, 3) after prompt 1 = (1, 2, 3). Block 3 hits (it is in the
    cache) but block 4 before it is new, so the prefix hit is block 1 only."""
    stream = ReferenceStream.from_prompts([((1, 2, 3), 48), ((1, 4, 3), 48)])
    distances = stack_distances(stream.blocks)
    # stream: 3 2 1 | 3 4 1 -> block 3 was referenced 3 references ago (2, 1 between)
    assert distances.tolist() == [COLD, COLD, COLD, 2, COLD, 2]
    assert leading_runs(distances, stream.starts, 100).tolist() == [0, 1]
    assert effective_distances(distances, stream.starts).tolist()[3:] == [COLD, COLD, 2]
    assert monotone_violations(distances, stream.starts) == 1


@given(prompt_lists, st.integers(0, 40))
@settings(max_examples=200, deadline=None)
def test_leading_runs_match_naive(prompts, capacity):
    stream = ReferenceStream.from_prompts((p, 16 * len(p)) for p in prompts)
    distances = stack_distances(stream.blocks)
    runs = leading_runs(distances, stream.starts, capacity)
    assert runs.tolist() == naive_leading_runs(prompts, capacity)
    curve = MissRatioCurve.of_stream(stream, kv_bytes_per_block=1)
    assert curve.hits(capacity) == runs.sum()


def _chained_calls() -> list[Call]:
    pool = coding_pool(seed=3, tasks=10, min_calls=3, max_calls=8)
    agents = synthetic_agents(seed=1, workflows=15)
    return [
        *interleave(pool, 4, decode_s_per_token=0.01),
        *interleave(agents, 5, decode_s_per_token=0.01, order="round-robin"),
    ]


def test_chained_prompts_are_monotone():
    """The theorem in policyd.models.stackdist: with chained hashes, distances never fall toward a
    prompt's tail, so effective distances equal distances (also for sampled sub-streams)."""
    stream = ReferenceStream.from_calls(_chained_calls())
    distances = stack_distances(stream.blocks)
    assert monotone_violations(distances, stream.starts) == 0
    assert np.array_equal(effective_distances(distances, stream.starts), distances)
    sampled = np.isin(stream.blocks, np.unique(stream.blocks)[::7])
    sub_starts = np.concatenate(([0], np.cumsum(sampled)))[stream.starts]
    sub = stack_distances(stream.blocks[sampled])
    assert monotone_violations(sub, sub_starts) == 0


def test_interleave_keeps_each_task_in_order_and_bounds_concurrency():
    pool = coding_pool(seed=2, tasks=9, min_calls=3, max_calls=6)
    for order in ("gaps", "round-robin"):
        calls = interleave(pool, 3, decode_s_per_token=0.01, order=order)
        assert sorted(map(id, calls)) == sorted(id(c) for s in pool for c in s)
        seen: dict[str, int] = {}
        open_tasks: set[str] = set()
        for call in calls:
            assert call.hints["step"] == seen.get(call.workflow_id, -1) + 1
            seen[call.workflow_id] = int(call.hints["step"])
            open_tasks.add(call.workflow_id)
            if call.last:
                open_tasks.discard(call.workflow_id)
            assert len(open_tasks) <= 3
    assert [c.workflow_id for c in interleave(pool, 1, decode_s_per_token=0.0)] == [
        c.workflow_id for s in pool for c in s
    ]
    with pytest.raises(ValueError, match="valid orders"):
        interleave(pool, 2, decode_s_per_token=0.0, order="random")


def test_doctests():
    assert doctest.testmod(policyd.models.stackdist).failed == 0


def test_random_prompts_with_shared_heads_are_monotone_only_when_chained():
    """Non-chained ids (a shared head then random blocks) can break monotonicity, which the
    exact path handles through effective distances."""
    rng = random.Random(5)
    prompts = [(0, *rng.sample(range(1, 30), 4)) for _ in range(40)]
    stream = ReferenceStream.from_prompts((p, 16 * len(p)) for p in prompts)
    distances = stack_distances(stream.blocks)
    effective = effective_distances(distances, stream.starts)
    assert monotone_violations(distances, stream.starts) > 0
    assert monotone_violations(effective, stream.starts) == 0
    assert (effective >= distances).all()
