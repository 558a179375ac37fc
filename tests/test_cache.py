"""The two-tier cache model: eviction queues, the GPU block pool, the host tier, vLLM's rules."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policyd.core.queues import EvictionQueue, KeyedQueue, LruQueue
from policyd.core.types import PolicySnapshot, ScoredBlocks
from policyd.policies import make_policy
from policyd.sim.cache import GpuTier, HostOrderQueue, HostTier
from policyd.sim.replay import SimConfig, Simulator
from policyd.tiers.host_order import HostOrder
from policyd.tiers.view import SnapshotView
from policyd.workloads.calls import Call, sequential

# ---- LruQueue ------------------------------------------------------------------------------------


def test_lru_queue_evicts_in_the_order_blocks_were_freed() -> None:
    q = LruQueue()
    q.push(3)
    q.push_many([1, 2])
    assert len(q) == 3 and 1 in q and 9 not in q
    assert q.peek() == 3
    assert q.pop_head() == 3
    assert q.pop_many(5) == [1, 2], "fewer than asked when the queue is shorter"
    assert q.pop_head() is None and q.peek() is None and q.pop_many(2) == []


def test_lru_queue_discard_removes_only_what_is_there() -> None:
    q = LruQueue()
    q.push_many([1, 2, 3, 4])
    q.discard(2)
    q.discard(99)
    q.discard_many([4, 98])
    assert list(q) == [1, 3]
    assert q.pop_many(1) == [1] and list(q) == [3]


def keyed(key: Callable[[int], Any]) -> KeyedQueue:
    """A KeyedQueue from a per-block key (the queue asks for keys in bulk)."""
    return KeyedQueue(lambda blocks: [key(b) for b in blocks])


QueueOp = tuple[str, int]
queue_ops = st.lists(
    st.tuples(
        st.sampled_from(["push", "push_many", "discard", "pop_head", "pop_many"]), st.integers(0, 9)
    ),
    max_size=40,
)


def run_reference(ops: Sequence[QueueOp]) -> list[object]:
    """A list-based LRU: the specification the queues are held to."""
    order: list[int] = []
    out: list[object] = []
    for op, x in ops:
        if op == "push" and x not in order:
            order.append(x)
        elif op == "push_many":
            order.extend(b for b in (x, x + 10) if b not in order)
        elif op == "discard" and x in order:
            order.remove(x)
        elif op == "pop_head":
            out.append(order.pop(0) if order else None)
        elif op == "pop_many":
            n = x % 4
            out.append(order[:n])
            del order[:n]
        out.append((list(order[:1]), len(order)))
    return out


def run_queue(q: LruQueue | KeyedQueue, ops: Sequence[QueueOp]) -> list[object]:
    out: list[object] = []
    for op, x in ops:
        if op == "push" and x not in q:  # blocks are pushed when freed: never while queued
            q.push(x)
        elif op == "push_many":
            q.push_many([b for b in (x, x + 10) if b not in q])
        elif op == "discard":
            q.discard(x)
        elif op == "pop_head":
            out.append(q.pop_head())
        elif op == "pop_many":
            out.append(q.pop_many(x % 4))
        head = q.peek()
        out.append(([] if head is None else [head], len(q)))
    return out


@settings(max_examples=200, deadline=None)
@given(ops=queue_ops)
def test_lru_queue_matches_a_reference_lru(ops: list[QueueOp]) -> None:
    assert run_queue(LruQueue(), ops) == run_reference(ops)


@settings(max_examples=200, deadline=None)
@given(ops=queue_ops)
def test_keyed_queue_with_equal_keys_is_an_lru(ops: list[QueueOp]) -> None:
    """Key ties break by recency, so one constant key makes a KeyedQueue an LRU."""
    assert run_queue(keyed(lambda b: 0), ops) == run_reference(ops)


# ---- KeyedQueue ----------------------------------------------------------------------------------


def test_keyed_queue_pops_the_smallest_key_first_ties_by_recency() -> None:
    keys = {1: 5.0, 2: 1.0, 3: 1.0, 4: 0.0}
    q = keyed(keys.__getitem__)
    q.push_many([1, 3, 2, 4])
    assert q.peek() == 4
    assert q.pop_many(3) == [4, 3, 2]
    assert q.pop_head() == 1 and q.pop_head() is None


def test_keyed_queue_discard_is_lazy_but_invisible() -> None:
    q = keyed(lambda b: b)
    q.push_many([1, 2, 3])
    q.discard(1)
    q.discard_many([2, 42])
    assert len(q) == 1 and 1 not in q
    assert q.peek() == 3 and q.pop_many(3) == [3]


def test_keyed_queue_push_again_takes_the_new_key() -> None:
    keys = {1: 0.0, 2: 1.0}
    q = keyed(keys.__getitem__)
    q.push_many([1, 2])
    q.discard(1)
    keys[1] = 9.0
    q.push(1)
    assert q.pop_many(2) == [2, 1]


def test_rekey_reevaluates_keys_and_keeps_recency_for_ties() -> None:
    """Scenario: blocks 30, 10, 20 are freed in that order with equal scores; a new snapshot
    raises 10's score. After ``rekey`` 10 goes last and 30 still precedes 20 (its tie), not
    block-id order."""
    scores = {30: 0.0, 10: 0.0, 20: 0.0}
    q = keyed(scores.__getitem__)
    q.push_many([30, 10, 20])
    scores[10] = 1.0
    assert q.peek() == 30, "keys are evaluated at push, not before rekey"
    q.rekey()
    assert len(q) == 3
    assert q.pop_many(3) == [30, 20, 10]


def test_rekey_drops_stale_heap_entries() -> None:
    q = keyed(lambda b: 0)
    q.push_many(list(range(10)))
    q.discard_many(list(range(0, 10, 2)))
    q.rekey()
    assert q.pop_many(10) == [1, 3, 5, 7, 9]
    assert q._heap == []


# ---- GpuTier -------------------------------------------------------------------------------------


def order(queue: EvictionQueue) -> list[int]:
    """An LRU queue's blocks, least recent first."""
    assert isinstance(queue, LruQueue)
    return list(queue)


def cached_request(gpu: GpuTier, blocks: list[int]) -> list[int]:
    """Run a request that computes ``blocks`` (no hit) and return what it held."""
    held: list[int] = []
    gpu.allocate(len(blocks))
    cached, _ = gpu.commit(blocks, held)
    assert cached == blocks
    return held


def test_release_frees_tail_first_so_the_deepest_block_is_evicted_first() -> None:
    gpu = GpuTier(4, LruQueue())
    held = cached_request(gpu, [1, 2, 3])
    assert gpu.free_blocks == 1 and len(gpu) == 3
    gpu.release(held, 0)
    assert order(gpu.queue) == [3, 2, 1]
    assert gpu.allocate(2) == [3], "the tail goes first; its parents stay"
    assert 1 in gpu and 2 in gpu and 3 not in gpu
    assert gpu.allocate(1) == [2]


def test_referenced_blocks_are_never_evicted() -> None:
    gpu = GpuTier(3, LruQueue())
    held = cached_request(gpu, [1, 2])
    gpu.release(held, 0)
    gpu.acquire([1])  # a new request hits block 1
    assert 1 not in gpu.queue and gpu.refs[1] == 1
    assert gpu.can_allocate(2) and not gpu.can_allocate(3)
    assert gpu.allocate(2) == [2]
    with pytest.raises(RuntimeError):
        gpu.allocate(1)
    assert 1 in gpu


def test_prefix_hits_stop_at_the_first_missing_block_and_at_the_limit() -> None:
    gpu = GpuTier(8, LruQueue())
    cached_request(gpu, [1, 2, 3, 5])
    assert gpu.prefix_hits([1, 2, 3, 4, 5], 5) == 3
    assert gpu.prefix_hits([1, 2, 3], 2) == 2
    assert gpu.prefix_hits([9, 1], 2) == 0


def test_shared_space_keeps_one_copy_of_a_block_computed_twice() -> None:
    gpu = GpuTier(6, LruQueue())
    held_a = cached_request(gpu, [1, 2])
    held_b: list[int] = []
    gpu.allocate(2)
    cached, evicted = gpu.commit([1, 3], held_b)
    assert cached == [3] and evicted == [] and held_b == [3]
    assert gpu.scratch_blocks == 1, "the second copy of 1 stays its request's scratch"
    assert gpu.refs[1] == 1
    gpu.release(held_a, 0)
    gpu.release(held_b, 1)
    assert gpu.scratch_blocks == 0 and gpu.free_blocks == 3
    assert sorted(order(gpu.queue)) == [1, 2, 3]


def test_separate_space_inserts_evicting_or_stops_at_the_first_block_it_cannot_cache() -> None:
    gpu = GpuTier(2, LruQueue(), running_space="separate")
    held: list[int] = []
    cached, evicted = gpu.commit([1, 2, 3], held)
    assert (cached, evicted) == ([1, 2], []), "no unreferenced block to evict for 3"
    gpu.release(held, 0)
    cached, evicted = gpu.commit([7, 8], [])
    assert (cached, evicted) == ([7, 8], [2, 1])


def test_separate_space_oracle_may_bypass_and_then_caches_nothing_deeper() -> None:
    gpu = GpuTier(1, LruQueue(), running_space="separate", admits=lambda block, victim: block == 5)
    held: list[int] = []
    gpu.commit([1], held)
    gpu.release(held, 0)
    cached, evicted = gpu.commit([4, 5], [])
    assert (cached, evicted) == ([], []), "4 is bypassed, and 5 cannot follow a missing parent"
    cached, evicted = gpu.commit([5], [])
    assert (cached, evicted) == ([5], [1])


def test_prefetched_blocks_only_take_free_space() -> None:
    gpu = GpuTier(3, LruQueue())
    cached_request(gpu, [1])
    assert gpu.insert_unreferenced([1, 2, 3, 4]) == [2, 3]
    assert gpu.free_blocks == 0 and gpu.refs[2] == 0 and 2 in gpu.queue


def test_negative_capacities_are_refused() -> None:
    with pytest.raises(ValueError):
        GpuTier(-1, LruQueue())
    with pytest.raises(ValueError):
        HostTier(-1, LruQueue())


# ---- HostTier ------------------------------------------------------------------------------------


def host_with(capacity: int, blocks: list[int]) -> HostTier:
    host = HostTier(capacity, LruQueue())
    assert host.store(blocks) == (blocks, [])
    return host


def test_host_store_evicts_least_recent_and_skips_resident_blocks() -> None:
    host = host_with(4, [1, 2, 3])
    assert host.store([3, 4, 5]) == ([4, 5], [1])
    assert order(host.queue) == [2, 3, 4, 5]
    host.touch([2])
    assert host.store([6]) == ([6], [3])


def test_host_store_is_all_or_nothing_without_admits() -> None:
    """Scenario: vLLM's ``prepare_store``. A full 4-block host tier holds block 9 and the
    request's own blocks 1-3 (protected). Storing two more blocks needs two evictions but only
    9 may go: nothing is stored and nothing is evicted. Storing one more evicts 9."""
    host = host_with(4, [9, 1, 2, 3])
    before = order(host.queue)
    assert host.store([4, 5], protected=[1, 2, 3]) == ([], [])
    assert order(host.queue) == before
    assert host.store([4], protected=[1, 2, 3]) == ([4], [9])


def test_host_store_never_evicts_protected_keys() -> None:
    host = host_with(3, [1, 2, 3])
    stored, evicted = host.store([4], protected=[1])
    assert (stored, evicted) == ([4], [2])
    assert 1 in host and 3 in host and 4 in host


def test_the_simulated_host_tier_changes_the_connectors_order_as_vllm_does() -> None:
    """Under the connector's order (``HostOrderQueue``) the simulated host tier makes the calls
    vLLM's manager makes on the connector's ``CachePolicy`` (connector/vllm_adapter.py): a
    store inserts its new keys and marks them evictable when it completes, a load holds its
    keys and lets them go (a new place in the order), a finished request's keys are touched in
    place. The places decide which keys a budgeted re-keying walk reaches first, so the order
    must match while a walk is under way too (a touch that removed and re-inserted its keys
    gave them new places)."""
    rng = random.Random(5)
    queue = HostOrderQueue()
    sim = HostTier(48, queue)
    ref: HostOrder[int] = HostOrder(int)  # driven as vLLM's manager drives the connector's
    for _ in range(600):
        resident = list(ref)
        op = rng.random()
        if op < 0.3:
            blocks = rng.sample(range(120), rng.randint(1, 12))
            stored, evicted = sim.store(blocks, protected=blocks)
            new = [b for b in blocks if b not in ref]
            surplus = len(ref) + len(new) - 48
            victims = ref.evict(surplus, {b for b in blocks if b in ref}) if surplus > 0 else []
            if victims is None:  # vLLM's prepare_store stores nothing
                assert (stored, evicted) == ([], [])
                continue
            assert (stored, evicted) == (new, victims)
            for block in new:  # prepare_store inserts, complete_store marks evictable
                ref.insert(block, evictable=False)
            for block in new:
                ref.mark_evictable(block)
        elif op < 0.55 and resident:
            used = rng.sample(resident, rng.randint(1, min(10, len(resident))))
            sim.touch(reversed(used))  # the simulator re-ranks a request's keys tail first
            ref.touch(used)
        elif op < 0.7 and resident:
            loaded = rng.sample(resident, rng.randint(1, min(6, len(resident))))
            sim.loaded(loaded)
            for block in loaded:  # prepare_load, then complete_load
                ref.mark_non_evictable(block)
            for block in loaded:
                ref.mark_evictable(block)
        elif op < 0.8:
            scored = ScoredBlocks(float(rng.randint(-2, 2)), tuple(rng.sample(range(120), 30)))
            view = SnapshotView.of(
                PolicySnapshot(version=1, ts=0.0, ttl_s=5.0, policy="agentkv", scores=(scored,))
            )
            retired = frozenset(rng.sample(range(120), 5))
            queue.order.set_view(view, retired)
            ref.set_view(view, retired)
        else:
            units = rng.randint(0, 4)
            queue.order.rekey(units)
            ref.rekey(units)
        assert queue.order.peek_order() == ref.peek_order()


def test_host_store_larger_than_the_tier_stores_nothing() -> None:
    host = HostTier(2, LruQueue())
    assert host.store([1, 2, 3]) == ([], [])
    assert len(host) == 0
    assert HostTier(0, LruQueue()).store([1]) == ([], [])


def test_host_store_with_an_oracle_decides_block_by_block() -> None:
    host = HostTier(2, LruQueue(), admits=lambda block, victim: block != 5)
    host.store([1, 2])
    stored, evicted = host.store([5, 6], protected=[])
    assert (stored, evicted) == ([6], [1])
    stored, evicted = host.store([7], protected=[2])
    assert (stored, evicted) == ([], []), "the victim would be protected: bypass"


def test_host_prefix_hits_count_the_run_after_the_gpu_prefix() -> None:
    host = host_with(8, [2, 3, 5])
    assert host.prefix_hits([1, 2, 3, 4, 5], 1, 5) == 2
    assert host.prefix_hits([1, 2, 3], 1, 2) == 1
    assert host.prefix_hits([1, 2], 0, 2) == 0


def test_host_clear_drops_everything_in_eviction_order() -> None:
    host = host_with(4, [1, 2, 3])
    assert host.clear() == [1, 2, 3] and len(host) == 0


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(0, 6),
    stores=st.lists(
        st.tuples(st.lists(st.integers(0, 9), max_size=5), st.sets(st.integers(0, 9))),
        max_size=12,
    ),
)
def test_host_store_invariants(capacity: int, stores: list[tuple[list[int], set[int]]]) -> None:
    host = HostTier(capacity, LruQueue())
    for blocks, protected in stores:
        before = set(order(host.queue))
        new = [b for b in dict.fromkeys(blocks) if b not in before]
        stored, evicted = host.store(blocks, protected=protected)
        after = set(order(host.queue))
        assert stored in ([], new) if capacity else stored == []
        assert set(evicted) <= before and not set(evicted) & protected
        assert after == (before - set(evicted)) | set(stored)
        assert len(after) <= capacity
        if not stored:
            assert evicted == []


# ---- vLLM's last-token rule, end to end ----------------------------------------------------------


def repeated_prompt_hits(k: int, prompt_tokens: int, recompute_last_token: bool) -> list[int]:
    blocks = tuple(range(100, 100 + k))
    call = Call(workflow_id="w", agent="a", block_hashes=blocks, prompt_tokens=prompt_tokens)
    config = SimConfig(
        concurrency=1,
        gpu_blocks=4 * k + 4,
        host_blocks=0,
        recompute_last_token=recompute_last_token,
        record_requests=True,
    )
    report = Simulator(sequential([call, call]), make_policy("lru"), config).run()
    return [r.gpu_hit_blocks for r in report.records]


@pytest.mark.parametrize("k", [1, 2, 5])
def test_a_fully_cached_prompt_recomputes_its_last_block(k: int) -> None:
    """vLLM always computes the last prompt token: a cached prompt of k*16 tokens gets k-1
    GPU hits; one token more (a partial block) and all k full blocks hit."""
    assert repeated_prompt_hits(k, 16 * k, recompute_last_token=True) == [0, k - 1]
    assert repeated_prompt_hits(k, 16 * k + 1, recompute_last_token=True) == [0, k]


@pytest.mark.parametrize("k", [1, 2, 5])
def test_without_the_last_token_rule_the_whole_prompt_hits(k: int) -> None:
    assert repeated_prompt_hits(k, 16 * k, recompute_last_token=False) == [0, k]
