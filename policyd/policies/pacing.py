"""How fast the pool references blocks, and how soon each workflow calls again.

EfficientAgent's model of a host copy's reuse distance in an LRU-like tier: the distinct blocks
referenced between a write and its reuse, about the pool's reference rate (prompt blocks per
second, over the working set's window) times the workflow's time until its next call (its
smoothed time between calls; the pool's mean for a workflow with one call so far).
"""

from __future__ import annotations

from collections import deque

from policyd.core.types import Event, RequestStarted, WorkflowFinished

INTERVAL_SMOOTHING = 0.5  # a workflow's time between calls: weight of the newest gap
POOL_SMOOTHING = 0.02  # the pool's mean time between a workflow's calls: weight of each gap
MAX_WINDOW_ENTRIES = 1 << 18  # the window's entries past which the oldest go, whatever the clock


class WorkflowPacing:
    """Per live workflow its smoothed time between calls, the pool's mean, and the prompt
    blocks referenced within the last ``window_s`` seconds. ``now_ts`` is the latest event's
    time: the clock of decisions taken between snapshots.

    The window keeps an entry per distinct request time (requests at the time of the entry
    before are added to it), at most ``max_entries`` of them: a sender whose clock does not
    advance costs one entry, not one per request, and a clock that never leaves the window
    cannot grow it without bound (past the bound the oldest entries leave it early)."""

    def __init__(self, *, window_s: float, max_entries: int = MAX_WINDOW_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.window_s = window_s
        self.max_entries = max_entries
        self.now_ts = 0.0
        self._refs: deque[tuple[float, int]] = deque()  # (ts, prompt blocks) in the window
        self._refs_in_window = 0
        self._last_call_ts: dict[str, float] = {}
        self._interval_s: dict[str, float] = {}  # workflow -> smoothed time between its calls
        self._mean_interval_s = 0.0

    def observe(self, event: Event) -> None:
        self.now_ts = max(self.now_ts, event.ts)
        kind = type(event)
        if kind is RequestStarted:
            assert isinstance(event, RequestStarted)
            wid = event.workflow_id
            last = self._last_call_ts.get(wid)
            self._last_call_ts[wid] = event.ts
            if last is not None:
                gap = event.ts - last
                a = INTERVAL_SMOOTHING
                old = self._interval_s.get(wid)
                self._interval_s[wid] = gap if old is None else a * gap + (1 - a) * old
                self._mean_interval_s = (
                    POOL_SMOOTHING * gap + (1 - POOL_SMOOTHING) * self._mean_interval_s
                )
            blocks = len(event.block_hashes)
            refs = self._refs
            if refs and refs[-1][0] == event.ts:
                refs[-1] = (event.ts, refs[-1][1] + blocks)
            else:
                refs.append((event.ts, blocks))
                if len(refs) > self.max_entries:
                    self._refs_in_window -= refs.popleft()[1]
            self._refs_in_window += blocks
        elif kind is WorkflowFinished:
            assert isinstance(event, WorkflowFinished)
            self._last_call_ts.pop(event.workflow_id, None)
            self._interval_s.pop(event.workflow_id, None)

    def reference_rate_blocks_per_s(self) -> float:
        """Prompt blocks referenced per second over the window: in an LRU-like tier a block's
        stack distance grows by the distinct blocks written or touched, which under pressure
        is about every prompt block referenced (the other workflows' prompts)."""
        horizon = self.now_ts - self.window_s
        refs = self._refs
        while refs and refs[0][0] < horizon:
            self._refs_in_window -= refs.popleft()[1]
        return self._refs_in_window / self.window_s

    def expected_reuse_s(self, workflow_id: str) -> float:
        """The workflow's smoothed time between calls; the pool's mean when it has none."""
        return self._interval_s.get(workflow_id, self._mean_interval_s)

    def pace(self, workflow_id: str) -> float:
        """How soon the workflow calls again, against the pool: ``1 / (1 + its smoothed time
        between calls / the pool's mean)``, in (0, 1); 1/2 for an average or unknown one.

        >>> pacing = WorkflowPacing(window_s=60.0)
        >>> pacing._mean_interval_s = 10.0
        >>> pacing._interval_s.update({"quick": 5.0, "slow": 30.0})
        >>> pacing.pace("quick"), pacing.pace("slow"), pacing.pace("new")
        (0.6666666666666666, 0.25, 0.5)
        """
        mean = self._mean_interval_s
        if mean <= 0.0:
            return 0.5
        return 1.0 / (1.0 + self._interval_s.get(workflow_id, mean) / mean)
