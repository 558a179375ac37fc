"""The efficientagent write filter: its pressure signal on a hand-fed Engine, and on replay."""

from __future__ import annotations

import pytest

from policyd.core.engine import Engine
from policyd.core.types import BlocksRemoved, BlocksStored, RequestStarted
from policyd.policies.efficientagent import EfficientAgent
from policyd.sim.replay import SimConfig, Simulator, simulate
from policyd.workloads import make_workload


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pool_engine(host_blocks: int, **params: object) -> tuple[Engine, EfficientAgent, Clock]:
    """Scenario: 8 agents each re-send a private 40-block context three times (reuse distance
    ~7 x 40 = 280 blocks); the host tier of ``host_blocks`` is filled and evicts once."""
    policy = EfficientAgent(host_blocks=host_blocks, gpu_blocks=0, **params)  # type: ignore[arg-type]
    clock = Clock()
    engine = Engine(policy, clock=clock)
    for rnd in range(3):
        for a in range(8):
            clock.now = rnd * 10.0 + a
            blocks = tuple(a * 1000 + i for i in range(40))
            engine.apply_event(
                RequestStarted(
                    ts=clock.now,
                    request_id=f"{a}.{rnd}",
                    workflow_id=f"w{a}",
                    agent="swe",
                    block_hashes=blocks,
                    prompt_tokens=40 * 16 + 5,
                )
            )
    fill = tuple(range(10**6, 10**6 + host_blocks))
    engine.apply_event(BlocksStored(ts=clock.now, tier="host", block_hashes=fill))
    engine.apply_event(BlocksRemoved(ts=clock.now, tier="host", block_hashes=(1,)))
    return engine, policy, clock


def test_pressure_needs_working_set_occupancy_and_a_recent_eviction() -> None:
    engine, _, clock = pool_engine(100)
    snap = engine.snapshot()
    assert snap.write_filter.mode == "conditioned" and snap.write_filter.pressure
    assert snap.write_filter.max_new_blocks == 8 * 64  # kappa = 8 chunks of 1024 tokens
    clock.now += 61.0  # the eviction left the 60 s window
    assert not engine.snapshot().write_filter.pressure
    engine.apply_event(BlocksRemoved(ts=clock.now, tier="host", block_hashes=(2,)))
    assert engine.snapshot().write_filter.pressure
    # occupancy below theta
    engine.apply_event(
        BlocksRemoved(ts=clock.now, tier="host", block_hashes=tuple(range(10**6, 10**6 + 10)))
    )
    assert not engine.snapshot().write_filter.pressure


def test_no_pressure_when_the_tier_holds_the_working_set() -> None:
    engine, policy, _ = pool_engine(5000)
    assert policy.sizing().target_blocks < 5000
    assert not engine.snapshot().write_filter.pressure


def test_modes_and_the_per_request_decision() -> None:
    engine, _, _ = pool_engine(100, kappa_chunks=1)
    engine.snapshot()
    small, large = tuple(range(64)), tuple(range(65))
    assert engine.admit("r", small).block_hashes == small  # a small extension is kept
    declined = engine.admit("r", large)
    assert declined.block_hashes == () and declined.declined == large
    for mode, pressure in (("none", False), ("fixed", True)):
        engine, _, _ = pool_engine(5000, mode=mode)
        assert engine.snapshot().write_filter.pressure is pressure
    with pytest.raises(ValueError, match="valid modes"):
        EfficientAgent(mode="sometimes")  # type: ignore[arg-type]


def test_replay_filters_refills_under_pressure_and_not_on_a_large_tier() -> None:
    pool = make_workload("coding-pool", seed=1, tasks=8, max_prompt_tokens=16_000)
    small = SimConfig(concurrency=6, gpu_blocks=1536, host_blocks=2000)
    lru = simulate(pool, "lru", small)
    policy = EfficientAgent(kappa_chunks=1)
    ea = Simulator(pool, policy, small).run()
    assert ea.host_declined_blocks > 0
    assert ea.host_write_bytes < lru.host_write_bytes
    # the recommendation comes from the online estimate the policy fed from RequestStarted
    sizing = policy.sizing()
    assert policy.working_set.shards.prompts == pool.calls
    assert sizing.current_host_blocks == 2000 and sizing.gpu_blocks == 1536
    assert sizing.recommended_host_blocks == sizing.target_blocks > 2000
    large = SimConfig(concurrency=6, gpu_blocks=1536, host_blocks=sizing.target_blocks * 4)
    lru_large = simulate(pool, "lru", large)
    ea_large = simulate(pool, "efficientagent", large)
    assert ea_large.host_declined_blocks == 0  # the tier holds the working set: write all
    assert ea_large.host_hit_blocks == lru_large.host_hit_blocks
    fixed = simulate(
        pool, "efficientagent", large, policy_params={"mode": "fixed", "kappa_chunks": 1}
    )
    assert fixed.recomputed_tokens > ea_large.recomputed_tokens  # the fixed filter's blow-up
