"""The daemon's model checkpoint file: loading it at start, saving it again, and what the stats
report about both (``info``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from policyd.daemon import checkpoint

log = logging.getLogger(__name__)


class ModelCheckpoints:
    """Loads and saves the models at ``path`` (``policyd.daemon.checkpoint``'s file format).

    ``info`` is what ``GET /api/stats`` shows under ``checkpoint``: the path, the last save's
    wall-clock time, the number of saves, whether models were restored at start, the load error
    and where a refused file was moved, and the persisted settings ignored at start (key ->
    why). ``load`` runs once, at construction of the service (one thread); ``save`` may run on
    any thread: it takes ``lock`` (the service's) while it collects the models and writes the
    file, so no event changes them half-way, and updates ``info`` after releasing it.
    """

    def __init__(
        self,
        path: Path,
        *,
        lock: AbstractContextManager[Any],
        wall_clock: Callable[[], float],
    ) -> None:
        self.path = path
        self.lock = lock
        self.wall_clock = wall_clock
        self.saves = 0
        self.info: dict[str, object] = {
            "path": str(path),
            "last_ts": None,
            "saves": 0,
            "restored": False,
            "error": None,
            "moved_to": None,
            "rejected_settings": {},  # persisted settings ignored at start, and why
        }

    def load(self) -> dict[str, Any] | None:
        """The saved models (None: no usable file); a refused file's error goes to ``info``."""
        restored = checkpoint.load(self.path)
        if restored.error is not None:
            self.info.update(
                error=restored.error, moved_to=str(restored.moved_to) if restored.moved_to else None
            )
        return restored.models

    def mark_restored(self) -> None:
        self.info["restored"] = True

    def report_rejected(self, errors: Mapping[str, str]) -> None:
        """Log and show persisted settings that were ignored at start (key -> why)."""
        for key, why in errors.items():
            log.warning("persisted setting %s ignored, its default used: %s", key[:200], why)
        rejected = self.info.setdefault("rejected_settings", {})
        assert isinstance(rejected, dict)
        rejected.update(errors)

    def save(self, models: Callable[[], dict[str, Any]]) -> dict[str, object]:
        """Write what ``models()`` returns (called under the lock); returns the path and bytes."""
        with self.lock:
            path = self.path
            nbytes = checkpoint.save(path, models(), wall_clock=self.wall_clock())
        self.saves += 1
        self.info.update(last_ts=self.wall_clock(), saves=self.saves)
        return {"path": str(path), "bytes": nbytes}
