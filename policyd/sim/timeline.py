"""Simulated time and the timers pending in it.

Timers fire in time order, timers set for one instant in the order they were set; popping one
advances ``now`` to its time (never backwards: no timer is set in the past).
"""

from __future__ import annotations

import heapq
from itertools import count

from policyd.sim.requests import SimRequest

# what a timer stands for: a request arrives, its prefill ends, it finishes; a snapshot is due
ARRIVE, PREFILLED, FINISH, SNAPSHOT = range(4)


class Timeline:
    """The clock (``now``, seconds of simulated time) and the heap of pending timers."""

    __slots__ = ("_seq", "_timers", "now")

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[tuple[float, int, int, SimRequest | None]] = []
        self._seq = count()

    def __len__(self) -> int:
        return len(self._timers)

    def at(self, when: float, kind: int, request: SimRequest | None) -> None:
        """Set a timer of ``kind`` (``ARRIVE``...) for ``when`` (``request``: None for
        ``SNAPSHOT``)."""
        heapq.heappush(self._timers, (when, next(self._seq), kind, request))

    def pop(self) -> tuple[int, SimRequest | None]:
        """The next timer's kind and request; ``now`` becomes its time."""
        when, _, kind, request = heapq.heappop(self._timers)
        self.now = when
        return kind, request
