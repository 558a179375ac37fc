"""Work the connector hands off vLLM's scheduler thread: a FIFO of jobs run by a thread of its own.

vLLM's thread only appends a job (a closure over facts it already holds: ids, digests, counts,
timestamps); this thread runs the jobs in the order they were handed over, so everything they
emit reaches the daemon in the order vLLM's hooks saw it. A job that raises loses only itself
(counted as failed and done, logged at most once per interval); a full queue drops the job
(counted). ``immediate`` runs a job at once on the caller's thread: the simulator's and unit
tests' setting.

Waking a sleeping thread is a system call and, on a virtual machine, an interrupt to another
CPU: the costliest part of a hand-off (docs/RESULTS.md, *The connector's time per scheduler
step*). So ``submit`` only appends to a deque, and this thread wakes by itself every
``POLL_S`` while idle: a job waits at most that long, and vLLM's thread never pays for a
wake-up. ``flush`` and ``close`` wake it at once.
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
POLL_S: Final = 0.005  # an idle thread looks for jobs this often


def immediate(job: Job) -> None:
    """Run ``job`` now, on the caller's thread (no hand-off)."""
    job()


class Deferred:
    """Runs handed-over jobs in order on its own thread; ``submit`` never blocks nor raises."""

    def __init__(self, name: str = "agentkv-deferred", max_jobs: int = MAX_QUEUED_JOBS) -> None:
        self.max_jobs = max_jobs
        self.submitted = 0
        self.failed = 0
        self.dropped = 0
        self.done = 0
        self.cpu_ns = 0  # this thread's CPU time in jobs: the work taken off vLLM's thread
        self._jobs: deque[Job] = deque()  # append and popleft are atomic
        self._wake = threading.Event()  # set: look for jobs now (flush, close)
        self._closed = False
        self._last_log_s = -LOG_INTERVAL_S
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; the thread finds it within ``POLL_S`` (no wake-up)."""
        if self._closed or len(self._jobs) >= self.max_jobs:
            self.dropped += 1
            return
        self.submitted += 1
        self._jobs.append(job)

    def _run(self) -> None:
        jobs = self._jobs
        while True:
            try:
                job = jobs.popleft()
            except IndexError:
                if self._closed:
                    return
                self._wake.wait(POLL_S)
                self._wake.clear()
                continue
            c0 = time.thread_time_ns()
            self._run_one(job)
            self.cpu_ns += time.thread_time_ns() - c0
            time.sleep(0)  # releases the GIL between jobs: a waiting vLLM thread goes first

    def _run_one(self, job: Job) -> None:
        try:
            job()
        except Exception as exc:  # a job never stops the ones after it
            self.failed += 1
            now = time.monotonic()
            if now - self._last_log_s >= LOG_INTERVAL_S:
                self._last_log_s = now
                log.warning(
                    "agentkv connector: deferred work failed (%r); %d so far", exc, self.failed
                )
        finally:
            self.done += 1

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every job handed over so far has run; False on timeout."""
        target = self.submitted
        deadline = time.monotonic() + timeout_s
        self._wake.set()
        while self.done < target:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Run what is queued (for at most ``timeout_s``), then stop the thread."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout_s)
