"""Issue #32, point 4: SQL serves concurrent queries (each in an instance of its own: 8 at once
are answered, a long query fails no other), no path or setting is readable through SQL
functions or error text, and with a token set /api/sql needs it unless a setting opens it. A
real daemon, real DuckDB."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from policyd.daemon.server import RunningDaemon, start_daemon
from policyd.history.safe_sql import run_readonly_query
from tests.test_daemon import settings_for

LONG = "select count(*) from range(100000000000) a"  # runs into the 5 s time limit


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    running = start_daemon(settings_for(tmp_path_factory.mktemp("sql")))
    with httpx.Client(base_url=running.http_url, timeout=60) as http:
        assert http.post("/api/history/publish").status_code == 200
    yield running
    running.stop()


def test_eight_concurrent_queries_are_all_answered_beside_a_long_one(
    daemon: RunningDaemon,
) -> None:
    def query(sql: str) -> httpx.Response:
        with httpx.Client(base_url=daemon.http_url, timeout=60) as http:
            return http.post("/api/sql", json={"sql": sql})

    sqls = [LONG] + [f"select {i} as i, count(*) from requests" for i in range(8)]
    with ThreadPoolExecutor(len(sqls)) as pool:
        answers = list(pool.map(query, sqls))
    long, quick = answers[0], answers[1:]
    for i, r in enumerate(quick):
        assert r.status_code == 200, r.text
        assert r.json()["rows"][0][0] == i
    assert long.status_code == 400 and "time limit" in long.json()["error"]


def test_no_path_or_setting_is_readable(daemon: RunningDaemon) -> None:
    secrets = [str(daemon.service.settings.db.parent), str(Path.home()), str(Path.cwd())]
    attempts = [
        "select * from duckdb_settings()",
        "select value from duckdb_settings() where name = 'secret_directory'",
        "select current_setting('secret_directory')",
        "select path from duckdb_databases()",
        "select * from duckdb_secrets()",
        "select * from duckdb_extensions()",
        "select * from query('select * from duckdb_settings()')",
        "select * from no_such_table",
        "select * from read_csv('/etc/passwd')",
        "select * from '/nonexistent/file.parquet'",
        "select * from history.main.nope",
    ]
    with httpx.Client(base_url=daemon.http_url, timeout=60) as http:
        for sql in attempts:
            r = http.post("/api/sql", json={"sql": sql})
            assert r.status_code == 400, (sql, r.text)
            for secret in secrets:
                assert secret not in r.text, (sql, r.text)
        ok = http.post(
            "/api/sql", json={"sql": "select table_catalog from information_schema.tables"}
        )
        assert ok.status_code == 200
        assert all(row == ["history"] for row in ok.json()["rows"])  # an alias, not the file


def test_concurrent_queries_in_process_each_get_their_own_instance(
    daemon: RunningDaemon,
) -> None:
    path = Path(str(daemon.service.history.stats()["snapshot_path"]))
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: run_readonly_query(path, f"select {i}"), range(32)))
    assert [r.rows[0][0] for r in results] == list(range(32))


def test_with_a_token_sql_needs_it_unless_opened(tmp_path: Path) -> None:
    for opened, expected in ((False, 401), (True, 200)):
        running = start_daemon(
            settings_for(tmp_path / str(opened), token="t0k", sql_without_token=opened)
        )
        try:
            with httpx.Client(base_url=running.http_url, timeout=60) as http:
                r = http.post("/api/sql", json={"sql": "select 1"})
                assert r.status_code == expected, r.text
                auth = {"Authorization": "Bearer t0k"}
                ok = http.post("/api/sql", json={"sql": "select 1"}, headers=auth)
                assert ok.status_code == 200
        finally:
            running.stop()


def test_a_long_bad_query_is_not_echoed_whole(daemon: RunningDaemon) -> None:
    with httpx.Client(base_url=daemon.http_url, timeout=60) as http:
        r = http.post("/api/sql", json={"sql": "select * from " + "x" * 90_000})
    assert r.status_code == 400 and len(r.json()["error"]) < 600
