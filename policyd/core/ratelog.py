"""Log lines for bad input, rate-limited with counts; bad values quoted, never echoed whole.

Bad input is counted where it is rejected (always); its log line is written at most once per
``interval_s`` per kind, saying how many of that kind were suppressed since the last line. A
flood of 100,000 one-byte frames writes a handful of lines, not 16 MB of them (issue #32).

>>> import logging
>>> lines = []
>>> class Keep(logging.Handler):
...     def emit(self, record): lines.append(record.getMessage())
>>> logger = logging.getLogger("ratelog-doctest"); logger.addHandler(Keep())
>>> logger.propagate = False
>>> t = [0.0]
>>> rl = RateLimitedLog(logger, interval_s=10.0, clock=lambda: t[0])
>>> [rl.warning("frame", "bad frame: %s", "x") for _ in range(5)]
[True, False, False, False, False]
>>> t[0] = 11.0
>>> rl.warning("frame", "bad frame: %s", "y")
True
>>> lines
['bad frame: x', 'bad frame: y (4 more like it suppressed in the last 11 s)']
"""

from __future__ import annotations

import logging
import reprlib
import threading
import time
from collections.abc import Callable
from typing import Final

LOG_INTERVAL_S: Final = 10.0
QUOTE_CHARS: Final = 200  # at most this much of a bad value is quoted back in a message


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters, safe on values of any size or depth (a
    10 MB string, a 2,000-deep list): error messages quote a bad value, never echo it whole.

    >>> quote("x" * 1000)[:12], len(quote("x" * 1000)) < 260
    ("'xxxxxxxxxxx", True)
    >>> quote([[[[[1]]]]])
    '[[[[[...]]]]]'
    """
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother, short.maxlong = 4, limit, limit, limit
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 8
    try:
        text = short.repr(value)
    except (RecursionError, ValueError):  # pathological nesting; ints past the digit limit
        text = f"<{type(value).__name__}>"
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return text


class RateLimitedLog:
    """At most one line per ``kind`` every ``interval_s``; the rest are counted and the count
    is said on the next line of that kind. Thread-safe."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless a line of ``kind`` went out within ``interval_s``; True
        when it was logged."""
        now = self.clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return False
            suppressed = self._suppressed.pop(kind, 0)
            self._last[kind] = now
        if suppressed:
            since = now - last if last is not None else 0.0
            msg += f" ({suppressed} more like it suppressed in the last {since:.0f} s)"
        self.logger.warning(msg, *args)
        return True
