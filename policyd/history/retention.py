"""The history's retention rules: rows older than ``retention_s``, then the oldest rows beyond
``retention_rows`` per table, deleted. DuckDB reuses the freed blocks; the file does not shrink.
"""

from __future__ import annotations

from policyd.history.config import HistoryConfig
from policyd.history.connection import WriterConnection
from policyd.history.schema import TABLES


def apply_retention(
    connection: WriterConnection, config: HistoryConfig, now: float
) -> dict[str, int]:
    """Apply ``config``'s rules at wall-clock time ``now``; returns rows deleted per table
    (every table, 0 where none; nothing is deleted when both rules are None)."""
    deleted = dict.fromkeys(TABLES, 0)
    cutoff = None if config.retention_s is None else now - config.retention_s
    cap = config.retention_rows
    for table in TABLES:
        if cutoff is not None:
            deleted[table] += connection.count(f'DELETE FROM "{table}" WHERE ts < ?', [cutoff])
        if cap is not None:
            excess = connection.count(f'SELECT count(*) FROM "{table}"') - cap
            if excess > 0:
                deleted[table] += connection.count(
                    f'DELETE FROM "{table}" WHERE rowid IN (SELECT rowid FROM "{table}" '
                    "ORDER BY ts, rowid LIMIT ?)",
                    [excess],
                )
    return deleted
