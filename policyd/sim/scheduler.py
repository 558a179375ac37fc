"""vLLM's scheduler and KV cache manager as the simulator models them.

Requests are admitted first-come first-served when the GPU pool can hold all their blocks (head-
of-line blocking included); when it cannot, the connector's pins are released first (as the
connector does) and the head is looked at again. At admission, as vLLM with an offloading
connector does it: the GPU prefix hit is taken (never the whole prompt when
``recompute_last_token``: the last token is always computed), then the run of host-resident
blocks after it is loaded over the host link, the rest is recomputed; the figures go to the
report. A request's computed blocks are cached on the GPU when it is scheduled (later admissions
hit them), its output blocks when it finishes, and its GPU blocks are freed by ``release``.
Every change to the tiers is sent to the engine as events; the request's start is flushed before
any decision about its blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import msgspec

from policyd.core.queues import LruQueue
from policyd.core.types import (
    BlocksLoaded,
    BlocksRemoved,
    BlocksStored,
    PolicySnapshot,
    PrefixHit,
    RequestStarted,
)
from policyd.sim.audit import DeclineAudit
from policyd.sim.cache import GpuTier, HostOrderQueue, HostTier
from policyd.sim.config import SimConfig
from policyd.sim.costs import CostModel
from policyd.sim.link import EventOutbox
from policyd.sim.report import Report, RequestRecord
from policyd.sim.requests import SimRequest
from policyd.sim.snapshots import SnapshotApplier
from policyd.sim.timeline import PREFILLED, Timeline
from policyd.tiers.view import write_allowed
from policyd.workloads.calls import Call


class RequestScheduler:
    """The waiting queue, the admission of its head, and the running requests' GPU blocks.

    ``script``: the k-th request admitted (from 0) adopts ``script[k]`` after its GPU prefix
    lookup, before its blocks are allocated - where the connector adopts a snapshot that arrived
    while vLLM was idle. ``tier_log``: when a list, both tiers' blocks are appended to it right
    after each request's allocation (``engine_check``). ``audit``: told of each admission."""

    def __init__(
        self,
        config: SimConfig,
        gpu: GpuTier,
        host: HostTier,
        *,
        connector: SnapshotApplier,
        costs: CostModel,
        timeline: Timeline,
        outbox: EventOutbox,
        report: Report,
        script: dict[int, PolicySnapshot] | None,
    ) -> None:
        self.config = config
        self.block_tokens = config.block_tokens
        self.gpu = gpu
        self.host = host
        self.connector = connector
        self.costs = costs
        self.timeline = timeline
        self.outbox = outbox
        self.report = report
        self.script = script
        self.tier_log: list[dict[str, list[int]]] | None = None
        self.audit: DeclineAudit | None = None
        self.waiting: deque[SimRequest] = deque()
        self.running = 0
        self._admitted_count = 0

    def arrive(self, req: SimRequest) -> None:
        """``req`` joins the waiting queue; admit what fits."""
        self.waiting.append(req)
        self.admit_waiting()

    def admit_waiting(self) -> None:
        """Admit the waiting requests, in order, while the GPU pool can hold the head's blocks.
        Raises ``ValueError`` when the head cannot fit even with nothing running."""
        gpu, connector = self.gpu, self.connector
        connector.new_round()
        while self.waiting:
            req = self.waiting[0]
            blocks = req.call.block_hashes
            limit = self._hit_limit(req.call)
            gpu_hit = gpu.prefix_hits(blocks, limit)
            if self.script is not None and self._admitted_count in self.script:
                snap = self.script.pop(self._admitted_count)
                # dated on arrival
                connector.adopt(msgspec.structs.replace(snap, ts=self.timeline.now))
            connector.step_plan(frozenset(blocks[:gpu_hit]))
            refs = gpu.refs
            queued_hits = len([b for b in blocks[:gpu_hit] if not refs[b]])
            new_blocks = req.physical_blocks - gpu_hit
            need = new_blocks + queued_hits
            if not gpu.can_allocate(need) and connector.gpu_applier.make_room(
                need, gpu.free_blocks + len(gpu.queue)
            ):
                continue  # the pins were released (as the connector does): look again
            if not gpu.can_allocate(need):
                if self.running == 0:
                    raise ValueError(
                        f"request {req.rid} needs {req.physical_blocks} GPU blocks but the GPU "
                        f"tier has {gpu.capacity_blocks}: raise the GPU capacity"
                    )
                return
            self.waiting.popleft()
            self._admitted_count += 1
            self.running += 1
            self._start(req, gpu_hit, new_blocks)

    def _hit_limit(self, call: Call) -> int:
        n = len(call.block_hashes)
        if self.config.recompute_last_token:
            # vLLM computes at least the last prompt token, so a fully cached prompt loses a block
            return min(n, (call.prompt_tokens - 1) // self.block_tokens)
        return n

    def _start(self, req: SimRequest, gpu_hit: int, new_blocks: int) -> None:
        call, gpu, host, now = req.call, self.gpu, self.host, self.timeline.now
        blocks = call.block_hashes
        # vLLM's offloading lookup is not capped at N-1 tokens: it may load the whole prompt
        # and then recompute one token (offloading/scheduler.py, sched/scheduler.py in 0.32)
        host_hit = host.prefix_hits(blocks, gpu_hit, len(blocks)) if len(host) else 0
        req.gpu_hit, req.host_hit = gpu_hit, host_hit
        if self.audit is not None:
            self.audit.started(req.rid, blocks, gpu_hit)
        outbox = self.outbox
        outbox.add(
            RequestStarted(
                ts=now,
                request_id=req.rid,
                workflow_id=call.workflow_id,
                agent=call.agent,
                workflow_type=call.workflow_type,
                block_hashes=blocks,
                prompt_tokens=call.prompt_tokens,
                hints=call.hints,
            )
        )
        outbox.add(
            PrefixHit(
                ts=now,
                request_id=req.rid,
                gpu_blocks=gpu_hit,
                host_blocks=host_hit,
                recomputed_blocks=len(blocks) - gpu_hit - host_hit,
            )
        )
        # the connector's lookup takes the write filter's decision for the request from the
        # snapshot it holds (connector/runtime.py)
        view = self.connector.view_fresh()
        staged = view is not None and any(b in view.stage for b in blocks)
        req.may_store = write_allowed(view, len(blocks) - gpu_hit - host_hit, staged)
        # the policy sees the request before any decision about its blocks (the connector
        # sends the start first, too)
        outbox.flush()
        gpu.acquire(blocks[:gpu_hit])
        req.held.extend(blocks[:gpu_hit])
        evicted = gpu.allocate(new_blocks)
        if self.config.running_space == "shared":
            req.scratch = new_blocks
        if evicted:
            outbox.add(BlocksRemoved(ts=now, tier="gpu", block_hashes=tuple(evicted)))
        load_bytes = self.costs.block_bytes(host_hit)
        load_end = self.costs.load(now, load_bytes) if load_bytes else now
        # vLLM caches a request's blocks when it is scheduled: later admissions hit them
        self.cache(req, blocks[gpu_hit:])
        if host_hit:
            run = blocks[gpu_hit : gpu_hit + host_hit]
            host.loaded(run)
            refs = gpu.refs  # what the GPU now holds of the loaded run (all of it in shared space)
            loaded = tuple(b for b in run if b in refs)
            if loaded:
                outbox.add(BlocksLoaded(ts=now, block_hashes=loaded, request_id=req.rid))
        if self.tier_log is not None:
            self.tier_log.append(self._tier_contents())
        computed_tokens = max(1, call.prompt_tokens - (gpu_hit + host_hit) * self.block_tokens)
        req.prefill_end_s = self.costs.prefill(now, load_end, computed_tokens)
        r = self.report
        r.requests += 1
        r.prompt_blocks += len(blocks)
        r.prompt_tokens += call.prompt_tokens
        r.gpu_hit_blocks += gpu_hit
        r.host_hit_blocks += host_hit
        r.recomputed_tokens += computed_tokens
        r.host_read_bytes += load_bytes
        r.gpu_evicted_blocks += len(evicted)
        if self.config.record_requests:
            r.records.append(
                RequestRecord(req.rid, call.workflow_id, call.agent, len(blocks), gpu_hit, host_hit)
            )
        self.timeline.at(req.prefill_end_s, PREFILLED, req)

    def _tier_contents(self) -> dict[str, list[int]]:
        """As the connector traces them: the GPU's free queue (next victim first), its held
        blocks sorted, the host tier's blocks sorted."""
        free = list(self.gpu.queue) if isinstance(self.gpu.queue, LruQueue) else []
        held = sorted(b for b, n in self.gpu.refs.items() if n)
        host = self.host.queue
        return {
            "gpu_free_order": free,
            "gpu_held": held,
            "host": sorted(host) if isinstance(host, LruQueue | HostOrderQueue) else [],
        }

    def cache(self, req: SimRequest, blocks: Sequence[int]) -> None:
        """Cache ``blocks`` on the GPU for ``req`` (its blocks that precede them are cached)."""
        cached, evicted = self.gpu.commit(blocks, req.held)
        if self.config.running_space == "shared":
            req.scratch -= len(cached)
        now = self.timeline.now
        if evicted:
            self.outbox.add(BlocksRemoved(ts=now, tier="gpu", block_hashes=tuple(evicted)))
            self.report.gpu_evicted_blocks += len(evicted)
        if cached:
            self.outbox.add(
                BlocksStored(ts=now, tier="gpu", block_hashes=tuple(cached), request_id=req.rid)
            )

    def release(self, req: SimRequest) -> None:
        """``req`` finished: its GPU blocks are freed (its cached ones stay, evictable)."""
        self.gpu.release(req.held, req.scratch)
        self.running -= 1
