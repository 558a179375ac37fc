"""A DuckDB file held read-write by another process, as a running daemon holds it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from policyd.history import migrate


@contextmanager
def held_by_another_process(db: Path, setup_sql: str = "") -> Iterator[Path]:
    """Create ``db`` at the newest schema, then keep it open in a child process (after running
    ``setup_sql`` there) until the block exits."""
    migrate(db)
    script = (
        "import duckdb, sys; c = duckdb.connect(sys.argv[1]); "
        "[c.execute(s) for s in sys.argv[2:] if s]; "
        "print('ready', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(db), setup_sql],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield db
    finally:
        proc.kill()
        proc.wait()
