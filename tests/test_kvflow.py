"""The kvflow baseline: steps-to-execution on the static graphs, scores, prefetch."""

from __future__ import annotations

import math

from policyd.core.engine import Engine
from policyd.core.types import BlocksStored, RequestFinished, RequestStarted, Tier, WorkflowFinished
from policyd.models.stepgraph import steps_from
from policyd.policies.kvflow import DEFAULT_GRAPHS, KVFlow
from policyd.sim.replay import SimConfig, simulate
from policyd.workloads import make_workload


def call(
    engine: Engine,
    rid: str,
    wid: str,
    agent: str,
    blocks: tuple[int, ...],
    *,
    wtype: str = "code-writing",
    tier: Tier = "gpu",
    finish: bool = True,
) -> None:
    engine.apply_event(
        RequestStarted(
            ts=0.0,
            request_id=rid,
            workflow_id=wid,
            agent=agent,
            workflow_type=wtype,
            block_hashes=blocks,
            prompt_tokens=16 * len(blocks) + 1,
        )
    )
    engine.apply_event(BlocksStored(ts=0.0, tier=tier, block_hashes=blocks, request_id=rid))
    if finish:
        engine.apply_event(RequestFinished(ts=0.0, request_id=rid))


def test_steps_to_execution_on_the_default_graphs() -> None:
    cw = DEFAULT_GRAPHS["code-writing"]
    assert steps_from(cw, "planner") == {
        "coder": 1,
        "tester": 2,
        "debugger": 3,
        "reviewer": 3,
    }
    assert steps_from(cw, "tester") == {"debugger": 1, "reviewer": 1, "coder": 2, "tester": 3}
    assert steps_from(cw, "reviewer") == {}
    fc = DEFAULT_GRAPHS["fact-checking"]
    assert steps_from(fc, "planner") == {"retriever": 1, "verifier": 2, "summarizer": 3}
    assert steps_from(fc, "verifier") == {"retriever": 1, "summarizer": 1, "verifier": 2}
    fa = DEFAULT_GRAPHS["financial"]
    assert steps_from(fa, "planner") == {
        "income_analyst": 1,
        "balance_analyst": 1,
        "cashflow_analyst": 1,
        "ratio_analyst": 2,
        "risk_analyst": 3,
        "writer": 4,
    }
    assert steps_from(fa, "ratio_analyst") == {"ratio_analyst": 1, "risk_analyst": 1, "writer": 2}
    assert steps_from(fa, "writer") == {}


def test_private_blocks_rank_by_steps_and_unreachable_ones_go_first() -> None:
    """Scenario: a code-writing workflow has run planner, coder, tester, debugger; the coder is
    next (1 step), the tester after it (2), the planner never again (unreachable)."""
    policy = KVFlow()
    engine = Engine(policy, clock=lambda: 0.0)
    call(engine, "r0", "w", "planner", (10, 11))
    call(engine, "r1", "w", "coder", (20, 21))
    call(engine, "r2", "w", "tester", (30, 31))
    call(engine, "r3", "w", "debugger", (40, 41))
    assert policy.workflow_steps(engine.state.workflows["w"], engine.state) == {
        "coder": 1,
        "tester": 2,
        "debugger": 3,
        "reviewer": 3,
    }
    scores = policy.block_scores(engine.state)
    assert scores[20] == 1.0 and scores[30] == 0.5 and scores[40] == 1 / 3
    assert 10 not in scores and 11 not in scores, "the planner is at infinite steps"
    ranked = policy.victims("gpu", [20, 21, 30, 31, 40, 41, 10, 11], 8, engine.state)
    assert set(ranked[:2]) == {10, 11}
    assert ranked[2:4] == [41, 40] and set(ranked[4:6]) == {30, 31}
    assert set(ranked[6:]) == {20, 21}
    snap = engine.snapshot()
    assert snap.default_score == 0.0 < min(g.score for g in snap.scores)


def test_a_shared_prefix_takes_the_minimum_steps_over_workflows() -> None:
    """Scenario: the coder's system prompt (1, 2) is shared; w1 just planned (coder 1 step
    away), w2 just coded (coder 3 steps away via tester and debugger)."""
    policy = KVFlow()
    engine = Engine(policy, clock=lambda: 0.0)
    call(engine, "a0", "w1", "planner", (100,))
    call(engine, "b0", "w2", "planner", (200,))
    call(engine, "b1", "w2", "coder", (1, 2, 201))
    call(engine, "c0", "w3", "planner", (300,))
    call(engine, "c1", "w3", "coder", (1, 2, 301))  # the prefix is now learned: (1, 2)
    call(engine, "c2", "w3", "tester", (302,))
    call(engine, "c3", "w3", "reviewer", (303,))
    engine.apply_event(WorkflowFinished(ts=0.0, workflow_id="w3"))
    assert engine.state.agent_prefix["coder"] == (1, 2)
    scores = policy.block_scores(engine.state)
    assert scores[1] == scores[2] == 1.0, "w1's coder is one step away"
    assert scores[201] == 1 / 3, "w2's own coder prompt is three steps away"
    assert not {300, 301} & scores.keys(), "a finished workflow is at infinite steps"
    # (302 and 303 are the tester's and reviewer's prefixes as learned from the only prompts
    # seen: shared knowledge, scored by w2, which will reach both)
    assert scores[302] == 1 / 1 and scores[303] == 1 / 2
    # with w1 gone the prefix falls back to w2's distance
    engine.apply_event(WorkflowFinished(ts=0.0, workflow_id="w1"))
    assert policy.block_scores(engine.state)[1] == 1 / 3


def test_a_fan_out_stands_at_every_running_agent() -> None:
    policy = KVFlow()
    engine = Engine(policy, clock=lambda: 0.0)
    call(engine, "r0", "w", "planner", (1,), wtype="financial")
    call(engine, "r1", "w", "income_analyst", (2,), wtype="financial", finish=False)
    call(engine, "r2", "w", "balance_analyst", (3,), wtype="financial", finish=False)
    wf = engine.state.workflows["w"]
    assert policy.positions(wf, engine.state) == {"income_analyst", "balance_analyst"}
    assert policy.workflow_steps(wf, engine.state)["ratio_analyst"] == 1


def test_an_unknown_workflow_type_gets_no_scores() -> None:
    policy = KVFlow()
    engine = Engine(policy, clock=lambda: 0.0)
    call(engine, "r0", "w", "planner", (1, 2), wtype="triage")
    call(engine, "r1", "w", "coder", (3, 4), wtype="triage")
    assert policy.score_groups(engine.state) == []
    assert policy.prefetch(8, engine.state) == []
    # a graph given for it makes it known
    custom = KVFlow(graphs={"triage": {"planner": ["coder"], "coder": ["planner"]}})
    engine = Engine(custom, clock=lambda: 0.0)
    call(engine, "r0", "w", "planner", (1, 2), wtype="triage")
    call(engine, "r1", "w", "coder", (3, 4), wtype="triage")
    assert custom.block_scores(engine.state) == {1: 1.0, 2: 1.0, 3: 0.5, 4: 0.5}


def test_prefetch_loads_next_step_host_blocks_of_idle_workflows_within_budget() -> None:
    policy = KVFlow()
    engine = Engine(policy, clock=lambda: 0.0)
    # w: coder and tester prompts on the host; after the tester, debugger and reviewer are next
    call(engine, "r0", "w", "planner", (1,), tier="host")
    call(engine, "r1", "w", "coder", (2, 3), tier="host")
    call(engine, "r2", "w", "tester", (4, 5), tier="host")
    call(engine, "r3", "w", "debugger", (6, 7, 8), tier="host")
    call(engine, "r4", "w", "coder", (2, 3, 9), tier="host")
    engine.apply_event(BlocksStored(ts=0.0, tier="gpu", block_hashes=(4,), request_id="r2"))
    # the tester (4, 5) is the only next step; 4 is on the GPU already
    assert policy.prefetch(8, engine.state) == [5]
    assert policy.prefetch(0, engine.state) == []
    call(engine, "r5", "w", "tester", (4, 5, 10, 11, 12), tier="host")
    wanted = policy.prefetch(2, engine.state)
    assert len(wanted) == 2 and set(wanted) <= {6, 7, 8}, "the debugger's blocks, up to budget"
    assert set(policy.prefetch(100, engine.state)) == {6, 7, 8}  # reviewer not called yet
    # a running workflow is not idle: nothing to prefetch for it
    call(engine, "r6", "w", "debugger", (6, 7, 8, 13), tier="host", finish=False)
    assert policy.prefetch(8, engine.state) == []


def test_kvflow_is_no_worse_than_lru_on_the_static_workload() -> None:
    workload = make_workload("financial", seed=1, workflows=40)
    config = SimConfig(concurrency=16, gpu_blocks=8000, host_blocks=0)
    lru = simulate(workload, "lru", config)
    kvflow = simulate(workload, "kvflow", config)
    assert math.isfinite(kvflow.hit_rate)
    assert kvflow.hit_rate >= lru.hit_rate - 0.01
