"""The daemon's one lock: re-entrant, and telling whether another thread waits for it."""

from __future__ import annotations

import threading


class YieldingLock:
    """A re-entrant lock that knows whether a thread waits for it. Python's locks are not fair:
    the engine worker, releasing and re-taking the lock batch after batch, would starve an HTTP
    decision waiting for it while a backlog drains (seconds per answer); the worker checks
    ``contended`` after each batch and steps aside."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count = threading.Lock()
        self._waiting = 0

    def __enter__(self) -> YieldingLock:
        with self._count:
            self._waiting += 1
        self._lock.acquire()
        with self._count:
            self._waiting -= 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    @property
    def contended(self) -> bool:
        return self._waiting > 0
