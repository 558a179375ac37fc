"""The history writer's own DuckDB connection, and the only one it uses.

Opened on a migrated file with the writer's settings: no progress bar, ``memory_limit`` (DuckDB's
buffer-pool cap), one thread (appends need no parallel scan: the other cores stay with the
Engine and the senders). Every statement's result is read to the end: DuckDB refuses any other
work on a connection whose last result is unfinished, so a half-read result would fail every
later write. Not thread-safe: one thread (the writer's) uses it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa  # type: ignore[import-untyped]

from policyd.history.revisions import _open_error


class WriterConnection:
    """One read-write connection to the history file (see the module)."""

    def __init__(self, db_path: Path, *, memory_limit: str) -> None:
        """Open ``db_path`` (already migrated); ``memory_limit`` is a validated size like
        ``512MB``. A file that cannot be opened (held, unreadable) raises ``HistoryError``."""
        try:
            self.duckdb = duckdb.connect(str(db_path))
            self.duckdb.execute("SET enable_progress_bar = false")  # no bars in the daemon's log
            self.duckdb.execute(f"SET memory_limit = '{memory_limit}'")  # validated by the config
            self.duckdb.execute("SET threads = 1")
        except duckdb.Error as exc:
            raise _open_error(db_path, exc) from exc

    def rows(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        """Every row of a statement."""
        return self.duckdb.execute(sql, list(params)).fetchall()

    def first_row(self, sql: str, params: Sequence[object] = ()) -> tuple[Any, ...] | None:
        """The first row of a statement (its result read to the end all the same)."""
        rows = self.rows(sql, params)
        return tuple(rows[0]) if rows else None

    def count(self, sql: str, params: Sequence[object] = ()) -> int:
        """The number in the first column of the first row (rows a DELETE or UPDATE touched, a
        ``count(*)``); 0 when there is none."""
        row = self.first_row(sql, params)
        return int(row[0]) if row else 0

    @contextmanager
    def registered(self, name: str, data: pa.Table) -> Iterator[None]:
        """``data`` readable as the view ``name`` in statements run meanwhile."""
        self.duckdb.register(name, data)
        try:
            yield
        finally:
            self.duckdb.unregister(name)

    def memory_bytes(self) -> int | None:
        """DuckDB's memory use now (capped by ``memory_limit``; a reading takes ~10 ms)."""
        row = self.first_row("SELECT sum(memory_usage_bytes) FROM duckdb_memory()")
        return int(row[0] or 0) if row else None

    def close(self) -> None:
        self.duckdb.close()
