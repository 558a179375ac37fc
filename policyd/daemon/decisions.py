"""The daemon's decisions: the synchronous answers (evict, admit, prefetch) and the log every
decision goes to (a count per kind, a ``decisions`` history row with its reason)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final

from policyd.core.engine import Engine
from policyd.core.policy import Policy
from policyd.core.types import PolicySnapshot, Tier
from policyd.history import History
from policyd.history.process import HistoryProcess

TIER_NAMES: Final[dict[str, Tier]] = {"gpu": "gpu", "host": "host"}


class DecisionLog:
    """Counts each decision by kind (``counts``) and records it in the history's ``decisions``
    table with the policy's name and the version of ``latest_snapshot()``.

    ``record`` is called from any thread, with or without the service's lock (the engine hook
    calls it under the lock, the HTTP answers and the publisher after releasing it); it takes
    no lock: ``counts`` is incremented by whichever thread decides, and the history's
    ``record`` is thread-safe."""

    def __init__(
        self,
        history: History | HistoryProcess,
        engine: Engine,
        *,
        wall_clock: Callable[[], float],
        latest_snapshot: Callable[[], PolicySnapshot | None],
    ) -> None:
        self.history = history
        self.engine = engine
        self.wall_clock = wall_clock
        self.latest_snapshot = latest_snapshot
        self.counts: Counter[str] = Counter()

    def record(
        self,
        kind: str,
        *,
        tier: str | None,
        n_blocks: int,
        reason: str,
        request_id: str | None = None,
        workflow_id: str | None = None,
    ) -> None:
        self.counts[kind] += 1
        self.history.record(
            "decisions",
            [
                {
                    "ts": self.wall_clock(),
                    "kind": kind,
                    "tier": tier,
                    "request_id": request_id,
                    "workflow_id": workflow_id,
                    "n_blocks": n_blocks,
                    "reason": reason,
                    "policy": self.engine.policy.name,
                    "snapshot_version": self._snapshot_version(),
                }
            ],
        )

    def _snapshot_version(self) -> int | None:
        snapshot = self.latest_snapshot()
        return snapshot.version if snapshot else None


class DecisionDesk:
    """Answers the synchronous decisions of ``POST /api/decide/*`` from the Engine's policy,
    with the reason logged (``DecisionLog``).

    Runs on the HTTP threadpool: each answer holds the service's lock only while the Engine
    decides, and logs the decision after releasing it. ``write_declined_blocks`` in ``counts``
    (the service's counters) is incremented after the lock is released."""

    def __init__(
        self,
        lock: AbstractContextManager[Any],
        engine: Engine,
        decisions: DecisionLog,
        counts: Counter[str],
    ) -> None:
        self.lock = lock
        self.engine = engine
        self.decisions = decisions
        self.counts = counts

    def evict(self, tier: str, candidates: Sequence[int], n_blocks: int) -> dict[str, Any]:
        with self.lock:
            policy = self.engine.policy
            victims = self.engine.victims(TIER_NAMES[tier], candidates, n_blocks)
            retired: set[int] = getattr(policy, "retired", set())
            n_retired = len([b for b in victims if b in retired])
        if policy.ordering == "recency":
            reason = "least recently used first"
        else:
            reason = f"{policy.name}: lowest score first, ties by recency"
        if n_retired:
            reason = f"{n_retired} retired (workflow finished); " + reason
        self.decisions.record("evict", tier=tier, n_blocks=len(victims), reason=reason)
        return {"evict": victims, "reason": reason}

    def admit(self, request_id: str, block_hashes: Sequence[int]) -> dict[str, Any]:
        with self.lock:
            admit = self.engine.admit(request_id, block_hashes)
            req = self.engine.state.requests.get(request_id)
            workflow_id = req.workflow_id if req is not None else None
        self.counts["write_declined_blocks"] += len(admit.declined)
        if admit.block_hashes:
            self.decisions.record(
                "admit",
                tier="host",
                n_blocks=len(admit.block_hashes),
                reason=admit.reason,
                request_id=request_id,
                workflow_id=workflow_id,
            )
        if admit.declined:
            self.decisions.record(
                "decline",
                tier="host",
                n_blocks=len(admit.declined),
                reason=admit.reason,
                request_id=request_id,
                workflow_id=workflow_id,
            )
        return {
            "admit": list(admit.block_hashes),
            "declined": list(admit.declined),
            "reason": admit.reason,
        }

    def prefetch(self, budget_blocks: int) -> dict[str, Any]:
        """Host blocks to load into free GPU space. Every answer is logged, an empty one too
        (as ``evict`` logs a zero-victim answer), with why it is empty."""
        with self.lock:
            blocks = self.engine.prefetch(budget_blocks)
            policy = self.engine.policy
        if blocks:
            reason = f"{policy.name}: blocks of likely next agents"
        elif budget_blocks <= 0:
            reason = f"{policy.name}: nothing to prefetch (a budget of 0 blocks)"
        elif type(policy).prefetch is Policy.prefetch:
            reason = f"{policy.name}: nothing to prefetch (the policy does not prefetch)"
        else:
            reason = f"{policy.name}: nothing to prefetch (no host block of a likely next agent)"
        self.decisions.record("prefetch", tier="gpu", n_blocks=len(blocks), reason=reason)
        return {"prefetch": blocks, "reason": reason}
