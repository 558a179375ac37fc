"""agentkv's host-tier order: published apart from the GPU's (``PolicySnapshot.host_scores``),
honoured by the simulator, carried by the codec; absent, both tiers follow ``scores``."""

from __future__ import annotations

from typing import ClassVar

import msgspec
import pytest

from policyd.core.engine import Engine, EngineState
from policyd.core.policy import Ordering, Policy
from policyd.core.types import (
    PROTOCOL_VERSION,
    SNAPSHOT_CODEC,
    BlocksStored,
    PolicySnapshot,
    ScoredBlocks,
    WorkflowFinished,
)
from policyd.policies.agentkv import AgentKV
from policyd.policies.pbkv import PBKV, RETIRED_SCORE
from policyd.sim.replay import SimConfig, Simulator
from policyd.tiers.view import SnapshotView
from policyd.workloads import make_workload
from tests.test_agentkv import Clock, finish, press, solo_call, start, trained


def _scores(groups: tuple[ScoredBlocks, ...] | None) -> dict[int, float]:
    assert groups is not None
    out: dict[int, float] = {}
    for group in groups:
        assert not set(group.block_hashes) & out.keys(), "a block said twice"
        out.update(dict.fromkeys(group.block_hashes, group.score))
    return out


def _resident_half(host_blocks: int, pressed: bool) -> tuple[AgentKV, PolicySnapshot]:
    """Scenario: a live workflow whose planner prompt is half (9001) in the host tier, and
    finished workflows whose private blocks are retired; the tier full and evicting or not
    (EfficientAgent's pressure: occupancy 1, a capacity eviction now, a working set above the
    tier)."""
    engine, policy, clock = trained(host_blocks=host_blocks, shards_rate=1.0)
    if pressed:
        press(engine, clock, host_blocks)
    blocks = start(engine, clock, "live.0", "live", agent="planner", private=(9001, 9002))
    finish(engine, clock, "live.0", blocks)
    engine.apply_event(
        BlocksStored(ts=clock.now, tier="host", block_hashes=(9001,), request_id="live.0")
    )
    return policy, engine.snapshot()


def test_under_pressure_the_host_order_raises_resident_copies_and_keeps_retired_lowest() -> None:
    """A thrashing tier: the resident half scores 1.2x the other half; retired blocks are
    lowest in both orders."""
    policy, snap = _resident_half(4, pressed=True)  # (the working set: 7 blocks)
    assert snap.write_filter is not None and snap.write_filter.pressure
    host = _scores(snap.host_scores)
    assert host[9002] > 0 and host[9001] == pytest.approx(host[9002] * 1.2)
    gpu = _scores(snap.scores)
    assert gpu[9001] == gpu[9002]  # residency plays no part on the GPU
    retired = set(policy.retired)
    assert retired and all(host[b] == gpu[b] == RETIRED_SCORE for b in retired)


def test_without_pressure_a_resident_copy_gets_no_bonus() -> None:
    """A tier that is not thrashing (here: room left, nothing evicted) keeps its copies by
    value alone: a stale resident copy must not outrank a newcomer of the same value (on the
    SWE-bench pool at the recommended size the bonus cost 24% more recomputed tokens)."""
    policy, snap = _resident_half(100, pressed=False)
    assert snap.write_filter is not None and not snap.write_filter.pressure
    host = _scores(snap.host_scores)
    assert host[9002] > 0 and host[9001] == host[9002]
    retired = set(policy.retired)
    assert retired and all(host[b] == RETIRED_SCORE for b in retired)


def test_while_degraded_and_not_thrashing_both_orders_agree() -> None:
    """A degraded predictor: the GPU and the host are both ranked by steps alone, and a tier
    that is not thrashing raises no resident copy."""
    engine, policy, clock = trained()
    policy.trust.min_accuracy = 1.01  # no predictor reaches it
    blocks = start(engine, clock, "live.0", "live", agent="planner", private=(9001, 9002))
    finish(engine, clock, "live.0", blocks)
    engine.apply_event(
        BlocksStored(ts=clock.now, tier="host", block_hashes=(9001,), request_id="live.0")
    )
    snap = engine.snapshot()
    assert policy.degraded and policy.ranking == "steps"
    assert snap.write_filter is not None and not snap.write_filter.pressure
    assert _scores(snap.host_scores) == _scores(snap.scores)
    # one ranking orders both tiers: one tuple in the snapshot, one index in the view
    assert snap.host_scores is snap.scores
    view = SnapshotView.of(snap)
    assert view.host_scores is view.scores
    decoded = SNAPSHOT_CODEC.decode(SNAPSHOT_CODEC.encode(snap))  # off the wire: two tuples
    assert decoded.host_scores is not decoded.scores
    assert dict(SnapshotView.of(decoded).host_scores) == dict(view.scores)


def test_admission_values_a_prompt_in_the_host_order() -> None:
    """The value ``admit`` compares with what a write displaces is the host order's: steps +
    lookahead in a structured type, steps alone while the predictor is degraded."""
    engine, policy, clock = trained()
    blocks = start(engine, clock, "live.0", "live", agent="planner", private=(9001, 9002))
    finish(engine, clock, "live.0", blocks)
    engine.snapshot()
    state = engine.state
    both = policy.host_order.value("live", "planner", state, degraded=False)
    steps = policy.host_order.value("live", "planner", state, degraded=True)
    ahead = policy.lookahead.mass("live", "planner")
    assert both is not None and steps is not None
    assert steps == policy.steps.value("live", "planner", state) > 0
    assert both == pytest.approx(steps + ahead) and ahead > 0
    assert policy.host_order.value("nobody", "planner", state, degraded=False) is None


BASE = {"quick": 50_000, "slow": 60_000}  # each workflow's private blocks start there


def _solo_pool() -> tuple[Engine, AgentKV]:
    """Scenario: a flat type (one agent per workflow, like the SWE-bench pool): 30 finished
    workflows of four calls, then two live ones - "quick" calling every 5 s, "slow" every
    30 s - each prompt one block longer than the workflow's previous one."""
    policy = AgentKV(min_observations=0, min_accuracy=0.0, host_blocks=100, guard=False)
    clock = Clock()
    engine = Engine(policy, clock=clock)

    def call(wid: str, base: int, n: int) -> None:
        blocks = tuple(range(base, base + n + 2))
        solo_call(engine, clock, f"{wid}.{n}", wid, kind="solo", blocks=blocks)

    for w in range(30):
        for n in range(4):
            clock.now += 10.0
            call(f"done{w}", 10_000 + 100 * w, n)
        engine.apply_event(WorkflowFinished(ts=clock.now, workflow_id=f"done{w}"))
    for n in range(3):
        call("slow", BASE["slow"], n)
        for i in range(6):
            clock.now += 5.0
            call("quick", BASE["quick"], 6 * n + i)
    return engine, policy


def _private(groups: tuple[ScoredBlocks, ...] | None, wid: str) -> list[float]:
    """The distinct scores of ``wid``'s private blocks."""
    return sorted({s for b, s in _scores(groups).items() if BASE[wid] <= b < BASE[wid] + 100})


def test_in_a_flat_type_the_host_keeps_the_workflow_that_calls_again_sooner() -> None:
    """A single-agent type's lookahead is only survival, which the forecast cannot tell apart
    (it orders the tier by noise); the host order uses the workflow's pace instead: steps
    (1 for both) + 1 / (1 + its time between calls / the pool's mean). Without a host tier
    (nothing to order) the host ranking is the plain sum, steps + lookahead."""
    engine, policy = _solo_pool()
    assert policy.steps.graph.flat("solo")
    snap = engine.snapshot()
    quick, slow = policy.pacing.pace("quick"), policy.pacing.pace("slow")
    assert 0.0 < slow < 0.5 < quick < 1.0
    assert _private(snap.host_scores, "quick") == pytest.approx([1.0 + quick])
    assert _private(snap.host_scores, "slow") == pytest.approx([1.0 + slow])
    state = engine.state
    value = policy.host_order.value("quick", "solver", state, degraded=False)
    assert value == pytest.approx(1.0 + quick)
    rankings, host = policy._rankings(state)
    both = rankings["both"]
    assert host is not both
    ahead = both.private["quick", "solver"]
    assert ahead > 1.0 + quick  # 1 + the survival mass
    steps, lookahead = rankings["steps"], rankings["lookahead"]
    assert policy.host_order.ranking(steps, lookahead, both, state, host_tier=False) is both


class Published(Policy):
    """Publishes the same snapshot every time: ``scores``, ``host_scores``, ``inherit``."""

    name: ClassVar[str] = "published"
    ordering: ClassVar[Ordering] = "snapshot"

    def __init__(
        self,
        scores: tuple[ScoredBlocks, ...],
        host_scores: tuple[ScoredBlocks, ...] | None = None,
        inherit: bool = False,
    ) -> None:
        self.scores, self.host_scores, self.inherit = scores, host_scores, inherit

    def snapshot(
        self, state: EngineState, *, now: float, version: int, ttl_s: float
    ) -> PolicySnapshot:
        return PolicySnapshot(
            version=version,
            ts=now,
            ttl_s=ttl_s,
            policy=self.name,
            scores=self.scores,
            host_scores=self.host_scores,
            inherit_scores=self.inherit,
        )


def _simulator(policy: Policy, host_blocks: int) -> Simulator:
    work = make_workload("code-writing", seed=0, workflows=1)
    sim = Simulator(work, policy, SimConfig(gpu_blocks=4096, host_blocks=host_blocks))
    sim._apply_snapshot()
    while sim.step_budget.busy:  # the host order follows once the plan's recount is done and
        sim.step_budget.new_step()  # its walk has re-keyed every key, a step budget at a time
        sim._step_plan(frozenset())
    return sim


@pytest.mark.parametrize("host", [True, False])
def test_the_simulator_orders_the_host_tier_by_host_scores_when_given(host: bool) -> None:
    # block 2 first out of the host when the snapshot gives the host its own order; else the
    # GPU's scores order it too (block 1 first), as every policy but agentkv publishes
    scores = (ScoredBlocks(1.0, (1,)), ScoredBlocks(2.0, (2,)))
    host_scores = (ScoredBlocks(2.0, (1,)), ScoredBlocks(1.0, (2,))) if host else None
    sim = _simulator(Published(scores, host_scores), host_blocks=2)
    sim.host.queue.push_many([1, 2])
    assert sim.host.queue.pop_head() == (2 if host else 1)


def test_agentkv_asks_for_inherited_scores_and_pbkv_does_not() -> None:
    """agentkv scores each call's output as its prompt, and the blocks stored between
    snapshots likewise; pbkv leaves both unscored."""
    for policy, expected in [(AgentKV(guard=False), True), (PBKV(), False)]:
        snap = policy.snapshot(EngineState(), now=0.0, version=1, ttl_s=5.0)
        assert snap.inherit_scores is expected


def test_the_codec_carries_host_scores_and_reads_snapshots_without_them() -> None:
    snap = PolicySnapshot(
        version=3,
        ts=1.0,
        ttl_s=5.0,
        policy="agentkv",
        scores=(ScoredBlocks(1.0, (7, 8)),),
        host_scores=(ScoredBlocks(0.5, (8,)), ScoredBlocks(2.0, (7,))),
    )
    assert SNAPSHOT_CODEC.decode(SNAPSHOT_CODEC.encode(snap)) == snap
    # a frame from a sender that knows no host order
    old = msgspec.msgpack.encode(
        (PROTOCOL_VERSION, {"version": 1, "ts": 0.0, "ttl_s": 5.0, "policy": "pbkv"})
    )
    assert SNAPSHOT_CODEC.decode(old).host_scores is None
    assert SNAPSHOT_CODEC.decode(old).inherit_scores is False
    asks = msgspec.structs.replace(snap, inherit_scores=True)
    assert SNAPSHOT_CODEC.decode(SNAPSHOT_CODEC.encode(asks)) == asks
