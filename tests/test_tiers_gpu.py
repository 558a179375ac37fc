"""``policyd.tiers.gpu.GpuApplier`` on the simulator's GPU tier: retire, rank and pin as moves
in vLLM's free-queue order, bounded work per step, and a stale view that undoes every pin.
(The same plan on vLLM's real ``BlockPool``: tests/vllm/test_pool_differential.py.)"""

from __future__ import annotations

import pytest

from policyd.core.queues import LruQueue
from policyd.core.types import PolicySnapshot, ScoredBlocks, WriteFilter
from policyd.sim.cache import GpuTier
from policyd.tiers.budget import ADOPT_COST_OPS, BATCH_OPS, STARVED_STEPS, StepBudget
from policyd.tiers.gpu import GpuApplier
from policyd.tiers.host_order import HostOrder
from policyd.tiers.view import Ownership, Retirement, SnapshotView


def pool_with_free(blocks: list[int], capacity: int = 16) -> GpuTier:
    """A GPU tier whose free queue holds ``blocks`` cached, first victim first."""
    gpu = GpuTier(capacity, LruQueue())
    held: list[int] = []
    gpu.allocate(len(blocks))
    gpu.commit(blocks, held)
    gpu.release(list(reversed(held)), 0)  # freed tail first: ``blocks[0]`` is evicted first
    return gpu


def view(scores: dict[int, float], pin: tuple[int, ...] = (), default: float = 0.0) -> SnapshotView:
    groups = tuple(ScoredBlocks(s, (b,)) for b, s in scores.items())
    snap = PolicySnapshot(
        version=1, ts=0.0, ttl_s=60.0, policy="t", scores=groups, pin=pin, default_score=default
    )
    return SnapshotView.of(snap)


def retiring(*workflows: str) -> SnapshotView:
    snap = PolicySnapshot(version=1, ts=0.0, ttl_s=60.0, policy="t", retired_workflows=workflows)
    return SnapshotView.of(snap)


def order(gpu: GpuTier) -> list[int]:
    assert isinstance(gpu.queue, LruQueue)
    return list(gpu.queue)


def test_ranked_blocks_go_behind_the_unranked_in_ascending_score() -> None:
    gpu = pool_with_free([1, 2, 3, 4, 5, 6])
    applier = GpuApplier(gpu, max_ranked_blocks=8)
    # 1 and 5 ranked above the default, 3 below it (keeps its place), the rest unnamed
    applier.adopt(view({1: 2.0, 5: 1.0, 3: -1.0}), frozenset())
    assert applier.step() == []
    assert order(gpu) == [2, 3, 4, 6, 5, 1]


def test_the_rank_cap_keeps_the_highest() -> None:
    gpu = pool_with_free([1, 2, 3, 4])
    applier = GpuApplier(gpu, max_ranked_blocks=1)
    applier.adopt(view({1: 2.0, 2: 3.0}), frozenset())
    applier.step()
    assert order(gpu) == [1, 3, 4, 2]


def test_retired_free_blocks_are_evicted_and_their_slots_reused_first() -> None:
    gpu = pool_with_free([1, 2, 3, 4], capacity=4)
    applier = GpuApplier(gpu)
    gpu.acquire([4])  # a running request holds 4
    applier.adopt(view({}), frozenset({3, 4}))
    assert applier.step() == [3]  # the held block stays
    assert 3 not in gpu and 4 in gpu and gpu.free_blocks == 1
    assert gpu.allocate(1) == []  # the retired slot, not block 1
    assert order(gpu) == [1, 2]


def test_pins_follow_the_snapshot_list_then_the_ranking_capped_and_a_stale_view_frees_them() -> (
    None
):
    gpu = pool_with_free([1, 2, 3, 4, 5])
    applier = GpuApplier(gpu, max_pinned_blocks=2, max_ranked_blocks=0)
    applier.adopt(view({4: 9.0, 5: 1.0}, pin=(2,)), frozenset())
    applier.step()
    assert sorted(applier.pinned) == [2, 4]
    assert gpu.refs[2] == gpu.refs[4] == 1 and order(gpu) == [1, 3, 5]
    applier.adopt(None, frozenset())  # stale: every pin released, to the tail
    applier.step()
    assert applier.pinned == {} and order(gpu) == [1, 3, 5, 2, 4]


def test_a_plan_runs_in_budgeted_steps_and_an_unchanged_view_costs_nothing() -> None:
    gpu = pool_with_free(list(range(1, 11)))
    applier = GpuApplier(gpu, max_ranked_blocks=10)
    applier.adopt(view({b: float(b) for b in range(1, 11)}), frozenset({1, 2}))
    per_step = []
    while applier.busy:
        before = applier.counters.ops
        applier.step(3)
        per_step.append(applier.counters.ops - before)
    # 2 retire, then 8 rank (the view lists its ranking ready-made): at most 3 a step
    assert per_step == [3, 3, 3, 1]
    assert order(gpu) == list(range(3, 11))
    ops = applier.counters.ops
    assert applier.step(3) == [] and applier.counters.ops == ops


def test_a_new_view_supersedes_an_unfinished_plan() -> None:
    gpu = pool_with_free([1, 2, 3, 4])
    applier = GpuApplier(gpu, max_ranked_blocks=4)
    applier.adopt(view({1: 1.0, 2: 2.0}), frozenset())
    applier.step(1)  # ascending: 1 goes to the tail first
    applier.adopt(view({}), frozenset())  # nothing ranked: 2 stays where it is
    applier.step()
    assert not applier.busy
    assert order(gpu) == [2, 3, 4, 1]


def test_negative_caps_are_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        GpuApplier(GpuTier(4, LruQueue()), max_pinned_blocks=-1)


def test_the_retire_rule_spares_the_prefix_hit_of_the_request_being_looked_up() -> None:
    gpu = pool_with_free([1, 2, 3], capacity=3)
    applier = GpuApplier(gpu)
    applier.adopt(view({}), frozenset({1, 2, 3}))
    # vLLM has counted blocks 1 and 2 as the request's hit before the connector is asked
    assert applier.step(hit=frozenset({1, 2})) == [3]
    assert 1 in gpu and 2 in gpu and 3 not in gpu


def test_a_block_no_longer_retired_when_its_turn_comes_is_kept() -> None:
    gpu = pool_with_free([1, 2, 3], capacity=3)
    applier = GpuApplier(gpu)
    retired = {1, 2, 3}  # a live set, as Ownership keeps it
    applier.adopt(view({}), retired)
    assert applier.step(1) == [1]
    retired.discard(2)  # a new request of a live workflow uses block 2
    assert applier.step() == [3]
    assert 2 in gpu


def test_a_plan_walks_only_newly_retired_blocks_and_retries_those_a_request_held() -> None:
    gpu = pool_with_free([1, 2, 3, 4], capacity=4)
    applier = GpuApplier(gpu)
    own = Ownership()
    own.record("done", [1, 2])
    own.record("live", [3, 4])
    gpu.acquire([2])  # a running request holds 2
    applier.adopt(retiring("done"), own.retire(frozenset({"done"})))
    assert applier.step() == [1]  # 2 is held: kept for the next plan
    gpu.release([2], 0)
    applier.adopt(retiring("done"), own.retire(frozenset({"done"})))
    ops = applier.counters.ops
    assert applier.step() == [2]  # 1 is not walked again
    applier.adopt(retiring("done", "live"), own.retire(frozenset({"done", "live"})))
    assert sorted(applier.step()) == [3, 4]
    assert applier.counters.ops - ops < 8


def test_the_retired_set_is_recounted_under_the_step_budget() -> None:
    own = Ownership()
    own.record("done", list(range(100, 140)))  # 40 blocks: 10 recount units of 4
    gpu = pool_with_free([], capacity=4)
    applier = GpuApplier(gpu)
    settled: list[int] = []
    applier.adopt(
        retiring("done"), own.retire(frozenset({"done"})), on_settled=lambda: settled.append(1)
    )
    applier.step(5)
    assert not settled and 0 < len(own.dead) < 40  # part of the way, within the budget
    while applier.busy:
        applier.step(5)
    assert settled == [1] and set(own.dead) == set(range(100, 140))


def test_one_step_budget_is_shared_by_the_gpu_plan_and_the_host_rekeying() -> None:
    gpu = pool_with_free(list(range(1, 11)))
    applier = GpuApplier(gpu, max_ranked_blocks=10)
    host: HostOrder[int] = HostOrder(int)
    for key in range(100, 140):  # 40 keys: a walk of 10 units
        host.insert(key, evictable=True)
    budget = StepBudget(applier, host, ops_per_step=8)
    applier.adopt(view({b: float(b) for b in range(1, 11)}), frozenset())
    host.set_view(view({}))
    budget.run()
    assert applier.counters.ops == 4 and budget.left == 0  # half to the walk, then the plan
    budget.run()
    assert applier.counters.ops == 4  # nothing left in this step
    spent = []
    while budget.busy:
        budget.new_step()
        ops = applier.counters.ops
        budget.run()
        spent.append(applier.counters.ops - ops)
    assert spent[:2] == [4, 2] and sum(spent) == 6  # the plan's 10 moves, then the walk alone
    assert not host.rekeying and applier.counters.ranked_blocks == 10


def test_the_host_order_takes_a_view_that_orders_it_once_recounted_and_lru_at_once() -> None:
    """A view that orders the host tier waits for the retired set's recount; one that does not
    (vLLM's default, a write filter alone) is taken at once, however long the recount it starts
    (un-retiring a workflow of many blocks) takes: a guard's switch away from the learned order
    makes the host tier vLLM's LRU from the adopting step on."""
    own = Ownership()
    own.record("done", list(range(100, 500)))  # 400 blocks: 100 recount units
    gpu = pool_with_free([], capacity=4)
    applier = GpuApplier(gpu)
    host: HostOrder[int] = HostOrder(int)
    for key in range(100, 110):
        host.insert(key, evictable=True)
    budget = StepBudget(applier, host, ops_per_step=12)
    learned = SnapshotView.of(
        PolicySnapshot(
            version=1, ts=0.0, ttl_s=60.0, policy="t", retired_workflows=("done",),
            host_scores=(ScoredBlocks(1.0, (100,)),),
        )
    )  # fmt: skip
    budget.adopt(learned, own.retire(frozenset({"done"})))
    budget.run()
    assert host.view is None  # still recounting: the order waits for a settled retired set
    while applier.busy:
        budget.new_step()
        budget.run()
    assert host.view is learned and host.peek_order()[0] == 101  # all retired; 100 scored last
    filtered = SnapshotView.of(
        PolicySnapshot(version=2, ts=0.0, ttl_s=60.0, policy="t", write_filter=WriteFilter("fixed"))
    )
    budget.new_step()
    budget.adopt(filtered, own.retire(frozenset()))  # un-retires 400 blocks: many steps
    assert host.view is filtered and host.evict(1) == [100]  # LRU at once
    budget.run()
    assert applier.busy and len(own.dead) > 0  # the recount goes on under the budget


def test_the_step_that_adopts_a_snapshot_pays_for_it_from_its_budget() -> None:
    gpu = pool_with_free([1, 2, 3, 4, 5, 6])
    applier = GpuApplier(gpu, max_ranked_blocks=6)
    budget = StepBudget(applier, None, ops_per_step=ADOPT_COST_OPS + 2)
    budget.adopt(view({b: float(b) for b in range(1, 7)}), Retirement.settled(frozenset()))
    budget.run()
    assert applier.counters.ops == 2 and budget.left == 0  # the rest went to the adoption
    budget.new_step()
    budget.run()
    assert applier.counters.ops == 6 and not budget.busy  # the other 4 moves, the next step


def test_a_deadline_stops_the_step_between_batches_and_the_work_waits_for_the_next_step() -> None:
    """The connector's deadline: looked at before every batch of ``BATCH_OPS``; once it says the
    step's time is spent the step does no more (later lookups included), and the next step goes
    on where it stopped, so the plan lands whole, only later, in the same final order."""
    blocks = list(range(1, 11))
    scores = {b: float(11 - b) for b in blocks}
    free_run = pool_with_free(blocks)
    unhurried = GpuApplier(free_run, max_ranked_blocks=10)
    unhurried.adopt(view(scores), frozenset())
    unhurried.step(None)

    gpu = pool_with_free(blocks)
    applier = GpuApplier(gpu, max_ranked_blocks=10)
    budget = StepBudget(applier, None, ops_per_step=12)
    budget.adopt(view(scores), Retirement.settled(frozenset()))
    budget.left = 12 + ADOPT_COST_OPS  # this test is about the deadline, not the adoption charge
    looks: list[int] = []

    def over() -> bool:
        looks.append(applier.counters.ops)
        return len(looks) > 2  # time for two batches

    budget.run(over=over)
    assert applier.counters.ops == 2 * BATCH_OPS and budget.cut_steps == 1
    budget.run(over=lambda: False)  # a later lookup in the same step: nothing more
    assert applier.counters.ops == 2 * BATCH_OPS
    steps = 1
    while budget.busy:
        budget.new_step()
        budget.run(over=lambda: False)
        steps += 1
    assert steps == 2 and applier.counters.ops == unhurried.counters.ops
    assert order(gpu) == order(free_run)  # the same moves, one step later


def test_steps_that_are_always_past_the_deadline_still_move_the_plan() -> None:
    """A step cut before any work is starved; after ``STARVED_STEPS`` of them in a row the next
    step's first batch runs regardless of the deadline, so the plan cannot stall for good."""
    gpu = pool_with_free(list(range(1, 11)))
    applier = GpuApplier(gpu, max_ranked_blocks=10)
    budget = StepBudget(applier, None, ops_per_step=12)
    applier.adopt(view({b: float(b) for b in range(1, 11)}), frozenset())
    done = []
    for _ in range(3 * (STARVED_STEPS + 1)):
        budget.new_step()
        budget.run(over=lambda: True)
        done.append(applier.counters.ops)
    per_step = [b - a for a, b in zip([0, *done], done, strict=False)]
    assert per_step == ([0] * STARVED_STEPS + [BATCH_OPS]) * 3
