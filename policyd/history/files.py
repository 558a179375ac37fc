"""Where the history lives: the live file, its published snapshot, and which one a reader opens.

DuckDB lets one read-write process *or* many read-only ones open a file, and while the daemon
holds the live file every other open fails (DESIGN.md §4). Outside readers therefore read the
snapshot the daemon publishes next to it, or the live file itself when no daemon runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

DEFAULT_DB_PATH: Final = Path("policyd-history.duckdb")
DB_PATH_ENV: Final = "POLICYD_DB"
SNAPSHOT_SUFFIX: Final = ".snapshot.duckdb"


def default_db_path() -> Path:
    """``$POLICYD_DB`` when set, else ``./policyd-history.duckdb``."""
    value = os.environ.get(DB_PATH_ENV, "").strip()
    return Path(value) if value else DEFAULT_DB_PATH


def default_snapshot_path(db_path: Path) -> Path:
    """``history.duckdb`` -> ``history.snapshot.duckdb`` (same folder: the rename is atomic)."""
    db_path = Path(db_path)
    stem = db_path.name.removesuffix(".duckdb").removesuffix(".db")
    return db_path.with_name(stem + SNAPSHOT_SUFFIX)


def snapshot_is_current(db_path: Path, snapshot_path: Path) -> bool:
    """True when the snapshot exists and is at least as new as the live file (or it is gone)."""
    if not snapshot_path.exists():
        return False
    if not db_path.exists():
        return True
    return snapshot_path.stat().st_mtime >= db_path.stat().st_mtime
