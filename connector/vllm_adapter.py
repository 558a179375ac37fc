"""The only module that imports vLLM (pinned: vLLM 0.32.0; docs/CONNECTOR.md says how to move it).

Load it with::

    --kv-transfer-config '{"kv_connector": "AgentKVConnector",
                           "kv_connector_module_path": "connector.vllm_adapter",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000}}'

What each piece adds to vLLM's own ``OffloadingConnector`` (whose scheduling of loads and stores
it keeps unchanged):

* ``AgentKVConnector`` - streams AgentKV's events to the daemon (request started with
  the workflow / agent read from ``kv_transfer_params``, prefix hit per tier, request and
  workflow finished) through the non-blocking ``DaemonClient``, and applies the snapshot on the
  GPU tier through the bound block pool with ``policyd.tiers.gpu`` (the simulator's code too):
  retired workflows' free blocks evicted first, the highest-scored free blocks re-ranked at the
  free queue's tail, a few pinned; a budget of moves at each prefix lookup.
* ``AgentKVSpec`` - the out-of-tree offloading spec (``spec_name`` / ``spec_module_path``): its
  manager is vLLM's ``CPUOffloadingManager`` with the write filter in ``prepare_store`` and the
  host-tier events, its eviction order is ``ScoredCachePolicy`` (retired first, by score, LRU),
  and its worker is ``TorchHostWorker``, which copies rows with torch, so it runs on the CPU
  platform (vLLM's own worker refuses it) and on CUDA (pinned memory, side stream).

Every hook runs its AgentKV part under ``Guard``: a failure there, or a daemon that is down,
slow or sends garbage, degrades to vLLM's defaults and never reaches the request.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_block_hash
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from connector.copy_plan import plan_rows
from connector.deferred import Deferred, Job, immediate
from connector.events import block_hash_int
from connector.runtime import ConnectorRuntime, Guard, StepTimes
from connector.trace_file import TraceFile
from policyd.core.client import DaemonClient
from policyd.core.wire import Endpoints
from policyd.tiers.budget import DEFAULT_STEP_DEADLINE_US, StepBudget
from policyd.tiers.gpu import DEFAULT_STEP_OPS, GpuApplier, gpu_caps
from policyd.tiers.host_order import HostOrder
from policyd.tiers.view import SnapshotView

log = logging.getLogger("agentkv.connector")

VLLM_PIN: Final = "0.32.0"
SPEC_NAME: Final = "AgentKVSpec"
POLICY_NAME: Final = "ScoredCachePolicy"
MAX_DIGESTS: Final = 1 << 20  # wire hash -> vLLM hash, for blocks the snapshot names


# ---- the host tier's eviction order ----------------------------------------------------------


class ScoredCachePolicy(CachePolicy):
    """vLLM's ``CachePolicy`` over ``HostOrder``: retired first, then by score, then LRU.

    The connector's runtime sets the order's view when a snapshot's retired set is settled
    (``StepBudget.adopt``) and its GPU tier performs the re-keying within the step
    budget; until then (and whenever the snapshot is stale) the order is exactly LRU.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self.order: HostOrder[OffloadKey] = HostOrder(block_hash_int)
        # while the manager completes a store: the keys vLLM marks evictable, i.e. the ones that
        # store made ready (``CPUOffloadingManager.complete_store``'s own rule)
        self.ready: list[OffloadKey] | None = None

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        self.chunks[key] = chunk
        self.order.insert(key, evictable=chunk.ref_cnt == 0)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self.order.remove(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.order.touch(list(keys))

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        self.order.touch(order_request_keys(key_groups, req_context))

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        keys = self.order.evict(n, protected)
        if keys is None:
            return None
        return [(key, self.chunks.pop(key)) for key in keys]

    def clear(self) -> None:
        self.chunks.clear()
        self.order.clear()

    def mark_evictable(self, key: OffloadKey) -> None:
        self.order.mark_evictable(key)
        if self.ready is not None:
            self.ready.append(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.order.mark_non_evictable(key)


# ---- the host tier's manager -----------------------------------------------------------------


class AgentKVManager(CPUOffloadingManager):
    """vLLM's CPU offloading manager plus the write filter and the host-tier events."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.runtime: ConnectorRuntime | None = None
        self.guard = Guard()
        self.declined_keys = 0
        self.stored_keys = 0

    @property
    def scored_policy(self) -> ScoredCachePolicy:
        policy = self._policy
        assert isinstance(policy, ScoredCachePolicy)
        return policy

    def attach(self, runtime: ConnectorRuntime) -> None:
        self.runtime = runtime
        order = runtime.host_order = self.scored_policy.order
        order.release = runtime.release

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        rt = self.runtime
        if rt is not None and not self.guard.call(
            "write filter", lambda: rt.may_store(req_context.req_id), True
        ):
            self.guard.call("declined", lambda: self._decline(rt, keys), None)
            # an empty keys_to_store advances vLLM's index: these chunks are declined for good
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [])
        out = super().prepare_store(keys, req_context)
        if rt is not None and out is not None and out.evicted_keys:
            evicted = out.evicted_keys
            self.guard.call("host removed", lambda: rt.host_removed(list(evicted)), None)
        return out

    def _decline(self, rt: ConnectorRuntime, keys: Collection[OffloadKey]) -> None:
        new = sum(1 for key in keys if self._policy.get(key) is None)
        self.declined_keys += new
        rt.store_declined(new)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        rt = self.runtime
        policy = self.scored_policy
        policy.ready = [] if success and rt is not None else None
        try:
            super().complete_store(keys, req_context, success)
        finally:
            ready, policy.ready = policy.ready, None
        if ready and rt is not None:  # the keys this completion made ready
            self.stored_keys += len(ready)
            self.guard.call("host stored", lambda: rt.host_stored(ready), None)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        spec = super().prepare_load(keys, req_context)
        rt = self.runtime
        if rt is not None:
            self.guard.call(
                "host loaded", lambda: rt.host_loaded(list(keys), req_context.req_id), None
            )
        return spec


# ---- the worker: host buffer <-> vLLM's KV tensors, with torch --------------------------------


@dataclass
class _Job:
    job_id: int
    nbytes: int
    started_s: float
    event: Any = None  # a torch.cuda.Event on CUDA
    finish: Any = None  # CUDA stores: scatter the pinned staging buffer into the host buffer


class TorchHostWorker(OffloadingWorker):
    """Copies KV pages between vLLM's tensors and a host buffer with plain torch ops.

    CPU platform: synchronous ``index_select`` / ``index_copy_`` (the job is done on return).
    CUDA: pinned host memory and non-blocking copies on a side stream that first waits for the
    compute stream; a store lands in a pinned staging buffer and is scattered into the host
    buffer once its event has fired.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int):
        self.blocks_per_chunk = blocks_per_chunk
        self.gpu: list[torch.Tensor] = []
        self.host: list[torch.Tensor] = []
        self.device = kv_caches.tensors[0].tensor.device if kv_caches.tensors else None
        self.cuda = self.device is not None and self.device.type == "cuda"
        for t in kv_caches.tensors:
            tensor = t.tensor
            if tensor.dtype != torch.int8 or tensor.dim() != 2:
                tensor = tensor.view(torch.int8).view(-1, t.page_size_bytes)
            self.gpu.append(tensor)
            self.host.append(
                torch.zeros(
                    (num_chunks * blocks_per_chunk, tensor.shape[1]),
                    dtype=torch.int8,
                    pin_memory=self.cuda,
                )
            )
        self.group_tensors = [
            sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs
        ]
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._pending: deque[_Job] = deque()
        self._done: list[TransferResult] = []

    def _plans(self, gpu_spec: GPULoadStoreSpec, host_spec: LoadStoreSpec) -> list[Any]:
        assert isinstance(host_spec, CPULoadStoreSpec)
        return plan_rows(
            gpu_spec.block_ids,
            host_spec.block_ids,
            gpu_spec.group_sizes,
            gpu_spec.block_indices,
            self.blocks_per_chunk,
        )

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        t0 = time.perf_counter()
        nbytes = 0
        scatters: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        stream = self.stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        for g, (gpu_rows, host_rows) in enumerate(self._plans(src_spec, dst_spec)):
            if len(gpu_rows) == 0:
                continue
            host_idx = torch.from_numpy(host_rows)
            for t in self.group_tensors[g]:
                gpu, host = self.gpu[t], self.host[t]
                nbytes += len(gpu_rows) * gpu.shape[1]
                if stream is None:
                    host.index_copy_(0, host_idx, gpu.index_select(0, torch.from_numpy(gpu_rows)))
                    continue
                with torch.cuda.stream(stream):
                    idx = torch.from_numpy(gpu_rows).to(self.device, non_blocking=True)
                    rows = gpu.index_select(0, idx)
                    staging = torch.empty(rows.shape, dtype=torch.int8, pin_memory=True)
                    staging.copy_(rows, non_blocking=True)
                scatters.append((host, host_idx, staging))
        job = _Job(job_id, nbytes, t0)
        if stream is not None:
            job.event = torch.cuda.Event()
            job.event.record(stream)
            job.finish = scatters
        self._pending.append(job)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        t0 = time.perf_counter()
        nbytes = 0
        keep: list[torch.Tensor] = []
        stream = self.stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        for g, (gpu_rows, host_rows) in enumerate(self._plans(dst_spec, src_spec)):
            if len(gpu_rows) == 0:
                continue
            gpu_idx = torch.from_numpy(gpu_rows)
            for t in self.group_tensors[g]:
                gpu, host = self.gpu[t], self.host[t]
                nbytes += len(gpu_rows) * gpu.shape[1]
                rows = host.index_select(0, torch.from_numpy(host_rows))
                if stream is None:
                    gpu.index_copy_(0, gpu_idx, rows)
                    continue
                pinned = rows.pin_memory()
                with torch.cuda.stream(stream):
                    dev_rows = pinned.to(self.device, non_blocking=True)
                    gpu.index_copy_(0, gpu_idx.to(self.device, non_blocking=True), dev_rows)
                keep.append(pinned)
        job = _Job(job_id, nbytes, t0)
        if stream is not None:
            job.event = torch.cuda.Event()
            job.event.record(stream)
            job.finish = keep  # kept alive until the copy has run
        self._pending.append(job)
        return True

    def _complete(self, job: _Job) -> None:
        if job.event is not None:
            for item in job.finish or ():
                if isinstance(item, tuple):
                    host, host_idx, staging = item
                    host.index_copy_(0, host_idx, staging)
        self._done.append(
            TransferResult(
                job_id=job.job_id,
                success=True,
                transfer_size=job.nbytes,
                transfer_time=time.perf_counter() - job.started_s,
            )
        )

    def get_finished(self) -> list[TransferResult]:
        while self._pending and (self._pending[0].event is None or self._pending[0].event.query()):
            self._complete(self._pending.popleft())
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        for job in list(self._pending):
            if job.job_id in job_ids and job.event is not None:
                job.event.synchronize()

    def shutdown(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._pending.clear()


# ---- the spec ---------------------------------------------------------------------------------


class AgentKVSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading sizing (``cpu_bytes_to_use``) with AgentKV's manager and worker."""

    def __init__(self, config: OffloadingConfig):
        if config.canonical_layout:
            raise ValueError("AgentKVSpec does not support canonical_layout; leave it unset")
        super().__init__(config)
        self._torch_worker: TorchHostWorker | None = None

    def _uses_shared_region(self) -> bool:
        return False  # our worker owns a private host buffer per tensor

    def get_manager(self) -> OffloadingManager:
        if not self._manager:  # type: ignore[has-type]
            self._manager = AgentKVManager(
                num_chunks=self.num_chunks,
                cache_policy=POLICY_NAME,
                cache_policy_module_path=__name__,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._torch_worker is None:
            self._torch_worker = TorchHostWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._torch_worker


# ---- the GPU tier -----------------------------------------------------------------------------


class VllmPool:
    """``policyd.tiers.gpu.GpuPool`` over vLLM's live ``BlockPool``: a handle is the block's
    ``KVCacheBlock`` in each prefix-cacheable group, found by the wire hash of a block some
    request named (``remember``)."""

    def __init__(self, pool: BlockPool, group_ids: Sequence[int]) -> None:
        self.pool = pool
        self.group_ids = list(group_ids)
        self.digests = _RecentDigests(MAX_DIGESTS)
        # vLLM 0.32 keys its cache by hash + 4-byte big-endian group id
        # (``make_block_hash_with_group_id``); reading that dict directly saves two calls per
        # lookup, the plan's most frequent operation. ``get_cached_block`` when it is not there.
        self._suffixes = [g.to_bytes(4, "big") for g in self.group_ids]
        self._cache: dict[bytes, Any] | None = getattr(
            pool.cached_block_hash_to_block, "_cache", None
        )

    def remember(self, digests: Sequence[bytes], blocks: Sequence[int]) -> None:
        """Keep the wire hash -> vLLM hash mapping for blocks a snapshot may name: a request's
        digests and their wire hashes (``connector.events.block_hash_ints``), in order."""
        self.digests.update(blocks, digests)

    def lookup(self, block: int) -> list[KVCacheBlock] | None:
        digest = self.digests.get(block)
        if digest is None:
            return None
        cache = self._cache
        if cache is None:
            cached: list[KVCacheBlock] | None = self.pool.get_cached_block(digest, self.group_ids)
            return cached
        handle: list[KVCacheBlock] = []
        for suffix in self._suffixes:
            found = cache.get(digest + suffix)
            if found is None:
                return None
            handle.append(found if isinstance(found, KVCacheBlock) else next(iter(found.values())))
        return handle

    def is_free(self, handle: list[KVCacheBlock]) -> bool:
        return all(b.ref_cnt == 0 and not b.is_null for b in handle)

    def touch(self, handles: Sequence[list[KVCacheBlock]]) -> None:
        self.pool.touch([b for h in handles for b in h])

    def free(self, handles: Sequence[list[KVCacheBlock]]) -> None:
        self.pool.free_blocks([b for h in handles for b in h])

    def evict(self, handles: Sequence[list[KVCacheBlock]]) -> None:
        blocks = [b for h in handles for b in h]
        self.pool.evict_blocks({b.block_id for b in blocks})
        queue = self.pool.free_block_queue
        for b in blocks:
            queue.remove(b)
        queue.prepend_n(blocks)  # no hash now: their slots are reused first

    def to_tail(self, handles: Sequence[list[KVCacheBlock]]) -> None:
        blocks = [b for h in handles for b in h]
        queue = self.pool.free_block_queue
        for b in blocks:
            queue.remove(b)
        queue.append_n(blocks)


class _RecentDigests:
    """Wire hash -> vLLM digest for the blocks requests named most recently: at least the
    newest ``capacity // 2`` and at most ``capacity``. Two generations, so remembering a
    request's blocks is one C-level ``dict.update`` (no per-block Python on vLLM's thread):
    when the newer fills up it becomes the older and the older is dropped."""

    def __init__(self, capacity: int) -> None:
        self.half = max(capacity // 2, 1)
        self._newer: dict[int, bytes] = {}
        self._older: dict[int, bytes] = {}

    def update(self, blocks: Sequence[int], digests: Sequence[bytes]) -> None:
        self._newer.update(zip(blocks, digests, strict=True))
        if len(self._newer) >= self.half:
            self._older, self._newer = self._newer, {}

    def get(self, block: int) -> bytes | None:
        found = self._newer.get(block)
        return self._older.get(block) if found is None else found

    def __len__(self) -> int:
        return len(self._newer) + len(self._older)


class PrefixHit(AbstractSet[int]):
    """A request's counted prefix hit as wire hashes, for the retire rule's membership test.
    The digest set is built on the first question (a plan asks only when it has a retired block
    to move), so a lookup with a long prefix costs nothing otherwise."""

    def __init__(self, pool: VllmPool, digests: Sequence[bytes]) -> None:
        self._pool = pool
        self._source = digests
        self._digests: set[bytes] | None = None

    def _set(self) -> set[bytes]:
        if self._digests is None:
            self._digests = {bytes(d) for d in self._source}
        return self._digests

    def __contains__(self, block: object) -> bool:
        digest = self._pool.digests.get(block) if isinstance(block, int) else None
        return digest is not None and digest in self._set()

    def __iter__(self) -> Iterator[int]:
        return (block_hash_int(d) for d in self._set())

    def __len__(self) -> int:
        return len(self._set())


class GpuTier:
    """The snapshot's decisions on vLLM's live ``BlockPool``: ``policyd.tiers.gpu``'s plan
    (recount, retire, rank, pin), the same code the simulator runs, and the host order's
    re-keying, together at most ``budget_ops`` operations per scheduler step, performed at its
    prefix lookups (``policyd.tiers.budget.StepBudget``). Blocks a running request holds are
    never moved."""

    def __init__(
        self,
        pool: BlockPool,
        group_ids: Sequence[int],
        *,
        max_pinned_blocks: int,
        max_ranked_blocks: int,
        budget_ops: int = DEFAULT_STEP_OPS,
        host: HostOrder[Any] | None = None,
    ) -> None:
        self.pool = VllmPool(pool, group_ids)
        self.applier: GpuApplier[list[KVCacheBlock]] = GpuApplier(
            self.pool, max_pinned_blocks=max_pinned_blocks, max_ranked_blocks=max_ranked_blocks
        )
        self.budget = StepBudget(self.applier, host, budget_ops)
        self._applied_generation = 0
        self._refreshed = False  # this step has looked for a new view already

    @property
    def pinned(self) -> dict[int, list[KVCacheBlock]]:
        return self.applier.pinned

    def remember(self, digests: Sequence[bytes], blocks: Sequence[int]) -> None:
        self.pool.remember(digests, blocks)

    def cached(self, block: int) -> list[KVCacheBlock]:
        return self.pool.lookup(block) or []

    def unpin_all(self) -> None:
        self.applier.release_all()

    def make_room(self, request: Any, num_computed_tokens: int) -> bool:
        """Pins never make a request wait: before vLLM allocates for a waiting request, release
        them if its new blocks (and its prefix hit's free blocks, which leave the free queue)
        exceed what the pool can give. The simulator applies the same rule at admission."""
        if not self.applier.pinned:
            return False
        block_size = self.pool.pool.hash_block_size
        hit_blocks = num_computed_tokens // block_size
        need = -(-request.num_tokens // block_size) - hit_blocks
        available = self.pool.pool.get_num_free_blocks()
        if need + hit_blocks > available:  # cheap bound first; then count the free hits
            for digest in request.block_hashes[:hit_blocks]:
                cached = self.pool.pool.get_cached_block(digest, self.pool.group_ids)
                if cached and all(b.ref_cnt == 0 for b in cached):
                    need += 1
        return self.applier.make_room(need, available)

    def close_step(self) -> None:
        """A scheduler step ended: the next one gets a whole budget, and looks for a new view."""
        self.budget.new_step()
        self._refreshed = False

    def adopt(self, rt: ConnectorRuntime) -> None:
        """At a prefix lookup, first: adopt the runtime's view if it changed. Once a scheduler
        step (at its first lookup): a snapshot that arrives during a step waits for the next,
        and the step's later lookups decide with the same view."""
        if self._refreshed:
            return
        self._refreshed = True
        rt.refresh()
        if rt.generation != self._applied_generation:
            self._applied_generation = rt.generation
            self.budget.adopt(rt.view, rt.retirement)

    def apply(
        self, rt: ConnectorRuntime, request: Any = None, num_computed_tokens: int = 0
    ) -> list[int]:
        """At a prefix lookup: ``adopt``, then ``plan``."""
        self.adopt(rt)
        return self.plan(rt, request, num_computed_tokens)

    def plan(
        self,
        rt: ConnectorRuntime,
        request: Any = None,
        num_computed_tokens: int = 0,
        over: Callable[[], bool] | None = None,
    ) -> list[int]:
        """At a prefix lookup, after ``adopt``: spend what is left of this scheduler step's
        budget (never retiring the request's counted prefix hit), stopping early once ``over``
        says the step's time is spent; the blocks the retire rule evicted."""
        if not self.budget.ready(over):
            return []
        hit: AbstractSet[int] = frozenset()
        if request is not None and num_computed_tokens:
            n = num_computed_tokens // self.pool.pool.hash_block_size
            hit = PrefixHit(self.pool, request.block_hashes[:n])
        evicted = self.budget.run(hit, over)
        rt.counters.gpu_pinned_blocks = len(self.applier.pinned)
        rt.gpu_removed(evicted)
        return evicted


# ---- the connector ----------------------------------------------------------------------------


def _endpoints(extra: dict[str, Any]) -> Endpoints:
    env = Endpoints.from_env()
    return Endpoints(
        events=str(extra.get("agentkv_events_endpoint", env.events)),
        snapshots=str(extra.get("agentkv_snapshot_endpoint", env.snapshots)),
        http_url=env.http_url,
    )


class AgentKVConnector(OffloadingConnector):
    """vLLM's offloading connector with AgentKV's events and decisions (see module docstring).

    ``kv_connector_extra_config`` keys, besides vLLM's (``cpu_bytes_to_use``, ...):
    ``agentkv_daemon`` (default true; false = no client, plain LRU: vLLM's default policy),
    ``agentkv_events_endpoint`` / ``agentkv_snapshot_endpoint`` (default: policyd.core.wire, env
    AGENTKV_EVENTS_ENDPOINT / AGENTKV_SNAPSHOT_ENDPOINT), ``agentkv_max_pinned_blocks`` (default
    1% of the GPU pool), ``agentkv_max_ranked_blocks`` (2048), ``agentkv_step_ops`` (12 a
    scheduler step), ``agentkv_step_deadline_us`` (the step's share of AgentKV time after
    which the GPU plan waits for the next step, 50), ``agentkv_trace_path`` /
    ``agentkv_trace_tiers``, ``agentkv_queue_max_events`` (the client's bounded queue);
    docs/CONNECTOR.md has the table.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any):
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        extra = transfer.kv_connector_extra_config
        extra.setdefault("spec_name", SPEC_NAME)
        extra.setdefault("spec_module_path", __name__)
        super().__init__(vllm_config, role, kv_cache_config)
        self._guard = Guard()
        self.step_times = StepTimes(self._guard)
        self._client: DaemonClient | None = None
        self._runtime: ConnectorRuntime | None = None
        self._trace_file: TraceFile | None = None
        self._deferred: Deferred | None = None
        self._gpu: GpuTier | None = None
        self._block_size = vllm_config.cache_config.block_size
        self._max_pinned = self._max_ranked = 0
        self._step_ops = DEFAULT_STEP_OPS
        self._step_deadline_ns = DEFAULT_STEP_DEADLINE_US * 1000
        self.lookup_parts_ns = {"gpu adopt": 0, "gpu plan": 0, "make room": 0}
        self._group_ids = list(kv_cache_config.prefix_cacheable_group_ids)
        if role == KVConnectorRole.SCHEDULER:
            self._guard.call("start", lambda: self._start(extra, kv_cache_config), None)

    def _start(self, extra: dict[str, Any], kv_cache_config: Any) -> None:
        pin, rank = extra.get("agentkv_max_pinned_blocks"), extra.get("agentkv_max_ranked_blocks")
        n_blocks = kv_cache_config.num_blocks
        self._max_pinned, self._max_ranked = gpu_caps(
            n_blocks, None if pin is None else int(pin), None if rank is None else int(rank)
        )
        self._step_ops = int(extra.get("agentkv_step_ops", DEFAULT_STEP_OPS))
        deadline_us = float(extra.get("agentkv_step_deadline_us", DEFAULT_STEP_DEADLINE_US))
        if deadline_us <= 0:
            raise ValueError(f"agentkv_step_deadline_us must be > 0, got {deadline_us}")
        self._step_deadline_ns = int(deadline_us * 1000)
        client: DaemonClient | None = None
        if _flag(extra.get("agentkv_daemon", True)):
            client = DaemonClient(
                f"vllm-{os.getpid()}",
                _endpoints(extra),
                queue_max_events=int(extra.get("agentkv_queue_max_events", 65536)),
                # indexed on the client's thread, not vLLM's, with the ranking the plan needs
                compile_snapshot=partial(
                    SnapshotView.of, top_blocks=max(self._max_pinned, self._max_ranked)
                ),
            )
        self._client = client
        trace_path = extra.get("agentkv_trace_path")
        trace: Callable[[dict[str, object]], None] | None = None
        defer: Callable[[Job], None]
        if trace_path is not None and _flag(extra.get("agentkv_trace_tiers", False)):
            # tier contents (small pools only) are read from vLLM's pool, on vLLM's thread: the
            # bookkeeping stays there too
            lines = self._trace_file = TraceFile(str(trace_path))
            trace = lambda record: lines({**record, **self._tier_contents()})  # noqa: E731
            defer = immediate
        else:
            if trace_path is not None:
                trace = self._trace_file = TraceFile(str(trace_path))
            deferred = self._deferred = Deferred()
            defer = deferred.submit
        self._runtime = ConnectorRuntime(
            client if client is not None else _NullSink(),
            _views(client) if client is not None else _no_snapshot,
            tokens_per_block=self._block_size,
            trace=trace,
            defer=defer,
        )
        manager = self.scheduler.manager
        if isinstance(manager, AgentKVManager):
            manager.attach(self._runtime)
            manager.guard = self._guard  # one account of AgentKV's time in the scheduler
        log.info(
            "agentkv connector (vLLM %s): daemon %s, GPU blocks pinned <= %d, ranked <= %d",
            VLLM_PIN,
            "on" if client else "off",
            self._max_pinned,
            self._max_ranked,
        )

    @property
    def runtime(self) -> ConnectorRuntime | None:
        return self._runtime

    def _tier_contents(self) -> dict[str, object]:
        """Both tiers' blocks (wire hashes): the GPU's cached blocks, free-queue order first
        (the next victim first) then the held ones sorted, and the host tier's, sorted."""
        out: dict[str, object] = {}
        if self._gpu is not None:
            pool = self._gpu.pool.pool
            free = [
                block_hash_int(bytes(get_block_hash(b.block_hash)))
                for b in pool.free_block_queue.get_all_free_blocks()
                if b.block_hash is not None
            ]
            free_set = set(free)
            held = sorted(
                {
                    block_hash_int(bytes(get_block_hash(b.block_hash)))
                    for b in pool.blocks
                    if b.block_hash is not None and not b.is_null
                }
                - free_set
            )
            out["gpu_free_order"], out["gpu_held"] = free, held
        manager = self.scheduler.manager if self.scheduler is not None else None
        if isinstance(manager, AgentKVManager):
            out["host"] = sorted(block_hash_int(k) for k in manager.scored_policy.chunks)
        return out

    # -- scheduler hooks: vLLM's behaviour first, then AgentKV's, guarded ----------------------

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)
        self._gpu = GpuTier(
            gpu_block_pool,
            self._group_ids,
            max_pinned_blocks=self._max_pinned,
            max_ranked_blocks=self._max_ranked,
            budget_ops=self._step_ops,
            host=self._runtime.host_order if self._runtime is not None else None,
        )
        if self._runtime is not None:
            self._runtime.remember = self._gpu.remember  # from the runtime's deferred jobs

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        rt = self._runtime
        if rt is None:
            return
        # queued: run in the next timed call (the request's lookup), before it
        self._guard.later(
            "request started",
            partial(
                rt.request_started,
                request.request_id,
                request.kv_transfer_params,
                getattr(request, "session_id", None),
                list(request.block_hashes),  # a copy: vLLM appends to its list as tokens come
                request.num_prompt_tokens,
            ),
        )

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        rt = self._runtime
        if rt is not None:
            self._guard.call(
                "lookup", lambda: self._at_lookup(rt, request, num_computed_tokens, result[0]), None
            )
        return result

    def _at_lookup(
        self, rt: ConnectorRuntime, request: Any, num_computed_tokens: int, host: int | None
    ) -> None:
        """One guarded call per prefix lookup (a guard's clock reads are its own cost). First a new
        view, if one came (looked for once a scheduler step, at its first lookup); then the
        snapshot's moves, a budget of them at each lookup, before vLLM allocates for the request
        (the simulator steps them at the same point), until the step's deadline; then pins
        yield if the request needs their room; the lookup's record is kept even if those fail.
        The parts' wall time is kept apart (``lookup_parts_ns``) to show where it goes."""
        gpu, parts = self._gpu, self.lookup_parts_ns
        try:
            if gpu is not None:
                t0 = time.perf_counter_ns()
                gpu.adopt(rt)
                t1 = time.perf_counter_ns()
                gpu.plan(rt, request, num_computed_tokens, self._over_deadline)
                t2 = time.perf_counter_ns()
                gpu.make_room(request, num_computed_tokens)
                parts["gpu adopt"] += t1 - t0
                parts["gpu plan"] += t2 - t1
                parts["make room"] += time.perf_counter_ns() - t2
        finally:
            if host is not None:  # the view ``adopt`` refreshed (or, if it failed, the last one)
                rt.lookup_done(request.request_id, num_computed_tokens, host, refresh=gpu is None)

    def _over_deadline(self) -> bool:
        """The scheduler step has spent its share of AgentKV's time (every hook's so far, the
        running one included): the GPU plan stops until the next step."""
        return self.step_times.so_far_ns() >= self._step_deadline_ns

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        rt = self._runtime
        if rt is not None:
            self._guard.later("allocated", partial(rt.allocated, request.request_id))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        result: tuple[bool, Any] = super().request_finished(request, block_ids)
        self._finished(request)
        return result

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Any]:
        result: tuple[bool, Any] = super().request_finished_all_groups(request, block_ids)
        self._finished(request)
        return result

    def _finished(self, request: Any) -> None:
        rt = self._runtime
        if rt is not None:
            self._guard.call(
                "request finished",
                lambda: rt.request_finished(
                    request.request_id,
                    request.num_output_tokens,
                    list(request.block_hashes) if rt.trace is not None else (),
                ),
                None,
            )

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self._guard.drain()  # the step's last queued hooks, timed in this step
        self.step_times.close_step()  # once per scheduler step, at its end
        if self._gpu is not None:
            self._gpu.close_step()
        return super().build_connector_meta(scheduler_output)

    def _plan_record(self) -> dict[str, object]:
        """The GPU plan's work over the run, for the replay's report."""
        gpu = self._gpu
        return {
            "lookups": self._guard.calls_by_hook.get("lookup", 0),
            "lookup_parts_us": {k: v / 1e3 for k, v in self.lookup_parts_ns.items()},
            "ops": 0 if gpu is None else gpu.applier.counters.ops,
            "host_units": 0 if gpu is None else gpu.budget.host_units,
            "cut_steps": 0 if gpu is None else gpu.budget.cut_steps,
            "steps": len(self.step_times.steps_cpu_us),
        }

    def shutdown(self) -> None:
        rt, deferred = self._runtime, self._deferred
        self._guard.drain()
        if deferred is not None:
            self._guard.call("deferred close", deferred.close, None)
        if rt is not None and rt.trace is not None:
            steps: dict[str, object] = {
                "step_us": list(self.step_times.steps_us),
                "step_cpu_us": list(self.step_times.steps_cpu_us),
                "hook_cpu_us": {k: v / 1e3 for k, v in self._guard.cpu_ns_by_hook.items()},
                "hook_calls": dict(self._guard.calls_by_hook),
                "queued_hooks": dict(self._guard.queued_by_hook),
                "worst_steps": self.step_times.worst_steps(),
                "deferred_cpu_us": None if deferred is None else deferred.cpu_ns / 1e3,
                "deferred_jobs": None if deferred is None else deferred.done,
                "plan": self._plan_record(),
            }
            self._guard.call("trace", lambda: rt.trace(steps), None)  # type: ignore[misc]
        if self._trace_file is not None:
            self._guard.call("trace close", self._trace_file.close, None)
        if self._gpu is not None:
            self._guard.call("unpin", self._gpu.unpin_all, None)
        if self._client is not None:
            self._guard.call("client close", lambda: self._client.close(0.5), None)  # type: ignore[union-attr]
        super().shutdown()


def _flag(value: object) -> bool:
    return str(value).lower() not in ("0", "false", "no", "off")


class _NullSink:
    def send_many(self, events: Sequence[Any]) -> int:
        return len(events)


def _no_snapshot() -> None:
    return None


def _views(client: DaemonClient) -> Callable[[], SnapshotView | None]:
    def view() -> SnapshotView | None:
        compiled = client.compiled()
        return compiled if isinstance(compiled, SnapshotView) else None

    return view
