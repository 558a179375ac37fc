"""``policyd migrate`` and ``policyd sql``: the history file from the command line.

``policyd sql`` works whether or not the daemon runs: it reads the published snapshot when that
is current, else the live file read-only, else (the daemon holds the live file) the last
snapshot. ``policyd sql --fleet SOURCE`` runs the statement over every replica's exported
segments instead (``policyd.history.fleet_sql``; SOURCE a directory or a ``nats://`` URL, or
``$POLICYD_FLEET_HISTORY`` with ``--fleet`` given no value), under the same limits.
``policyd export-segments`` exports one replica's history as segments (what the daemon does on
a timer). Every failure is one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import decimal
import io
import json
import os
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

from policyd.cli.arguments import int_at_least

if TYPE_CHECKING:
    from rich.console import Group

    from policyd.history.safe_sql import QueryResult

# Contract: importing this module costs nothing beyond the standard library and
# ``policyd.cli.arguments`` (``policyd --help`` builds every parser); each handler imports DuckDB,
# Alembic or rich when it runs.

EXIT_REFUSED: Final = 2  # the query was refused or failed
EXIT_UNAVAILABLE: Final = 3  # no readable history file (locked, missing, too new)
FLEET_ENV: Final = "POLICYD_FLEET_HISTORY"  # the same name as policyd.history.fleet_sql's
FLEET_FROM_ENV: Final = "$" + FLEET_ENV


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected positive seconds, got {text!r}")
    return value


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``migrate`` and ``sql`` on the ``policyd`` subcommand parser."""
    db_help = "history file (default: $POLICYD_DB or ./policyd-history.duckdb)"
    mig = sub.add_parser(
        "migrate",
        help="create or upgrade the history file to the newest schema",
        description="Upgrades in place (Alembic revisions under migrations/); refuses a file "
        "written by a newer AgentKV. Stop the daemon first: it holds the file.",
    )
    mig.add_argument("--db", type=Path, help=db_help)

    sql = sub.add_parser(
        "sql",
        help="run one read-only SELECT over the history",
        description="One SELECT, read-only, no file or network access, with time, memory and "
        "row limits. Reads the daemon's published snapshot (or the live file when no daemon "
        "holds it). Tables: requests, block_accesses, decisions, predictions, mrc_points, "
        "sizing, cache_stats, settings_changes.",
    )
    sql.add_argument(
        "query", nargs="?", help='e.g. "SELECT agent, count(*) FROM requests GROUP BY 1"'
    )
    sql.add_argument("--db", type=Path, help=db_help)
    sql.add_argument("--snapshot", type=Path, help="snapshot file (default: next to --db)")
    sql.add_argument("--format", choices=sorted(FORMATS), default="table")
    sql.add_argument(
        "--max-rows", type=int_at_least(0), default=1000, help="row cap (default 1000)"
    )
    sql.add_argument(
        "--timeout-s", type=_positive_float, default=10.0, help="time limit (default 10 s)"
    )
    sql.add_argument("--memory-limit", default="256MB", help="memory limit (default 256MB)")
    sql.add_argument(
        "--fleet",
        nargs="?",
        const=FLEET_FROM_ENV,
        metavar="SOURCE",
        help="query every replica's exported segments (a directory or "
        f"nats://host:port/bucket; given no value: ${FLEET_ENV}); tables gain a replica column",
    )
    sql.add_argument(
        "--cache-dir", type=Path, help="with --fleet: where segments and the fleet file are kept"
    )

    exp = sub.add_parser(
        "export-segments",
        help="export one replica's history as Parquet segments for fleet SQL",
        description="Exports the rows added since the last export of each table, from the "
        "published snapshot, as one Parquet segment per table (idempotent, resumable).",
    )
    exp.add_argument("destination", help="a directory or nats://host:port[,host:port]/bucket")
    exp.add_argument("--replica", required=True, help="this replica's name")
    exp.add_argument("--db", type=Path, help=db_help)
    exp.add_argument("--snapshot", type=Path, help="snapshot file (default: next to --db)")
    exp.add_argument(
        "--max-segments",
        type=int_at_least(2),
        default=64,
        help="segments kept per table before the oldest are merged (default 64)",
    )


def _fail(command: str, message: str, code: int) -> int:
    print(f"policyd {command}: {message}", file=sys.stderr)
    return code


def run_migrate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from policyd.history.files import default_db_path  # noqa: PLC0415 - see the contract
    from policyd.history.revisions import HistoryError, migrate  # noqa: PLC0415

    db = args.db or default_db_path()
    try:
        before, after = migrate(db)
    except HistoryError as exc:  # SchemaTooNew included
        return _fail("migrate", str(exc), EXIT_UNAVAILABLE)
    if before == after:
        print(f"{db}: schema already at revision {after}")
    else:
        print(f"{db}: migrated from revision {before or '(empty)'} to {after}")
    return 0


def _jsonable(value: object) -> object:
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal | uuid.UUID):
        return str(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def _render_json(result: QueryResult, source: Path | str) -> str:
    rows = [dict(zip(result.columns, map(_jsonable, row), strict=True)) for row in result.rows]
    body = {
        "columns": result.columns,
        "rows": rows,
        "truncated": result.truncated,
        "elapsed_ms": round(result.elapsed_ms, 3),
        "source": str(source),
    }
    return json.dumps(body, default=str)


def _render_csv(result: QueryResult, source: Path | str) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(result.columns)
    writer.writerows(result.rows)
    return out.getvalue().rstrip("\n")


def _render_table(result: QueryResult, source: Path | str) -> Group:
    from rich.console import Group  # noqa: PLC0415 - see the contract
    from rich.table import Table  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    note = f"{len(result.rows)} rows in {result.elapsed_ms:.0f} ms from {source}"
    if result.truncated:
        note += " (truncated: raise --max-rows)"
    table = Table()
    for name in result.columns:
        table.add_column(name, overflow="fold")
    for row in result.rows:
        table.add_row(*("NULL" if v is None else str(v) for v in row))
    return Group(table, Text(note, style="dim"))


FORMATS: Final[dict[str, Callable[[QueryResult, Path | str], object]]] = {
    "table": _render_table,
    "csv": _render_csv,
    "json": _render_json,
}


def _query(args: argparse.Namespace) -> tuple[QueryResult, Path | str]:
    """The result of ``args.query`` and what it read: the history file, or the fleet."""
    from policyd.history.files import default_db_path  # noqa: PLC0415 - see the contract
    from policyd.history.safe_sql import query_history  # noqa: PLC0415

    limits = {
        "max_rows": args.max_rows,
        "timeout_s": args.timeout_s,
        "memory_limit": args.memory_limit,
    }
    if args.fleet is None:
        return query_history(
            args.db or default_db_path(), args.query, snapshot_path=args.snapshot, **limits
        )
    from policyd.history.fleet_sql import query_fleet  # noqa: PLC0415

    source = args.fleet
    if args.query is None:  # `--fleet "SELECT ..."`: the statement, with the source from the env
        args.query, source = source, FLEET_FROM_ENV
    if source == FLEET_FROM_ENV:
        source = os.environ.get(FLEET_ENV, "").strip()
        if not source:
            raise ValueError(f"--fleet given no SOURCE and ${FLEET_ENV} is not set")
    result, info = query_fleet(args.query, source, cache_dir=args.cache_dir, **limits)
    replicas = ", ".join(info.replicas) or "no replica yet"
    return result, f"the fleet ({info.segments} segments of {replicas}; {info.source})"


def run_sql(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from policyd.history.revisions import HistoryError  # noqa: PLC0415 - see the contract
    from policyd.history.safe_sql import SqlRefused  # noqa: PLC0415

    if args.query is None and args.fleet in (None, FLEET_FROM_ENV):
        return _fail("sql", 'a query is needed: policyd sql [--fleet SOURCE] "SELECT ..."', 2)
    try:
        result, source = _query(args)
    except SqlRefused as exc:
        return _fail("sql", str(exc), EXIT_REFUSED)
    except HistoryError as exc:  # SegmentStoreError included
        return _fail("sql", str(exc), EXIT_UNAVAILABLE)
    except ValueError as exc:  # a malformed --fleet source
        return _fail("sql", str(exc), EXIT_UNAVAILABLE)
    rendered = FORMATS[args.format](result, source)
    if isinstance(rendered, str):
        print(rendered)
        if result.truncated:
            print(f"policyd sql: truncated at {args.max_rows} rows", file=sys.stderr)
    else:
        from rich.console import Console  # noqa: PLC0415 - see the contract

        console = Console()
        (console if console.is_terminal else Console(width=200)).print(rendered)
    return 0


def run_export_segments(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from policyd.history.files import (  # noqa: PLC0415 - see the contract
        default_db_path,
        default_snapshot_path,
        snapshot_is_current,
    )
    from policyd.history.revisions import HistoryError  # noqa: PLC0415
    from policyd.history.segments import SegmentExporter  # noqa: PLC0415

    db = args.db or default_db_path()
    snapshot = args.snapshot or default_snapshot_path(db)
    if not snapshot_is_current(db, snapshot) and db.exists():
        snapshot = db  # no daemon publishes: the live file, read-only
    try:
        exporter = SegmentExporter(
            snapshot, args.replica, args.destination, max_segments=args.max_segments
        )
        done = exporter.export()
    except (HistoryError, ValueError) as exc:
        return _fail("export-segments", str(exc), EXIT_UNAVAILABLE)
    print(json.dumps(done, default=str))
    return 0


COMMANDS: Final[dict[str, Callable[[argparse.Namespace, Sequence[str]], int]]] = {
    "migrate": run_migrate,
    "sql": run_sql,
    "export-segments": run_export_segments,
}
