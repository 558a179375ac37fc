"""The DuckDB history: one writer (the daemon), versioned schema, published snapshots, safe SQL.

See docs/HISTORY.md. The daemon calls ``History`` (record, flush, publish_snapshot, stats,
query_live, close); users read through ``run_readonly_query`` / ``query_history`` (``policyd
sql``) or open the published snapshot with any DuckDB client.
"""

from __future__ import annotations

from policyd.history.files import (
    DB_PATH_ENV,
    DEFAULT_DB_PATH,
    default_db_path,
    default_snapshot_path,
)
from policyd.history.revisions import (
    HistoryError,
    SchemaTooNew,
    head_revision,
    known_revisions,
    migrate,
    schema_revision,
)
from policyd.history.safe_sql import QueryResult, SqlRefused, query_history, run_readonly_query
from policyd.history.schema import TABLES
from policyd.history.store import History, HistoryConfig

__all__ = [
    "DB_PATH_ENV",
    "DEFAULT_DB_PATH",
    "TABLES",
    "History",
    "HistoryConfig",
    "HistoryError",
    "QueryResult",
    "SchemaTooNew",
    "SqlRefused",
    "default_db_path",
    "default_snapshot_path",
    "head_revision",
    "known_revisions",
    "migrate",
    "query_history",
    "run_readonly_query",
    "schema_revision",
]
