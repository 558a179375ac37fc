"""The history's writer thread: the one thread that touches the DuckDB connection.

It takes the intake's items in order: rows are set aside, event batches fanned out into rows
(``policyd.history.fanout``), and everything set aside is written (``Appender``) every
``flush_interval_s`` or once ``WRITE_ROWS`` rows wait. A call runs after everything queued
before it is written. The same thread applies retention every ``retention_interval_s`` and
publishes a snapshot every ``snapshot_interval_s``. A failing periodic task is recorded in
``errors.last_error`` and the thread goes on. It opens and closes the connection (``open``,
``close``).

Its CPU on rows (fanning out and appending; not snapshots, retention nor calls: fewer rows
would not make those cheaper) is measured over each ``CPU_WINDOW_S`` as ``cpu_share``, for the
intake's ``cpu_budget``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Final

import duckdb

from policyd.history.appender import Appender, WriterErrors
from policyd.history.config import HistoryConfig
from policyd.history.connection import WriterConnection
from policyd.history.fanout import FanOut, Pending
from policyd.history.intake import STOP, Batch, Call, Intake, Rows
from policyd.history.retention import apply_retention
from policyd.history.revisions import HistoryError
from policyd.history.snapshot import copy_database

# how long the writer steps aside (releasing the interpreter lock) before fanning out an event
# batch while ``defer`` says that more urgent work waits: a fan-out takes ~0.5 ms
DEFER_S: Final = 0.002
CPU_WINDOW_S: Final = 1.0  # the writer's CPU share (cpu_budget) is measured over this
# a write happens when this many rows are pending, even before flush_interval_s
WRITE_ROWS: Final = 200_000
MEMORY_PROBE_S: Final = 5.0  # seconds between readings of DuckDB's own memory (~10 ms each)


class Writer:
    """The writer thread's work (see the module). ``run`` is the thread's body; the other
    methods run on that thread too, but for ``open`` and ``close`` (before it starts and after
    it ended) and reading the counters (any time)."""

    def __init__(
        self,
        config: HistoryConfig,
        intake: Intake,
        *,
        clock: Callable[[], float],
        defer: Callable[[], bool] | None,
    ) -> None:
        self.config = config
        self.clock = clock
        self._connection: WriterConnection | None = None
        self._intake = intake
        # true while more urgent work waits for the interpreter lock (the daemon: its Engine
        # is behind); the writer then steps aside before each event batch it fans out
        self._defer = defer
        self.errors = WriterErrors()
        self.appender = Appender(self.errors)
        self.fanout = FanOut(block_sample_rate=config.block_sample_rate)
        self.pending = Pending()
        self._pending_estimate = 0  # what the pending rows held in the intake's bound
        self.deferrals = 0
        self.flushes = 0
        self.last_flush_ts: float | None = None
        self.last_snapshot_ts: float | None = None
        self.last_retention_ts: float | None = None
        self.cpu_share = 0.0  # the thread's CPU on rows, in cores, over CPU_WINDOW_S
        self._upkeep_cpu_s = 0.0  # its CPU on snapshots, retention and calls (not counted)
        self.duckdb_memory_bytes: int | None = None  # DuckDB's buffer pool use, last read
        self._memory_probed_s = -1e18

    def open(self) -> None:
        """Open the (migrated) file; ``HistoryError`` when it cannot be."""
        self._connection = WriterConnection(
            self.config.db_path, memory_limit=self.config.memory_limit
        )

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    @property
    def is_open(self) -> bool:
        return self._connection is not None

    @property
    def connection(self) -> WriterConnection:
        if self._connection is None:
            raise HistoryError(f"{self.config.db_path} is not open")
        return self._connection

    def run(self) -> None:
        now = time.monotonic()
        next_write = now + self.config.flush_interval_s
        next_retention = now + self.config.retention_interval_s
        interval = self.config.snapshot_interval_s
        next_snapshot = now + interval if interval else float("inf")
        cpu_at, cpu_s = now, self._row_cpu_s()
        while True:
            item = self._intake.get(timeout=max(0.0, next_write - time.monotonic()))
            if item is STOP:
                self._guard(self.write_pending)
                return
            if isinstance(item, Call):
                self._guard(self.write_pending)
                self._upkeep(partial(self._serve, item))
            elif item is not None:
                self._take(item)
            now = time.monotonic()
            if now - cpu_at >= CPU_WINDOW_S:
                cpu_now = self._row_cpu_s()
                self.cpu_share = (cpu_now - cpu_s) / (now - cpu_at)
                cpu_at, cpu_s = now, cpu_now
            if now >= next_write or self.pending.rows >= WRITE_ROWS:
                self._guard(self.write_pending)
                next_write = now + self.config.flush_interval_s
            if now >= next_retention:
                self._upkeep(lambda: self._guard(self.retain))
                next_retention = now + self.config.retention_interval_s
            if now >= next_snapshot:
                self._upkeep(lambda: self._guard(self.publish))
                next_snapshot = now + (interval or float("inf"))

    def _row_cpu_s(self) -> float:
        """The thread's CPU so far, but for upkeep (``_upkeep``)."""
        return time.thread_time() - self._upkeep_cpu_s

    def _upkeep(self, fn: Callable[[], object]) -> None:
        """Run work that is not rows (a snapshot, retention, a call) and count its CPU apart."""
        started = time.thread_time()
        try:
            fn()
        finally:
            self._upkeep_cpu_s += time.thread_time() - started

    def _guard(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as exc:  # the writer must survive a failed periodic task
            self.errors.failed(getattr(fn, "__name__", repr(fn)), exc)

    @staticmethod
    def _serve(call: Call) -> None:
        try:
            call.future.set_result(call.fn())
        except BaseException as exc:
            call.future.set_exception(exc)

    def _take(self, item: object) -> None:
        if isinstance(item, Rows):
            self.pending.add_rows(item.table, item.rows)
            self._pending_estimate += len(item.rows)
        elif isinstance(item, Batch):
            if self._defer is not None and self._defer():
                self.deferrals += 1
                time.sleep(DEFER_S)
            try:
                self.fanout.block_sample_rate = item.rate
                self.fanout.add(self.pending, item.batch, item.received_ts)
            except Exception as exc:
                self.errors.rejected(item.estimate, f"event batch from {item.batch.source}", exc)
            self._pending_estimate += item.estimate

    def write_pending(self) -> None:
        """Write every row set aside so far, and give its room in the intake back."""
        pending, estimate = self.pending, self._pending_estimate
        self.pending, self._pending_estimate = Pending(), 0
        if estimate == 0 and pending.rows == 0:
            return
        try:
            self.appender.write(self.connection, pending)
        finally:
            self._intake.written(estimate)
            self.flushes += 1
            self.last_flush_ts = self.clock()
            self._probe_memory()

    def _probe_memory(self) -> None:
        """Read DuckDB's memory use now and then (``MEMORY_PROBE_S``), so that the daemon's RSS
        can be split into DuckDB's part and the rest; a failed reading keeps the last one."""
        now = time.monotonic()
        if now - self._memory_probed_s < MEMORY_PROBE_S or self._connection is None:
            return
        self._memory_probed_s = now
        try:
            self.duckdb_memory_bytes = self._connection.memory_bytes()
        except duckdb.Error:
            return

    def retain(self) -> dict[str, int]:
        """Apply the retention rules now; rows deleted per table."""
        deleted = apply_retention(self.connection, self.config, self.clock())
        self.last_retention_ts = self.clock()
        return deleted

    def publish(self) -> Path:
        """Publish a snapshot now (``policyd.history.snapshot``); its path."""
        target = self.config.resolved_snapshot_path
        copy_database(
            self.connection.duckdb, target, storage_version=self.config.snapshot_storage_version
        )
        self.last_snapshot_ts = self.clock()
        return target
