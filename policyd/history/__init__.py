"""The DuckDB history: one writer (the daemon), versioned schema, published snapshots, safe SQL.

See docs/HISTORY.md. The daemon calls ``History`` (record, flush, publish_snapshot, stats,
query_live, close); users read through ``run_readonly_query`` / ``query_history`` (``policyd
sql``) or open the published snapshot with any DuckDB client.

Each name below is imported from its module on first use, so that ``policyd sql`` (DuckDB
only) does not pay for the writer's Arrow schema.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policyd.history.config import HistoryConfig
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
    from policyd.history.safe_sql import (
        QueryResult,
        SqlRefused,
        query_history,
        run_readonly_query,
    )
    from policyd.history.schema import TABLES
    from policyd.history.store import History

_MODULE_OF = {
    **dict.fromkeys(
        ("DB_PATH_ENV", "DEFAULT_DB_PATH", "default_db_path", "default_snapshot_path"), "files"
    ),
    **dict.fromkeys(
        (
            "HistoryError",
            "SchemaTooNew",
            "head_revision",
            "known_revisions",
            "migrate",
            "schema_revision",
        ),
        "revisions",
    ),
    **dict.fromkeys(
        ("QueryResult", "SqlRefused", "query_history", "run_readonly_query"), "safe_sql"
    ),
    "TABLES": "schema",
    "History": "store",
    "HistoryConfig": "config",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


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
