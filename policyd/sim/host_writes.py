"""The host tier's side of a request, as vLLM's offloading connector runs it.

When a request's prefill ends its new blocks are offered to the host tier (write-through): every
prompt block, or, after a host load, the blocks past the loaded ones; output blocks only when
``offload_prompt_only`` is off. The write filter decides per request at its lookup: all of the
candidates or none (``SimRequest.may_store``) - or, for offline analyses, ``OfflineAdmission``
per block. When the request finishes its keys are re-ranked, tail first. After a finish, blocks
the engine asks to prefetch are loaded into free GPU space.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from policyd.core.types import BlocksLoaded, BlocksRemoved, BlocksStored
from policyd.sim.audit import DeclineAudit
from policyd.sim.cache import GpuTier, HostTier
from policyd.sim.config import SimConfig
from policyd.sim.costs import CostModel
from policyd.sim.link import EventOutbox, SimEngine
from policyd.sim.report import Report
from policyd.sim.requests import SimRequest
from policyd.sim.timeline import Timeline

# (request id, candidate blocks) -> the blocks written: a per-block host admission decided
# offline, for analyses such as Proposition 1's audit (sim/audit.py). No connector applies it,
# so no policy figure may come from it.
OfflineAdmission = Callable[[str, list[int]], list[int]]


class HostWrites:
    """Writes to, re-ranks and prefetches from the host tier; the writes and loads are booked
    on the link (``CostModel``), sent as events and counted in the report. ``audit``: told of
    each declined write."""

    def __init__(
        self,
        config: SimConfig,
        gpu: GpuTier,
        host: HostTier,
        *,
        engine: SimEngine,
        costs: CostModel,
        timeline: Timeline,
        outbox: EventOutbox,
        report: Report,
        offline_admission: OfflineAdmission | None,
    ) -> None:
        self.config = config
        self.gpu = gpu
        self.host = host
        self.engine = engine
        self.costs = costs
        self.timeline = timeline
        self.outbox = outbox
        self.report = report
        self.offline_admission = offline_admission
        self.audit: DeclineAudit | None = None

    def prefilled(self, req: SimRequest) -> None:
        """``req``'s prompt KV exists: write what it offers to the host tier."""
        if self.host.capacity_blocks:
            self._store(req, self._offered(req))

    def finished(self, req: SimRequest) -> None:
        """``req`` finished: the offloading manager re-ranks its keys (the loaded keys and the
        offered ones), tail first."""
        if self.host.capacity_blocks:
            touched = req.call.block_hashes[req.gpu_hit :] if req.host_hit else self._offered(req)
            self.host.touch(reversed(touched))

    def prefetch(self) -> None:
        """Load the host blocks the engine asks for (at most ``prefetch_budget_blocks``, and
        what the GPU has free) that the GPU lacks."""
        budget = min(self.config.prefetch_budget_blocks, self.gpu.free_blocks)
        if budget <= 0 or not len(self.host):
            return
        wanted = [b for b in self.engine.prefetch(budget) if b in self.host and b not in self.gpu]
        if not wanted:
            return
        loaded = self.gpu.insert_unreferenced(wanted)
        if loaded:
            nbytes = self.costs.block_bytes(len(loaded))
            self.report.host_read_bytes += nbytes
            self.report.prefetched_blocks += len(loaded)
            self.costs.load(self.timeline.now, nbytes)
            self.outbox.add(BlocksLoaded(ts=self.timeline.now, block_hashes=tuple(loaded)))

    def _offered(self, req: SimRequest) -> Sequence[int]:
        """What vLLM's offloading scheduler offers to the host tier for this request: every
        prompt block, or, after a host load, the blocks past the loaded ones; output blocks
        only when ``offload_prompt_only`` is off."""
        blocks = req.call.block_hashes
        offered = blocks[req.gpu_hit + req.host_hit :] if req.host_hit else blocks
        if not self.config.offload_prompt_only:
            offered = offered + req.output_blocks
        return offered

    def _store(self, req: SimRequest, offered: Sequence[int]) -> None:
        host = self.host
        candidates = [b for b in offered if b not in host]
        if not candidates:
            return
        admitted = self._admitted(req, candidates)
        stored, evicted = host.store(admitted, protected=offered)
        r = self.report
        r.host_declined_blocks += len(candidates) - len(stored)
        if self.audit is not None:
            kept = set(stored)
            self.audit.declined(req.rid, (b for b in candidates if b not in kept))
        r.host_evicted_blocks += len(evicted)
        now = self.timeline.now
        if evicted:
            self.outbox.add(BlocksRemoved(ts=now, tier="host", block_hashes=tuple(evicted)))
        if stored:
            self.outbox.add(
                BlocksStored(ts=now, tier="host", block_hashes=tuple(stored), request_id=req.rid)
            )
            nbytes = self.costs.block_bytes(len(stored))
            r.host_write_bytes += nbytes
            self.costs.store(now, nbytes)

    def _admitted(self, req: SimRequest, candidates: list[int]) -> list[int]:
        """The write filter's per-request decision, taken at the lookup (as the connector's
        ``prepare_store`` applies it): all of the request's new blocks, or none."""
        if self.offline_admission is not None:
            return self.offline_admission(req.rid, candidates)
        return candidates if req.may_store else []
