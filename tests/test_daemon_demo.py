"""``run_demo``: a daemon fed by the simulator over the real wire fills the history, the
predictions and the sizing, and keeps serving when asked (what the dashboard's tests use)."""

from __future__ import annotations

from pathlib import Path

import httpx

from policyd.daemon.demo import render_summary, run_demo


def test_a_short_demo_fills_everything_and_keeps_serving(tmp_path: Path) -> None:
    db = tmp_path / "demo.duckdb"
    lines: list[str] = []
    run = run_demo(db=db, workflows=6, seconds=4.0, keep_serving=True, progress=lines.append)
    try:
        s = run.summary
        assert run.http_url is not None
        assert s["requests"] > 6 and s["events_dropped"] == 0
        assert s["daemon_events"] == s["events_sent"] > 0  # everything sent was applied
        assert s["snapshots_used"] > 0  # decisions came back over the wire
        assert "policyd sql" in render_summary(s) and str(db) in render_summary(s)
        assert lines and "workload" in lines[0]
        with httpx.Client(base_url=run.http_url, timeout=30) as http:
            stats = http.get("/api/stats").json()
            assert stats["requests"] == s["requests"]
            sizing = http.get("/api/sizing").json()
            assert sizing["mrc"] and sizing["working_set_blocks"] > 0
            assert http.get("/api/predictions").json()["checked"]["1"] > 0
            answer = http.post(
                "/api/sql", json={"sql": "select count(*) from requests where finished_ts > 0"}
            ).json()
            assert answer["rows"][0][0] > 0
            changes = http.get("/api/settings/history").json()["changes"]
            assert any(c["key"] == "host_tier_gib" and c["actor"] == "demo" for c in changes)
    finally:
        run.stop()
    assert db.exists() and Path(s["snapshot_path"]).exists()
