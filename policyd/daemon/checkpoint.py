"""Model checkpoints: the learnt state (the next-agent predictor with its River models and
accuracy counters, the SHARDS estimator) survives a restart.

A checkpoint is a pickle of ``{"format": FORMAT_VERSION, "saved_ts": ..., "models": {...}}``
(River objects pickle; pickle is the format River documents for persisting models), written to a
temporary file and moved into place with ``os.replace``, so a crash mid-write leaves the previous
checkpoint whole. Loading a file that is unreadable, truncated, of another format or of the wrong
shape is never fatal: the file is moved aside to ``<name>.corrupt-<unix ts>`` and the daemon
starts fresh. Only load checkpoints this daemon wrote: unpickling runs code. So a checkpoint is
written 0600 (owner only), and one that is not owned by the daemon's user or is writable by
group or others (checked on the opened file, not the path) is refused unread: set aside, the
daemon starts fresh (issue #32).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

log = logging.getLogger(__name__)

FORMAT_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class Restored:
    models: dict[str, Any] | None  # None: nothing usable (missing or set aside)
    error: str | None = None
    moved_to: Path | None = None


def save(path: Path, models: dict[str, Any], *, wall_clock: float | None = None) -> int:
    """Write ``models`` atomically; returns the bytes written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT_VERSION,
        "saved_ts": time.time() if wall_clock is None else wall_clock,
        "models": models,
    }
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a leftover of ours: O_EXCL below makes the file new, and 0600
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return len(data)


class UnsafeCheckpointError(ValueError):
    """A checkpoint someone else could have written: not unpickled."""


def _check_owner_only(fd: int, path: Path) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise UnsafeCheckpointError(f"{path} is owned by uid {st.st_uid}, not this daemon's user")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCheckpointError(
            f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
            "a checkpoint is unpickled, so only one writable by this user alone is loaded"
        )


def load(path: Path) -> Restored:
    """The models saved at ``path``; a missing file is a fresh start, a bad one is set aside."""
    if not path.exists():
        return Restored(None)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            _check_owner_only(fd, path)  # before unpickling anything
            payload = pickle.load(fh)  # our own file only: see the module docstring
        if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
            found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
            raise ValueError(f"checkpoint format {found!r}, this daemon reads {FORMAT_VERSION}")
        models = payload.get("models")
        if not isinstance(models, dict):
            raise ValueError("checkpoint has no models mapping")
        return Restored(models)
    except Exception as exc:  # anything unreadable is set aside, never fatal
        aside = set_aside(path)
        message = f"{type(exc).__name__}: {exc}"
        log.error(
            "checkpoint %s unreadable (%s); moved to %s, starting fresh", path, message, aside
        )
        return Restored(None, error=message, moved_to=aside)


def set_aside(path: Path) -> Path | None:
    """Rename a bad checkpoint to ``<name>.corrupt-<ts>`` (kept for inspection)."""
    target = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
    n = 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt-{int(time.time())}-{n}")
    try:
        os.replace(path, target)
    except OSError as exc:
        log.error("could not move the bad checkpoint %s aside: %s", path, exc)
        return None
    return target
