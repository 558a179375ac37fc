"""Model checkpoints: the learnt state (the next-agent predictor with its River models and
accuracy counters, the SHARDS estimator) survives a restart.

A checkpoint is a pickle of ``{"format": FORMAT_VERSION, "saved_ts": ..., "models": {...}}``
(River objects pickle; pickle is the format River documents for persisting models), written to a
temporary file and moved into place with ``os.replace``, so a crash mid-write leaves the previous
checkpoint whole. Loading a file that is unreadable, truncated, of another format or of the wrong
shape is never fatal: the file is moved aside to ``<name>.corrupt-<unix ts>`` and the daemon
starts fresh. Only load checkpoints this daemon wrote: unpickling runs code.
"""

from __future__ import annotations

import logging
import os
import pickle
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
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return len(data)


def load(path: Path) -> Restored:
    """The models saved at ``path``; a missing file is a fresh start, a bad one is set aside."""
    if not path.exists():
        return Restored(None)
    try:
        with open(path, "rb") as fh:
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
