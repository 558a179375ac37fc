"""The virtual-tier referee: its tiers against the simulator's, and its judgement."""

from __future__ import annotations

from typing import ClassVar

import pytest

from policyd.core.engine import EngineState
from policyd.core.types import BlocksStored, Event, RequestFinished, RequestStarted
from policyd.policies.agentkv import AgentKV
from policyd.policies.lru import LRU
from policyd.policies.virtual import VirtualReferee, VirtualTier
from policyd.sim.replay import SimConfig, Simulator
from policyd.workloads import make_workload


class WatchedLRU(LRU):
    """vLLM's LRU, with a virtual tier of the same size fed the events it sees."""

    name: ClassVar[str] = "watched-lru"

    def __init__(self, gpu_blocks: int) -> None:
        self.virtual = VirtualReferee(("lru",), capacity_blocks=gpu_blocks, window=1 << 30)
        self.hit_blocks = 0

    def observe(self, event: Event, state: EngineState) -> None:
        virtual = self.virtual
        if isinstance(event, RequestStarted):
            virtual.started(event.request_id, event.block_hashes)
            if event.block_hashes:
                self.hit_blocks += virtual._samples[-1][1][0]
        elif isinstance(event, BlocksStored) and event.tier == "gpu" and event.request_id:
            virtual.stored(event.request_id, event.block_hashes)
        elif isinstance(event, RequestFinished):
            virtual.finished(event.request_id, event.output_tokens)


@pytest.mark.parametrize("workload", ["code-writing", "financial"])
def test_a_virtual_tier_with_no_scores_is_the_simulators_lru_tier(workload: str) -> None:
    """Differential: with every score equal the virtual tier is vLLM's LRU (ties by recency,
    freed tail first); fed the simulator's events it hits what the simulator's GPU tier hit.
    Not to the block: the simulator reserves each request's exact output, the virtual tier a
    moving average of the outputs seen, and caps a fully cached prompt's hit one block short."""
    work = make_workload(workload, seed=1, workflows=24)
    config = SimConfig(concurrency=12, gpu_blocks=3000, host_blocks=0)
    policy = WatchedLRU(3000)
    report = Simulator(work, policy, config).run()
    assert report.gpu_evicted_blocks > 0  # contended: the order matters
    assert report.gpu_hit_blocks > 0
    assert policy.hit_blocks == pytest.approx(report.gpu_hit_blocks, rel=0.02)


def test_a_request_hits_the_leading_run_and_its_blocks_are_pinned_while_it_runs() -> None:
    tier = VirtualTier(4)
    assert tier.reference((1, 2, 3)) == 0
    tier.release((1, 2, 3))
    assert tier.reference((1, 9, 3)) == 1  # 3 is held, but after a miss: no prefix hit
    # two over: only 2 is not pinned, so it goes and the tier overflows while 1, 9, 3 run
    assert tier.reference((5, 6)) == 0
    assert 2 not in tier and len(tier) == 5
    tier.release((1, 9, 3))  # freed tail first: 3 is the oldest of them
    assert 3 not in tier and 1 in tier and 9 in tier and len(tier) == 4


def test_a_finished_request_is_freed_tail_first_and_evicted_by_score() -> None:
    tier = VirtualTier(3)
    tier.reference((1, 2, 3))
    tier.release((1, 2, 3))
    tier.reference((4,))
    assert 3 not in tier and 1 in tier and 2 in tier  # the deepest block went first
    tier.rescore({1: 1.0})
    tier.reference((5,))
    assert 2 not in tier and 1 in tier  # scored above the tie, 1 outlives 2


def test_the_referee_prefers_the_ranking_whose_tier_hit_more() -> None:
    referee = VirtualReferee(("steps", "lookahead"), capacity_blocks=3, min_samples=4)
    for rid, blocks in (("a", (1, 2)), ("b", (3,))):
        referee.started(rid, blocks)
        referee.finished(rid)
    referee.rescore("lookahead", {1: 1.0, 2: 1.0})
    referee.started("c", (4,))  # one block must go: steps drops 2 (oldest), lookahead 3
    referee.finished("c")
    assert referee.best() == "steps"  # three requests judged: too few, the first ranking
    referee.started("d", (1, 2))
    assert referee.hit_rates() == pytest.approx({"steps": 1 / 6, "lookahead": 2 / 6})
    assert referee.best() == "lookahead"


def test_an_equal_judgement_keeps_the_first_ranking_and_a_lost_finish_is_bounded() -> None:
    referee = VirtualReferee(("steps", "both"), capacity_blocks=8, min_samples=0, max_running=2)
    for rid in "abc":  # never finished
        referee.started(rid, (ord(rid),))
    assert referee.best() == "steps"
    assert len(referee._running) == 2  # "a" was let go: its block is cached, not pinned
    assert all(ord("a") not in tier.pinned for tier in referee.tiers.values())
    with pytest.raises(ValueError, match="capacity_blocks"):
        VirtualReferee(("steps",), capacity_blocks=0)


def test_agentkv_judges_by_virtual_tiers_when_asked_and_it_knows_the_gpu_tier() -> None:
    assert AgentKV(gpu_blocks=1000).virtual is None  # the default judges by marks
    assert AgentKV(referee="virtual").virtual is None  # no GPU size given: marks
    policy = AgentKV(gpu_blocks=1000, referee="virtual")
    assert policy.virtual is not None
    policy.configure_tiers(gpu_blocks=2000, host_blocks=0)
    assert all(t.capacity_blocks == 2000 for t in policy.virtual.tiers.values())
    with pytest.raises(ValueError, match="valid referees: marks, virtual"):
        AgentKV(referee="nope")
