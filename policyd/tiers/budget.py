"""One budget per scheduler step for the tiers' pending work.

A new snapshot leaves two kinds of work on vLLM's scheduler thread: the GPU plan
(``gpu.GpuApplier``: recount, retire, rank, pin) and the host order's re-keying walk
(``host_order.HostOrder.rekey``). ``StepBudget`` performs both within ``ops_per_step``
operations per scheduler step, at the step's prefix lookups: while both have work the host walk
takes at most half of a step's budget first, then the GPU plan what is left, then the walk
anything still unused, so neither starves the other. ``adopt`` starts a new snapshot's plan,
hands the view to the host order once the plan's recount is done, and charges the adopting
step ``ADOPT_COST_OPS`` (a view refreshed, an old plan dropped, a new one started, its first
work on cold caches; connector.bench_step times it). The connector (``GpuTier``) and the simulator
(``sim.snapshots.SnapshotApplier.step_plan``) both run it, at the same points and in the same
batches of ``BATCH_OPS`` operations, so they stay in step.

The connector adds a deadline (``run``'s ``over``): before each batch it asks whether the
scheduler step has already spent its share of the connector's time (every hook's, measured),
and stops for this step if so; after ``STARVED_STEPS`` steps in a row cut before any work, the
next step's first batch runs regardless, so the plan never stalls. The work is not lost: it
waits for the next step's budget. The simulator runs without a deadline, so where the connector
is cut it lags the simulator; the connector counts those steps (``cut_steps``) so the lag is
measured, not assumed.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any, Final

from policyd.tiers.gpu import GpuApplier
from policyd.tiers.host_order import HostOrder
from policyd.tiers.view import Retirement, SnapshotView

ADOPT_COST_OPS: Final = 8  # what adopting a snapshot costs, in operations (connector.bench_step)
BATCH_OPS: Final = 2  # operations performed between two looks at the deadline
STARVED_STEPS: Final = 4  # steps in a row the deadline left with no work done: the next does some
# The connector's deadline: a scheduler step's share of AgentKV's CPU time on vLLM's thread (every
# hook's so far) after which the plan waits for the next step, so that the step's later hooks
# (allocation, host stores, further lookups) fit the 200 us budget beside it (connector.replay
# prints the steps it cut)
DEFAULT_STEP_DEADLINE_US: Final = 50
# What AgentKV may add to a vLLM scheduler step: p99 of its CPU time on vLLM's thread, us (the
# target connector.bench_step and connector.replay --repeat check)
STEP_BUDGET_P99_US: Final = 200.0


class StepBudget:
    """The operations left in this scheduler step, and how they are spent."""

    def __init__(
        self,
        applier: GpuApplier[Any],
        host: HostOrder[Any] | None,
        ops_per_step: int | None,
        *,
        adopt_cost_ops: int = ADOPT_COST_OPS,
    ) -> None:
        if ops_per_step is not None and ops_per_step < 1:
            raise ValueError("ops_per_step must be >= 1 (or None: no limit)")
        self.applier = applier
        self.host = host
        self.ops_per_step = ops_per_step
        self.adopt_cost_ops = adopt_cost_ops  # scaled down by a sampled shadow (policies.shadow)
        self.left = ops_per_step
        self._adopted = False
        self.cut_steps = 0  # steps the deadline stopped with budget and work left
        self.host_units = 0  # the host order's re-keying work done, in operations
        self._cut = False  # this step was cut: no more work in it
        self._worked = False  # this step did a batch
        self._starved = 0  # steps in a row cut before their first batch

    def adopt(self, view: SnapshotView | None, retirement: Retirement) -> None:
        """A new view (``None``: stale): the GPU plan for it, then the host order takes it once
        the retired set is recounted; the next ``run`` (the adopting step's) is charged for it.

        A view that gives the host tier no order (vLLM's default, a write filter alone, a stale
        snapshot: ``SnapshotView.orders_host``) needs no retired set there, so the host order
        takes it at once and is vLLM's LRU from this step on. The recount that the GPU plan
        still starts with (un-retiring what the last order's list retired) can take thousands
        of steps where a workflow owns thousands of blocks, and plans superseded before it ends
        never settle: a switch of the recency guard to vLLM's default or the write filter alone
        would leave the host tier in the learned order for as long."""
        host = self.host
        settled: Callable[[], None] | None = None
        if host is not None:
            if view is not None and view.orders_host:

                def settled() -> None:
                    host.set_view(view, retirement.blocks)

            else:
                host.set_view(view, frozenset())

        self.applier.adopt(view, retirement, on_settled=settled)
        self._adopted = True

    @property
    def spent(self) -> bool:
        """Nothing more in this step: its budget is used, or the deadline cut it (an adoption
        still to charge is not spent: ``run`` charges it this step, as the simulator does)."""
        return not self._adopted and (self._cut or (self.left is not None and self.left <= 0))

    @property
    def busy(self) -> bool:
        return self.applier.busy or (self.host is not None and self.host.rekeying)

    def new_step(self) -> None:
        """A scheduler step begins: a whole budget again."""
        self.left = self.ops_per_step
        self._starved = self._starved + 1 if self._cut and not self._worked else 0
        self._cut = self._worked = False

    def ready(self, over: Callable[[], bool] | None = None) -> bool:
        """Whether ``run`` would do any work now, decided at the cost of one look at the
        deadline: the caller skips building ``run``'s arguments for a step that is spent. A
        step whose deadline has passed is cut here as ``run`` would cut it (and charged its
        adoption): nothing more in it."""
        self._charge_adoption()
        if self.spent or not self.busy:
            return False
        if over is not None and self._may_cut() and over():
            self._cut_now()
            return False
        return True

    def _charge_adoption(self) -> None:
        if self._adopted:
            self._adopted = False
            if self.left is not None:
                self.left -= self.adopt_cost_ops

    def _may_cut(self) -> bool:
        """The deadline may stop this step: it worked already, or it is not starved."""
        return self._worked or self._starved < STARVED_STEPS

    def _cut_now(self) -> None:
        self._cut = True
        self.cut_steps += 1

    def run(
        self, hit: AbstractSet[int] = frozenset(), over: Callable[[], bool] | None = None
    ) -> list[int]:
        """Spend what is left of this step's budget; the blocks the GPU plan's retire rule
        evicted (``hit``: the prefix hit of the request being looked up, see ``GpuApplier``).
        ``over``: true once the step has no time left (the connector's deadline; None: none)."""
        self._charge_adoption()
        left, host, applier = self.left, self.host, self.applier
        if left is None:  # no limit: everything now
            everything = applier.step(None, hit)
            if host is not None:
                host.rekey(None)
            return everything
        if self.spent or not self.busy:
            return []
        evicted: list[int] = []
        rekey = self._rekey
        if host is not None and host.rekeying and applier.busy:
            left -= self._in_batches(min(left, max(1, left // 2)), rekey, over)
        if applier.busy and left > 0:

            def plan(n: int) -> int:
                ops = applier.counters.ops
                evicted.extend(applier.step(n, hit))
                return applier.counters.ops - ops

            left -= self._in_batches(left, plan, over)
        if host is not None and left > 0:
            left -= self._in_batches(left, rekey, over)
        self.left = left
        return evicted

    def _rekey(self, units: int) -> int:
        assert self.host is not None
        used = self.host.rekey(units)
        self.host_units += used
        return used

    def _in_batches(
        self, ops: int, work: Callable[[int], int], over: Callable[[], bool] | None
    ) -> int:
        """``work(n)`` (performs at most ``n`` operations, returns how many) in batches of
        ``BATCH_OPS`` until ``ops`` are spent, nothing is left, or ``over`` says stop; after
        ``STARVED_STEPS`` steps in a row cut before any work, a step's first batch runs
        regardless, so the plan progresses however busy the steps are before it."""
        used = 0
        while used < ops and not self._cut:
            if over is not None and self._may_cut() and over():
                self._cut_now()
                break
            self._worked = True
            n = min(BATCH_OPS, ops - used)
            done = work(n)
            used += done
            if done < n:
                break  # nothing more to do
        return used
