"""Measure what a hung history process does to `policyd serve` (issue #32, point 5; not part of
CI, ~40 s): start the daemon, stop its history process with SIGSTOP, then time how long until
/readyz answers 503, how long POST /api/history/publish takes, and how long SIGTERM takes.

    python scripts/hung_history.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def main() -> int:
    folder = tempfile.mkdtemp(prefix="policyd-hung-")
    cmd = [
        sys.executable, "-m", "policyd.cli", "serve", "--db", f"{folder}/h.duckdb",
        "--events", "tcp://127.0.0.1:*", "--snapshots", "tcp://127.0.0.1:*",
        "--http-port", "0", "--log-level", "ERROR",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    while line and not line.startswith("POLICYD_READY "):
        line = proc.stdout.readline()
    ready = json.loads(line.split(" ", 1)[1])
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    os.kill(int(children[0]), signal.SIGSTOP)  # the history process hangs
    started = time.monotonic()
    with httpx.Client(base_url=ready["http_url"], timeout=120) as http:
        while http.get("/readyz").status_code == 200:
            time.sleep(0.2)
        print(f"/readyz 503 after {time.monotonic() - started:.1f} s of a stopped history process")
        t0 = time.monotonic()
        status = http.post("/api/history/publish").status_code
        print(f"POST /api/history/publish: {status} in {1000 * (time.monotonic() - t0):.1f} ms")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=600)
    print(f"SIGTERM: exit code {proc.returncode} in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
