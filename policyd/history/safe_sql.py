"""Running a user's SQL over the history without letting it touch anything else.

The layers (each one alone was found insufficient):

1. a DuckDB instance of its own per query (never the daemon's writer connection): an in-memory
   instance that attaches the file ``READ_ONLY`` as ``history``, so that any number of queries
   run at once, each with its own limits (one instance per file, as before, shared DuckDB's
   instance cache: a second query's connect hit the first one's locked configuration and
   failed, issue #32);
2. configuration set at connect time: external access off (no files, no network, no
   INSTALL/LOAD), extension autoload/autoinstall off, Python replacement scans off, no spilling
   to a temp directory, ``max_execution_time``, ``memory_limit``, few threads, no progress
   bars, and then ``lock_configuration`` so no statement can undo any of it;
3. exactly one statement, of type SELECT, by DuckDB's own parser (a data-modifying CTE parses as
   SELECT: layer 1 refuses it), naming none of the functions that read the server's settings,
   paths or environment (``INTROSPECTION``: ``duckdb_settings()``, ``duckdb_databases()``,
   ``current_setting()``, ``query()`` ...; by DuckDB's tokenizer);
4. rows capped with ``fetchmany(max_rows + 1)``, a timer that interrupts the connection as a
   second guard on the time limit.

Every refusal raises ``SqlRefused`` whose ``rule`` says which layer refused and whose message is
one line a user can act on; a filesystem path in DuckDB's error text is replaced by ``<path>``.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import duckdb

from policyd.history.files import default_snapshot_path, snapshot_is_current
from policyd.history.revisions import HistoryError

ALLOWED_STATEMENTS: Final = frozenset({duckdb.StatementType.SELECT})
QUERY_THREADS: Final = 2


class SqlRefused(ValueError):  # noqa: N818 (the name is the contract, HISTORY_API.md)
    """A user query was refused or failed; ``rule`` names why (see ``RULES``)."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule


RULES: Final[dict[str, str]] = {
    "syntax": "the SQL does not parse",
    "one-statement": "exactly one statement per query",
    "select-only": "only SELECT queries are allowed",
    "read-only": "the history is read-only",
    "external-access": "no file, network or extension access",
    "introspection": "no function that reads the server's settings, paths or environment",
    "locked-configuration": "settings cannot be changed",
    "time-limit": "the query ran past its time limit",
    "memory-limit": "the query needed more memory than its limit",
    "query-error": "the query failed",
}


@dataclass(frozen=True)
class QueryResult:
    columns: list[str]
    rows: list[tuple[object, ...]]
    truncated: bool
    elapsed_ms: float


# DuckDB's own catalog functions that are safe to read (the schema); every other duckdb_* one
# and these names are refused: they show paths (duckdb_databases, duckdb_settings'
# secret_directory, duckdb_extensions' install paths, duckdb_temporary_files), settings or
# secrets, or run a query given as a string (query, query_table) past the check above
SAFE_CATALOG_FUNCTIONS: Final = frozenset(
    {
        "duckdb_columns", "duckdb_constraints", "duckdb_functions", "duckdb_indexes",
        "duckdb_keywords", "duckdb_schemas", "duckdb_tables", "duckdb_types", "duckdb_views",
        "duckdb_sequences", "duckdb_dependencies",
    }
)  # fmt: skip
INTROSPECTION: Final = frozenset(
    {
        "current_setting", "getenv", "getvariable", "which_secret", "query", "query_table",
        "pragma_database_list", "pragma_database_size", "pragma_metadata_info",
        "pragma_storage_info", "pragma_user_agent", "pragma_platform", "parse_filename",
    }
)  # fmt: skip
ATTACH_AS: Final = "history"
_PATH = re.compile(r"(?<![\w.:/])(?:~|\.{1,2})?(?:/[^\s'\"`/,;()]+)+/?")


def scrub_paths(text: str, *paths: str | Path) -> str:
    """``text`` with every filesystem path (the given ones first, then anything that looks like
    an absolute path) replaced by ``<path>``.

    >>> scrub_paths('Cannot open "/root/.duckdb/stored_secrets": denied')
    'Cannot open "<path>": denied'
    >>> scrub_paths("Binder Error: column a/b not found, 1 / 2, tcp://h:1")
    'Binder Error: column a/b not found, 1 / 2, tcp://h:1'
    """
    for path in sorted({str(p) for p in paths if str(p) not in ("", "/", ".")}, key=len)[::-1]:
        text = text.replace(path, "<path>")
    return _PATH.sub("<path>", text)


def lockdown_config(*, timeout_s: float, memory_limit: str) -> dict[str, str | bool | int | float]:
    """The connect-time configuration of a user-query instance (locked by SESSION_SETTINGS;
    external access is turned off once the history file is attached: ``open_locked``)."""
    return {
        "allow_persistent_secrets": False,
        "autoload_known_extensions": False,
        "autoinstall_known_extensions": False,
        "python_enable_replacements": False,
        "python_scan_all_frames": False,
        "temp_directory": "",  # no spilling: a big query hits memory_limit, writes nothing
        "max_execution_time": max(1, round(timeout_s * 1000)),
        "memory_limit": memory_limit,
        "threads": QUERY_THREADS,
    }


# session settings applied after connecting, then the lock (no statement can undo any of it)
SESSION_SETTINGS: Final = (
    "SET enable_progress_bar = false",  # never draw bars into the daemon's log or a CLI pipe
    "SET lock_configuration = true",
)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _classify(exc: duckdb.Error, timeout_s: float, memory_limit: str) -> SqlRefused:
    """Turn a DuckDB error into the rule it hit."""
    line = _first_line(exc)
    lowered = line.lower()
    if isinstance(exc, duckdb.InterruptException):
        return SqlRefused(
            "time-limit", f"refused: the query ran past its time limit of {timeout_s:g} s"
        )
    if isinstance(exc, duckdb.OutOfMemoryException):
        return SqlRefused(
            "memory-limit",
            f"refused: the query needed more than its memory limit of {memory_limit}",
        )
    if isinstance(exc, duckdb.PermissionException) or "disabled by configuration" in lowered:
        return SqlRefused(
            "external-access", f"refused: no file, network or extension access ({line})"
        )
    if "configuration has been locked" in lowered:
        return SqlRefused("locked-configuration", f"refused: settings cannot be changed ({line})")
    if "read-only" in lowered or "read only" in lowered:
        return SqlRefused("read-only", f"refused: the history is read-only ({line})")
    if isinstance(exc, duckdb.ParserException):
        return SqlRefused("syntax", line)
    return SqlRefused("query-error", line)


def check_names(sql: str) -> None:
    """No function that reads the server's settings, paths or environment (``INTROSPECTION``,
    ``duckdb_*`` outside ``SAFE_CATALOG_FUNCTIONS``), by DuckDB's tokenizer: a name quoted or
    qualified (``"duckdb_settings"``, ``main.duckdb_settings``) is the same name."""
    try:
        tokens = duckdb.tokenize(sql)
    except duckdb.Error as exc:
        raise SqlRefused("syntax", _first_line(exc)) from None
    ends = [start for start, _ in tokens[1:]] + [len(sql)]
    for (start, kind), end in zip(tokens, ends, strict=True):
        if kind != duckdb.token_type.identifier:
            continue
        name = sql[start:end].strip().strip('"').lower()
        if name in INTROSPECTION or (
            name.startswith("duckdb_") and name not in SAFE_CATALOG_FUNCTIONS
        ):
            raise SqlRefused(
                "introspection",
                f"refused: {name[:64]} reads the server's settings, paths or environment",
            )


def check_statement(conn: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Exactly one statement, and a SELECT, by DuckDB's parser; no introspection function."""
    if not sql.strip():
        raise SqlRefused("syntax", "empty query")
    try:
        statements = conn.extract_statements(sql)
    except duckdb.Error as exc:
        raise SqlRefused("syntax", scrub_paths(_first_line(exc))) from None
    if len(statements) != 1:
        raise SqlRefused(
            "one-statement", f"refused: exactly one statement per query, got {len(statements)}"
        )
    kind = statements[0].type
    if kind not in ALLOWED_STATEMENTS:
        name = getattr(kind, "name", str(kind))
        raise SqlRefused("select-only", f"refused: only SELECT queries are allowed, got {name}")
    check_names(sql)


def open_locked(db_path: Path, *, timeout_s: float, memory_limit: str) -> duckdb.DuckDBPyConnection:
    """A locked-down in-memory DuckDB instance with ``db_path`` attached read-only as
    ``history`` (and in use): one per query, so queries never share a configuration.
    HistoryError if the file cannot be opened (its message names the file: for the CLI, not for
    the HTTP API)."""
    db_path = Path(db_path)
    if not db_path.is_file():
        raise HistoryError(f"no history file at {db_path}")
    config = lockdown_config(timeout_s=timeout_s, memory_limit=memory_limit)
    conn = duckdb.connect(":memory:", config=config)  # type: ignore[arg-type]
    try:
        literal = str(db_path).replace("'", "''")
        try:
            conn.execute(f"ATTACH '{literal}' AS {ATTACH_AS} (READ_ONLY)")
        except duckdb.Error as exc:
            line = _first_line(exc)
            if "lock" in line.lower():
                raise HistoryError(
                    f"{db_path} is held by another process (a running daemon?): {line}"
                ) from None
            raise HistoryError(f"cannot open {db_path} read-only: {line}") from None
        conn.execute(f"USE {ATTACH_AS}")
        conn.execute("SET enable_external_access = false")  # after the attach, never back
        for statement in SESSION_SETTINGS:
            conn.execute(statement)
    except BaseException:
        conn.close()
        raise
    return conn


def run_readonly_query(
    db_path: Path,
    sql: str,
    *,
    max_rows: int = 10_000,
    timeout_s: float = 5.0,
    memory_limit: str = "256MB",
) -> QueryResult:
    """Run one SELECT on ``db_path`` in a locked-down instance of its own; at most ``max_rows``
    rows come back (``truncated`` says whether there were more). Raises SqlRefused."""
    if max_rows < 0 or timeout_s <= 0:
        raise ValueError("max_rows must be >= 0 and timeout_s > 0")
    started = time.perf_counter()
    conn = open_locked(db_path, timeout_s=timeout_s, memory_limit=memory_limit)
    # second guard on the time limit, covering fetching as well as executing
    timer = threading.Timer(timeout_s + 1.0, conn.interrupt)
    timer.daemon = True
    try:
        check_statement(conn, sql)
        timer.start()
        try:
            cursor = conn.execute(sql)
            columns = [str(d[0]) for d in cursor.description or ()]
            rows = cursor.fetchmany(max_rows + 1)
        except duckdb.Error as exc:
            refused = _classify(exc, timeout_s, memory_limit)
            raise SqlRefused(refused.rule, scrub_paths(str(refused), db_path)) from None
    finally:
        timer.cancel()
        conn.close()
    truncated = len(rows) > max_rows
    return QueryResult(
        columns=columns,
        rows=[tuple(r) for r in rows[:max_rows]],
        truncated=truncated,
        elapsed_ms=(time.perf_counter() - started) * 1000.0,
    )


def query_history(
    db_path: Path,
    sql: str,
    *,
    snapshot_path: Path | None = None,
    max_rows: int = 10_000,
    timeout_s: float = 5.0,
    memory_limit: str = "256MB",
) -> tuple[QueryResult, Path]:
    """Run a user query on whichever history file is readable now; returns it with the file.

    The published snapshot when it is at least as new as the live file; else the live file
    (free when no daemon runs); else, when a daemon holds the live file, the older snapshot.
    Raises HistoryError when the live file is held and no snapshot exists.
    """
    db_path = Path(db_path)
    snapshot = Path(snapshot_path) if snapshot_path else default_snapshot_path(db_path)
    kwargs = {"max_rows": max_rows, "timeout_s": timeout_s, "memory_limit": memory_limit}
    if snapshot_is_current(db_path, snapshot):
        return run_readonly_query(snapshot, sql, **kwargs), snapshot  # type: ignore[arg-type]
    if not db_path.exists():
        raise HistoryError(f"no history at {db_path} (and no snapshot at {snapshot})")
    try:
        return run_readonly_query(db_path, sql, **kwargs), db_path  # type: ignore[arg-type]
    except HistoryError as exc:
        if "held by another process" not in str(exc):
            raise
        if snapshot.exists():
            return run_readonly_query(snapshot, sql, **kwargs), snapshot  # type: ignore[arg-type]
        raise HistoryError(
            f"{db_path} is held by a running daemon and no snapshot has been published at "
            f"{snapshot} yet: wait for the daemon's next snapshot, or query it over its HTTP API"
        ) from None
