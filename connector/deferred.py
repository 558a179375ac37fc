"""Work the connector hands off vLLM's scheduler thread: a FIFO of jobs run by a thread of its own.

vLLM's thread only appends a job (a closure over facts it already holds: ids, digests, counts,
timestamps); this thread runs the jobs in the order they were handed over, so everything they
emit reaches the daemon in the order vLLM's hooks saw it. A job that raises loses only itself
(counted, logged at most once per interval); a full queue drops the job (counted). ``immediate``
runs a job at once on the caller's thread: the simulator's and unit tests' setting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Final

log = logging.getLogger("agentkv.connector")

Job = Callable[[], None]
MAX_QUEUED_JOBS: Final = 1 << 16
LOG_INTERVAL_S: Final = 30.0


def immediate(job: Job) -> None:
    """Run ``job`` now, on the caller's thread (no hand-off)."""
    job()


class Deferred:
    """Runs handed-over jobs in order on its own thread; ``submit`` never blocks nor raises."""

    def __init__(self, name: str = "agentkv-deferred", max_jobs: int = MAX_QUEUED_JOBS) -> None:
        self.max_jobs = max_jobs
        self.failed = 0
        self.dropped = 0
        self.done = 0
        self.cpu_ns = 0  # this thread's CPU time in jobs: the work taken off vLLM's thread
        self._jobs: deque[Job] = deque()
        self._wake = threading.Condition(threading.Lock())
        self._closed = False
        self._idle = threading.Event()
        self._idle.set()
        self._last_log_s = -LOG_INTERVAL_S
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self._closed or len(self._jobs) >= self.max_jobs:
            self.dropped += 1
            return
        with self._wake:
            self._jobs.append(job)
            self._wake.notify()

    def _run(self) -> None:
        jobs = self._jobs
        while True:
            with self._wake:
                while not jobs and not self._closed:
                    self._idle.set()
                    self._wake.wait(1.0)
                self._idle.clear()
                if not jobs and self._closed:
                    self._idle.set()
                    return
            c0 = time.thread_time_ns()
            while jobs:
                self._run_one(jobs.popleft())
            self.cpu_ns += time.thread_time_ns() - c0

    def _run_one(self, job: Job) -> None:
        try:
            job()
            self.done += 1
        except Exception as exc:  # a job never stops the ones after it
            self.failed += 1
            now = time.monotonic()
            if now - self._last_log_s >= LOG_INTERVAL_S:
                self._last_log_s = now
                log.warning(
                    "agentkv connector: deferred work failed (%r); %d so far", exc, self.failed
                )

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every job handed over so far has run; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._jobs or not self._idle.is_set():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Run what is queued (for at most ``timeout_s``), then stop the thread."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout_s)
