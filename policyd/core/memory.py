"""Handing freed heap memory back to the operating system, and reading a process's RSS (used by
the daemon, its history writer process and the benchmarks that watch them).

The daemon's threads (ingest, engine, history writer, HTTP) allocate and free many small
objects; glibc keeps freed memory in per-thread arenas and returns it only from the top of
each heap, so after a burst (a backlog of queued frames, a large history flush) RSS stays at
the burst's high-water mark although Python has freed the objects. ``malloc_trim(0)`` (glibc,
``man 3 malloc_trim``) releases the free pages of every arena. It is called now and then from
the housekeeping thread; on a C library without it this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        log.info("malloc_trim is not available here: freed heap stays with the process")
        return None
    return trim


def release_free_heap() -> bool:
    """Return free heap pages to the OS; ``True`` when the C library did (glibc)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def rss_bytes(pid: int | str = "self") -> int | None:
    """A process's resident set size (``VmRSS`` in ``/proc/<pid>/status``); None off Linux or
    for a process that is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
