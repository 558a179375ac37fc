"""Schema versions on real DuckDB files: the revisions build exactly the declared schema (by
Alembic's own autogenerate comparison), create, upgrade from the previous version with rows in
it, refuse a newer file, refuse a file another process holds; the CLI's ``policyd migrate``."""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from policyd.cli import main
from policyd.history import (
    HistoryError,
    SchemaTooNew,
    head_revision,
    known_revisions,
    migrate,
    schema_revision,
)
from policyd.history.dialect import engine
from policyd.history.revisions import SCRIPT_LOCATION, alembic_config
from policyd.history.tables import KEY_COLUMN, METADATA
from tests.holders import held_by_another_process


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def columns(path: Path) -> dict[str, list[tuple[str, str]]]:
    with duckdb.connect(str(path), read_only=True) as conn:
        rows = conn.execute(
            "SELECT table_name, column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = 'main' ORDER BY table_name, ordinal_position"
        ).fetchall()
    out: dict[str, list[tuple[str, str]]] = {}
    for table, column, kind in rows:
        out.setdefault(table, []).append((column, kind))
    return out


@contextmanager
def connected(db: Path) -> Iterator[sa.Connection]:
    """A SQLAlchemy connection on ``db``, closed (the file released) on exit."""
    history_engine = engine(db)
    try:
        with history_engine.connect() as conn:
            yield conn
    finally:
        history_engine.dispose()


def differences(db: Path, metadata: sa.MetaData = METADATA) -> list[Any]:
    """What Alembic's autogenerate would change in ``db`` to make it ``metadata``."""
    with connected(db) as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "compare_server_default": True}
        )
        return list(compare_metadata(context, metadata))


@pytest.fixture(scope="module")
def head_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file built by every revision in turn (read only by the tests that share it)."""
    db = tmp_path_factory.mktemp("head") / "h.duckdb"
    migrate(db)
    return db


def test_the_revisions_build_exactly_the_declared_schema(head_file: Path) -> None:
    assert differences(head_file) == []
    # compare_metadata does not look at column order nor at sequences: checked here
    found = columns(head_file)
    for name, table in METADATA.tables.items():
        assert [column for column, _ in found[name]] == [c.name for c in table.columns], name
    assert set(found) == set(METADATA.tables) | {"alembic_version"}
    with duckdb.connect(str(head_file), read_only=True) as conn:
        found_sequences = conn.execute("SELECT sequence_name FROM duckdb_sequences()").fetchall()
    key_defaults: list[Any] = [t.c[KEY_COLUMN].server_default for t in METADATA.tables.values()]
    assert {r[0] for r in found_sequences} == {d.arg.sequence.name for d in key_defaults}


def _declared_but(change: Callable[[sa.MetaData], None]) -> sa.MetaData:
    copy = sa.MetaData()
    for table in METADATA.tables.values():
        table.to_metadata(copy)
    change(copy)
    return copy


def _real_coverage(md: sa.MetaData) -> None:
    md.tables["sizing"].c.coverage.type = sa.REAL()  # DuckDB's FLOAT: 4 bytes, not DOUBLE


def _int_tokens(md: sa.MetaData) -> None:
    md.tables["requests"].c.prompt_tokens.type = sa.Integer()


def _agent_required(md: sa.MetaData) -> None:
    md.tables["requests"].c.agent.nullable = False


def _other_key_sequence(md: sa.MetaData) -> None:
    md.tables["decisions"].c.id.server_default = sa.DefaultClause(sa.text("nextval('x_seq')"))


def _no_request_index(md: sa.MetaData) -> None:
    md.tables["requests"].indexes.clear()


def _unique_setting_key(md: sa.MetaData) -> None:
    table = md.tables["settings_changes"]
    table.indexes.clear()
    sa.Index("settings_changes_key_idx", table.c.key, unique=True)


def _one_more_column(md: sa.MetaData) -> None:
    md.tables["block_accesses"].append_column(sa.Column("extra", sa.String))


@pytest.mark.parametrize(
    ("change", "found"),
    [
        (_real_coverage, "modify_type"),
        (_int_tokens, "modify_type"),
        (_agent_required, "modify_nullable"),
        (_other_key_sequence, "modify_default"),
        (_no_request_index, "remove_index"),
        (_unique_setting_key, "add_index"),
        (_one_more_column, "add_column"),
    ],
)
def test_the_comparison_sees_each_kind_of_change(
    head_file: Path, change: Callable[[sa.MetaData], None], found: str
) -> None:
    """The check above can fail: float widths and indexes reflect (``policyd.history.dialect``)."""
    ops = [op for diff in differences(head_file, _declared_but(change)) for op in _ops(diff)]
    assert found in ops


def _ops(diff: Any) -> list[str]:
    return [op[0] for op in diff] if isinstance(diff, list) else [diff[0]]


def test_autogenerate_against_head_drafts_an_empty_revision(head_file: Path) -> None:
    """``migrations/env.py`` hands Alembic the declaration: nothing to draft at head."""
    drafted: list[Any] = []

    def capture(context: object, revision: object, directives: list[Any]) -> None:
        drafted.extend(directives)
        directives.clear()  # write no file

    config = alembic_config()
    with connected(head_file) as conn:
        config.attributes["connection"] = conn
        command.revision(config, "probe", autogenerate=True, process_revision_directives=capture)
    (script,) = drafted
    assert script.upgrade_ops.is_empty() and script.downgrade_ops.is_empty()


def test_frozen_revisions_import_nothing_of_policyd() -> None:
    """A past revision keeps the DDL of its time: it never imports the live declaration."""
    for path in sorted((SCRIPT_LOCATION / "versions").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.split(".")[0] == "policyd" for n in names), path.name


def test_revisions_form_one_chain_found_from_the_checkout() -> None:
    assert (SCRIPT_LOCATION / "env.py").is_file()
    assert Path(__file__).resolve().parents[1] / "migrations" == SCRIPT_LOCATION
    assert known_revisions() == ["0001", "0002", "0003"]
    assert head_revision() == "0003"


def test_a_missing_file_is_created_at_head(tmp_path: Path) -> None:
    db = tmp_path / "sub" / "h.duckdb"
    assert schema_revision(db) is None
    assert migrate(db) == (None, "0003")
    assert schema_revision(db) == "0003"
    assert differences(db) == []
    assert migrate(db) == ("0003", "0003")  # idempotent


def test_an_empty_file_is_created_and_a_foreign_file_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.duckdb"
    empty.touch()
    assert schema_revision(empty) is None
    assert migrate(empty) == (None, "0003")
    foreign = tmp_path / "notes.duckdb"
    foreign.write_text("not a database\n")
    with pytest.raises(HistoryError, match="not a valid DuckDB database") as info:
        migrate(foreign)
    assert "\n" not in str(info.value) and "sqlalche" not in str(info.value)
    assert foreign.read_text() == "not a database\n"


def test_upgrade_from_0001_keeps_rows_and_adds_cache_stats_and_indexes(tmp_path: Path) -> None:
    db = tmp_path / "old.duckdb"
    assert migrate(db, revision="0001") == (None, "0001")
    assert "cache_stats" not in columns(db)
    with duckdb.connect(str(db)) as conn:
        conn.execute(
            "INSERT INTO requests (ts, request_id, agent, prompt_blocks) "
            "VALUES (1.0, 'r1', 'planner', 4), (2.0, 'r2', 'coder', 9)"
        )
        conn.execute("INSERT INTO settings_changes (ts, key, new_value) VALUES (3.0, 'k', '3')")
    assert migrate(db, revision="0002") == ("0001", "0002")
    with duckdb.connect(str(db), read_only=True) as conn:
        assert conn.execute(
            "SELECT id, request_id, agent, prompt_blocks FROM requests ORDER BY ts"
        ).fetchall() == [(1, "r1", "planner", 4), (2, "r2", "coder", 9)]
        assert conn.execute("SELECT key, new_value FROM settings_changes").fetchall() == [
            ("k", "3")
        ]
        assert conn.execute("SELECT count(*) FROM cache_stats").fetchone() == (0,)
        indexes = {r[0] for r in conn.execute("SELECT index_name FROM duckdb_indexes()").fetchall()}
    assert "requests_request_id_idx" in indexes
    # the sequence carries on after the migrated rows
    with duckdb.connect(str(db)) as conn:
        conn.execute("INSERT INTO requests (ts, request_id) VALUES (4.0, 'r3')")
        assert conn.execute("SELECT id FROM requests WHERE request_id = 'r3'").fetchone() == (3,)


def test_upgrade_from_0002_adds_block_sample_rate_keeping_rows(tmp_path: Path) -> None:
    """0003 adds ``block_accesses.sample_rate`` in place: the rows there stay, with NULL (their
    rate was the setting of the time), and new rows carry theirs."""
    db = tmp_path / "previous.duckdb"
    assert migrate(db, revision="0002") == (None, "0002")
    assert "sample_rate" not in dict(columns(db)["block_accesses"])
    with duckdb.connect(str(db)) as conn:
        conn.execute(
            "INSERT INTO block_accesses (ts, kind, tier, block_hash) "
            "VALUES (1.0, 'stored', 'gpu', 7), (2.0, 'removed', 'gpu', 7)"
        )
    assert migrate(db) == ("0002", "0003")
    assert dict(columns(db)["block_accesses"])["sample_rate"] == "DOUBLE"
    with duckdb.connect(str(db)) as conn:
        conn.execute(
            "INSERT INTO block_accesses (ts, kind, block_hash, sample_rate) "
            "VALUES (3.0, 'stored', 8, 0.5)"
        )
        assert conn.execute(
            "SELECT kind, block_hash, sample_rate FROM block_accesses ORDER BY ts"
        ).fetchall() == [("stored", 7, None), ("removed", 7, None), ("stored", 8, 0.5)]


def test_a_newer_file_is_refused_and_left_untouched(tmp_path: Path) -> None:
    db = tmp_path / "new.duckdb"
    migrate(db)
    with duckdb.connect(str(db)) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0099'")
    before = digest(db)
    with pytest.raises(SchemaTooNew) as info:
        migrate(db)
    message = str(info.value)
    assert "'0099'" in message and "'0003'" in message
    assert digest(db) == before


@pytest.fixture
def held_file(tmp_path: Path) -> Iterator[Path]:
    """A history file opened read-write by another process, as a running daemon holds it."""
    with held_by_another_process(tmp_path / "held.duckdb") as db:
        yield db


def test_a_file_held_by_another_process_is_a_clear_error(held_file: Path) -> None:
    with pytest.raises(HistoryError, match="held by another process"):
        migrate(held_file)
    assert main(["migrate", "--db", str(held_file)]) == 3


def test_cli_migrate_prints_from_and_to(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "cli.duckdb"
    migrate(db, revision="0001")
    assert main(["migrate", "--db", str(db)]) == 0
    assert "from revision 0001 to 0003" in capsys.readouterr().out
    assert main(["migrate", "--db", str(db)]) == 0
    assert "already at revision 0003" in capsys.readouterr().out
    with duckdb.connect(str(db)) as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'ffff'")
    assert main(["migrate", "--db", str(db)]) == 3
    err = capsys.readouterr().err.strip()
    assert "'ffff'" in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_cli_migrate_defaults_to_policyd_db(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "env.duckdb"
    monkeypatch.setenv("POLICYD_DB", str(db))
    assert main(["migrate"]) == 0
    assert str(db) in capsys.readouterr().out
    assert schema_revision(db) == "0003"
