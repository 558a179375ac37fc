"""The single writer of one DuckDB history file: ``History``.

Callers (the daemon's ingest and decision paths) hand rows or event batches to ``record`` /
``record_batch``, which only append to a bounded in-memory queue and never block: beyond
``queue_max_rows`` rows are dropped and counted (``policyd.history.intake``). One writer thread
owns the DuckDB connection (``policyd.history.writer``): it drains the queue, groups rows per
table and appends them as Arrow tables every ``flush_interval_s`` (``INSERT INTO t SELECT ...
FROM arrow``: ~0.5-0.9M rows/s against a few hundred rows/s with executemany). The same thread
applies retention, publishes snapshots and serves the daemon's own reads (``query_live``), so
nothing else ever touches the connection.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final, TypeVar

import pyarrow as pa  # type: ignore[import-untyped]

from policyd.core.types import EventBatch
from policyd.history.config import HistoryConfig
from policyd.history.intake import STOP, Call, Intake
from policyd.history.revisions import HistoryError, migrate
from policyd.history.schema import check_rows
from policyd.history.writer import Writer

__all__ = ["CLOSE_FLUSH_TIMEOUT_S", "History", "HistoryConfig"]

T = TypeVar("T")

# closing waits this long for the queued rows (at most ``queue_max_rows``: a full queue took
# ~20 s to write on a loaded 2-core machine, and 10 s was too short - rows were left unwritten)
CLOSE_FLUSH_TIMEOUT_S: Final = 180.0


class History:
    """The single writer of one DuckDB file. A writer thread owns the connection and appends
    batches through Arrow; callers never block."""

    def __init__(
        self,
        config: HistoryConfig,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        defer: Callable[[], bool] | None = None,
    ) -> None:
        """``clock`` stamps flushes, snapshots and retention's cutoff; ``monotonic`` paces the
        adaptive sample rate; ``defer`` is true while more urgent work waits for the
        interpreter lock (the daemon: its Engine is behind), and the writer then steps aside
        before each event batch it fans out."""
        self.config = config
        self.clock = clock
        self.monotonic = monotonic
        self.defer = defer
        self._intake = Intake(config, monotonic)
        self._writer = Writer(config, self._intake, clock=clock, defer=defer)
        self._thread: threading.Thread | None = None
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Migrate the file (refusing SchemaTooNew), open it, start the writer thread."""
        if self._thread is not None:
            raise HistoryError("History.start() called twice")
        migrate(self.config.db_path)
        self._writer.open()
        # pyarrow imports pandas at its first conversion (~0.6 s of CPU, holding the
        # interpreter lock): here, not at the first write, when events are already arriving
        pa.array([0])
        self._thread = threading.Thread(
            target=self._writer.run, name="policyd-history", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Flush, publish a final snapshot, stop the writer and close the file. Idempotent."""
        if self._closed or self._thread is None:
            self._closed = True
            self._intake.close()
            return
        try:
            if self._thread.is_alive():
                self.flush(CLOSE_FLUSH_TIMEOUT_S)
                self.publish_snapshot()
        finally:
            self._closed = True
            self._intake.close()
            self._intake.put(STOP)
            self._thread.join(timeout=60)
            self._writer.close()

    def __enter__(self) -> History:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the callers' side (never blocks) ------------------------------------------------------

    @property
    def block_sample_rate(self) -> float:
        """The share of block rows kept now (the setting, halved while the writer is behind)."""
        return self._intake.rate

    def set_block_sample_rate(self, rate: float) -> None:
        """The most of the block rows to keep (the ``block_sample_rate`` setting), from now on."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"block_sample_rate must be in [0, 1], got {rate}")
        self._intake.set_ceiling(rate)

    def record(self, table: str, rows: Sequence[Mapping[str, object]]) -> bool:
        """Queue rows for ``table`` (the dicts are kept, not copied: do not mutate them after).
        Unknown table or column -> ValueError; over the queue's bound -> the rows are dropped
        and counted, and False is returned. A missing column is NULL."""
        check_rows(table, rows)
        if not rows:
            return True
        return self._intake.put_rows(table, rows)

    def record_batch(self, batch: EventBatch, *, received_ts: float) -> None:
        """Queue an event batch for ``requests`` and (sampled) ``block_accesses`` rows.

        The queue's bound counts what a batch holds until the writer fans it out - every event
        and hash, whatever the sample rate - so memory stays bounded however low the rate goes.
        A batch past the bound is cut to its request-level events, whose rows still go in while
        they fit; the rows its block events would have made are dropped and counted. Events out
        of their schema's ranges (``policyd.core.validate``) are left out first, counted."""
        self._intake.put_batch(batch, received_ts, cpu_share=self._writer.cpu_share)

    # ---- calls, answered by the writer thread ------------------------------------------------

    def _call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """Run ``fn`` on the writer thread after everything queued before it is written."""
        thread = self._thread
        if thread is None or not thread.is_alive() or not self._writer.is_open:
            raise HistoryError(
                f"the history writer is not running ({self._writer.errors.last_error or 'stopped'})"
            )
        call = Call(fn)
        self._intake.put(call)
        try:
            return call.future.result(timeout=timeout_s)  # type: ignore[return-value]
        except TimeoutError:
            raise HistoryError(f"the history writer did not answer within {timeout_s} s") from None

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until everything queued so far is on disk."""
        self._call(lambda: None, timeout_s)

    def publish_snapshot(self, timeout_s: float = 600.0) -> Path:
        """Copy the database into a fresh file next to the snapshot path and rename it into
        place atomically (readers see the old snapshot or the new one, never a partial one)."""
        return self._call(self._writer.publish, timeout_s)

    def apply_retention(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Apply the retention rules now; returns rows deleted per table."""
        return self._call(self._writer.retain, timeout_s)

    def query_live(self, sql: str, params: Sequence[object] = ()) -> list[tuple[object, ...]]:
        """Daemon-internal read on the writer's connection, serialised by the writer thread.
        Never for user SQL (see policyd.history.safe_sql)."""
        return self._call(lambda: self._writer.connection.rows(sql, params), 30.0)

    def stats(self) -> dict[str, object]:
        """Counters for /stats and Prometheus."""
        path = self.config.db_path
        intake = self._intake.counters()
        writer = self._writer
        return {
            "rows_written": dict(writer.appender.rows_written),
            "rows_dropped": intake["rows_dropped"],
            "block_sample_rate": intake["block_sample_rate"],
            "block_sample_rate_max": intake["block_sample_rate_max"],
            "block_sample_rate_changes": intake["block_sample_rate_changes"],
            "rows_rejected": writer.errors.rows_rejected,
            "events_invalid": intake["events_invalid"],
            "request_updates_unmatched": writer.appender.request_updates_unmatched,
            "queue_rows": intake["queue_rows"],
            "flushes": writer.flushes,
            "deferrals": writer.deferrals,
            "cpu_share": writer.cpu_share,
            "cpu_budget": self.config.cpu_budget,
            "last_flush_ts": writer.last_flush_ts,
            "last_snapshot_ts": writer.last_snapshot_ts,
            "last_retention_ts": writer.last_retention_ts,
            "last_error": writer.errors.last_error,
            "snapshot_path": str(self.config.resolved_snapshot_path),
            "db_path": str(path),
            "db_bytes": path.stat().st_size if path.exists() else 0,
            "duckdb_memory_bytes": writer.duckdb_memory_bytes,
            "writer_alive": self._thread is not None and self._thread.is_alive(),
        }
