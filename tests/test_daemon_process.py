"""A real ``policyd serve`` process: it learns from a replay, is stopped with SIGTERM (history
flushed, models checkpointed), restarted on the same files, and its predictor answers exactly
as before (forecasts of a workflow that was mid-flight, accuracy counters, calibration)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from policyd.core.client import DaemonClient
from policyd.core.types import Event
from policyd.core.wire import Endpoints
from policyd.daemon.server import READY_PREFIX
from tests.test_daemon import workflow_events


def wait_for(cond: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@contextmanager
def serve(db: Path) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    cmd = [sys.executable, "-m", "policyd.cli", "serve", "--db", str(db),
           "--events", "tcp://127.0.0.1:*", "--snapshots", "tcp://127.0.0.1:*",
           "--http-port", "0", "--log-level", "WARNING"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready: dict[str, Any] | None = None
        for line in proc.stdout:
            if line.startswith(READY_PREFIX):
                ready = json.loads(line[len(READY_PREFIX) :])
                break
        assert ready is not None, proc.stderr.read() if proc.stderr else "no ready line"
        yield proc, ready
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return err


def learned(http: httpx.Client, workflow_id: str) -> dict[str, Any]:
    pred = http.get("/api/predictions").json()
    live = {w["workflow_id"]: w["steps"] for w in pred["workflows"]}
    return {
        "accuracy_total": pred["accuracy_total"],
        "checked": pred["checked"],
        "cross_entropy": pred["calibration"]["cross_entropy"],
        "forecast": live.get(workflow_id),
    }


def test_model_state_survives_a_restart(
    tmp_path: Path,
) -> None:
    db = tmp_path / "history.duckdb"
    events: list[Event] = []
    for w in range(30):  # planner -> coder -> tester, with a retry loop in every third
        agents = ("planner", "coder", "tester", "coder", "tester") if w % 3 == 0 else None
        events += workflow_events(w, agents) if agents else workflow_events(w)
    events += workflow_events(99)[:4]  # workflow w99 is mid-flight (planner called)
    with serve(db) as (proc, ready):
        assert ready["restored"] is False
        client = DaemonClient(
            "replay", Endpoints(events=ready["events"], snapshots=ready["snapshots"])
        )
        client.send_many(events)
        client.flush()
        client.close()
        with httpx.Client(base_url=ready["http_url"], timeout=30) as http:
            assert wait_for(lambda: http.get("/api/stats").json()["events"] == len(events))
            before = learned(http, "w99")
        err = stop(proc)
    assert "checkpointed" in err
    assert before["forecast"] is not None and before["checked"]["1"] > 0
    checkpoint = Path(ready["checkpoint"])
    assert checkpoint.exists()

    with serve(db) as (proc, ready):
        assert ready["restored"] is True
        with httpx.Client(base_url=ready["http_url"], timeout=30) as http:
            after = learned(http, "w99")
            stats = http.get("/api/stats").json()
            assert stats["checkpoint"]["restored"] is True
            rows = http.post("/api/sql", json={"sql": "select count(*) from requests"}).json()
            assert rows["rows"] == [[3 * 30 + 10 * 2 + 1]]  # the history survived too
        stop(proc)
    assert after == before
