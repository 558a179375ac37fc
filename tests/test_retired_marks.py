"""A snapshot's scores answer for the moment it was taken, however long a tier holds them.

``Lifecycle.mark`` stands in for a copy of the retired set per snapshot (``RetiredMark``), and
``rankings.ScoreMap`` for a dict of every block's score. Driven here by random event streams
against the plain construction they replace: a frozen copy of the set at each mark, and
``score_map`` of the live groups and the retired group.
"""

from __future__ import annotations

from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policyd.core.state import EngineState, WorkflowState
from policyd.core.types import (
    BlocksRemoved,
    RequestStarted,
    ScoredBlocks,
    WorkflowFinished,
    score_map,
)
from policyd.policies import lifecycle as lifecycle_module
from policyd.policies import rankings
from policyd.policies.lifecycle import RETIRED_SCORE, Lifecycle, RetiredMark
from policyd.policies.rankings import ScoreMap, disjoint
from policyd.sim.config import SimConfig
from policyd.sim.replay import simulate
from policyd.workloads.calls import sequential
from policyd.workloads.synthetic import synthetic_agents

BLOCKS = list(range(1, 13))
WORKFLOWS = ["a", "b", "c"]

blocks = st.lists(st.sampled_from(BLOCKS), max_size=6).map(tuple)
step = st.one_of(
    st.tuples(st.just("start"), blocks),
    st.tuples(st.just("finish"), st.sampled_from(WORKFLOWS)),
    st.tuples(st.just("evict"), blocks),
    st.tuples(st.just("replace"), st.frozensets(st.sampled_from(BLOCKS))),
    st.tuples(st.just("mark"), st.just(None)),
    st.tuples(st.just("drop"), st.integers(0, 5)),
)


def _state(owners: dict[int, str]) -> EngineState:
    """Each block owned by one workflow; every block resident on the GPU at first."""
    state = EngineState()
    for wid in WORKFLOWS:
        blocks_of = {b for b, w in owners.items() if w == wid}
        state.workflows[wid] = WorkflowState(wid, "t", 0.0, 0.0, blocks=blocks_of)
    state.owners = {b: frozenset({w}) for b, w in owners.items()}
    state.resident["gpu"] = set(BLOCKS)
    return state


scenario = {
    "owners": st.fixed_dictionaries({b: st.sampled_from(WORKFLOWS) for b in BLOCKS}),
    "steps": st.lists(step, max_size=40),
    "live": blocks,
}


@settings(max_examples=150, deadline=None)
@given(**scenario)
def test_marks_answer_for_their_moment(
    owners: dict[int, str], steps: list[tuple[str, object]], live: tuple[int, ...]
) -> None:
    _check(owners, steps, live)


@settings(max_examples=150, deadline=None)
@given(**scenario)
def test_marks_detached_answer_the_same(
    owners: dict[int, str], steps: list[tuple[str, object]], live: tuple[int, ...]
) -> None:
    """Marks held long detach from the log (here after two changed blocks): the same answers."""
    with patch.object(lifecycle_module, "DETACH_AFTER", 2):
        _check(owners, steps, live)


def _check(owners: dict[int, str], steps: list[tuple[str, object]], live: tuple[int, ...]) -> None:
    state = _state(owners)
    lifecycle = Lifecycle()
    held: list[tuple[RetiredMark, frozenset[int]]] = []  # each mark, with the set it stands for
    for i, (kind, arg) in enumerate(steps):
        if kind == "start":
            assert isinstance(arg, tuple)
            event = RequestStarted(
                ts=0.0, request_id=f"r{i}", workflow_id="x", agent="p", block_hashes=arg
            )
            lifecycle.observe(event, state)
        elif kind == "finish":
            assert isinstance(arg, str)
            state.workflows[arg].done = True
            lifecycle.observe(WorkflowFinished(ts=0.0, workflow_id=arg), state)
        elif kind == "evict":
            assert isinstance(arg, tuple)
            state.resident["gpu"].difference_update(arg)
            lifecycle.observe(BlocksRemoved(ts=0.0, tier="gpu", block_hashes=arg), state)
        elif kind == "replace":
            assert isinstance(arg, frozenset)
            lifecycle.retired = set(arg)
        elif kind == "mark":
            held.append((lifecycle.mark(), frozenset(lifecycle.retired)))
        elif held:  # a tier lets go of a view: its mark is no longer logged
            assert isinstance(arg, int)
            held.pop(arg % len(held))
        for mark, then in held:
            assert {b for b in BLOCKS if mark.retired(b)} == then
            assert set(mark.blocks()) == then
            assert mark.any_retired() == bool(then)  # (the walk-free answer)

    groups = [ScoredBlocks(2.0, live[:3]), ScoredBlocks(1.0, live[2:])]
    ranked = disjoint(groups, lifecycle.mark())
    retired = lifecycle.group(groups)
    expected = score_map(groups if retired is None else [*groups, retired])
    assert dict(ranked.scores) == expected
    assert bool(ranked.scores) == bool(expected)  # (``__bool__`` walks nothing)
    assert {b: ranked.scores.get(b, 0.0) for b in BLOCKS} == {
        b: expected.get(b, 0.0) for b in BLOCKS
    }
    published = ranked.published(lifecycle)
    assert score_map(published) == expected
    assert sum(len(g.block_hashes) for g in published) == len(expected)  # each block once


def test_a_score_map_outlives_the_next_snapshot() -> None:
    """A tier may keep a view while later snapshots arrive: its scores do not move."""
    state = _state(dict.fromkeys(BLOCKS, "a"))
    lifecycle = Lifecycle()
    state.workflows["a"].done = True
    lifecycle.observe(WorkflowFinished(ts=0.0, workflow_id="a"), state)
    first = disjoint([ScoredBlocks(1.0, (1,))], lifecycle.mark()).scores
    start = RequestStarted(ts=0.0, request_id="r", workflow_id="b", agent="p", block_hashes=(2,))
    lifecycle.observe(start, state)
    second = disjoint([], lifecycle.mark()).scores
    assert first[2] == RETIRED_SCORE and 2 not in second
    assert first[1] == 1.0 and second[1] == RETIRED_SCORE
    with pytest.raises(KeyError):
        _ = second[2]


def test_whether_a_score_map_scores_anything_is_answered_without_a_walk() -> None:
    """Every tier adopting a view asks whether it orders the host tier (``bool`` of its host
    scores): that must not walk the retired set, which outnumbers the live blocks where
    workflows are short."""
    state = _state(dict.fromkeys(BLOCKS, "a"))
    lifecycle = Lifecycle()
    empty = disjoint([], lifecycle.mark()).scores
    state.workflows["a"].done = True
    lifecycle.observe(WorkflowFinished(ts=0.0, workflow_id="a"), state)
    retired_only = disjoint([], lifecycle.mark()).scores
    live_only = disjoint([ScoredBlocks(1.0, (1,))], Lifecycle().mark()).scores
    with patch.object(RetiredMark, "blocks", side_effect=AssertionError("walked")):
        assert not empty
        assert retired_only
        assert live_only


def test_an_agentkv_replay_of_one_call_workflows_never_walks_a_score_map() -> None:
    """Where every workflow is one call nearly every block is retired, and a walk of a
    snapshot's scores per adoption made agentkv's replay quadratic (the first 300 Mooncake
    calls took 10x as long): the replay's hot paths only look scores up."""
    calls = [c for stream in synthetic_agents(seed=0, workflows=40) for c in stream][:40]
    config = SimConfig(concurrency=1, gpu_blocks=8_000, host_blocks=8_000, snapshot_interval_s=0.1)
    walks = {"iter": 0, "len": 0}
    real_iter, real_len = ScoreMap.__iter__, ScoreMap.__len__

    def counted_iter(self: ScoreMap) -> object:
        walks["iter"] += 1
        return real_iter(self)

    def counted_len(self: ScoreMap) -> int:
        walks["len"] += 1
        return real_len(self)

    with (
        patch.object(ScoreMap, "__iter__", counted_iter),
        patch.object(ScoreMap, "__len__", counted_len),
    ):
        report = simulate(sequential(calls), "agentkv", config, model="python")
    assert report.requests == 40 and report.hit_rate > 0
    assert walks == {"iter": 0, "len": 0}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0.5, 1.0, 2.0]),
            st.lists(st.integers(1, 12), max_size=8).map(tuple),
        ),
        max_size=6,
    )
)
def test_groups_are_said_once_when_published_only(raw: list[tuple[float, tuple[int, ...]]]) -> None:
    """``disjoint`` leaves the groups as given until a snapshot publishes them: then each block
    is in the last group naming it, at its first place there, and an emptied group is gone.
    The scores never need that walk (the guard's shadows read only them)."""
    groups = [ScoredBlocks(score, blocks) for score, blocks in raw]
    once = [
        ScoredBlocks(score, kept)
        for i, (score, blocks) in enumerate(raw)
        if (
            kept := tuple(
                b for b in dict.fromkeys(blocks) if not any(b in later for _, later in raw[i + 1 :])
            )
        )
    ]
    lifecycle = Lifecycle()
    calls: list[int] = []
    said_once = rankings._said_once

    def counted(g: tuple[ScoredBlocks, ...]) -> tuple[ScoredBlocks, ...]:
        calls.append(len(g))
        return said_once(g)

    with patch.object(rankings, "_said_once", counted):
        ranked = disjoint(groups, lifecycle.mark())
        assert dict(ranked.scores) == score_map(groups)
        assert not calls  # the scores alone: no walk
        published = ranked.published(lifecycle)
        ranked.published(lifecycle)
    repeated = sum(len(g.block_hashes) for g in groups) != len(score_map(groups))
    assert len(calls) == (1 if repeated else 0)  # at most once, when a block repeats
    assert published == (tuple(once) if repeated else tuple(groups))
