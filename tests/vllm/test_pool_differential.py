"""One decision path, checked: the same call sequence on the simulator's GPU tier and on vLLM
0.32's real ``BlockPool``, with the same ``GpuApplier`` applying the same snapshots, gives the
same evictions, the same free-queue order and the same pins (no engine; seeded random
sequences of requests started and finished and snapshots applied, whole or in budgeted steps).

The driver does on vLLM's pool what vLLM's KV cache manager does for a request: touch the
prefix hit, take new blocks from the free queue (evicting cached ones from its head), cache the
new full blocks, and free everything tail first when the request ends. A block already cached
under the same hash stays uncached scratch, as the simulator models it (stated in sim/cache.py).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from policyd.core.queues import LruQueue
from policyd.core.types import PolicySnapshot, ScoredBlocks
from policyd.sim.cache import GpuTier
from policyd.tiers.gpu import GpuApplier
from policyd.tiers.view import SnapshotView

pytestmark = pytest.mark.vllm

GROUP = 0
TOKENS = 16


def digest(block: int) -> bytes:
    return block.to_bytes(8, "big") + bytes(24)


class VllmSide:
    """vLLM's ``BlockPool`` (one null block more: vLLM reserves block 0) and the connector's
    ``VllmPool`` over it."""

    def __init__(self, capacity: int, max_pinned: int, max_ranked: int) -> None:
        from vllm.v1.core.block_pool import BlockPool  # noqa: PLC0415
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: PLC0415

        from connector.vllm_adapter import VllmPool  # noqa: PLC0415

        self.key = make_block_hash_with_group_id
        self.pool = BlockPool(
            num_gpu_blocks=capacity + 1, enable_caching=True, hash_block_size=TOKENS
        )
        self.ops = VllmPool(self.pool, [GROUP])
        self.applier: GpuApplier[Any] = GpuApplier(
            self.ops, max_pinned_blocks=max_pinned, max_ranked_blocks=max_ranked
        )
        self.wire: dict[int, int] = {}  # block id -> wire hash of the block cached there
        self.held: dict[str, list[Any]] = {}

    def cached(self) -> set[int]:
        return set(self.wire.values())

    def start(self, rid: str, blocks: list[int], scratch: int) -> tuple[int, list[int]]:
        hit = 0
        while hit < len(blocks) and self.ops.lookup(blocks[hit]) is not None:
            hit += 1
        hits = [self.ops.lookup(b)[0] for b in blocks[:hit]]  # type: ignore[index]
        self.pool.touch(hits)
        before = dict(self.wire)
        new = self.pool.get_new_blocks(len(blocks) - hit + scratch)
        for b in new:
            self.wire.pop(b.block_id, None)
        evicted = [before[b.block_id] for b in new if b.block_id in before]
        cached_now = self.cached()
        for block, phys in zip(blocks[hit:], new, strict=False):
            if block in cached_now:
                continue  # computed twice: scratch
            self.ops.remember([digest(block)], [block])
            self.pool._insert_block_hash(self.key(digest(block), GROUP), phys, TOKENS)
            self.wire[phys.block_id] = block
            cached_now.add(block)
        self.held[rid] = hits + new
        return hit, evicted

    def finish(self, rid: str) -> None:
        self.pool.free_blocks(reversed(self.held.pop(rid)))

    def apply(
        self, view: SnapshotView | None, retired: frozenset[int], budget: int | None
    ) -> list[int]:
        self.applier.adopt(view, retired)
        evicted = self.applier.step(budget)
        for block_id in [i for i, w in self.wire.items() if w in set(evicted)]:
            del self.wire[block_id]
        return evicted

    def queue_order(self) -> list[int]:
        """The cached blocks in the free queue, first victim first."""
        return [
            self.wire[b.block_id]
            for b in self.pool.free_block_queue.get_all_free_blocks()
            if b.block_id in self.wire
        ]


class SimSide:
    def __init__(self, capacity: int, max_pinned: int, max_ranked: int) -> None:
        self.gpu = GpuTier(capacity, LruQueue())
        self.applier = GpuApplier(
            self.gpu, max_pinned_blocks=max_pinned, max_ranked_blocks=max_ranked
        )
        self.held: dict[str, tuple[list[int], int]] = {}

    def start(self, rid: str, blocks: list[int], scratch: int) -> tuple[int, list[int]]:
        gpu = self.gpu
        hit = gpu.prefix_hits(blocks, len(blocks))
        gpu.acquire(blocks[:hit])
        n_new = len(blocks) - hit + scratch
        evicted = gpu.allocate(n_new)
        held = list(blocks[:hit])
        cached, _ = gpu.commit(blocks[hit:], held)
        self.held[rid] = (held, n_new - len(cached))
        return hit, evicted

    def finish(self, rid: str) -> None:
        held, scratch = self.held.pop(rid)
        self.gpu.release(held, scratch)

    def apply(
        self, view: SnapshotView | None, retired: frozenset[int], budget: int | None
    ) -> list[int]:
        self.applier.adopt(view, retired)
        return self.applier.step(budget)

    def queue_order(self) -> list[int]:
        assert isinstance(self.gpu.queue, LruQueue)
        return list(self.gpu.queue)


def random_view(
    rng: random.Random, cached: list[int], version: int
) -> tuple[SnapshotView, frozenset[int]]:
    named = rng.sample(cached, k=min(len(cached), rng.randrange(0, 12)))
    groups = tuple(ScoredBlocks(round(rng.uniform(-1.0, 3.0), 1), (b,)) for b in named)
    pin = tuple(rng.sample(cached, k=min(len(cached), rng.randrange(0, 3))))
    snap = PolicySnapshot(version=version, ts=0.0, ttl_s=60.0, policy="t", scores=groups, pin=pin)
    retired = frozenset(rng.sample(cached, k=min(len(cached), rng.randrange(0, 4))))
    return SnapshotView.of(snap), retired


@pytest.mark.parametrize("seed", range(12))
def test_the_same_moves_give_the_same_evictions_on_vllms_pool_and_the_simulators(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.choice([24, 40, 64])
    max_pinned, max_ranked = rng.choice([(0, 8), (2, 0), (3, 16)])
    vllm, sim = (
        VllmSide(capacity, max_pinned, max_ranked),
        SimSide(capacity, max_pinned, max_ranked),
    )
    # prompts share prefixes: a few documents, each request a prefix of one plus new blocks
    docs = [[1000 * d + i for i in range(12)] for d in range(6)]
    running: list[str] = []
    fresh = iter(range(10**6, 10**7))
    version = 0
    for step in range(300):
        action = rng.random()
        if action < 0.45:
            doc = rng.choice(docs)
            blocks = doc[: rng.randrange(1, len(doc) + 1)] + [
                next(fresh) for _ in range(rng.randrange(0, 3))
            ]
            scratch = rng.randrange(0, 2)
            need = len(blocks) + scratch  # an upper bound on what the request allocates
            if need > sim.gpu.free_blocks + len(sim.gpu.queue):
                continue
            rid = f"r{step}"
            got_sim, got_vllm = sim.start(rid, blocks, scratch), vllm.start(rid, blocks, scratch)
            assert got_vllm == got_sim, f"step {step}: start {rid} (hit, evicted)"
            running.append(rid)
        elif action < 0.8 and running:
            rid = running.pop(rng.randrange(len(running)))
            sim.finish(rid)
            vllm.finish(rid)
        else:
            version += 1
            cached = sorted(vllm.cached())
            view, retired = (
                (None, frozenset()) if rng.random() < 0.1 else random_view(rng, cached, version)
            )
            budget = rng.choice([None, None, 1, 3])
            assert vllm.apply(view, retired, budget) == sim.apply(view, retired, budget), (
                f"step {step}"
            )
        assert vllm.cached() == set(sim.gpu.refs), f"step {step}: cached blocks"
        assert vllm.queue_order() == sim.queue_order(), f"step {step}: free-queue order"
        assert sorted(vllm.applier.pinned) == sorted(sim.applier.pinned), f"step {step}: pins"
        assert vllm.pool.get_num_free_blocks() == sim.gpu.free_blocks + len(sim.gpu.queue)
