"""Issue #32, points 6 and the bind rule: stale temporary files are removed at start;
checkpoints are written 0600 and one writable by others is refused unread; the token comes from
a file or the environment (never needs the command line); the daemon refuses to serve its HTTP
API beyond loopback without a token unless told; log lines for bad input are rate-limited."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import zmq

from policyd.daemon import checkpoint
from policyd.daemon.server import READY_PREFIX, start_daemon
from policyd.daemon.service import Service
from policyd.daemon.settings import DaemonSettings
from policyd.history.files import default_snapshot_path
from tests.test_daemon import settings_for, wait_for


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporary_files_are_removed_at_start(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    snap = default_snapshot_path(settings.db)
    ckpt = settings.checkpoint_path
    gone = dead_pid()
    stale = [
        snap.with_name(f".{snap.name}.{gone}.3.tmp"),
        snap.with_name(f".{snap.name}.{gone}.3.tmp.wal"),
        ckpt.with_name(f".{ckpt.name}.tmp-{gone}"),
    ]
    alive = snap.with_name(f".{snap.name}.{os.getppid()}.1.tmp")  # its writer still runs
    other = tmp_path / f".unrelated.{gone}.1.tmp"  # not one of ours
    for path in [*stale, alive, other]:
        path.write_bytes(b"half written")
    Service(settings)
    assert not any(p.exists() for p in stale)
    assert alive.exists() and other.exists()


def test_checkpoints_are_written_0600_and_refused_when_others_can_write(tmp_path: Path) -> None:
    path = tmp_path / "m.ckpt"
    checkpoint.save(path, {"tunables": {"lookahead_k": 4}})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert checkpoint.load(path).models == {"tunables": {"lookahead_k": 4}}
    os.chmod(path, 0o666)  # anyone could have put a pickle that runs code here
    restored = checkpoint.load(path)
    assert restored.models is None and "writable by group or others" in str(restored.error)
    assert not path.exists() and restored.moved_to is not None


def test_the_token_comes_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-from-file\n")
    token_file.chmod(0o600)
    assert DaemonSettings.load({"token_file": token_file}).token == "s3cret-from-file"
    monkeypatch.setenv("POLICYD_TOKEN_FILE", str(token_file))
    assert DaemonSettings.load().token == "s3cret-from-file"
    monkeypatch.delenv("POLICYD_TOKEN_FILE")
    monkeypatch.setenv("POLICYD_API_TOKEN", "from-env")
    assert DaemonSettings.load().token == "from-env"
    monkeypatch.delenv("POLICYD_API_TOKEN")
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        DaemonSettings.load({"token_file": empty, "token": None})
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    daemon_doc = (Path(__file__).resolve().parents[1] / "docs" / "DAEMON.md").read_text()
    assert "--token " not in readme and 'serve --token "' not in daemon_doc


def test_no_token_means_no_http_api_beyond_loopback(tmp_path: Path) -> None:
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
        with pytest.raises(ValueError, match="without a token"):
            DaemonSettings.load({"http_host": host})
        assert DaemonSettings.load({"http_host": host, "token": "t"}).token == "t"
        assert DaemonSettings.load({"http_host": host, "allow_open_http": True}).allow_open_http
    for host in ("127.0.0.1", "::1", "localhost"):
        assert DaemonSettings.load({"http_host": host}).token is None
    # settings made by replace() skip load(): start_daemon checks again
    base = settings_for(tmp_path)
    with pytest.raises(ValueError, match="without a token"):
        start_daemon(base.replace(http_host="0.0.0.0"))
    out = subprocess.run(
        [sys.executable, "-m", "policyd.cli", "serve", "--db", str(tmp_path / "x.duckdb"),
         "--http-host", "0.0.0.0"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 2 and "without a token" in out.stderr
    assert not (tmp_path / "x.duckdb").exists()  # refused before anything was opened


def test_a_flood_of_bad_frames_writes_a_few_log_lines_and_counts_them_all(
    tmp_path: Path,
) -> None:
    cmd = [
        sys.executable, "-m", "policyd.cli", "serve", "--db", str(tmp_path / "h.duckdb"),
        "--events", "tcp://127.0.0.1:*", "--snapshots", "tcp://127.0.0.1:*",
        "--http-port", "0",
    ]  # fmt: skip
    env = {**os.environ, "POLICYD_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while line and not line.startswith(READY_PREFIX):
            line = proc.stdout.readline()
        ready = json.loads(line[len(READY_PREFIX) :])
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 5000)
        push.connect(ready["events"])
        n = 20_000
        for i in range(n):
            push.send(bytes([i % 256]))
        with httpx.Client(base_url=ready["http_url"], timeout=30) as http:
            assert wait_for(
                lambda: http.get("/api/stats").json()["malformed_frames"] == n, timeout_s=60
            )

            def history_counted() -> bool:  # (frames the link had no room for are counted too)
                h = http.get("/api/stats").json()["history"]
                return int(h.get("link_malformed", 0)) + int(h["frames_dropped"]) == n

            assert wait_for(history_counted, timeout_s=60), http.get("/api/stats").json()["history"]
        push.close()
        ctx.term()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    warnings = [w for w in err.splitlines() if " WARNING " in w]
    malformed = [w for w in warnings if "malformed" in w or "rejected" in w]
    assert 1 <= len(malformed) <= 10, warnings
    assert len(err) < 20_000


def test_a_stream_of_bad_vllm_kv_batches_logs_a_line_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from policyd.daemon.kv_events import KvEventSubscriber  # noqa: PLC0415

    delivered: list[object] = []
    sub = KvEventSubscriber("tcp://127.0.0.1:9", delivered.append, clock=lambda: 0.0)
    with caplog.at_level("WARNING", logger="policyd.daemon.kv_events"):
        for seq in range(1, 2001):
            sub.handle([b"kv", seq.to_bytes(8, "big", signed=True), b"\xc1"], None)
    assert sub.counters["malformed"] == 2000 and not delivered
    assert 1 <= len(caplog.records) <= 2
