"""The callers' side of the history writer: one queue, bounded in rows, that never blocks.

Callers (the daemon's ingest and decision paths, on any thread) put rows and event batches;
the writer thread takes them in order. The bound, ``queue_max_rows``, counts what a queued batch
holds until the writer fans it out - every event and hash, whatever the sample rate - so memory
stays bounded however low the rate goes; what does not fit is dropped and counted, never waited
for. The block rows' sample rate (``AdaptiveRate``) is decided here, as each batch is admitted,
from how full the queue is and the writer's CPU share. Calls and the stop sign are not rows:
they always go in.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Final

from policyd.core.types import EventBatch
from policyd.core.validate import Validator
from policyd.history.config import HistoryConfig
from policyd.history.fanout import requests_only, rows_estimate
from policyd.history.sampling import AdaptiveRate


@dataclass
class Rows:
    """Rows for one table, as ``History.record`` took them."""

    table: str
    rows: Sequence[Mapping[str, object]]


@dataclass
class Batch:
    """An event batch, admitted at ``rate``; it holds ``estimate`` rows until fanned out."""

    batch: EventBatch
    received_ts: float
    estimate: int  # rows_estimate at rate 1: what it holds in the queue's bound
    rate: float  # the block rows' sample rate it was admitted at


@dataclass
class Call:
    """A function the writer thread runs once everything queued before it is written."""

    fn: Callable[[], object]
    future: Future[object] = field(default_factory=Future)


STOP: Final = object()  # the writer thread writes what it holds and ends


class Intake:
    """The queue between the callers and the writer thread (see the module). ``put_*`` never
    block; ``written`` gives the bound back once the writer has written what it took."""

    def __init__(self, config: HistoryConfig, monotonic: Callable[[], float]) -> None:
        self._bound = config.queue_max_rows
        self._cpu_budget = config.cpu_budget
        self._monotonic = monotonic
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards everything below
        self._queued_rows = 0
        self._rows_dropped = 0
        self._closed = False
        self._validator = Validator()  # out-of-range events are left out of the rows
        self._rate = AdaptiveRate(
            ceiling=config.block_sample_rate,
            floor=config.min_block_sample_rate,
            now=monotonic(),
            adaptive=config.adaptive_sampling,
        )

    def close(self) -> None:
        """From now on every row is dropped and counted."""
        with self._lock:
            self._closed = True

    @property
    def rate(self) -> float:
        """The share of block rows kept now."""
        with self._lock:
            return self._rate.rate

    def set_ceiling(self, rate: float) -> None:
        with self._lock:
            self._rate.set_ceiling(rate)

    def put_rows(self, table: str, rows: Sequence[Mapping[str, object]]) -> bool:
        """Queue the rows (a list of the same dicts) unless they do not fit: then drop and count
        them and return False."""
        with self._lock:
            if self._closed or self._queued_rows + len(rows) > self._bound:
                self._rows_dropped += len(rows)
                return False
            self._queued_rows += len(rows)
        self._queue.put(Rows(table, list(rows)))
        return True

    def put_batch(self, batch: EventBatch, received_ts: float, *, cpu_share: float) -> None:
        """Queue an event batch at the rate decided now (``History.record_batch``): cut to its
        request-level events when it does not fit whole, dropped and counted when even those do
        not. ``cpu_share`` is the writer's, for ``cpu_budget``."""
        batch = self._validator.clean(batch)
        with self._lock:
            budget = self._cpu_budget
            rate = self._rate.update(
                self._queued_rows / self._bound,
                self._monotonic(),
                dropped=self._rows_dropped,
                busy=budget is not None and cpu_share > budget,
                idle=budget is None or cpu_share < budget / 2.0,
            )
            estimate = rows_estimate(batch)  # one pass: what follows is arithmetic
            held = estimate.rows()
            room = self._bound - self._queued_rows
            if held > room and not self._closed:
                cut_held = estimate.rows(requests_only=True)
                if estimate.requests and cut_held <= room:  # cut to its request-level events
                    self._rows_dropped += estimate.rows(rate) - estimate.rows(
                        rate, requests_only=True
                    )
                    batch, held = requests_only(batch), cut_held
            if held > room or self._closed:  # (never a cut batch: it fits)
                self._rows_dropped += estimate.rows(rate)
                return
            self._queued_rows += held
        self._queue.put(Batch(batch, received_ts, held, rate))

    def put(self, item: Call | object) -> None:
        """A call or ``STOP``: outside the bound."""
        self._queue.put(item)

    def get(self, timeout: float) -> object | None:
        """The next item, or None after ``timeout`` seconds without one."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def written(self, rows: int) -> None:
        """The writer is done with ``rows`` of what it took (written or rejected)."""
        with self._lock:
            self._queued_rows -= rows

    def counters(self) -> dict[str, object]:
        """Its part of ``History.stats()``."""
        with self._lock:
            return {
                "rows_dropped": self._rows_dropped,
                "block_sample_rate": self._rate.rate,
                "block_sample_rate_max": self._rate.ceiling,
                "block_sample_rate_changes": self._rate.changes,
                "events_invalid": self._validator.total,
                "queue_rows": self._queued_rows,
            }
