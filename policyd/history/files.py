"""Where the history lives: the live file, its published snapshot, and which one a reader opens.

DuckDB lets one read-write process *or* many read-only ones open a file, and while the daemon
holds the live file every other open fails. Outside readers therefore read the
snapshot the daemon publishes next to it, or the live file itself when no daemon runs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
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


_TEMP_NAMES: Final = (
    # a history snapshot being written: .<name>.<pid>.<n>.tmp (and its .wal)
    re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.\d+\.tmp(?:\.wal)?$"),
    # a model checkpoint being written: .<name>.tmp-<pid>
    re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$"),
)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # ours from before a restart in this process: nothing writes it now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_files(targets: Iterable[Path]) -> list[Path]:
    """Remove what a crash while writing one of ``targets`` left beside it (the temporary file
    of a snapshot or a checkpoint whose writing process is gone); returns what was removed.
    Called at start: a temporary file is only ever renamed into place, so one whose process
    is gone is never finished."""
    removed: list[Path] = []
    by_dir: dict[Path, set[str]] = {}
    for target in targets:
        by_dir.setdefault(Path(target).parent, set()).add(Path(target).name)
    for folder, names in by_dir.items():
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for entry in entries:
            for pattern in _TEMP_NAMES:
                found = pattern.match(entry.name)
                if found and found["name"] in names and not _running(int(found["pid"])):
                    try:
                        entry.unlink()
                        removed.append(entry)
                    except OSError:
                        pass
                    break
    return removed
