"""The policy's snapshots, applied as the connector applies them.

A snapshot is adopted from the engine every ``snapshot_interval_s`` of simulated time (or from a
script); adopting one retires the finished workflows' ownership and hands the view to the
connector's ``StepBudget``, which carries out the GPU plan and re-keys the host order a
scheduling round's ``step_ops`` at a time, at the prefix lookups that follow. The write filter of
a lookup reads the view while its snapshot is fresh (``view_fresh``), and nothing (LRU, store
all) once its ``ttl_s`` has passed.
"""

from __future__ import annotations

import msgspec

from policyd.core.types import BlocksRemoved, PolicySnapshot
from policyd.policies import Policy
from policyd.sim.cache import GpuTier, HostOrderQueue, HostTier
from policyd.sim.config import SimConfig
from policyd.sim.link import EventOutbox, SimEngine
from policyd.sim.report import Report
from policyd.sim.timeline import Timeline
from policyd.tiers.budget import StepBudget
from policyd.tiers.gpu import GpuApplier, gpu_caps
from policyd.tiers.view import Ownership, SnapshotView


def uses_snapshots(policy: Policy) -> bool:
    """Whether the connector applies ``policy``'s snapshots: score-ordered policies, and any
    publishing more than the empty default (a write filter); plain LRU runs without them."""
    return policy.ordering == "snapshot" or (
        policy.ordering == "recency" and type(policy).snapshot is not Policy.snapshot
    )


class SnapshotApplier:
    """The connector's state between snapshots: who used which blocks (``ownership``), the GPU
    moves (``gpu_applier``), the round's work (``step_budget``) and the view adopted last.
    Evictions the GPU plan makes are sent as ``BlocksRemoved`` and counted in the report."""

    def __init__(
        self,
        engine: SimEngine,
        gpu: GpuTier,
        host: HostTier,
        config: SimConfig,
        *,
        timeline: Timeline,
        outbox: EventOutbox,
        report: Report,
    ) -> None:
        self.engine = engine
        self.timeline = timeline
        self.outbox = outbox
        self.report = report
        # what the connector knows and decides: who used which blocks, the GPU moves
        self.ownership = Ownership()
        pinned, ranked = gpu_caps(
            gpu.capacity_blocks, config.max_pinned_blocks, config.max_ranked_blocks
        )
        self.gpu_applier = GpuApplier(gpu, max_pinned_blocks=pinned, max_ranked_blocks=ranked)
        host_order = host.queue.order if isinstance(host.queue, HostOrderQueue) else None
        # the connector's work per scheduling round: the GPU plan and the host order's re-keying
        self.step_budget = StepBudget(self.gpu_applier, host_order, config.step_ops)
        self._snapshot: PolicySnapshot | None = None
        self._view: SnapshotView | None = None
        self._events_at_snapshot = -1
        self._round_s = -1.0

    def refresh(self) -> None:
        """The engine's snapshot is due: adopt it, or, when no event reached the engine since
        the last one, only re-date the one held (the decisions would be the same)."""
        events = self.engine.state.counters.events
        if self._snapshot is not None and events == self._events_at_snapshot:
            self._snapshot = msgspec.structs.replace(self._snapshot, ts=self.timeline.now)
            return
        self._events_at_snapshot = events
        self.adopt(self.engine.snapshot())

    def adopt(self, snap: PolicySnapshot) -> None:
        """Apply a snapshot as the connector does: the GPU moves, the host order, and the
        write filter for the lookups that follow."""
        self._snapshot = snap
        limit = max(self.gpu_applier.max_pinned_blocks, self.gpu_applier.max_ranked_blocks)
        view = self._view = SnapshotView.of(snap, top_blocks=limit)
        # stepped at the lookups that follow; the host order takes the view once recounted
        self.step_budget.adopt(view, self.ownership.retire(view.retired_workflows))

    def new_round(self) -> None:
        """A lookup at ``now``: the first at this instant opens a scheduling round (a fresh
        ``step_ops`` budget); events at one instant share their round."""
        now = self.timeline.now
        if now != self._round_s:
            self._round_s = now
            self.step_budget.new_step()

    def step_plan(self, hit: frozenset[int]) -> None:
        """The connector's work at a prefix lookup (``hit``: the GPU prefix it found): what is
        left of this scheduling round's ``step_ops`` operations (a round, like a vLLM scheduler
        step, may admit several requests; the budget is the round's)."""
        if not self.step_budget.busy:
            return
        evicted = self.step_budget.run(hit)
        if evicted:
            self.outbox.add(
                BlocksRemoved(ts=self.timeline.now, tier="gpu", block_hashes=tuple(evicted))
            )
            self.report.gpu_evicted_blocks += len(evicted)

    def view_fresh(self) -> SnapshotView | None:
        """The applied view while its snapshot is fresh; None (LRU, store all) once stale."""
        snap = self._snapshot
        if snap is None or self.timeline.now - snap.ts > snap.ttl_s:
            return None
        return self._view
