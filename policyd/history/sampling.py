"""How much of the block rows the history keeps: the ``block_sample_rate`` setting, halved
while the writer falls behind and doubled back once it has caught up
(``HistoryConfig.adaptive_sampling``).

The signal is the writer's queue, as a share of its bound (``fill``): the queue grows when rows
come faster than DuckDB appends them. A halving shows only once the backlog queued before it is
written, so the rate is halved again only while the queue is still growing (its fill above what
it was a check earlier, checks at least ``DOWN_AFTER_S`` apart) or rows were dropped at its
bound since that check (a full queue does not grow) - a queue that drains at the new rate is
left to drain. A writer over its CPU budget (``busy``: ``HistoryConfig.cpu_budget``) is treated
as behind whatever its queue: on a busy machine the history takes less, not the Engine. The
rate is doubled after the queue stayed below ``UP_FILL`` for ``UP_AFTER_S`` (and as long since
the last change) with the writer under half its budget, so that a writer that just caught up
does not fall straight behind again. Rates are the setting times a power of two, and the
sample is a hash threshold (``fanout.block_keep_mask``): a lower rate keeps a subset of the
blocks a higher one keeps.

>>> rate = AdaptiveRate(ceiling=1.0, floor=2.0**-10, now=0.0)
>>> [rate.update(fill, now) for fill, now in [(0.6, 1.0), (0.7, 1.5), (0.8, 2.0), (0.7, 3.0)]]
[0.5, 0.5, 0.25, 0.25]
>>> [rate.update(0.1, now) for now in (4.0, 13.9, 14.0, 24.0)]
[0.25, 0.25, 0.5, 1.0]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

log = logging.getLogger(__name__)

DOWN_FILL: Final = 0.5  # the queue's fill at which the rate is halved (while it grows)
UP_FILL: Final = 0.2  # ... below which, for UP_AFTER_S, it is doubled back
DOWN_AFTER_S: Final = 1.0  # the least time between two checks for halving
UP_AFTER_S: Final = 10.0


@dataclass
class AdaptiveRate:
    """The block rows' sample rate: ``ceiling`` (the setting) times 2^-``halvings``, never
    below ``floor`` by halving. Not thread-safe: the history calls it under its lock."""

    ceiling: float
    floor: float
    now: float  # when it was made (the first halving comes DOWN_AFTER_S after)
    adaptive: bool = True
    halvings: int = 0
    changes: int = 0

    def __post_init__(self) -> None:
        self._changed_s = self.now
        self._checked = (self.now, 0.0)  # (time, fill) of the last check for halving
        self._dropped = 0  # rows dropped at the bound as of that check
        self._low_since_s: float | None = None

    @property
    def rate(self) -> float:
        return self.ceiling * 2.0**-self.halvings

    def set_ceiling(self, rate: float) -> None:
        """A new setting: the rate starts again from it."""
        self.ceiling = rate
        self.halvings = 0

    def update(
        self, fill: float, now: float, *, dropped: int = 0, busy: bool = False, idle: bool = True
    ) -> float:
        """The rate for the next batch, given the queue's ``fill`` (queued rows / bound) now,
        the rows ``dropped`` at its bound so far (a running count), whether the writer is over
        its CPU budget (``busy``) and under half of it (``idle``)."""
        if not self.adaptive:
            return self.ceiling
        if fill < UP_FILL and idle and not busy:
            if self._low_since_s is None:
                self._low_since_s = now
        else:
            self._low_since_s = None
        checked_s, checked_fill = self._checked
        if now - checked_s >= DOWN_AFTER_S:
            self._checked = (now, fill)
            dropping, self._dropped = dropped > self._dropped, dropped
            behind = fill >= DOWN_FILL and (fill > checked_fill or dropping)
            if (behind or busy) and self.rate / 2.0 >= self.floor:
                self._change(+1, now)
                log.warning(
                    "history: the writer is %s; block rows now sampled at %.4g",
                    f"behind (its queue at {100.0 * fill:.0f}% of the bound and "
                    f"{'dropping' if dropping else 'growing'})"
                    if behind
                    else "over its CPU budget",
                    self.rate,
                )
                return self.rate
        low = self._low_since_s
        if self.halvings and low is not None and now - max(low, self._changed_s) >= UP_AFTER_S:
            self._change(-1, now)
            log.info("history: the writer caught up; block rows sampled at %.4g", self.rate)
        return self.rate

    def _change(self, halvings: int, now: float) -> None:
        self.halvings += halvings
        self.changes += 1
        self._changed_s = now
