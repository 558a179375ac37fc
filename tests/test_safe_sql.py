"""User SQL over the history: every attack is refused with a clear reason and leaves the file
byte-identical; normal SELECTs over every table work; ``policyd sql`` end to end."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest

from policyd.cli import main
from policyd.core.types import BlocksStored, EventBatch, RequestStarted
from policyd.history import (
    TABLES,
    History,
    HistoryConfig,
    SqlRefused,
    default_snapshot_path,
    migrate,
    run_readonly_query,
)
from policyd.history.safe_sql import RULES, open_locked
from tests.holders import held_by_another_process

NOW = 1_800_000_000.0


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A published snapshot with rows in every table."""
    folder = tmp_path_factory.mktemp("history")
    h = History(HistoryConfig(db_path=folder / "h.duckdb", snapshot_interval_s=None))
    with h:
        batch = EventBatch(
            source="s",
            seq=1,
            events=(
                RequestStarted(
                    ts=0, request_id="r1", workflow_id="w", agent="a", block_hashes=(1, 2)
                ),
                BlocksStored(ts=0, tier="gpu", block_hashes=(1, 2), request_id="r1"),
            ),
        )
        h.record_batch(batch, received_ts=NOW)
        required = {"decisions": "kind", "predictions": "workflow_id", "settings_changes": "key"}
        for table in TABLES:
            if table not in ("requests", "block_accesses"):
                extra = {required[table]: "x"} if table in required else {}
                assert h.record(table, [{"ts": NOW, **extra}])
        h.flush()
        assert h.stats()["rows_rejected"] == 0
    return default_snapshot_path(folder / "h.duckdb")


@pytest.fixture
def untouched(snapshot: Path) -> Iterator[Path]:
    """The snapshot, checked byte-identical (and with no new files beside it) afterwards."""
    before, listing = digest(snapshot), sorted(snapshot.parent.iterdir())
    yield snapshot
    assert digest(snapshot) == before
    assert sorted(snapshot.parent.iterdir()) == listing


OUTSIDE = "/tmp/policyd-attack"
ATTACKS: list[tuple[str, str]] = [
    ("SELECT * FROM read_csv('/etc/passwd')", "external-access"),
    ("SELECT * FROM '/etc/passwd'", "query-error"),  # no replacement scan: no such table
    ("SELECT * FROM read_text('/etc/hostname')", "external-access"),
    ("SELECT * FROM read_blob('/etc/hostname')", "external-access"),
    (f"SELECT * FROM read_parquet('{OUTSIDE}.parquet')", "external-access"),
    ("SELECT * FROM glob('/etc/*')", "external-access"),
    ("SELECT * FROM read_json('http://127.0.0.1:9/x.json')", "external-access"),
    ("SELECT * FROM 'https://example.com/data.csv'", "external-access"),
    ("WITH d AS (DELETE FROM requests RETURNING *) SELECT * FROM d", "read-only"),
    ("WITH d AS (UPDATE requests SET agent = 'x' RETURNING *) SELECT * FROM d", "read-only"),
    # query() runs a string as SQL past the statement check: refused by name (issue #32)
    ("SELECT * FROM query('DELETE FROM requests')", "introspection"),
    ("SELECT * FROM query('SELECT * FROM duckdb_settings()')", "introspection"),
    ("SELECT * FROM duckdb_settings()", "introspection"),
    ('SELECT * FROM main."DuckDB_Databases"()', "introspection"),
    ("SELECT current_setting('secret_directory')", "introspection"),
    ("SELECT * FROM duckdb_extensions()", "introspection"),
    ("SELECT * FROM duckdb_temporary_files()", "introspection"),
    ("SELECT nextval('requests_id_seq')", "read-only"),
    ("SELECT * FROM read_csv(['/etc/passwd'])", "external-access"),
    ("SELECT * FROM duckdb_secrets()", "introspection"),
    # extension autoload is off: the function is unknown rather than installed and run
    ("SELECT * FROM sqlite_scan('/tmp/x.db', 't')", "query-error"),
    ("USE system", "select-only"),
    (f"COPY requests TO '{OUTSIDE}.csv'", "select-only"),
    (f"COPY (SELECT 1) TO '{OUTSIDE}.parquet' (FORMAT parquet)", "select-only"),
    (f"EXPORT DATABASE '{OUTSIDE}'", "select-only"),
    (f"ATTACH '{OUTSIDE}.duckdb' AS x", "select-only"),
    ("DETACH h", "select-only"),
    ("INSTALL httpfs", "select-only"),
    ("LOAD httpfs", "select-only"),
    ("SET memory_limit = '64GB'", "select-only"),
    ("SET enable_external_access = true", "select-only"),
    ("RESET lock_configuration", "select-only"),
    ("CHECKPOINT", "select-only"),
    ("CREATE TABLE t AS SELECT 1", "select-only"),
    ("CREATE VIEW v AS SELECT 1", "select-only"),
    ("CREATE TEMP TABLE t (a INT)", "select-only"),
    ("CREATE MACRO m(a) AS a + 1", "select-only"),
    ("CREATE SEQUENCE s", "select-only"),
    ("INSERT INTO requests (ts, request_id) VALUES (1, 'x')", "select-only"),
    ("UPDATE requests SET agent = 'x'", "select-only"),
    ("DELETE FROM requests", "select-only"),
    ("DROP TABLE requests", "select-only"),
    ("ALTER TABLE requests ADD COLUMN z INT", "select-only"),
    ("PRAGMA version", "select-only"),
    ("PRAGMA database_size", "select-only"),
    ("CALL pragma_version()", "select-only"),
    ("EXPLAIN SELECT 1", "select-only"),
    ("SELECT 1; DELETE FROM requests", "one-statement"),
    ("SELECT 1; SELECT 2", "one-statement"),
    ("", "syntax"),
    ("SELEC 1", "syntax"),
    ("SELECT * FROM no_such_table", "query-error"),
]


@pytest.mark.parametrize(("sql", "rule"), ATTACKS)
def test_attack_is_refused_with_its_rule(untouched: Path, sql: str, rule: str) -> None:
    with pytest.raises(SqlRefused) as info:
        run_readonly_query(untouched, sql, timeout_s=5)
    assert info.value.rule == rule, str(info.value)
    message = str(info.value)
    assert message and "\n" not in message
    assert not list(Path("/tmp").glob("policyd-attack*"))


# What the statement check refuses must also fail in the locked instance alone (defence in depth:
# the check alone was found insufficient).
LOCKDOWN_ONLY = [
    f"COPY requests TO '{OUTSIDE}.csv'",
    f"EXPORT DATABASE '{OUTSIDE}'",
    f"ATTACH '{OUTSIDE}.duckdb' AS x",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET enable_external_access = true",
    "SET memory_limit = '64GB'",
    "SET lock_configuration = false",
    "CREATE TABLE t AS SELECT 1",
    "INSERT INTO requests (ts, request_id) VALUES (1, 'x')",
    "UPDATE requests SET agent = 'x'",
    "DELETE FROM requests",
    "DROP TABLE requests",
]


@pytest.mark.parametrize("sql", LOCKDOWN_ONLY)
def test_lockdown_alone_refuses_what_the_statement_check_catches(untouched: Path, sql: str) -> None:
    conn = open_locked(untouched, timeout_s=5, memory_limit="128MB")
    try:
        with pytest.raises(duckdb.Error):
            conn.execute(sql)
        settings = conn.execute(
            "SELECT current_setting('enable_external_access'), "
            "current_setting('lock_configuration'), current_setting('memory_limit')"
        ).fetchone()
        assert settings is not None and settings[:2] == (False, True)
        assert settings[2] != "64.0 GiB"
    finally:
        conn.close()
    assert not list(Path("/tmp").glob("policyd-attack*"))


def test_a_long_query_hits_the_time_limit(untouched: Path) -> None:
    with pytest.raises(SqlRefused, match=r"time limit of 0\.5 s") as info:
        run_readonly_query(untouched, "SELECT count(*) FROM range(1000000000000)", timeout_s=0.5)
    assert info.value.rule == "time-limit"
    with pytest.raises(SqlRefused) as info:
        run_readonly_query(
            untouched,
            "SELECT sum(a.range * b.range) FROM range(1000000) a, range(1000000) b",
            timeout_s=0.5,
        )
    assert info.value.rule == "time-limit"


def test_a_memory_blow_up_hits_the_memory_limit(untouched: Path) -> None:
    with pytest.raises(SqlRefused, match="memory limit of 64MB") as info:
        run_readonly_query(
            untouched,
            "SELECT list(range) FROM range(200000000)",
            memory_limit="64MB",
            timeout_s=20,
        )
    assert info.value.rule == "memory-limit"


def test_rows_beyond_the_cap_are_truncated(untouched: Path) -> None:
    capped = run_readonly_query(untouched, "SELECT * FROM range(1000000000)", max_rows=10)
    assert capped.rows == [(i,) for i in range(10)] and capped.truncated
    exact = run_readonly_query(untouched, "SELECT * FROM range(10)", max_rows=10)
    assert len(exact.rows) == 10 and not exact.truncated


def test_a_select_over_every_table_works(untouched: Path) -> None:
    for table, columns in TABLES.items():
        result = run_readonly_query(untouched, f"SELECT * FROM {table}")
        assert result.columns == ["id"] + [name for name, _ in columns], table
        assert result.rows and not result.truncated, table
    joined = run_readonly_query(
        untouched,
        "WITH b AS (SELECT request_id, count(*) AS n FROM block_accesses GROUP BY 1) "
        "SELECT r.request_id, b.n FROM requests r JOIN b USING (request_id)",
    )
    assert joined.rows == [("r1", 2)]
    assert run_readonly_query(untouched, "FROM requests SELECT agent").rows == [("a",)]


def test_every_rule_has_a_description() -> None:
    assert {rule for _, rule in ATTACKS} | {"time-limit", "memory-limit"} <= set(RULES)


# ---- policyd sql -------------------------------------------------------------------------------


def test_cli_formats(untouched: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = untouched.parent / "h.duckdb"
    query = "SELECT request_id, prompt_blocks FROM requests"
    assert main(["sql", query, "--db", str(db), "--format", "json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["rows"] == [{"request_id": "r1", "prompt_blocks": 2}]
    assert body["columns"] == ["request_id", "prompt_blocks"] and body["truncated"] is False
    assert main(["sql", query, "--db", str(db), "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["request_id,prompt_blocks", "r1,2"]
    assert main(["sql", "SELECT * FROM range(5)", "--db", str(db), "--max-rows", "3"]) == 0
    captured = capsys.readouterr()
    assert "truncated" in captured.out and "│ 2 " in captured.out and "│ 3 " not in captured.out


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("DELETE FROM requests", "only SELECT"),
        ("SELECT * FROM read_csv('/etc/passwd')", "no file, network"),
        ("SELECT 1; SELECT 2", "exactly one statement"),
        ("SELECT nope FROM requests", "nope"),
    ],
)
def test_cli_refusal_is_one_line_and_nonzero(
    untouched: Path, capsys: pytest.CaptureFixture[str], sql: str, expected: str
) -> None:
    assert main(["sql", sql, "--db", str(untouched.parent / "h.duckdb")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert expected in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "Traceback" not in captured.err


def test_cli_reads_the_live_file_when_no_daemon_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "live.duckdb"
    migrate(db)
    with duckdb.connect(str(db)) as conn:
        conn.execute("INSERT INTO sizing (ts, reason) VALUES (1, 'live')")
    assert main(["sql", "SELECT reason FROM sizing", "--db", str(db), "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["reason", "live"]
    assert main(["sql", "SELECT 1", "--db", str(tmp_path / "missing.duckdb")]) == 3
    assert "no history" in capsys.readouterr().err


@pytest.fixture
def daemon_holding(tmp_path: Path) -> Iterator[Path]:
    """Another process holds the live file read-write, as a running daemon does."""
    with held_by_another_process(
        tmp_path / "held.duckdb", "INSERT INTO sizing (ts, reason) VALUES (2, 'held')"
    ) as db:
        yield db


def test_cli_with_the_daemon_holding_the_file(
    daemon_holding: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = daemon_holding
    assert main(["sql", "SELECT reason FROM sizing", "--db", str(db)]) == 3
    err = capsys.readouterr().err
    assert "held by a running daemon" in err and "no snapshot" in err
    assert len(err.strip().splitlines()) == 1
    # an older snapshot exists (published before; the live file has changed since): it is read
    snapshot = default_snapshot_path(db)
    with duckdb.connect(str(snapshot)) as conn:
        conn.execute("CREATE TABLE sizing (ts DOUBLE, reason VARCHAR)")
        conn.execute("INSERT INTO sizing VALUES (1, 'from-snapshot')")
    old = db.stat().st_mtime - 60
    os.utime(snapshot, (old, old))
    assert main(["sql", "SELECT reason FROM sizing", "--db", str(db), "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["reason", "from-snapshot"]
