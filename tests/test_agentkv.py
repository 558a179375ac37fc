"""The agentkv policy: its host admission tests on a hand-fed Engine, and replays."""

from __future__ import annotations

from policyd.engine import Engine
from policyd.policies.agentkv import AgentKV
from policyd.sim.replay import SimConfig, simulate
from policyd.types import (
    BlocksRemoved,
    BlocksStored,
    RequestFinished,
    RequestStarted,
    WorkflowFinished,
)
from policyd.workloads import make_workload

SYS = (1, 2, 3)  # the planner's system prompt, shared by every workflow


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def start(
    engine: Engine, clock: Clock, rid: str, wid: str, *, agent: str, private: tuple[int, ...]
) -> tuple[int, ...]:
    blocks = (*SYS, *private) if agent == "planner" else private
    engine.apply_event(
        RequestStarted(
            ts=clock.now,
            request_id=rid,
            workflow_id=wid,
            agent=agent,
            workflow_type="t",
            block_hashes=blocks,
            prompt_tokens=16 * len(blocks) + 1,
        )
    )
    return blocks


def finish(engine: Engine, clock: Clock, rid: str, blocks: tuple[int, ...]) -> None:
    engine.apply_event(BlocksStored(ts=clock.now, tier="gpu", block_hashes=blocks, request_id=rid))
    engine.apply_event(RequestFinished(ts=clock.now, request_id=rid))


def trained(host_blocks: int = 100, **params: object) -> tuple[Engine, AgentKV, Clock]:
    """Scenario: workflows of one type run planner -> coder -> planner -> end, 10 s apart."""
    policy = AgentKV(min_observations=0, min_accuracy=0.0, host_blocks=host_blocks, **params)  # type: ignore[arg-type]
    clock = Clock()
    engine = Engine(policy, clock=clock)
    base = 100
    for w in range(40):
        wid = f"w{w}"
        for step, (agent, private) in enumerate(
            (
                ("planner", (base, base + 1)),
                ("coder", (base + 2,)),
                ("planner", (base, base + 1, base + 3)),
            )
        ):
            clock.now += 10.0
            rid = f"{wid}.{step}"
            finish(engine, clock, rid, start(engine, clock, rid, wid, agent=agent, private=private))
        engine.apply_event(WorkflowFinished(ts=clock.now, workflow_id=wid))
        base += 10
    return engine, policy, clock


def press(engine: Engine, clock: Clock, host_blocks: int) -> None:
    """Fill the host tier and evict: occupancy 1, a capacity eviction now."""
    fill = tuple(range(10**6, 10**6 + host_blocks))
    engine.apply_event(BlocksStored(ts=clock.now, tier="host", block_hashes=fill))
    engine.apply_event(BlocksRemoved(ts=clock.now, tier="host", block_hashes=(10**6,)))
    engine.apply_event(BlocksStored(ts=clock.now, tier="host", block_hashes=(10**6,)))


def test_blocks_no_step_will_reuse_are_declined_but_the_shared_prefix_is_kept() -> None:
    engine, _, clock = trained()
    blocks = start(engine, clock, "live.0", "live", agent="planner", private=(9001, 9002))
    finish(engine, clock, "live.0", blocks)
    blocks = start(engine, clock, "live.1", "live", agent="coder", private=(9003,))
    finish(engine, clock, "live.1", blocks)
    engine.snapshot()  # publishes: the predictor is trusted
    last = start(engine, clock, "live.2", "live", agent="planner", private=(9001, 9002, 9004))
    decision = engine.admit("live.2", last)
    assert set(decision.declined) == {9001, 9002, 9004}  # the workflow ends after this call
    assert decision.block_hashes == SYS  # other workflows' planners read the system prompt
    # after the planner's first call, the planner is called again: everything is written
    first = start(engine, clock, "new.0", "new", agent="planner", private=(9101,))
    assert engine.admit("new.0", first).block_hashes == first


def test_under_pressure_small_extensions_pass_and_refills_must_survive() -> None:
    """Scenario: a one-block host tier, far below the working set, full and evicting."""
    engine, policy, clock = trained(host_blocks=1, shards_rate=1.0)
    press(engine, clock, 1)
    blocks = start(engine, clock, "live.0", "live", agent="planner", private=(9001, 9002))
    engine.snapshot()
    assert policy.working_set.pressure(engine.state, clock.now, theta=0.95, source="shards")
    assert engine.admit("live.0", blocks[:1]).reason == "small extension"  # kappa: 512 blocks
    policy.max_new_blocks = 0  # every write is now a refill
    # expected distance = prompt blocks referenced per second x the workflow's time to its
    # next call: at the pool's pace (10 s between calls) it exceeds the 1-block tier
    assert policy.expected_reuse_s("live") > 1.0
    assert policy.reference_rate_blocks_per_s() * policy.expected_reuse_s("live") >= 1
    refill = engine.admit("live.0", blocks)
    assert refill.block_hashes == () and refill.declined == blocks
    policy._interval_s["live"] = 0.0  # a workflow calling again at once: the refill survives
    survives = engine.admit("live.0", blocks)
    assert survives.block_hashes == blocks and survives.reason.startswith("expected distance")
    policy.survival = False  # EfficientAgent's fixed rule: refills never survive
    assert engine.admit("live.0", blocks).block_hashes == ()
    press(engine, clock, 1)
    clock.now += 61.0  # the last capacity eviction leaves the window: no pressure
    engine.apply_event(RequestFinished(ts=clock.now, request_id="live.0"))
    again = start(engine, clock, "live.1", "live", agent="coder", private=(9003,))
    assert engine.admit("live.1", again).reason in (
        "no pressure",
        "no reuse expected (lifecycle / prediction)",
    )


def test_degraded_predictor_falls_back_to_the_efficientagent_rule() -> None:
    engine, policy, clock = trained()
    policy.min_accuracy = 1.01  # no predictor reaches it
    engine.snapshot()
    assert policy.degraded
    blocks = start(engine, clock, "live.2", "live", agent="planner", private=(9001, 9002, 9004))
    # no prediction-based decline: with no pressure everything is written
    assert engine.admit("live.2", blocks).block_hashes == blocks


def test_agentkv_is_at_least_lru_and_efficientagent_at_a_contended_point() -> None:
    work = make_workload("code-writing", seed=2, workflows=24)
    config = SimConfig(concurrency=12, gpu_blocks=3000, host_blocks=3000)
    lru = simulate(work, "lru", config)
    ea = simulate(work, "efficientagent", config)
    ours = simulate(work, "agentkv", config)
    assert ours.hit_rate >= max(lru.hit_rate, ea.hit_rate)
    assert ours.recomputed_tokens <= min(lru.recomputed_tokens, ea.recomputed_tokens)
