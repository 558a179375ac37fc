"""GpuTier against vLLM 0.32's real ``BlockPool`` (no engine): pins are capped and released,
a retired workflow's free blocks lose their hash and are reused first, held blocks are never
touched, and a stale snapshot undoes every pin."""

from __future__ import annotations

from typing import Any

import pytest

from connector.runtime import ConnectorRuntime
from policyd.core.types import Event, PolicySnapshot

pytestmark = pytest.mark.vllm

GROUP = 0


class Sink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def send_many(self, events: Any) -> int:
        self.events.extend(events)
        return len(events)


def digest(i: int) -> bytes:
    return i.to_bytes(8, "big") + bytes(24)


def setup(n_blocks: int = 12) -> tuple[Any, Any, ConnectorRuntime, list[PolicySnapshot | None]]:
    from vllm.v1.core.block_pool import BlockPool  # noqa: PLC0415
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: PLC0415

    from connector.vllm_adapter import GpuTier  # noqa: PLC0415

    pool = BlockPool(num_gpu_blocks=n_blocks, enable_caching=True, hash_block_size=32)
    current: list[PolicySnapshot | None] = [None]
    rt = ConnectorRuntime(Sink(), lambda: current[0], tokens_per_block=32)
    tier = GpuTier(pool, [GROUP], max_pinned_blocks=2, max_ranked_blocks=0)
    # blocks 1..8 cached with hashes 1..8; 1..4 belong to "old", 5..8 to "live"; all free
    blocks = pool.get_new_blocks(8)
    for i, block in enumerate(blocks, start=1):
        pool._insert_block_hash(make_block_hash_with_group_id(digest(i), GROUP), block, 32)
        tier.remember([digest(i)], [i])
    rt.request_started(
        "r-old", {"workflow_id": "old"}, None, [digest(i) for i in (1, 2, 3, 4)], 128
    )
    rt.request_started(
        "r-live", {"workflow_id": "live"}, None, [digest(i) for i in range(5, 9)], 128
    )
    blocks[7].ref_cnt += 1  # block 8 stays held by a running request
    pool.free_blocks(reversed(blocks))  # free them as vLLM does: tail first
    return pool, tier, rt, current


def run_plan(tier: Any, rt: ConnectorRuntime) -> list[int]:
    """Prefix lookups, a scheduler step each, until the plan is done (the adopting step does no
    plan work); the blocks it evicted."""
    evicted = list(tier.apply(rt))
    while tier.budget.busy:
        tier.close_step()
        evicted += tier.apply(rt)
    tier.close_step()
    return evicted


def snap(version: int, **kw: Any) -> PolicySnapshot:
    return PolicySnapshot(version=version, ts=0.0, ttl_s=60.0, policy="t", **kw)


def test_pins_are_capped_and_released_when_the_snapshot_goes_stale() -> None:
    pool, tier, rt, current = setup()
    free_before = pool.get_num_free_blocks()
    current[0] = snap(1, pin=(5, 6, 7))
    run_plan(tier, rt)
    assert sorted(tier.pinned) == [5, 6]  # capped at 2
    assert pool.get_num_free_blocks() == free_before - 2
    assert all(b.ref_cnt == 1 for blocks in tier.pinned.values() for b in blocks)
    assert tier.apply(rt) == [] and sorted(tier.pinned) == [5, 6]  # same view: nothing redone
    tier.close_step()
    current[0] = None  # stale: the next step's first lookup adopts that
    run_plan(tier, rt)
    assert tier.pinned == {}
    assert pool.get_num_free_blocks() == free_before


def test_retired_free_blocks_lose_their_hash_and_are_reused_first() -> None:
    pool, tier, rt, current = setup()
    current[0] = snap(1, retired_workflows=("old",))
    evicted = run_plan(tier, rt)
    assert sorted(evicted) == [1, 2, 3, 4]
    for i in (1, 2, 3, 4):
        assert tier.cached(i) == []  # no longer a prefix-cache hit
    for i in (5, 6, 7, 8):
        assert tier.cached(i)  # the live workflow keeps its blocks
    reused = pool.get_new_blocks(4)
    assert {b.block_id for b in reused} == {1, 2, 3, 4}  # the retired slots go first


def test_held_blocks_are_never_evicted() -> None:
    _, tier, rt, current = setup()
    rt.request_started("r2", {"workflow_id": "gone"}, None, [digest(8)], 32)
    current[0] = snap(1, retired_workflows=("gone", "live"))
    evicted = run_plan(tier, rt)
    assert 8 not in evicted  # block 8 is held (ref_cnt 1)
    assert tier.cached(8)
    assert sorted(evicted) == [5, 6, 7]


def test_recent_digests_keep_the_newest_half_at_least_and_never_more_than_capacity() -> None:
    from connector.vllm_adapter import _RecentDigests  # noqa: PLC0415

    recent = _RecentDigests(capacity=8)
    for i in range(100):
        recent.update([i], [digest(i)])
        assert len(recent) <= 8
        assert all(recent.get(j) == digest(j) for j in range(max(i - 3, 0), i + 1))
    assert recent.get(0) is None
    recent.update([5, 6], [digest(5), digest(6)])  # named again: newest again
    assert recent.get(5) == digest(5)


def test_a_step_past_its_deadline_does_no_plan_work_and_the_next_step_resumes() -> None:
    """The connector's deadline on the real pool: a step whose time is spent moves nothing
    (nor do later lookups in it); the next step resumes, and the plan lands whole."""
    _pool, tier, rt, current = setup()
    current[0] = snap(1, retired_workflows=("old",))
    tier.adopt(rt)
    evicted = tier.plan(rt, over=lambda: True)
    assert evicted == [] and tier.applier.counters.ops == 0
    assert tier.budget.spent and tier.budget.cut_steps == 1
    assert tier.plan(rt, over=lambda: False) == []  # the same step: nothing more
    while tier.budget.busy:
        tier.close_step()
        evicted += tier.plan(rt, over=lambda: False)
    assert sorted(evicted) == [1, 2, 3, 4]  # the retired workflow's free blocks, all of them
    assert all(tier.cached(b) == [] for b in (1, 2, 3, 4))
