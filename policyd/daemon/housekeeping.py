"""The daemon's housekeeping: periodic jobs on one thread, each on its own interval."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from policyd.core.memory import release_free_heap

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Job:
    """``run`` every ``interval()`` seconds (read again after each run, so a live setting
    applies from the next one); the first run is ``first_delay_s`` after the loop starts
    (None: ``interval()``)."""

    name: str
    run: Callable[[], object]
    interval: Callable[[], float]
    first_delay_s: float | None = None


class Housekeeping:
    """Runs ``jobs`` on the ``policyd-housekeeping`` thread (``run``) until ``stop`` is set.

    Every 0.1 s it runs the jobs that are due, in ``jobs``' order, then ``after_pass``. A job
    that raises is logged and rescheduled as if it had returned; each job takes the service's
    lock itself where it needs it, so nothing here holds it."""

    def __init__(
        self,
        jobs: Sequence[Job],
        *,
        clock: Callable[[], float],
        after_pass: Callable[[], object],
    ) -> None:
        self.jobs = {job.name: job for job in jobs}
        self.clock = clock
        self.after_pass = after_pass

    def run(self, stop: threading.Event) -> None:
        now = self.clock()
        due = {
            name: now + (job.interval() if job.first_delay_s is None else job.first_delay_s)
            for name, job in self.jobs.items()
        }
        while not stop.wait(0.1):
            now = self.clock()
            for name, when in list(due.items()):
                if now < when:
                    continue
                job = self.jobs[name]
                try:
                    job.run()
                except Exception:
                    log.exception("housekeeping job %s failed", name)
                due[name] = self.clock() + job.interval()
            self.after_pass()


class HeapTrimmer:
    """Hands the allocator's free heap back to the system (a housekeeping job); ``trims``
    counts the calls that released memory. One caller thread (housekeeping)."""

    def __init__(self) -> None:
        self.trims = 0

    def trim(self) -> None:
        self.trims += release_free_heap()
