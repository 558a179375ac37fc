"""The daemon's housekeeping scheduler: jobs run when due, in their declared order, each
rescheduled from when it finished - a failing one too, logged - and ``after_pass`` runs after
every pass."""

from __future__ import annotations

import logging
import threading

import pytest

from policyd.daemon.housekeeping import Housekeeping, Job


def test_jobs_run_when_due_in_order_and_a_failure_is_logged_and_rescheduled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    ran: list[tuple[str, float]] = []
    stop = threading.Event()
    passes = [0]

    def job(name: str, fail: bool = False) -> Job:
        def run() -> None:
            ran.append((name, now[0]))
            if fail:
                raise RuntimeError("boom")

        return Job(name, run, lambda: 2.0 if fail else 1.0, first_delay_s=2.5 if fail else 0.5)

    def after_pass() -> None:  # the clock moves half a second per pass; eight passes
        passes[0] += 1
        now[0] += 0.5
        if passes[0] == 8:
            stop.set()

    housekeeping = Housekeeping(
        [job("a"), job("b", fail=True)], clock=lambda: now[0], after_pass=after_pass
    )
    with caplog.at_level(logging.ERROR, logger="policyd.daemon.housekeeping"):
        housekeeping.run(stop)
    # passes at 0.0, 0.5, ..., 3.5: "a" first after 0.5 s then every 1 s; "b" first after
    # 2.5 s (after "a", due at the same time), then 2 s later: past the last pass
    assert ran == [("a", 0.5), ("a", 1.5), ("a", 2.5), ("b", 2.5), ("a", 3.5)]
    assert passes[0] == 8
    assert [r.getMessage() for r in caplog.records] == ["housekeeping job b failed"]
