"""Writing one flush's pending rows into the history file, through Arrow.

Each table's rows become one Arrow table and one ``INSERT INTO t SELECT ... FROM`` it (never
``executemany``: a few hundred rows/s that way); the prefix-hit and finish columns of requests
whose start row is already on disk become one ``UPDATE ... FROM`` an Arrow table. Rows that do
not fit the schema (a string in a DOUBLE, a NULL ``ts``) are rejected and counted, alone: the rows
queued beside them are still written.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Final

import duckdb
import pyarrow as pa  # type: ignore[import-untyped]

from policyd.core.ratelog import RateLimitedLog, quote
from policyd.history.connection import WriterConnection
from policyd.history.fanout import Pending
from policyd.history.schema import ARROW_SCHEMAS, TABLES

log = logging.getLogger(__name__)

_REQUEST_UPDATE_COLUMNS: Final = (
    "gpu_hit_blocks",
    "host_hit_blocks",
    "recomputed_blocks",
    "finished_ts",
    "output_tokens",
)
# what converting Python values to an Arrow column of the wrong type raises
_CONVERSION_ERRORS: Final = (pa.ArrowException, TypeError, ValueError, OverflowError)


def rows_to_arrow(rows: Sequence[Mapping[str, object]], schema: pa.Schema) -> pa.Table:
    """Dict rows to an Arrow table, column by column (about twice as fast as from_pylist);
    a missing key is NULL, a value of the wrong type raises an Arrow error."""
    return pa.Table.from_arrays(
        [pa.array([row.get(f.name) for row in rows], type=f.type) for f in schema], schema=schema
    )


class WriterErrors:
    """What went wrong on the writer thread: rows rejected (counted, logged at a bounded rate)
    and the last error of any kind, for ``stats()``."""

    def __init__(self) -> None:
        self.rows_rejected = 0
        self.last_error: str | None = None
        self._ratelog = RateLimitedLog(log)

    def rejected(self, n: int, what: str, exc: BaseException) -> None:
        self.rows_rejected += n
        self.last_error = f"{what}: {type(exc).__name__}: {exc}"
        self._ratelog.warning(
            "rejected", "history: rejected %d rows (%s)", n, quote(self.last_error, 300)
        )

    def failed(self, task: str, exc: BaseException) -> None:
        """A periodic task failed (the writer goes on)."""
        self.last_error = f"{type(exc).__name__}: {exc}"
        log.exception("history writer: %s failed", task)


class Appender:
    """Writes ``Pending`` rows on the writer's connection; its counts cover every write since
    it was made."""

    def __init__(self, errors: WriterErrors) -> None:
        self._errors = errors
        self.rows_written = dict.fromkeys(TABLES, 0)
        self.request_updates_unmatched = 0  # updates for a request never seen

    def write(self, conn: WriterConnection, pending: Pending) -> None:
        for table, chunks in pending.chunks.items():
            self._append_chunks(conn, table, chunks)
        if pending.requests_new:
            self._append_chunks(conn, "requests", [list(pending.requests_new.values())])
        blocks = pending.block_table()
        if blocks is not None:
            self._insert_guarded(conn, "block_accesses", blocks)
        if pending.requests_update:
            self._update_requests(conn, list(pending.requests_update.values()))

    def _append_chunks(
        self, conn: WriterConnection, table: str, chunks: list[list[Mapping[str, object]]]
    ) -> None:
        """All record() calls' rows in one conversion and one insert (a row at a time, as
        decisions come, made a one-row Arrow batch each: ~0.1 ms a row); when that fails, each
        call's rows separately, so that a bad chunk is rejected alone."""
        schema = ARROW_SCHEMAS[table]
        if len(chunks) > 1:
            try:
                data = rows_to_arrow(list(chain.from_iterable(chunks)), schema)
                self._insert_or_raise(conn, table, data)
            except (*_CONVERSION_ERRORS, duckdb.Error):
                pass  # find the chunk that broke it, below
            else:
                self.rows_written[table] += data.num_rows
                return
        for rows in chunks:
            try:
                part = rows_to_arrow(rows, schema)
            except _CONVERSION_ERRORS as exc:
                self._errors.rejected(len(rows), f"{table} rows", exc)
                continue
            self._insert_guarded(conn, table, part)

    def _insert_guarded(self, conn: WriterConnection, table: str, data: pa.Table) -> None:
        try:
            self._insert_or_raise(conn, table, data)
            self.rows_written[table] += data.num_rows
        except duckdb.Error as exc:
            self._errors.rejected(data.num_rows, f"{table} insert", exc)

    def _insert_or_raise(self, conn: WriterConnection, table: str, data: pa.Table) -> None:
        columns = ", ".join(f'"{name}"' for name in data.column_names)
        with conn.registered("_policyd_rows", data):
            conn.rows(f'INSERT INTO "{table}" ({columns}) SELECT {columns} FROM _policyd_rows')

    def _update_requests(self, conn: WriterConnection, updates: list[dict[str, object]]) -> None:
        """Fill in prefix-hit and finish columns of requests whose start row is already on disk."""
        schema = pa.schema(
            [("request_id", pa.string())]
            + [(c, ARROW_SCHEMAS["requests"].field(c).type) for c in _REQUEST_UPDATE_COLUMNS]
        )
        try:
            data = rows_to_arrow(updates, schema)
        except _CONVERSION_ERRORS as exc:
            self._errors.rejected(len(updates), "requests updates", exc)
            return
        sets = ", ".join(
            f'"{c}" = coalesce(u."{c}", requests."{c}")' for c in _REQUEST_UPDATE_COLUMNS
        )
        try:
            with conn.registered("_policyd_updates", data):
                updated = conn.count(
                    f"UPDATE requests SET {sets} FROM _policyd_updates u "
                    "WHERE requests.request_id = u.request_id"
                )
        except duckdb.Error as exc:
            self._errors.rejected(len(updates), "requests updates", exc)
            return
        self.request_updates_unmatched += max(0, len(updates) - updated)
