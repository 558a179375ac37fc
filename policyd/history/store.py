"""The single writer of one DuckDB history file.

Callers (the daemon's ingest and decision paths) hand rows or event batches to ``record`` /
``record_batch``, which only append to a bounded in-memory queue and never block: beyond
``queue_max_rows`` rows are dropped and counted. One writer thread owns the DuckDB connection;
it drains the queue, groups rows per table and appends them as Arrow tables every
``flush_interval_s`` (``INSERT INTO t SELECT ... FROM arrow``: measured at ~0.5-0.9M
rows/s this way against a few hundred rows/s with executemany). The same thread applies
retention, publishes snapshots and serves the daemon's own reads, so nothing else ever touches
the connection.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any, Final, TypeVar

import duckdb
import pyarrow as pa  # type: ignore[import-untyped]

from policyd.core.ratelog import RateLimitedLog, quote
from policyd.core.types import EventBatch
from policyd.core.validate import Validator
from policyd.history.fanout import FanOut, Pending, requests_only, rows_estimate
from policyd.history.files import default_snapshot_path
from policyd.history.revisions import HistoryError, _open_error, migrate
from policyd.history.sampling import AdaptiveRate
from policyd.history.schema import ARROW_SCHEMAS, TABLES, check_rows
from policyd.history.snapshot import copy_database

log = logging.getLogger(__name__)
T = TypeVar("T")

# how long the writer steps aside (releasing the interpreter lock) before fanning out an event
# batch while ``History.defer`` says that more urgent work waits: a fan-out takes ~0.5 ms
DEFER_S: Final = 0.002
CPU_WINDOW_S: Final = 1.0  # the writer's CPU share (cpu_budget) is measured over this
# a write happens when this many rows are pending, even before flush_interval_s
WRITE_ROWS: Final = 200_000
_REQUEST_UPDATE_COLUMNS: Final = (
    "gpu_hit_blocks",
    "host_hit_blocks",
    "recomputed_blocks",
    "finished_ts",
    "output_tokens",
)


_MEMORY_LIMIT: Final = re.compile(r"[0-9]+(\.[0-9]+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)")


@dataclass(frozen=True)
class HistoryConfig:
    """How the history is kept. Every field has a production default."""

    db_path: Path
    """The live DuckDB file (created and migrated on start)."""
    snapshot_path: Path | None = None
    """Where snapshots are published; default: ``db_path`` with suffix ``.snapshot.duckdb``."""
    block_sample_rate: float = 1.0
    """Fraction of block-level rows kept, chosen by block hash (a kept block keeps all rows).
    With ``adaptive_sampling`` this is the most that is kept."""
    adaptive_sampling: bool = True
    """Halve the block rows' sample rate while the writer falls behind (its queue past half of
    ``queue_max_rows`` and growing; ``policyd.history.sampling``) and double it back, up to
    ``block_sample_rate``, once it has caught up:
    a smaller, still hash-consistent sample instead of whole batches dropped at the bound.
    Every block row records the rate it was sampled at (``sample_rate``)."""
    min_block_sample_rate: float = 2.0**-10
    """The adaptive rate is not halved below this."""
    retention_s: float | None = None
    """Drop rows whose ``ts`` is older than this many seconds; None keeps them."""
    retention_rows: int | None = None
    """Keep at most this many rows per table (the newest by ``ts``); None = no cap."""
    flush_interval_s: float = 0.5
    """How often pending rows are appended to the file."""
    queue_max_rows: int = 1_000_000
    """Rows queued in memory beyond which ``record`` drops (and counts) instead of blocking."""
    retention_interval_s: float = 60.0
    """How often the writer applies the retention rules."""
    snapshot_interval_s: float | None = 60.0
    """How often the writer publishes a snapshot by itself; None = only on request and close."""
    snapshot_storage_version: str | None = "v1.0.0"
    """DuckDB storage version of snapshots, so older DuckDB clients read them; None = this one."""
    cpu_budget: float | None = 0.25
    """Share of one core the writer thread may use on rows (fanning events out, DuckDB's
    appends; snapshots, retention and calls are not counted: fewer rows would not make them
    cheaper) before it halves the block rows' sample rate, as if it were behind
    (``adaptive_sampling``; doubled back only under half of it); None: no budget. It keeps a
    busy history from taking the machine from the daemon's Engine."""
    memory_limit: str = "512MB"
    """DuckDB's buffer-pool cap for the writer connection (its default is 80% of the machine's
    memory, which lets a long-running daemon's RSS grow with the file)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.block_sample_rate <= 1.0:
            raise ValueError(f"block_sample_rate must be in [0, 1], got {self.block_sample_rate}")
        if not 0.0 < self.min_block_sample_rate <= 1.0:
            raise ValueError(
                f"min_block_sample_rate must be in (0, 1], got {self.min_block_sample_rate}"
            )
        for name in ("retention_s", "retention_rows", "snapshot_interval_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value}")
        if self.flush_interval_s <= 0 or self.retention_interval_s <= 0:
            raise ValueError("flush_interval_s and retention_interval_s must be positive")
        if self.queue_max_rows < 1:
            raise ValueError(f"queue_max_rows must be >= 1, got {self.queue_max_rows}")
        if self.cpu_budget is not None and self.cpu_budget <= 0.0:
            raise ValueError(f"cpu_budget must be positive or None, got {self.cpu_budget}")
        if not _MEMORY_LIMIT.fullmatch(self.memory_limit):
            raise ValueError(
                f"memory_limit must look like '512MB' or '2GiB', got {self.memory_limit!r}"
            )
        if Path(self.resolved_snapshot_path).resolve() == Path(self.db_path).resolve():
            raise ValueError("snapshot_path must differ from db_path")

    @property
    def resolved_snapshot_path(self) -> Path:
        return self.snapshot_path or default_snapshot_path(self.db_path)


def rows_to_arrow(rows: Sequence[Mapping[str, object]], schema: pa.Schema) -> pa.Table:
    """Dict rows to an Arrow table, column by column (about twice as fast as from_pylist);
    a missing key is NULL, a value of the wrong type raises an Arrow error."""
    return pa.Table.from_arrays(
        [pa.array([row.get(f.name) for row in rows], type=f.type) for f in schema], schema=schema
    )


# closing waits this long for the queued rows (at most ``queue_max_rows``: a full queue took
# ~20 s to write on a loaded 2-core machine, and 10 s was too short - rows were left unwritten)
CLOSE_FLUSH_TIMEOUT_S: Final = 180.0


@dataclass
class _Rows:
    table: str
    rows: Sequence[Mapping[str, object]]


@dataclass
class _Batch:
    batch: EventBatch
    received_ts: float
    estimate: int  # what it holds, in rows (rows_estimate at rate 1), until fanned out
    rate: float  # the block rows' sample rate it was admitted at


@dataclass
class _Call:
    fn: Callable[[], object]
    future: Future[object] = field(default_factory=Future)


_STOP: Final = object()
MEMORY_PROBE_S: Final = 5.0  # seconds between readings of DuckDB's own memory (~10 ms each)


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
        self.config = config
        self.clock = clock
        self.monotonic = monotonic
        # true while more urgent work waits for the interpreter lock (the daemon: its Engine
        # is behind); the writer then steps aside before each event batch it fans out
        self.defer = defer
        self._deferrals = 0
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued_rows = 0
        self._rows_dropped = 0
        self._rows_rejected = 0
        self._validator = Validator()  # out-of-range events are left out of the rows
        self._ratelog = RateLimitedLog(log)
        self._rows_written = dict.fromkeys(TABLES, 0)
        self._request_updates_unmatched = 0
        self._last_flush_ts: float | None = None
        self._last_snapshot_ts: float | None = None
        self._last_retention_ts: float | None = None
        self._last_error: str | None = None
        self._flushes = 0
        self._duckdb_memory_bytes: int | None = None  # DuckDB's buffer pool use, last read
        self._memory_probed_s = -1e18
        self._conn: duckdb.DuckDBPyConnection | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._fanout = FanOut(block_sample_rate=config.block_sample_rate)
        # the block rows' sample rate (adaptive_sampling); guarded by _lock
        self._rate = AdaptiveRate(
            ceiling=config.block_sample_rate,
            floor=config.min_block_sample_rate,
            now=monotonic(),
            adaptive=config.adaptive_sampling,
        )
        self._pending = Pending()
        self._pending_estimate = 0
        self._cpu_share = 0.0  # the writer thread's CPU on rows, in cores, over CPU_WINDOW_S
        self._upkeep_cpu_s = 0.0  # its CPU on snapshots, retention and calls (not counted)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Migrate the file (refusing SchemaTooNew), open it, start the writer thread."""
        if self._thread is not None:
            raise HistoryError("History.start() called twice")
        migrate(self.config.db_path)
        try:
            self._conn = duckdb.connect(str(self.config.db_path))
            self._conn.execute("SET enable_progress_bar = false")  # no bars in the daemon's log
            self._conn.execute(f"SET memory_limit = '{self.config.memory_limit}'")  # validated
            # appends need no parallel scan: one thread (the writer's own, outside the
            # interpreter lock) leaves the other cores to the Engine and the senders
            self._conn.execute("SET threads = 1")
        except duckdb.Error as exc:
            raise _open_error(self.config.db_path, exc) from exc
        # pyarrow imports pandas at its first conversion (~0.6 s of CPU, holding the
        # interpreter lock): here, not at the first write, when events are already arriving
        pa.array([0])
        self._thread = threading.Thread(target=self._run, name="policyd-history", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Flush, publish a final snapshot, stop the writer and close the file. Idempotent."""
        if self._closed or self._thread is None:
            self._closed = True
            return
        try:
            if self._thread.is_alive():
                self.flush(CLOSE_FLUSH_TIMEOUT_S)
                self.publish_snapshot()
        finally:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join(timeout=60)
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> History:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the callers' side (never blocks) ------------------------------------------------------

    def _admit(self, n: int) -> bool:
        with self._lock:
            if self._closed or self._queued_rows + n > self.config.queue_max_rows:
                self._rows_dropped += n
                return False
            self._queued_rows += n
            return True

    @property
    def block_sample_rate(self) -> float:
        """The share of block rows kept now (the setting, halved while the writer is behind)."""
        with self._lock:
            return self._rate.rate

    def set_block_sample_rate(self, rate: float) -> None:
        """The most of the block rows to keep (the ``block_sample_rate`` setting), from now on."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"block_sample_rate must be in [0, 1], got {rate}")
        with self._lock:
            self._rate.set_ceiling(rate)

    def record(self, table: str, rows: Sequence[Mapping[str, object]]) -> bool:
        """Queue rows for ``table`` (the dicts are kept, not copied: do not mutate them after).
        Unknown table or column -> ValueError; over the queue's bound -> the rows are dropped
        and counted, and False is returned. A missing column is NULL."""
        check_rows(table, rows)
        if not rows:
            return True
        if not self._admit(len(rows)):
            return False
        self._queue.put(_Rows(table, list(rows)))
        return True

    def record_batch(self, batch: EventBatch, *, received_ts: float) -> None:
        """Queue an event batch for ``requests`` and (sampled) ``block_accesses`` rows.

        The queue's bound counts what a batch holds until the writer fans it out - every event
        and hash, whatever the sample rate - so memory stays bounded however low the rate goes.
        A batch past the bound is cut to its request-level events, whose rows still go in while
        they fit; the rows its block events would have made are dropped and counted. Events out
        of their schema's ranges (``policyd.core.validate``) are left out first, counted."""
        batch = self._validator.clean(batch)
        with self._lock:
            budget, share = self.config.cpu_budget, self._cpu_share
            rate = self._rate.update(
                self._queued_rows / self.config.queue_max_rows,
                self.monotonic(),
                dropped=self._rows_dropped,
                busy=budget is not None and share > budget,
                idle=budget is None or share < budget / 2.0,
            )
            estimate = rows_estimate(batch)  # one pass: what follows is arithmetic
            held = estimate.rows()
            room = self.config.queue_max_rows - self._queued_rows
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
        self._queue.put(_Batch(batch, received_ts, held, rate))

    def _call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """Run ``fn`` on the writer thread after everything queued before it is written."""
        thread = self._thread
        if thread is None or not thread.is_alive() or self._conn is None:
            raise HistoryError(
                f"the history writer is not running ({self._last_error or 'stopped'})"
            )
        call = _Call(fn)
        self._queue.put(call)
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
        return self._call(self._publish, timeout_s)

    def apply_retention(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Apply the retention rules now; returns rows deleted per table."""
        return self._call(self._retain, timeout_s)

    def query_live(self, sql: str, params: Sequence[object] = ()) -> list[tuple[object, ...]]:
        """Daemon-internal read on the writer's connection, serialised by the writer thread.
        Never for user SQL (see policyd.history.safe_sql)."""

        def run() -> list[tuple[object, ...]]:
            assert self._conn is not None
            return self._conn.execute(sql, list(params)).fetchall()

        return self._call(run, 30.0)

    def stats(self) -> dict[str, object]:
        """Counters for /stats and Prometheus."""
        path = self.config.db_path
        with self._lock:
            queued, dropped = self._queued_rows, self._rows_dropped
            rate, rate_max, changes = self._rate.rate, self._rate.ceiling, self._rate.changes
        return {
            "rows_written": dict(self._rows_written),
            "rows_dropped": dropped,
            "block_sample_rate": rate,
            "block_sample_rate_max": rate_max,
            "block_sample_rate_changes": changes,
            "rows_rejected": self._rows_rejected,
            "events_invalid": self._validator.total,
            "request_updates_unmatched": self._request_updates_unmatched,
            "queue_rows": queued,
            "flushes": self._flushes,
            "deferrals": self._deferrals,
            "cpu_share": self._cpu_share,
            "cpu_budget": self.config.cpu_budget,
            "last_flush_ts": self._last_flush_ts,
            "last_snapshot_ts": self._last_snapshot_ts,
            "last_retention_ts": self._last_retention_ts,
            "last_error": self._last_error,
            "snapshot_path": str(self.config.resolved_snapshot_path),
            "db_path": str(path),
            "db_bytes": path.stat().st_size if path.exists() else 0,
            "duckdb_memory_bytes": self._duckdb_memory_bytes,
            "writer_alive": self._thread is not None and self._thread.is_alive(),
        }

    # ---- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        now = time.monotonic()
        next_write = now + self.config.flush_interval_s
        next_retention = now + self.config.retention_interval_s
        interval = self.config.snapshot_interval_s
        next_snapshot = now + interval if interval else float("inf")
        # the writer's CPU on rows (fanning out, appending), for cpu_budget: what snapshots,
        # retention and calls take is left out - sampling fewer rows would not make it less
        cpu_at, cpu_s = now, self._row_cpu_s()
        while True:
            timeout = max(0.0, next_write - time.monotonic())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            if item is _STOP:
                self._guard(self._write_pending)
                return
            if isinstance(item, _Call):
                self._guard(self._write_pending)
                self._upkeep(partial(self._serve, item))
            elif item is not None:
                self._take(item)
            now = time.monotonic()
            if now - cpu_at >= CPU_WINDOW_S:
                cpu_now = self._row_cpu_s()
                self._cpu_share = (cpu_now - cpu_s) / (now - cpu_at)
                cpu_at, cpu_s = now, cpu_now
            if now >= next_write or self._pending.rows >= WRITE_ROWS:
                self._guard(self._write_pending)
                next_write = now + self.config.flush_interval_s
            if now >= next_retention:
                self._upkeep(lambda: self._guard(self._retain))
                next_retention = now + self.config.retention_interval_s
            if now >= next_snapshot:
                self._upkeep(lambda: self._guard(self._publish))
                next_snapshot = now + (interval or float("inf"))

    def _row_cpu_s(self) -> float:
        """The writer thread's CPU so far, but for upkeep (``_upkeep``)."""
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
            self._last_error = f"{type(exc).__name__}: {exc}"
            log.exception("history writer: %s failed", getattr(fn, "__name__", fn))

    def _serve(self, call: _Call) -> None:
        try:
            call.future.set_result(call.fn())
        except BaseException as exc:
            call.future.set_exception(exc)

    def _take(self, item: object) -> None:
        if isinstance(item, _Rows):
            self._pending.add_rows(item.table, item.rows)
            self._pending_estimate += len(item.rows)
        elif isinstance(item, _Batch):
            if self.defer is not None and self.defer():
                self._deferrals += 1
                time.sleep(DEFER_S)
            try:
                self._fanout.block_sample_rate = item.rate
                self._fanout.add(self._pending, item.batch, item.received_ts)
            except Exception as exc:
                self._reject(item.estimate, f"event batch from {item.batch.source}", exc)
            self._pending_estimate += item.estimate

    def _reject(self, n: int, what: str, exc: Exception) -> None:
        self._rows_rejected += n
        self._last_error = f"{what}: {type(exc).__name__}: {exc}"
        self._ratelog.warning(
            "rejected", "history: rejected %d rows (%s)", n, quote(self._last_error, 300)
        )

    def _write_pending(self) -> None:
        pending, estimate = self._pending, self._pending_estimate
        self._pending, self._pending_estimate = Pending(), 0
        if estimate == 0 and pending.rows == 0:
            return
        try:
            self._write(pending)
        finally:
            with self._lock:
                self._queued_rows -= estimate
            self._flushes += 1
            self._last_flush_ts = self.clock()
            self._probe_memory()

    def _first_row(self, sql: str, params: Sequence[object] = ()) -> tuple[Any, ...] | None:
        """The first row of a statement on the writer's connection, its result read to the end:
        DuckDB refuses any other work on a connection whose last result is unfinished
        (``fetchone`` can leave one open), so a half-read result would fail every later write."""
        assert self._conn is not None
        rows = self._conn.execute(sql, list(params)).fetchall()
        return tuple(rows[0]) if rows else None

    def _probe_memory(self) -> None:
        """Read DuckDB's memory use (capped by ``memory_limit``) now and then, so that the
        daemon's RSS can be split into DuckDB's part and the rest."""
        now = time.monotonic()
        if now - self._memory_probed_s < MEMORY_PROBE_S or self._conn is None:
            return
        self._memory_probed_s = now
        try:
            row = self._first_row("SELECT sum(memory_usage_bytes) FROM duckdb_memory()")
        except duckdb.Error:
            return
        self._duckdb_memory_bytes = int(row[0] or 0) if row else None

    def _write(self, pending: Pending) -> None:
        for table, chunks in pending.chunks.items():
            self._append_chunks(table, chunks)
        if pending.requests_new:
            self._append_chunks("requests", [list(pending.requests_new.values())])
        blocks = pending.block_table()
        if blocks is not None:
            self._insert_guarded("block_accesses", blocks)
        if pending.requests_update:
            self._update_requests(list(pending.requests_update.values()))

    def _append_chunks(self, table: str, chunks: list[list[Mapping[str, object]]]) -> None:
        """All record() calls' rows in one conversion and one insert (a row at a time, as
        decisions come, made a one-row Arrow batch each: ~0.1 ms a row); when that fails, each
        call's rows separately, so that a bad chunk is rejected alone."""
        schema = ARROW_SCHEMAS[table]
        if len(chunks) > 1:
            try:
                data = rows_to_arrow(list(chain.from_iterable(chunks)), schema)
                self._insert_or_raise(table, data)
            except (pa.ArrowException, TypeError, ValueError, OverflowError, duckdb.Error):
                pass  # find the chunk that broke it, below
            else:
                self._rows_written[table] += data.num_rows
                return
        for rows in chunks:
            try:
                part = rows_to_arrow(rows, schema)
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                self._reject(len(rows), f"{table} rows", exc)
                continue
            self._insert_guarded(table, part)

    def _insert_guarded(self, table: str, data: pa.Table) -> None:
        try:
            self._insert_or_raise(table, data)
            self._rows_written[table] += data.num_rows
        except duckdb.Error as exc:
            self._reject(data.num_rows, f"{table} insert", exc)

    def _insert_or_raise(self, table: str, data: pa.Table) -> None:
        assert self._conn is not None
        columns = ", ".join(f'"{name}"' for name in data.column_names)
        self._conn.register("_policyd_rows", data)
        try:
            self._conn.execute(
                f'INSERT INTO "{table}" ({columns}) SELECT {columns} FROM _policyd_rows'
            )
        finally:
            self._conn.unregister("_policyd_rows")

    def _update_requests(self, updates: list[dict[str, object]]) -> None:
        """Fill in prefix-hit and finish columns of requests whose start row is already on disk."""
        assert self._conn is not None
        schema = pa.schema(
            [("request_id", pa.string())]
            + [(c, ARROW_SCHEMAS["requests"].field(c).type) for c in _REQUEST_UPDATE_COLUMNS]
        )
        try:
            data = rows_to_arrow(updates, schema)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            self._reject(len(updates), "requests updates", exc)
            return
        sets = ", ".join(
            f'"{c}" = coalesce(u."{c}", requests."{c}")' for c in _REQUEST_UPDATE_COLUMNS
        )
        self._conn.register("_policyd_updates", data)
        try:
            row = self._first_row(
                f"UPDATE requests SET {sets} FROM _policyd_updates u "
                "WHERE requests.request_id = u.request_id"
            )
        except duckdb.Error as exc:
            self._reject(len(updates), "requests updates", exc)
            return
        finally:
            self._conn.unregister("_policyd_updates")
        updated = int(row[0]) if row else 0
        self._request_updates_unmatched += max(0, len(updates) - updated)

    def _retain(self) -> dict[str, int]:
        """Delete rows older than retention_s, then the oldest rows beyond retention_rows."""
        assert self._conn is not None
        deleted = dict.fromkeys(TABLES, 0)
        cutoff = None if self.config.retention_s is None else self.clock() - self.config.retention_s
        cap = self.config.retention_rows
        for table in TABLES:
            if cutoff is not None:
                row = self._first_row(f'DELETE FROM "{table}" WHERE ts < ?', [cutoff])
                deleted[table] += int(row[0]) if row else 0
            if cap is not None:
                count = self._first_row(f'SELECT count(*) FROM "{table}"')
                excess = (int(count[0]) if count else 0) - cap
                if excess > 0:
                    row = self._first_row(
                        f'DELETE FROM "{table}" WHERE rowid IN (SELECT rowid FROM "{table}" '
                        "ORDER BY ts, rowid LIMIT ?)",
                        [excess],
                    )
                    deleted[table] += int(row[0]) if row else 0
        self._last_retention_ts = self.clock()
        return deleted

    def _publish(self) -> Path:
        assert self._conn is not None
        target = self.config.resolved_snapshot_path
        copy_database(self._conn, target, storage_version=self.config.snapshot_storage_version)
        self._last_snapshot_ts = self.clock()
        return target
