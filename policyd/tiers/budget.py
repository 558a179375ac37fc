"""One budget per scheduler step for the tiers' pending work.

A new snapshot leaves two kinds of work on vLLM's scheduler thread: the GPU plan
(``gpu.GpuApplier``: recount, retire, rank, pin) and the host order's re-keying walk
(``host_order.HostOrder.rekey``). ``StepBudget`` performs both within ``ops_per_step``
operations per scheduler step, at the step's prefix lookups: while both have work the host walk
takes at most half of a step's budget first, then the GPU plan what is left, then the walk
anything still unused, so neither starves the other. ``adopt`` starts a new snapshot's plan,
hands the view to the host order once the plan's recount is done, and charges the adopting
step ``ADOPT_COST_OPS`` (a view refreshed, an old plan dropped, a new one started, its first
work on cold caches: 50-100 us on vLLM's thread). The connector (``GpuTier``) and the simulator
(``Simulator._step_plan``) both run it, at the same points, so they stay in step.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Any, Final

from policyd.tiers.gpu import GpuApplier
from policyd.tiers.host_order import HostOrder
from policyd.tiers.view import Retirement, SnapshotView

ADOPT_COST_OPS: Final = 8  # what adopting a snapshot costs, in operations (connector.bench_step)


class StepBudget:
    """The operations left in this scheduler step, and how they are spent."""

    def __init__(
        self, applier: GpuApplier[Any], host: HostOrder[Any] | None, ops_per_step: int | None
    ) -> None:
        if ops_per_step is not None and ops_per_step < 1:
            raise ValueError("ops_per_step must be >= 1 (or None: no limit)")
        self.applier = applier
        self.host = host
        self.ops_per_step = ops_per_step
        self.left = ops_per_step
        self._adopted = False

    def adopt(self, view: SnapshotView | None, retirement: Retirement) -> None:
        """A new view (``None``: stale): the GPU plan for it, then the host order takes it once
        the retired set is recounted; the next ``run`` (the adopting step's) is charged for it."""
        host = self.host

        def settled() -> None:
            if host is not None:
                host.set_view(view, retirement.blocks if view is not None else frozenset())

        self.applier.adopt(view, retirement, on_settled=settled)
        self._adopted = True

    @property
    def busy(self) -> bool:
        return self.applier.busy or (self.host is not None and self.host.rekeying)

    def new_step(self) -> None:
        """A scheduler step begins: a whole budget again."""
        self.left = self.ops_per_step

    def run(self, hit: AbstractSet[int] = frozenset()) -> list[int]:
        """Spend what is left of this step's budget; the blocks the GPU plan's retire rule
        evicted (``hit``: the prefix hit of the request being looked up, see ``GpuApplier``)."""
        if self._adopted:
            self._adopted = False
            if self.left is not None:
                self.left -= ADOPT_COST_OPS
        left, host, applier = self.left, self.host, self.applier
        if left is None:  # no limit: everything now
            everything = applier.step(None, hit)
            if host is not None:
                host.rekey(None)
            return everything
        if left <= 0 or not self.busy:
            return []
        if host is not None and host.rekeying and applier.busy:
            left -= host.rekey(min(left, max(1, left // 2)))
        evicted: list[int] = []
        if applier.busy and left > 0:
            ops = applier.counters.ops
            evicted = applier.step(left, hit)
            left -= applier.counters.ops - ops
        if host is not None and left > 0:
            left -= host.rekey(left)
        self.left = left
        return evicted
