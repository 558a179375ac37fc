"""Never behind vLLM's default: a guard that measures the learned decisions against a shadow LRU
and publishes vLLM's own behaviour while they lose.

The guard watches the same traffic as the policy. A **shadow** of vLLM's default estimates
what it would hit on it: a GPU tier in LRU order (a request's blocks become the most recent
when it starts, and again when it finishes and vLLM frees them, tail first), and a host tier
that stores every block the GPU computes and evicts the least recently stored or loaded (vLLM's
offloading default: a block the GPU hits is not touched on the host). It is sampled
SHARDS-style (Waldspurger et al., FAST 2015): a block takes part when a hash of it falls below
``rate``, and each shadow tier holds ``rate`` times its tier, with ``rate`` chosen so that both
together hold at most ``max_shadow_blocks``. Prefix caching is kept at the sample's
resolution: in a request, the sampled blocks after the first sampled miss (GPU, then host)
miss too.

For every request the ``PrefixHit`` says what really hit: its sampled blocks inside the hit
prefix. Window by window the guard compares the two:

* **learned** (the policy's snapshots): when the real hits since the probe began (older
  windows fading by ``memory`` a window) fall below the shadow's calibrated estimate by more
  than ``tolerance`` plus one standard deviation of a count that size, the next snapshots are
  **recency** (nothing ranked, pinned, retired or declined: exactly what the connector does
  without a snapshot, vLLM's default) for ``hold`` windows, doubled after each probe that
  loses again (at most ``max_hold``);
* **recency**: the real hits are vLLM's default's, so the window calibrates the shadow (the
  ratio of real to estimated hits, smoothed; the sampled estimate is biased by where the
  prefixes' unsampled blocks went); when the hold ends the learned snapshots are tried again.

A window closes after ``window`` sampled references and at least ``min_window_requests``
requests: a verdict on a handful of requests would follow their noise.

The guard starts in recency for one window, to calibrate. Its cost per event is a hash and a
compare per block of a request, plus an ordered-dict move per sampled block
(``policyd bench-guard`` measures it).

>>> guard = RecencyGuard(window=4, min_window_requests=1, hold=1)
>>> guard.configure(gpu_blocks=2, host_blocks=0)
>>> guard.learned
False
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Final

import numpy as np

from policyd.core.types import Event, PrefixHit, RequestFinished, RequestStarted

MAX_SHADOW_BLOCKS: Final = 8192
MAX_OPEN_REQUESTS: Final = 65536  # requests never reported finished are forgotten past this
# Fibonacci hashing (multiplication modulo 2**64, numpy's uint64 wraps): spreads sequential
# ids over 64 bits
_MIX_U64: Final = np.uint64(0x9E3779B97F4A7C15)


@dataclass(slots=True)
class GuardCounters:
    windows: int = 0
    learned_windows: int = 0
    recency_windows: int = 0
    switches_to_recency: int = 0
    probes: int = 0
    sampled_refs: int = 0
    real_hits: int = 0  # sampled blocks that hit, learned windows only
    shadow_hits: int = 0  # what the calibrated shadow expected for them


class RecencyGuard:
    """Chooses, window by window, between the policy's snapshots and vLLM's default."""

    def __init__(
        self,
        *,
        window: int = 4096,
        min_window_requests: int = 32,
        tolerance: float = 0.01,
        hold: int = 2,
        max_hold: int = 32,
        max_shadow_blocks: int = MAX_SHADOW_BLOCKS,
        calibration_smoothing: float = 0.3,
        memory: float = 0.75,
    ) -> None:
        if window < 1 or hold < 1 or max_hold < hold or max_shadow_blocks < 1:
            raise ValueError("window, hold, max_shadow_blocks >= 1 and max_hold >= hold")
        if not 0.0 <= tolerance < 1.0 or not 0.0 < calibration_smoothing <= 1.0:
            raise ValueError("tolerance in [0, 1), calibration_smoothing in (0, 1]")
        if not 0.0 <= memory < 1.0:
            raise ValueError("memory in [0, 1)")
        self.window = window
        self.min_window_requests = min_window_requests
        self.tolerance = tolerance
        self.hold = hold
        self.max_hold = max_hold
        self.max_shadow_blocks = max_shadow_blocks
        self.smoothing = calibration_smoothing
        self.memory = memory
        self.counters = GuardCounters()
        self.learned = False  # recency first: one window calibrates the shadow
        self.calibration = 1.0  # real default hits / shadow estimate, from recency windows
        self._calibrated = False
        self._hold_left = 1
        self._current_hold = hold
        self._threshold = 1 << 64
        self._gpu_capacity = self._host_capacity = 0
        self._gpu: OrderedDict[int, None] = OrderedDict()  # by reference, oldest first
        self._host: OrderedDict[int, None] = OrderedDict()  # by store or load, oldest first
        self._pending: dict[str, tuple[tuple[int, ...], int]] = {}  # request -> positions, hits
        self._running: dict[str, tuple[int, ...]] = {}  # request -> its sampled blocks
        self._real_sum = 0.0  # learned windows since the probe began, faded by ``memory``
        self._expected_sum = 0.0
        self._window_refs = 0
        self._window_requests = 0
        self._window_real = 0
        self._window_shadow = 0

    # -- set-up --------------------------------------------------------------------------------

    def configure(self, *, gpu_blocks: int, host_blocks: int) -> None:
        """The tiers' sizes; the shadow starts empty."""
        reach = max(gpu_blocks, 0) + max(host_blocks, 0)
        rate = min(1.0, self.max_shadow_blocks / reach) if reach else 1.0
        self._threshold = int(rate * (1 << 64))
        self._gpu_capacity = round(max(gpu_blocks, 0) * rate)
        self._host_capacity = round(max(host_blocks, 0) * rate)
        self._gpu.clear()
        self._host.clear()

    @property
    def rate(self) -> float:
        return self._threshold / (1 << 64)

    # -- events --------------------------------------------------------------------------------

    def observe(self, event: Event) -> None:
        kind = type(event)
        if kind is RequestStarted:
            assert isinstance(event, RequestStarted)
            self._started(event.request_id, event.block_hashes)
        elif kind is PrefixHit:
            assert isinstance(event, PrefixHit)
            self._hit(event.request_id, event.gpu_blocks + event.host_blocks)
        elif kind is RequestFinished:
            assert isinstance(event, RequestFinished)
            self._pending.pop(event.request_id, None)  # no hit reported: nothing to compare
            self._on_gpu_last(self._running.pop(event.request_id, ()))

    def _started(self, request_id: str, blocks: tuple[int, ...]) -> None:
        if not self._gpu_capacity and not self._host_capacity:
            return
        threshold = self._threshold
        if threshold >= 1 << 64:
            positions = tuple(range(len(blocks)))
            sampled = blocks
        else:
            mixed = np.fromiter(blocks, dtype=np.uint64, count=len(blocks)) * _MIX_U64
            positions = tuple(np.flatnonzero(mixed < np.uint64(threshold)).tolist())
            sampled = tuple(blocks[i] for i in positions)
        gpu, host = self._gpu, self._host
        on_gpu = 0  # prefix caching: the GPU prefix, then the host's continuation of it
        while on_gpu < len(sampled) and sampled[on_gpu] in gpu:
            on_gpu += 1
        hits = on_gpu
        while hits < len(sampled) and sampled[hits] in host:
            hits += 1
        # the most recent last, a request's first block the most recent of its own: vLLM frees
        # a request's blocks tail first, so a prefix is evicted from its end, never its start
        for block in reversed(sampled[hits:]):  # computed: vLLM's default stores every one
            host[block] = None
            host.move_to_end(block)
        for block in reversed(sampled[on_gpu:hits]):  # loaded: the host touches them
            host.move_to_end(block)
        self._on_gpu_last(sampled)  # all on the GPU now
        while len(host) > self._host_capacity:
            host.popitem(last=False)
        if positions:
            if len(self._pending) >= MAX_OPEN_REQUESTS:  # never reported: forget the oldest
                self._pending.pop(next(iter(self._pending)))
            self._pending[request_id] = (positions, hits)
            if len(self._running) >= MAX_OPEN_REQUESTS:
                self._running.pop(next(iter(self._running)))
            self._running[request_id] = sampled

    def _on_gpu_last(self, sampled: tuple[int, ...]) -> None:
        """The request's blocks become the GPU's most recent, its first block last (vLLM frees
        a request's blocks tail first). At its start, and again when it finishes and vLLM frees
        them (a request holds its blocks while it runs)."""
        gpu = self._gpu
        for block in reversed(sampled):
            gpu[block] = None
            gpu.move_to_end(block)
        while len(gpu) > self._gpu_capacity:
            gpu.popitem(last=False)

    def _hit(self, request_id: str, hit_blocks: int) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        positions, shadow = pending
        real = sum(1 for i in positions if i < hit_blocks)
        self._window_refs += len(positions)
        self._window_requests += 1
        self._window_real += real
        self._window_shadow += shadow
        self.counters.sampled_refs += len(positions)
        if self._window_refs >= self.window and self._window_requests >= self.min_window_requests:
            self._close_window()

    def _close_window(self) -> None:
        real, shadow = self._window_real, self._window_shadow
        self._window_refs = self._window_requests = self._window_real = self._window_shadow = 0
        c = self.counters
        c.windows += 1
        if not self.learned:
            c.recency_windows += 1
            if shadow > 0:  # the real hits are vLLM's default's: how far off the shadow is
                ratio = real / shadow
                a = 1.0 if not self._calibrated else self.smoothing
                self.calibration = a * ratio + (1 - a) * self.calibration
                self._calibrated = True
            self._hold_left -= 1
            if self._hold_left <= 0 and self._calibrated:  # no hits yet: nothing to compare to
                self.learned = True
                c.probes += 1
            return
        c.learned_windows += 1
        expected = shadow * self.calibration
        c.real_hits += real
        c.shadow_hits += round(expected)
        # the evidence since the probe began, older windows fading: a deficit beyond the
        # tolerance and one standard deviation of a count of that size (Poisson) is a loss
        d = self.memory
        self._real_sum = d * self._real_sum + real
        self._expected_sum = d * self._expected_sum + expected
        margin = self.tolerance * self._expected_sum + self._expected_sum**0.5
        if self._real_sum < self._expected_sum - margin:
            self._real_sum = self._expected_sum = 0.0
            self.learned = False
            c.switches_to_recency += 1
            self._hold_left = self._current_hold
            self._current_hold = min(self._current_hold * 2, self.max_hold)
        else:
            self._current_hold = self.hold  # it wins (or ties): the next loss holds briefly

    def state(self) -> dict[str, object]:
        """For stats and the dashboard."""
        return {
            "mode": "learned" if self.learned else "recency",
            "rate": self.rate,
            "calibration": round(self.calibration, 4),
            **asdict(self.counters),
        }
