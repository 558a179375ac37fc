"""One contract every registered policy passes (River's ``check_estimator``, for policies).

The suite is parametrized over ``policyd.policies.POLICIES``: a policy registered there is
picked up here with no edit. The ``policy_factory`` fixture knows how to build oracle
policies (they are given the future: the order of the calls the state was built from).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import get_args

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from policyd.core.engine import Engine, EngineState
from policyd.core.types import (
    SNAPSHOT_CODEC,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    Event,
    EventBatch,
    PolicySnapshot,
    PrefixHit,
    RequestFinished,
    RequestStarted,
    WorkflowFinished,
)
from policyd.policies import POLICIES, Ordering, Policy
from tests.conftest import build_policy, events

Order = Sequence[tuple[str, Sequence[int]]]
PolicyFactory = Callable[[Order], Policy]
CONTRACT_SETTINGS = settings(max_examples=40, deadline=None)


@pytest.fixture(scope="module", params=sorted(POLICIES))
def policy_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def policy_factory(policy_name: str) -> PolicyFactory:
    """Builds a fresh policy; oracles get a future made of ``order``."""

    def factory(order: Order) -> Policy:
        return build_policy(policy_name, order)

    return factory


@dataclass
class Situation:
    """An Engine state reached by a sequence of calls, and the calls (the oracle's future)."""

    engine: Engine
    order: list[tuple[str, tuple[int, ...]]]

    @property
    def state(self) -> EngineState:
        return self.engine.state

    @property
    def policy(self) -> Policy:
        return self.engine.policy


@st.composite
def call_histories(draw: st.DrawFn) -> list[tuple[str, str, tuple[int, ...], str, bool]]:
    """Calls as (request, workflow, blocks, where cached, finished?) over a few dozen blocks."""
    calls = []
    for i in range(draw(st.integers(0, 12))):
        root = draw(st.integers(0, 3)) * 100  # four prefixes: calls share their first blocks
        length = draw(st.integers(0, 6))
        blocks = tuple(root + j for j in range(length))
        calls.append(
            (
                f"r{i}",
                draw(st.sampled_from(["w0", "w1", "w2"])),
                blocks,
                draw(st.sampled_from(["gpu", "host", "both", "none"])),
                draw(st.booleans()),
            )
        )
    return calls


def situation(
    factory: PolicyFactory, calls: list[tuple[str, str, tuple[int, ...], str, bool]]
) -> Situation:
    order = [(rid, blocks) for rid, _, blocks, _, _ in calls]
    engine = Engine(factory(order), clock=lambda: 100.0)
    evs: list[Event] = []
    for t, (rid, wid, blocks, where, done) in enumerate(calls):
        evs.append(
            RequestStarted(
                ts=float(t),
                request_id=rid,
                workflow_id=wid,
                agent="a",
                block_hashes=blocks,
                prompt_tokens=16 * len(blocks) + 1,
            )
        )
        evs.append(
            PrefixHit(
                ts=float(t),
                request_id=rid,
                gpu_blocks=0,
                host_blocks=0,
                recomputed_blocks=len(blocks),
            )
        )
        for tier in ("gpu", "host"):
            if where in (tier, "both"):
                evs.append(
                    BlocksStored(ts=float(t), tier=tier, block_hashes=blocks, request_id=rid)
                )
        if done:
            evs.append(RequestFinished(ts=float(t), request_id=rid))
    evs.append(WorkflowFinished(ts=50.0, workflow_id="w0"))
    engine.apply(EventBatch(source="contract", seq=1, events=tuple(evs)))
    return Situation(engine, order)


def all_blocks(sit: Situation) -> list[int]:
    return sorted({b for _, blocks in sit.order for b in blocks} | {999, 1000})


# ---- the contract --------------------------------------------------------------------------------


def test_the_policy_is_registered_under_its_name(
    policy_name: str, policy_factory: PolicyFactory
) -> None:
    policy = policy_factory([])
    assert isinstance(policy, Policy)
    assert POLICIES[policy_name] is type(policy)
    assert policy.name == policy_name
    assert policy.ordering in get_args(Ordering)
    assert policy.description, "the UI shows it"


@CONTRACT_SETTINGS
@given(calls=call_histories(), data=st.data())
def test_victims_are_at_most_n_distinct_candidates(
    policy_factory: PolicyFactory,
    calls: list[tuple[str, str, tuple[int, ...], str, bool]],
    data: st.DataObject,
) -> None:
    sit = situation(policy_factory, calls)
    universe = all_blocks(sit)
    candidates = data.draw(st.lists(st.sampled_from(universe), unique=True), label="candidates")
    n = data.draw(st.integers(0, len(candidates) + 2), label="n_blocks")
    for tier in ("gpu", "host"):
        victims = sit.policy.victims(tier, candidates, n, sit.state)
        assert len(victims) <= n
        assert set(victims) <= set(candidates)
        assert len(set(victims)) == len(victims), "no block twice"
        assert sit.engine.victims(tier, candidates, n) == victims, "the Engine asks the policy"
    assert sit.policy.victims("gpu", [], 3, sit.state) == []


@CONTRACT_SETTINGS
@given(calls=call_histories(), data=st.data())
def test_admit_answers_for_a_subset_of_the_offered_blocks(
    policy_factory: PolicyFactory,
    calls: list[tuple[str, str, tuple[int, ...], str, bool]],
    data: st.DataObject,
) -> None:
    sit = situation(policy_factory, calls)
    offered = data.draw(st.lists(st.sampled_from(all_blocks(sit)), unique=True), label="offered")
    rid = calls[-1][0] if calls else "unknown"
    decision = sit.policy.admit(rid, offered, sit.state)
    assert decision.request_id == rid
    assert set(decision.block_hashes) <= set(offered)
    assert set(decision.declined) <= set(offered)
    assert not set(decision.block_hashes) & set(decision.declined)
    assert len(set(decision.block_hashes)) == len(decision.block_hashes)
    assert sit.engine.admit(rid, offered) == decision


@CONTRACT_SETTINGS
@given(calls=call_histories(), budget=st.integers(0, 8))
# two workflows whose prompts are one shared host block: named once
@example(calls=[("r0", "w1", (0,), "host", True), ("r1", "w2", (0,), "host", True)], budget=2)
def test_prefetch_respects_the_budget_and_names_host_blocks(
    policy_factory: PolicyFactory,
    calls: list[tuple[str, str, tuple[int, ...], str, bool]],
    budget: int,
) -> None:
    sit = situation(policy_factory, calls)
    wanted = sit.policy.prefetch(budget, sit.state)
    assert len(wanted) <= budget
    assert len(set(wanted)) == len(wanted)
    assert set(wanted) <= sit.state.resident["host"], "only host-resident blocks can be loaded"


@CONTRACT_SETTINGS
@given(calls=call_histories(), version=st.integers(1, 2**31), ttl_s=st.floats(0.1, 60.0))
def test_the_snapshot_is_valid_and_round_trips(
    policy_name: str,
    policy_factory: PolicyFactory,
    calls: list[tuple[str, str, tuple[int, ...], str, bool]],
    version: int,
    ttl_s: float,
) -> None:
    sit = situation(policy_factory, calls)
    snap = sit.policy.snapshot(sit.state, now=100.0, version=version, ttl_s=ttl_s)
    assert isinstance(snap, PolicySnapshot)
    assert (snap.version, snap.ts, snap.ttl_s, snap.policy) == (version, 100.0, ttl_s, policy_name)
    assert SNAPSHOT_CODEC.decode(SNAPSHOT_CODEC.encode(snap)) == snap
    scored = [b for group in snap.scores for b in group.block_hashes]
    assert len(set(scored)) == len(scored), "a block has one score"
    retired = snap.retired_workflows
    assert len(set(retired)) == len(retired)
    for wid in retired:  # an active workflow is never retired (a forgotten one may be listed)
        assert wid not in sit.state.workflows or sit.state.workflows[wid].done
    assert snap.write_filter.max_new_blocks >= 0


@CONTRACT_SETTINGS
@given(evs=st.lists(events, max_size=20))
def test_observe_accepts_any_event_stream(policy_factory: PolicyFactory, evs: list[Event]) -> None:
    """Connectors send what they saw: unknown requests, removals of unknown blocks, resets.
    A policy learns from all of it without raising, and still answers."""
    engine = Engine(policy_factory([]), clock=lambda: 0.0)
    engine.apply(EventBatch(source="fuzz", seq=1, events=tuple(evs)))
    engine.apply_event(AllBlocksCleared(ts=0.0, tier="gpu"))
    engine.apply_event(BlocksRemoved(ts=0.0, tier="host", block_hashes=(1, 2)))
    assert len(engine.victims("gpu", [1, 2, 3], 2)) <= 2
    snap = engine.snapshot()
    assert SNAPSHOT_CODEC.decode(SNAPSHOT_CODEC.encode(snap)) == snap


@CONTRACT_SETTINGS
@given(calls=call_histories())
def test_oracle_keys_rank_every_block(
    policy_factory: PolicyFactory, calls: list[tuple[str, str, tuple[int, ...], str, bool]]
) -> None:
    sit = situation(policy_factory, calls)
    if sit.policy.ordering != "oracle":
        with pytest.raises(NotImplementedError):
            sit.policy.oracle_keys("gpu", [1])
        return
    blocks = all_blocks(sit)
    for tier in ("gpu", "host"):
        keys = sit.policy.oracle_keys(tier, blocks)
        assert len(keys) == len(blocks)
        sorted(keys)  # comparable with one another
        assert isinstance(sit.policy.oracle_admits(tier, blocks[0], blocks[-1]), bool)
