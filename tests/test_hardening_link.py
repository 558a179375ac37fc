"""Issue #32, point 5: the history link. Its sockets are IPC sockets in a private 0700
directory (no TCP port another local user could reach), every message carries the run's secret,
a malformed or forged message is counted and dropped on either side, and a dead link makes
/readyz fail, calls fail at once instead of hanging, and SIGTERM end the daemon promptly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from policyd.daemon.server import READY_PREFIX
from policyd.history import HistoryConfig, HistoryError
from policyd.history.process import HistoryProcess
from tests.test_daemon import wait_for


@pytest.fixture
def history(tmp_path: Path) -> Iterator[HistoryProcess]:
    h = HistoryProcess(HistoryConfig(db_path=tmp_path / "h.duckdb", snapshot_interval_s=None))
    h.start()
    yield h
    h.close()


def test_the_link_is_ipc_in_a_private_directory(history: HistoryProcess) -> None:
    link = history.link_dir
    assert link is not None
    mode = os.stat(link).st_mode
    assert stat.S_IMODE(mode) == 0o700 and os.stat(link).st_uid == os.getuid()
    assert sorted(os.listdir(link)) == ["inbox", "outbox"]
    history.close()
    assert not os.path.exists(link)  # removed at close


def test_forged_messages_are_counted_and_dropped_on_both_sides(history: HistoryProcess) -> None:
    link = history.link_dir
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    to_daemon = ctx.socket(zmq.PUSH)
    to_daemon.connect(f"ipc://{link}/outbox")
    for forged in ([b"xy"], [b"stats", b"\x80"], [b"0" * 32, b"reply", b"\x93\x01\xc3\xc0"]):
        to_daemon.send_multipart(forged)
    assert wait_for(lambda: history.stats()["link_malformed_received"] == 3)
    # into the child: only the daemon's own socket reaches it (the child connects out); a
    # message on it without the run's secret (or otherwise malformed) is counted and dropped
    assert history._link is not None
    out = history._link._out
    assert out is not None
    with history._link._send_lock:
        out.send_multipart([b"zz"])
        out.send_multipart([b"0" * 32, b"c", b"\x93\x01\xa5close\x90"])  # a forged close
    assert wait_for(lambda: history.stats().get("link_malformed") == 2)
    # the link goes on: calls answer, the writer is alive
    history.record("decisions", [{"ts": 1.0, "kind": "evict", "n_blocks": 1}])
    history.flush()
    assert history.query_live("SELECT count(*) FROM decisions") == [(1,)]
    assert history.stats()["writer_alive"] is True
    to_daemon.close(0)
    ctx.term()


def test_a_dead_link_fails_readiness_and_calls_at_once(history: HistoryProcess) -> None:
    assert history._link is not None
    history._link.stop_listening()  # the listener thread ends (as it did on a forged message)
    stats = history.stats()
    assert stats["link_alive"] is False and stats["writer_alive"] is False
    with pytest.raises(HistoryError, match="link"):
        history.publish_snapshot()  # before: waited for a reply that could not come (600 s)
    with pytest.raises(HistoryError, match="did not close cleanly"):
        history.close()  # told to close without a reply; said so, not claimed clean


def test_sigterm_ends_a_daemon_whose_history_link_is_dead(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "policyd.cli", "serve", "--db", str(tmp_path / "h.duckdb"),
        "--events", "tcp://127.0.0.1:*", "--snapshots", "tcp://127.0.0.1:*",
        "--http-port", "0", "--log-level", "WARNING",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while line and not line.startswith(READY_PREFIX):
            line = proc.stdout.readline()
        ready = json.loads(line[len(READY_PREFIX) :])
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        os.kill(int(children[0]), signal.SIGKILL)  # the history process: the link is dead
        with httpx.Client(base_url=ready["http_url"], timeout=30) as http:
            assert wait_for(lambda: http.get("/readyz").status_code == 503)
            assert http.post("/api/history/publish").status_code == 503  # at once, no hang
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        print(f"SIGTERM with a dead history link: exited in {time.monotonic() - started:.1f} s")
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another local user")
def test_another_local_user_cannot_connect_to_the_link(history: HistoryProcess) -> None:
    """As ``nobody`` (uid 65534), connecting to either IPC socket is refused by the directory's
    0700 mode (before: any local process could connect to the loopback TCP ports)."""
    link = history.link_dir
    script = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "for name in ('inbox', 'outbox'):\n"
        "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "    try:\n"
        f"        s.connect({link!r} + '/' + name)\n"
        "        print('connected', name)\n"
        "    except PermissionError:\n"
        "        print('refused', name)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["refused", "inbox", "refused", "outbox"], out.stdout


def test_a_killed_daemons_link_directory_is_removed_by_the_next(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = Path(tempfile.mkdtemp(prefix=f"policyd-link-{gone.pid}-"))
    alive = Path(tempfile.mkdtemp(prefix=f"policyd-link-{os.getppid()}-"))
    h = HistoryProcess(HistoryConfig(db_path=tmp_path / "h.duckdb", snapshot_interval_s=None))
    h.start()
    try:
        assert not stale.exists() and alive.exists()
    finally:
        h.close()
        shutil.rmtree(alive, ignore_errors=True)


def test_a_hung_history_process_fails_readiness_calls_and_is_killed_at_close(
    tmp_path: Path,
) -> None:
    """The child stopped (SIGSTOP: a real hang): no heartbeat, so after ``stale_s`` the link
    reads dead, calls fail at once, and close() kills it and says rows may be lost."""
    h = HistoryProcess(
        HistoryConfig(db_path=tmp_path / "h.duckdb", snapshot_interval_s=None), stale_s=2.0
    )
    h.start()
    assert h.pid is not None
    os.kill(h.pid, signal.SIGSTOP)
    try:
        assert wait_for(lambda: not h.stats()["writer_alive"])
        with pytest.raises(HistoryError, match="link"):
            h.flush()
    finally:
        with pytest.raises(HistoryError, match="killed"):
            h.close()
    assert h._proc is not None and h._proc.poll() is not None
