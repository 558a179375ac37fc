"""The daemon's engine worker: takes what ingest queued, applies it to the Engine, and fans the
applied batches out to the history."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Final

from policyd.core.engine import Engine
from policyd.daemon.ingest import IngestQueue, Received
from policyd.daemon.locking import YieldingLock
from policyd.history import History
from policyd.history.process import HistoryProcess

YIELD_S: Final = 0.0002  # how long the engine worker steps aside for a waiting lock holder


def engine_behind(queue: IngestQueue) -> bool:
    """Whether the Engine's backlog is past half the depth at which block events are shed:
    the history writer then steps aside, so that the interpreter lock goes to applying
    events first - a history that falls behind samples its block rows, an Engine that
    falls behind sheds block events from the policy's view."""
    return queue.depth > queue.shed_above // 2


class EngineWorker:
    """Applies queued batches to ``engine`` and counts them in ``counts`` (``events``,
    ``block_events``); an applied batch that ingest did not already hand to the history is
    recorded there.

    ``run`` is the ``policyd-engine`` thread's loop; ``drain`` runs on the stopping thread
    once that thread has ended (or on a test's thread, with no worker running). Each batch is
    applied under ``lock`` (so an HTTP decision waits at most one batch); when another thread
    waits for the lock after a batch, the worker sleeps ``YIELD_S`` to let it in; the history
    is fed after the lock is released. ``tick`` (housekeeping's thread) finishes idle
    workflows under the lock."""

    def __init__(
        self,
        lock: YieldingLock,
        engine: Engine,
        queue: IngestQueue,
        history: History | HistoryProcess,
        counts: Counter[str],
    ) -> None:
        self.lock = lock
        self.engine = engine
        self.queue = queue
        self.history = history
        self.counts = counts

    def run(self, stop: threading.Event) -> None:
        """Apply what arrives until ``stop`` is set."""
        while not stop.is_set():
            self.apply_items(self.queue.take(16, 0.05))

    def drain(self) -> None:
        """Apply everything queued now, on the calling thread."""
        while True:
            items = self.queue.take(256, 0.0)
            if not items:
                return
            self.apply_items(items)

    def tick(self) -> None:
        with self.lock:
            self.engine.tick()

    def apply_items(self, items: Sequence[Received]) -> None:
        validator = self.queue.validator
        for item in items:
            with self.lock:  # per batch: HTTP decisions wait at most one batch
                # the checks that need the Engine's state (ingest did the stateless ones)
                batch = validator.check_hits(item.batch, self.engine.state)
                applied = self.engine.apply(batch)  # False: a duplicate or regressed seq
                if applied:
                    dropped = len(item.batch.events) - len(batch.events)
                    self.counts["events"] += item.events - dropped
                    self.counts["block_events"] += item.block_events
            if self.lock.contended:  # a decision or a snapshot waits: let it in first
                time.sleep(YIELD_S)
            if applied and batch.events and not item.recorded:
                self.history.record_batch(batch, received_ts=item.received_ts)
