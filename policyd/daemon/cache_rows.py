"""The daemon's periodic figures about the cache: the sizing view (miss-ratio curve, the host
tier's recommended size) with its ``mrc_points`` / ``sizing`` rows, and the ``cache_stats`` rows
(what the counters gained since the last row)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Final

from policyd.core.engine import Engine
from policyd.daemon.ingest import IngestQueue
from policyd.daemon.policy_holder import PolicyHolder
from policyd.daemon.sizing import compute_sizing, empty_sizing, lru_recomputed_blocks
from policyd.history import History
from policyd.history.process import HistoryProcess

CACHE_STATS_KEYS: Final = (
    "requests",
    "prompt_blocks",
    "gpu_hit_blocks",
    "host_hit_blocks",
    "recomputed_blocks",
    "host_written_bytes",
    "host_loaded_bytes",
    "write_declined_blocks",
)


class SizingTracker:
    """``view``: the last sizing of the cache from the SHARDS estimator (``GET /api/sizing``;
    before the first ``refresh``, the empty one). ``refresh`` (housekeeping, the demo) computes
    it under the service's lock and records its rows in the history after releasing it."""

    def __init__(
        self,
        lock: AbstractContextManager[Any],
        engine: Engine,
        holder: PolicyHolder,
        history: History | HistoryProcess,
        *,
        coverage: float,
        wall_clock: Callable[[], float],
    ) -> None:
        self.lock = lock
        self.engine = engine
        self.holder = holder
        self.history = history
        self.coverage = coverage
        self.wall_clock = wall_clock
        self.view: dict[str, Any] = empty_sizing(
            holder.shards, holder.gpu_blocks, holder.host_blocks(), holder.kv_bytes_per_block
        )

    def refresh(self) -> dict[str, Any]:
        holder = self.holder
        with self.lock:
            agents = len(self.engine.state.active_workflows())
            view, mrc_rows, sizing_row = compute_sizing(
                holder.shards,
                kv_bytes_per_block=holder.kv_bytes_per_block,
                gpu_blocks=holder.gpu_blocks,
                host_blocks=holder.host_blocks(),
                agents=agents,
                coverage=self.coverage,
                ts=self.wall_clock(),
            )
            self.view = view
        if mrc_rows:
            self.history.record("mrc_points", mrc_rows)
            self.history.record("sizing", [sizing_row])
        return view


class CacheStatsRows:
    """Records a ``cache_stats`` row per call: what ``counts`` (the service's counters, read
    under the lock) and the events shed gained since the last row, with what LRU would have
    recomputed at the sizing view's current hit ratio. Calls from several threads (the
    housekeeping job, a caller closing the interval now) each count every change once."""

    def __init__(
        self,
        lock: AbstractContextManager[Any],
        counts: Counter[str],
        queue: IngestQueue,
        sizing: SizingTracker,
        history: History | HistoryProcess,
        *,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
    ) -> None:
        self.lock = lock
        self.counts = counts
        self.queue = queue
        self.sizing = sizing
        self.history = history
        self.clock = clock
        self.wall_clock = wall_clock
        self._mark: dict[str, int] = {}
        self._mark_s = clock()
        self._interval_lock = threading.Lock()  # one interval closes at a time

    def record(self) -> None:
        with self._interval_lock:
            with self.lock:
                current = {k: self.counts[k] for k in CACHE_STATS_KEYS}
                current["events"] = self.counts["events"]
            current["events_shed"] = self.queue.counters.events_shed
            now = self.clock()
            row: dict[str, object] = {"ts": self.wall_clock(), "interval_s": now - self._mark_s}
            row.update({k: v - self._mark.get(k, 0) for k, v in current.items()})
            row["lru_recomputed_blocks"] = lru_recomputed_blocks(
                self.sizing.view.get("lru_hit_ratio_current"), row["prompt_blocks"]
            )
            self._mark, self._mark_s = current, now
            self.history.record("cache_stats", [row])
