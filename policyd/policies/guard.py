"""Never behind vLLM's default: a guard that runs the policy's decisions and vLLM's default side
by side on a sample of the traffic, and publishes vLLM's own behaviour unless the policy's win.

Two sampled shadows (``policies.shadow``) follow the same blocks of the same requests:

* **default**: the GPU and host tiers as vLLM runs them without a snapshot (LRU on both,
  store everything);
* **learned**: the same tiers applying every snapshot the policy computes - the write filter,
  the GPU plan, the host order, within the connector's budget per scheduler step - whether
  or not it is published.

Each request's sampled blocks hit in both; the guard compares the two counts (a paired
comparison: both see the same blocks, so the sample's error is common to both and cancels, and
no calibration against the real tiers is needed). Window by window (``window`` sampled
references and at least ``min_window_requests`` requests) it adds the window's difference
``learned - default`` to the evidence against what it publishes (Page's CUSUM: the learned
shadow's losses while it publishes the learned snapshots, its wins while it publishes vLLM's
default; the sum held at zero or above, so past windows that went the published way do not
shield a change), and switches once that evidence exceeds ``confidence`` standard deviations of
itself (the root of its windows' squares: one window alone never switches, the windows of a
phase are correlated) plus ``tolerance`` of the default shadow's hits in those windows:

* **learned**: the policy's snapshots;
* **recency**: an empty snapshot (nothing ranked, pinned, retired or declined - exactly what the
  connector does without a snapshot, vLLM's default).

It starts in recency: until the sample says the learned decisions win, vLLM's default is what
runs, so a workload where they only tie (GPU-only chats, say) gets exactly vLLM's behaviour.

Because the learned shadow follows the snapshots while recency is published, a policy that
starts winning is switched back as soon as its wins clear the margin, without probing on the
real tiers. Both shadows hold a running request's blocks, its prompt's and those it caches as
it decodes (``BlocksStored`` on the GPU), until it finishes, as vLLM's pool does.

The real tiers' hits (``PrefixHit``) are compared with the shadow of what was published, as a
check of the shadows' fidelity (``state()``'s ``real_hits`` against ``shadow_hits``); they take no
part in the verdict.

Its cost per event is a hash and a compare per block of a request, and per sampled block two
tiers' updates and the connector's budgeted plan; per snapshot, a pass over the shadow GPU's
blocks (``policyd bench-guard`` measures both).

>>> guard = RecencyGuard(window=4, min_window_requests=1)
>>> guard.configure(gpu_blocks=2, host_blocks=0)
>>> guard.learned, guard.state()["switches_to_learned"]
(False, 0)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Final

from policyd.core.types import (
    BlocksStored,
    Event,
    PolicySnapshot,
    PrefixHit,
    RequestFinished,
    RequestStarted,
)
from policyd.policies.shadow import BlockSampler, ShadowTiers

MAX_SHADOW_BLOCKS: Final = 8192
MAX_OPEN_REQUESTS: Final = 65536  # requests never reported finished are forgotten past this


@dataclass(slots=True)
class GuardCounters:
    windows: int = 0
    learned_windows: int = 0
    recency_windows: int = 0
    switches_to_recency: int = 0
    switches_to_learned: int = 0
    sampled_refs: int = 0
    learned_shadow_hits: int = 0  # sampled blocks the learned shadow hit
    default_shadow_hits: int = 0  # and the default shadow
    real_hits: int = 0  # sampled blocks the real tiers hit (requests that reported one)
    shadow_hits: int = 0  # what the shadow of the published decisions hit on those requests


class RecencyGuard:
    """Chooses, window by window, between the policy's snapshots and vLLM's default."""

    def __init__(
        self,
        *,
        window: int = 1024,
        min_window_requests: int = 8,
        tolerance: float = 0.01,
        confidence: float = 1.0,
        max_shadow_blocks: int = MAX_SHADOW_BLOCKS,
    ) -> None:
        if window < 1 or max_shadow_blocks < 1:
            raise ValueError("window and max_shadow_blocks >= 1")
        if not 0.0 <= tolerance < 1.0 or confidence < 0.0:
            raise ValueError("tolerance in [0, 1), confidence >= 0")
        self.window = window
        self.min_window_requests = min_window_requests
        self.tolerance = tolerance
        self.confidence = confidence
        self.max_shadow_blocks = max_shadow_blocks
        self.counters = GuardCounters()
        self.learned = False  # vLLM's default until the sample says the learned decisions win
        self.sampler = BlockSampler()
        self.default = ShadowTiers()
        self.follower = ShadowTiers()  # the learned decisions
        self._active = False  # a tier to shadow
        # request -> (its sampled blocks, the published shadow's hits), until its PrefixHit
        self._pending: dict[str, tuple[tuple[int, ...], int]] = {}
        self._running: dict[str, tuple[int, ...]] = {}  # request -> its sampled blocks
        self._cusum = self._cusum_sq = self._cusum_default = 0.0  # the evidence for a switch
        self._window_refs = self._window_requests = 0
        self._window_diff = self._window_default = 0

    # -- set-up --------------------------------------------------------------------------------

    def configure(self, *, gpu_blocks: int, host_blocks: int) -> None:
        """The tiers' sizes; the shadows start empty, in vLLM's default."""
        gpu, host = max(gpu_blocks, 0), max(host_blocks, 0)
        reach = gpu + host
        rate = min(1.0, self.max_shadow_blocks / reach) if reach else 1.0
        self.sampler.configure(rate)
        for shadow in (self.default, self.follower):
            shadow.configure(
                gpu_capacity=round(gpu * rate), host_capacity=round(host * rate), rate=rate
            )
        self._active = reach > 0
        self._pending.clear()
        self._running.clear()

    @property
    def rate(self) -> float:
        return self.sampler.rate

    # -- events and snapshots ----------------------------------------------------------------

    def observe(self, event: Event) -> None:
        kind = type(event)
        if kind is RequestStarted:
            assert isinstance(event, RequestStarted)
            self._started(event)
        elif kind is PrefixHit:
            assert isinstance(event, PrefixHit)
            self._real_hit(event.request_id, event.gpu_blocks + event.host_blocks)
        elif kind is BlocksStored:
            assert isinstance(event, BlocksStored)
            if event.tier == "gpu" and event.request_id in self._running:
                self._stored(event.request_id, event.block_hashes)
        elif kind is RequestFinished:
            assert isinstance(event, RequestFinished)
            self._pending.pop(event.request_id, None)
            self._finished(self._running.pop(event.request_id, ()))

    def adopt(
        self,
        snapshot: PolicySnapshot,
        scores: Mapping[int, float],
        host_scores: Mapping[int, float] | None = None,
    ) -> None:
        """The policy computed ``snapshot`` (``scores``, ``host_scores``: its two orders as
        maps): the learned shadow applies it, as the connector would had it been published."""
        if self._active:
            self.follower.adopt(snapshot, scores, host_scores)

    def _finished(self, sampled: tuple[int, ...]) -> None:
        self.default.finish(sampled)
        self.follower.finish(sampled)

    def _stored(self, request_id: str, blocks: tuple[int, ...]) -> None:
        """A running request cached more blocks on the GPU (its output, as it decodes): held
        by it in both shadows until it finishes, as they are in vLLM's pool."""
        held = self._running[request_id]
        known = set(held)
        new = tuple(b for i in self.sampler.positions(blocks) if (b := blocks[i]) not in known)
        if new:
            self.default.hold(new)
            self.follower.hold(new)
            self._running[request_id] = held + new

    def _started(self, event: RequestStarted) -> None:
        if not self._active:
            return
        blocks = event.block_hashes
        positions = self.sampler.positions(blocks)
        if not positions:
            return
        sampled = tuple(blocks[i] for i in positions)
        wf = event.workflow_id
        default = self.default.start(wf, sampled, positions, len(blocks))
        learned = self.follower.start(wf, sampled, positions, len(blocks))
        if len(self._pending) >= MAX_OPEN_REQUESTS:  # never reported: forget the oldest
            self._pending.pop(next(iter(self._pending)))
        if len(self._running) >= MAX_OPEN_REQUESTS:  # never finished: its blocks let go
            self._finished(self._running.pop(next(iter(self._running))))
        self._pending[event.request_id] = (positions, learned if self.learned else default)
        self._running[event.request_id] = sampled
        c = self.counters
        c.sampled_refs += len(sampled)
        c.learned_shadow_hits += learned
        c.default_shadow_hits += default
        diff = learned - default
        self._window_refs += len(sampled)
        self._window_requests += 1
        self._window_diff += diff
        self._window_default += default
        if self._window_refs >= self.window and self._window_requests >= self.min_window_requests:
            self._close_window()

    def _real_hit(self, request_id: str, hit_blocks: int) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            positions, shadow = pending
            self.counters.real_hits += sum(1 for i in positions if i < hit_blocks)
            self.counters.shadow_hits += shadow

    # -- the verdict ---------------------------------------------------------------------------

    def _close_window(self) -> None:
        """Page's CUSUM of the evidence against what is published (the learned shadow's loss
        while learned, its win while recency), each window's difference added, the sum held at
        zero or above; past ``confidence`` standard deviations of itself (and ``tolerance`` of
        the default's hits, against a loss) the guard switches, and the sum starts again. Old
        wins do not shield a new loss: the sum forgets what went the published way."""
        learned = self.learned
        evidence = -self._window_diff if learned else self._window_diff
        self._cusum = max(0.0, self._cusum + evidence)
        self._cusum_sq = self._cusum_sq + evidence * evidence if self._cusum > 0 else 0.0
        self._cusum_default = self._cusum_default + self._window_default if self._cusum else 0.0
        self._window_refs = self._window_requests = 0
        self._window_diff = self._window_default = 0
        c = self.counters
        c.windows += 1
        if learned:
            c.learned_windows += 1
        else:
            c.recency_windows += 1
        margin = self.confidence * self._cusum_sq**0.5 + self.tolerance * self._cusum_default
        if self._cusum > margin:
            self.learned = not learned
            self._cusum = self._cusum_sq = self._cusum_default = 0.0
            if learned:
                c.switches_to_recency += 1
            else:
                c.switches_to_learned += 1

    def state(self) -> dict[str, object]:
        """For stats and the dashboard."""
        return {
            "mode": "learned" if self.learned else "recency",
            "rate": self.rate,
            **asdict(self.counters),
        }
