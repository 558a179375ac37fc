"""What the daemon hears from its history process, and the calls waiting for a reply.

``ChildReports.received`` takes each authentic message from the link's listener thread
(``policyd.history.link``): ``ready`` resolves the start, ``stats`` replaces the latest counters,
``reply`` resolves the call it answers, ``beat`` only proves the child alive (the link counts
it). Anything else raises ``ValueError``, which the link counts as malformed. Thread-safe: the
listener resolves what callers on other threads wait for.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from typing import Any

from policyd.core.ratelog import quote
from policyd.history.link import start_error
from policyd.history.revisions import HistoryError


class ChildReports:
    """The child's start, its latest counters, and the futures of calls awaiting its reply."""

    def __init__(self) -> None:
        self.ready: Future[None] = Future()
        self.stats: dict[str, Any] = {}
        self.stats_received_s: float | None = None
        self._calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._lock = threading.Lock()

    def expect_reply(self) -> tuple[int, Future[Any]]:
        """A new call's id and the future its reply resolves."""
        call_id = next(self._call_ids)
        future: Future[Any] = Future()
        with self._lock:
            self._calls[call_id] = future
        return call_id, future

    def forget(self, call_id: int) -> None:
        """The call is over (answered, failed or timed out): a late reply is ignored."""
        with self._lock:
            self._calls.pop(call_id, None)

    def fail_pending(self, error: HistoryError) -> None:
        """Fail the start, if still waiting, and every call waiting for a reply."""
        if not self.ready.done():
            self.ready.set_exception(error)
        with self._lock:
            pending = list(self._calls.values())
        for future in pending:
            if not future.done():
                future.set_exception(error)

    def received(self, kind: bytes, body: Any) -> None:
        if kind == b"beat":  # the child's heartbeat thread: alive, even inside a long call
            return
        if kind == b"stats":
            if not isinstance(body, dict):
                raise ValueError("stats that are not a mapping")
            self.stats = body
            self.stats_received_s = time.monotonic()
        elif kind == b"reply":
            call_id, ok, value = body
            if not isinstance(call_id, int):
                raise ValueError("a reply without a call id")
            with self._lock:
                future = self._calls.get(call_id)
            if future is not None and not future.done():
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(HistoryError(str(value)))
        elif kind == b"ready":
            if self.ready.done():
                return
            ok, error = body
            if ok:
                self.stats_received_s = time.monotonic()  # its first report follows
                self.ready.set_result(None)
            else:
                self.ready.set_exception(start_error(error))
        else:
            raise ValueError(f"unknown message kind {quote(kind, 40)}")
