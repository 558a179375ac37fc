"""Schema versions of the history file: upgrade in place with Alembic, refuse a newer file.

Alembic is configured in code (``migrations/alembic.ini`` serves only the ``alembic`` command);
its scripts live in the repository's ``migrations/`` folder, found next to the ``policyd`` package
(a checkout or an editable install). Migrations run on ``policyd.history.dialect``'s engine
(duckdb-engine; the pinned versions are the set that works).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Final

import duckdb

if TYPE_CHECKING:  # Alembic and SQLAlchemy load only when a migration runs (~0.7 s)
    from alembic.config import Config
    from sqlalchemy import Connection

SCRIPT_LOCATION: Final = Path(__file__).resolve().parents[2] / "migrations"


class HistoryError(RuntimeError):
    """The history file cannot be used (locked by another process, unreadable, not DuckDB)."""


class SchemaTooNew(HistoryError):  # noqa: N818 (the name is the contract, HISTORY_API.md)
    """The file's schema revision is unknown to this code: written by a newer AgentKV."""


def alembic_config() -> Config:
    """Alembic's configuration for the ``migrations/`` folder beside the package (no database:
    a migration hands its connection over in ``attributes["connection"]``)."""
    from alembic.config import Config  # noqa: PLC0415 - loads only when migrating

    if not (SCRIPT_LOCATION / "env.py").is_file():
        raise HistoryError(
            f"Alembic scripts not found at {SCRIPT_LOCATION}: run from a checkout or an editable "
            "install (pip install -e .)"
        )
    config = Config(stdout=io.StringIO())
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    return config


def head_revision() -> str:
    """The newest revision this code knows."""
    from alembic.script import ScriptDirectory  # noqa: PLC0415

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise HistoryError(f"no revisions under {SCRIPT_LOCATION / 'versions'}")
    return head


def known_revisions() -> list[str]:
    """Every revision this code knows, oldest first."""
    from alembic.script import ScriptDirectory  # noqa: PLC0415

    script = ScriptDirectory.from_config(alembic_config())
    return [rev.revision for rev in reversed(list(script.walk_revisions()))]


def _open_error(db_path: Path, exc: BaseException) -> HistoryError:
    exc = getattr(exc, "orig", None) or exc  # SQLAlchemy wraps the driver's error
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "lock" in text.lower():
        return HistoryError(f"{db_path} is held by another process (a running daemon?): {text}")
    return HistoryError(f"cannot open {db_path}: {text}")


def schema_revision(db_path: Path) -> str | None:
    """The file's Alembic revision; None for a missing file or one never migrated."""
    db_path = Path(db_path)
    if not db_path.exists() or db_path.stat().st_size == 0:
        return None
    try:
        conn = duckdb.connect(str(db_path), read_only=True)
    except duckdb.Error as exc:
        raise _open_error(db_path, exc) from exc
    try:
        return _revision_on(conn)
    finally:
        conn.close()


_HAS_VERSION_TABLE: Final = (
    "SELECT count(*) FROM information_schema.tables WHERE table_name = 'alembic_version' "
    "AND table_catalog = current_database() AND table_schema = 'main'"
)


def _revision_on(conn: duckdb.DuckDBPyConnection) -> str | None:
    found = conn.execute(_HAS_VERSION_TABLE).fetchone()
    if not found or not found[0]:
        return None
    row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    return None if row is None else str(row[0])


def _revision_sa(conn: Connection) -> str | None:
    found = conn.exec_driver_sql(_HAS_VERSION_TABLE).scalar()
    if not found:
        return None
    value = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
    return None if value is None else str(value)


def check_known(revision: str | None) -> None:
    """Raise SchemaTooNew unless this code knows ``revision`` (None = empty file, known)."""
    if revision is None:
        return
    known = known_revisions()
    if revision not in known:
        raise SchemaTooNew(
            f"history schema revision {revision!r} is unknown to this AgentKV (it knows "
            f"{', '.join(known)}; head {known[-1]!r}): the file was written by a newer version. "
            "Upgrade AgentKV or point it at another file."
        )


def migrate(db_path: Path, *, revision: str = "head") -> tuple[str | None, str]:
    """Upgrade the file in place to the newest schema; returns (from_revision, to_revision).

    Creates the file when missing or empty (zero bytes). Raises SchemaTooNew on a file with an
    unknown (newer) revision, HistoryError when the file is locked or unreadable. Each revision
    runs in one transaction (DuckDB DDL is transactional), so a failed upgrade leaves the file
    as it was.
    ``revision`` stops at an older revision instead (tests build previous-version files so).
    """
    from alembic import command  # noqa: PLC0415 - Alembic loads only when migrating

    from policyd.history.dialect import engine as history_engine  # noqa: PLC0415

    db_path = Path(db_path)
    db_path.parent.mkdir(parents=True, exist_ok=True)
    if db_path.is_file() and db_path.stat().st_size == 0:
        db_path.unlink()  # an empty file (touch, mkstemp) holds nothing: DuckDB creates it anew
    config = alembic_config()
    try:
        engine = history_engine(db_path)
        conn = engine.connect()
    except Exception as exc:  # duckdb-engine wraps duckdb.Error in SQLAlchemy's DBAPIError
        raise _open_error(db_path, exc) from exc
    try:
        before = _revision_sa(conn)
        check_known(before)
        head = head_revision() if revision == "head" else revision
        if before != head:
            config.attributes["connection"] = conn
            command.upgrade(config, head)
            conn.commit()
        after = _revision_sa(conn)
    finally:
        conn.close()
        engine.dispose()
    if after != head:
        raise HistoryError(f"{db_path}: migration ended at {after!r}, expected {head!r}")
    return before, head
