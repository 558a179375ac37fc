"""The daemon's heap trim gives a burst's freed memory back to the OS (glibc, as CI runs)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from policyd.core.memory import release_free_heap
from policyd.daemon.settings import DaemonSettings


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_burst_freed_in_a_thread_leaves_rss_until_the_heap_is_trimmed() -> None:
    kept: list[bytes] = []

    def burst() -> None:  # ~100 MiB of malloc'd objects (over pymalloc's 512-byte limit)
        objects = [bytes(3000) for _ in range(35_000)]
        kept.append(bytes(3000))  # allocated last: pins the top of the thread's arena
        del objects

    release_free_heap()  # what earlier tests freed goes first: the burst needs fresh pages
    before = _rss_mib()
    worker = threading.Thread(target=burst)
    worker.start()
    worker.join()
    held = _rss_mib()
    assert held - before > 60  # freed by Python, still held by the C heap
    assert release_free_heap()
    assert _rss_mib() < held - 60  # returned to the OS


def test_the_trim_interval_is_validated() -> None:
    with pytest.raises(ValueError, match="heap_trim_interval_s"):
        DaemonSettings.load({"heap_trim_interval_s": -1.0})
    assert DaemonSettings.load({"heap_trim_interval_s": 0.0}).heap_trim_interval_s == 0.0
