"""Fleet history on real files: three replicas' DuckDB histories (the project's own writer),
exported as Parquet segments into a shared directory and into a JetStream object store (a real
nats-server), queried as one fleet under ``policyd sql``'s lockdown; idempotent and resumable
export, compaction, the HTTP API's fleet switch and the command line."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from streamlit.testing.v1 import AppTest

from policyd.cli import main as policyd_main
from policyd.core.types import EventBatch
from policyd.daemon.server import RunningDaemon, start_daemon
from policyd.daemon.settings import DaemonSettings
from policyd.history import History, HistoryConfig, SqlRefused, run_readonly_query
from policyd.history.fleet_sql import query_fleet
from policyd.history.segments import (
    DirectoryStore,
    ObjectStoreBucket,
    Segment,
    SegmentExporter,
    SegmentStoreError,
    live_segments,
    open_store,
)
from tests.test_daemon import workflow_events

NOW = 1_800_000_000.0
REPLICAS = {"r0": 2, "r1": 3, "r2": 5}  # replica -> workflows in its history
NATS_SERVER = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "nats-server"


def add_workflows(db: Path, first: int, count: int) -> Path:
    """Append ``count`` workflows (and a decision each) to the history at ``db`` through the
    project's writer; returns the published snapshot."""
    config = HistoryConfig(db_path=db, snapshot_interval_s=None, cpu_budget=None)
    history = History(config, clock=lambda: NOW)
    history.start()
    try:
        for seq, w in enumerate(range(first, first + count)):
            batch = EventBatch(source="vllm-0", seq=seq, events=tuple(workflow_events(w)))
            history.record_batch(batch, received_ts=NOW + w)
            history.record(
                "decisions",
                [{"ts": NOW + w, "kind": "evict", "tier": "gpu", "workflow_id": f"w{w}"}],
            )
        history.flush()
    finally:
        history.close()  # publishes the final snapshot
    return config.resolved_snapshot_path


def own_count(snapshot: Path, table: str) -> int:
    """The replica's own count, the way ``policyd sql`` reads it."""
    result = run_readonly_query(snapshot, f"SELECT count(*) FROM {table}")
    count = result.rows[0][0]
    assert isinstance(count, int)
    return count


def fleet_counts(source: str | Path, table: str, cache: Path) -> dict[str, int]:
    result, _ = query_fleet(
        f"SELECT replica, count(*) FROM {table} GROUP BY 1 ORDER BY 1", source, cache_dir=cache
    )
    return {str(r): int(n) for r, n in result.rows}  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each replica's published snapshot, built once (tests copy what they change)."""
    root = tmp_path_factory.mktemp("replicas")
    out: dict[str, Path] = {}
    for name, workflows in REPLICAS.items():
        out[name] = add_workflows(root / name / "history.duckdb", 100 * len(out), workflows)
    return out


def export_all(snapshots: dict[str, Path], destination: str | Path) -> list[dict[str, object]]:
    return [
        SegmentExporter(path, name, destination, settle_s=0.0).export()
        for name, path in snapshots.items()
    ]


def test_segment_names_parse_and_covered_segments_are_dropped() -> None:
    seg = Segment("r0", "requests", 3, 10, 20)
    assert seg.name == "r0/requests/00000003-000000000010-000000000020.parquet"
    assert Segment.parse(seg.name) == seg
    assert Segment.parse("r0/requests/.x.parquet.1.tmp") is None
    assert Segment.parse("../requests/1-1-2.parquet") is None
    merged = Segment("r0", "requests", 2, 1, 20)
    names = [Segment("r0", "requests", 1, 1, 9).name, merged.name, seg.name]
    names.append(Segment("r0", "requests", 4, 21, 30).name)
    live = live_segments(names)
    assert [s.name for s in live[("r0", "requests")]] == [merged.name, names[-1]]


def test_open_store_reads_both_destinations(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), DirectoryStore)
    assert open_store(f"file://{tmp_path}").root == tmp_path  # type: ignore[attr-defined]
    nats = open_store("nats://a:4222,b:4223/hist")
    assert isinstance(nats, ObjectStoreBucket)
    assert nats.servers == ["nats://a:4222", "nats://b:4223"] and nats.bucket == "hist"
    with pytest.raises(ValueError, match="bucket"):
        open_store("nats://a:4222")
    with pytest.raises(ValueError, match="replica name"):
        SegmentExporter(tmp_path / "s.duckdb", "../evil", tmp_path)


def test_fleet_query_sees_every_replica_and_reexport_adds_nothing(
    replicas: dict[str, Path], tmp_path: Path
) -> None:
    dest = tmp_path / "fleet"
    done = export_all(replicas, dest)
    assert all(d["segments"] for d in done)
    for table in ("requests", "block_accesses", "decisions"):
        own = {name: own_count(path, table) for name, path in replicas.items()}
        assert all(own.values()), table
        assert fleet_counts(dest, table, tmp_path / "cache") == own, table
    # a table nobody exported is there, empty, with its columns and the replica column
    result, info = query_fleet(
        "SELECT * FROM sizing", str(dest), cache_dir=tmp_path / "cache", max_rows=5
    )
    assert result.rows == [] and result.columns[:2] == ["id", "ts"]
    assert result.columns[-1] == "replica"
    assert info.replicas == sorted(REPLICAS)

    again = export_all(replicas, dest)
    assert all(d["segments"] == [] for d in again)
    own = {name: own_count(path, "requests") for name, path in replicas.items()}
    assert fleet_counts(dest, "requests", tmp_path / "cache") == own


def test_an_interrupted_export_resumes_and_new_rows_follow(
    replicas: dict[str, Path], tmp_path: Path
) -> None:
    db = tmp_path / "r9" / "history.duckdb"
    db.parent.mkdir()
    shutil.copy(replicas["r1"].with_name("history.duckdb"), db)
    snapshot = add_workflows(db, 500, 1)  # one workflow more than r1's
    dest = tmp_path / "fleet"
    first = SegmentExporter(snapshot, "r9", dest, settle_s=0.0).export()
    written = list(first["segments"])  # type: ignore[call-overload]
    # the crash: the last segment never made it (a temporary file is never visible)
    (dest / written[-1]).unlink()
    resumed = SegmentExporter(snapshot, "r9", dest, settle_s=0.0).export()
    assert resumed["segments"] == [written[-1]]
    cache = tmp_path / "cache"
    for table in ("requests", "block_accesses", "decisions"):
        assert fleet_counts(dest, table, cache) == {"r9": own_count(snapshot, table)}, table

    snapshot = add_workflows(db, 600, 2)
    more = SegmentExporter(snapshot, "r9", dest, settle_s=0.0).export()
    assert any("/00000002-" in name for name in more["segments"])  # type: ignore[attr-defined]
    assert fleet_counts(dest, "requests", cache) == {"r9": own_count(snapshot, "requests")}
    result, _ = query_fleet(
        "SELECT count(*) - count(DISTINCT id) FROM requests", dest, cache_dir=cache
    )
    assert result.rows == [(0,)]


def test_unfinished_requests_wait_until_they_settle(tmp_path: Path) -> None:
    db = tmp_path / "h.duckdb"
    config = HistoryConfig(db_path=db, snapshot_interval_s=None, cpu_budget=None)
    events = workflow_events(1)
    open_one = tuple(e for e in events if getattr(e, "request_id", "") != "w1.2" or
                     type(e).__name__ != "RequestFinished")  # fmt: skip
    with History(config, clock=lambda: NOW) as history:
        history.record_batch(EventBatch(source="s", seq=0, events=open_one), received_ts=NOW)
    snapshot = config.resolved_snapshot_path
    result = run_readonly_query(snapshot, "SELECT min(ts), max(ts) FROM requests")
    newest = float(result.rows[0][1])  # type: ignore[arg-type]
    dest = tmp_path / "fleet"
    waiting = SegmentExporter(snapshot, "r0", dest, settle_s=60.0, clock=lambda: newest + 1.0)
    waiting.export()
    assert fleet_counts(dest, "requests", tmp_path / "c") == {"r0": 2}
    settled = SegmentExporter(snapshot, "r0", dest, settle_s=60.0, clock=lambda: newest + 61.0)
    settled.export()
    assert fleet_counts(dest, "requests", tmp_path / "c") == {"r0": 3}


def test_old_segments_are_compacted_without_losing_or_repeating_rows(
    replicas: dict[str, Path], tmp_path: Path
) -> None:
    db = tmp_path / "r5" / "history.duckdb"
    db.parent.mkdir()
    shutil.copy(replicas["r0"].with_name("history.duckdb"), db)
    dest = tmp_path / "fleet"
    store = DirectoryStore(dest)
    snapshot = replicas["r0"]
    for round_ in range(4):
        snapshot = add_workflows(db, 700 + round_, 1)
        SegmentExporter(snapshot, "r5", dest, max_segments=2, settle_s=0.0).export()
    live = live_segments(store.names())[("r5", "requests")]
    assert len(live) == 2
    assert len([n for n in store.names() if n.startswith("r5/requests/")]) == 2
    cache = tmp_path / "cache"
    assert fleet_counts(dest, "requests", cache) == {"r5": own_count(snapshot, "requests")}
    # a compaction interrupted before its deletes: the merged segments are back beside it
    merged = live[0]
    old = Segment("r5", "requests", merged.seq, merged.last, merged.last)
    shutil.copy(dest / merged.name, dest / old.name)
    assert fleet_counts(dest, "requests", cache) == {"r5": own_count(snapshot, "requests")}


LOCKDOWN = (
    "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT * FROM read_parquet('{segment}')",
    "DELETE FROM requests",
    "SELECT 1; SELECT 2",
    "COPY requests TO '/tmp/x.parquet'",
    "SELECT * FROM duckdb_settings()",
    "ATTACH '/tmp/other.duckdb'",
)


def test_the_lockdown_holds_on_the_fleet(replicas: dict[str, Path], tmp_path: Path) -> None:
    dest = tmp_path / "fleet"
    export_all(replicas, dest)
    segment = dest / DirectoryStore(dest).names()[0]
    for template in LOCKDOWN:
        sql = template.format(segment=segment)
        with pytest.raises(SqlRefused) as fleet_err:
            query_fleet(sql, dest, cache_dir=tmp_path / "cache")
        with pytest.raises(SqlRefused) as own_err:
            run_readonly_query(replicas["r0"], sql)
        assert (fleet_err.value.rule, str(fleet_err.value)) == (
            own_err.value.rule,
            str(own_err.value),
        ), sql
        assert "\n" not in str(fleet_err.value) and str(tmp_path) not in str(fleet_err.value)
    result, _ = query_fleet(
        "SELECT * FROM range(100000)", dest, cache_dir=tmp_path / "cache", max_rows=10
    )
    assert len(result.rows) == 10 and result.truncated
    with pytest.raises(SqlRefused) as err:
        query_fleet(
            "SELECT list(range) FROM range(200000000)",
            dest,
            cache_dir=tmp_path / "cache",
            memory_limit="64MB",
        )
    assert err.value.rule == "memory-limit"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    if not NATS_SERVER.exists():
        pytest.skip("nats-server is not installed in .venv")
    port = free_port()
    proc = subprocess.Popen(
        [str(NATS_SERVER), "-js", "-sd", str(tmp_path / "js"), "-p", str(port), "-a", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}/policyd-history"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_fleet_through_a_jetstream_object_store(
    replicas: dict[str, Path], tmp_path: Path, nats_url: str
) -> None:
    assert open_store(nats_url).names() == []  # no bucket yet: nothing exported
    export_all(replicas, nats_url)
    cache = tmp_path / "cache"
    own = {name: own_count(path, "requests") for name, path in replicas.items()}
    assert fleet_counts(nats_url, "requests", cache) == own
    assert all(d["segments"] == [] for d in export_all(replicas, nats_url))
    assert fleet_counts(nats_url, "requests", cache) == own
    store = open_store(nats_url)
    gone = [n for n in store.names() if n.startswith("r2/")]
    store.delete(gone)  # r2's segments lost: its next export writes them all again
    assert "r2" not in fleet_counts(nats_url, "requests", cache)
    export_all({"r2": replicas["r2"]}, nats_url)
    assert fleet_counts(nats_url, "requests", cache) == own
    with pytest.raises(SqlRefused) as err:
        query_fleet("SELECT * FROM read_csv('/etc/passwd')", nats_url, cache_dir=cache)
    assert err.value.rule == "external-access"


def test_an_unreachable_object_store_is_one_error_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(SegmentStoreError, match="cannot reach JetStream object store"):
        query_fleet("SELECT 1", f"nats://127.0.0.1:{free_port()}/b", cache_dir=tmp_path)
    assert time.monotonic() - started < 5.0


def test_policyd_sql_fleet_and_export_segments_from_the_command_line(
    replicas: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dest = tmp_path / "fleet"
    for name, snapshot in replicas.items():
        db = snapshot.with_name("history.duckdb")
        argv = ["export-segments", str(dest), "--replica", name, "--db", str(db)]
        assert policyd_main(argv) == 0
        assert json.loads(capsys.readouterr().out)["replica"] == name
    sql = "SELECT replica, count(*) AS n FROM requests GROUP BY 1 ORDER BY 1"
    argv = ["sql", "--fleet", str(dest), "--cache-dir", str(tmp_path / "c"), "--format", "json"]
    assert policyd_main([*argv, sql]) == 0
    body = json.loads(capsys.readouterr().out)
    own = {name: own_count(path, "requests") for name, path in replicas.items()}
    assert {row["replica"]: row["n"] for row in body["rows"]} == own
    assert policyd_main([*argv, "DELETE FROM requests"]) == 2
    assert "only SELECT queries are allowed" in capsys.readouterr().err
    # `--fleet "SELECT ..."`: the statement, the source from $POLICYD_FLEET_HISTORY
    monkeypatch.setenv("POLICYD_FLEET_HISTORY", str(dest))
    bare = ["sql", "--cache-dir", str(tmp_path / "c"), "--format", "json", "--fleet", sql]
    assert policyd_main(bare) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == body["rows"]
    assert policyd_main(["sql", "--fleet"]) == 2  # no statement at all
    assert "a query is needed" in capsys.readouterr().err


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("fleet-api")
    settings = DaemonSettings.load(
        {
            "db": tmp / "history.duckdb",
            "events": "tcp://127.0.0.1:*",
            "snapshots": "tcp://127.0.0.1:*",
            "http_port": 0,
            "token": "t0ken",
        }
    )
    running = start_daemon(settings)
    yield running
    running.stop()


def test_the_api_runs_sql_over_the_fleet_when_the_daemon_has_one(
    daemon: RunningDaemon,
    replicas: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    headers = {"Authorization": "Bearer t0ken"}
    sql = "SELECT replica, count(*) FROM requests GROUP BY 1 ORDER BY 1"
    service = daemon.service
    with httpx.Client(base_url=daemon.http_url, timeout=30, headers=headers) as http:
        assert http.get("/api/fleet").json() == {"enabled": False}
        refused = http.post("/api/sql", json={"sql": sql, "fleet": True})
        assert refused.status_code == 409 and "fleet" in refused.json()["error"]

        dest = tmp_path / "fleet"
        export_all(replicas, dest)
        service.fleet_history = str(dest)
        service.fleet_cache_dir = tmp_path / "cache"  # type: ignore[attr-defined]
        try:
            assert http.get("/api/fleet").json() == {"enabled": True}
            body = http.post("/api/sql", json={"sql": sql, "fleet": True}).json()
            own = {name: own_count(path, "requests") for name, path in replicas.items()}
            assert {r: n for r, n in body["rows"]} == own
            assert body["fleet"]["replicas"] == sorted(REPLICAS)
            bad = http.post("/api/sql", json={"sql": "SELECT 1; SELECT 2", "fleet": True})
            assert bad.status_code == 400
            assert bad.json()["error"] == "refused: exactly one statement per query, got 2"
            own_replica = http.post("/api/sql", json={"sql": "SELECT 1 AS x"})
            assert own_replica.json()["rows"] == [[1]]
            assert_dashboard_switches_to_the_fleet(daemon, monkeypatch)
        finally:
            del service.fleet_history
            del service.fleet_cache_dir  # type: ignore[attr-defined]


def assert_dashboard_switches_to_the_fleet(
    daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SQL page offers the switch (the daemon has a fleet) and shows the replica column."""
    app = Path(__file__).resolve().parents[1] / "ui" / "app.py"
    monkeypatch.setenv("POLICYD_API_URL", daemon.http_url)
    monkeypatch.setenv("POLICYD_API_TOKEN", "t0ken")
    monkeypatch.setenv("POLICYD_UI_TIMEOUT_S", "20")
    at = AppTest.from_file(str(app), default_timeout=30).run()
    at.switch_page("views/sql.py").run()
    assert not at.exception, [e.value for e in at.exception]
    at.radio(key="sql_scope").set_value("the fleet").run()
    sql = "SELECT replica, count(*) AS n FROM requests GROUP BY 1 ORDER BY 1"
    at.text_area(key="sql_text").input(sql).run()
    at.button(key="sql_run").click().run()
    assert not at.error, [e.value for e in at.error]
    frame = at.dataframe[0].value
    assert list(frame["replica"]) == sorted(REPLICAS)
    assert any("the fleet: 3 replicas" in c.value for c in at.caption)
