"""Never behind vLLM's default: a guard that runs vLLM's default and the policy's candidate
decisions side by side on a sample of the traffic, and publishes vLLM's own behaviour unless a
candidate wins.

Sampled shadows (``policies.shadow``) follow the same blocks of the same requests, one per
*arm*:

* **recency**: the GPU and host tiers as vLLM runs them without a snapshot (LRU on both,
  store everything) - an empty snapshot, what the connector does without one;
* each of the policy's arms (agentkv: ``filter`` and ``learned``): the same tiers applying
  every snapshot the policy computes for that arm - the write filter, the GPU plan, the host
  order, within the connector's budget per scheduler step - whether or not it is published.

Each request's sampled blocks hit in every shadow; the guard compares the counts (a paired
comparison: all see the same blocks, so the sample's error is common to them and cancels, and
no calibration against the real tiers is needed). Window by window (``window`` sampled
references and at least ``min_window_requests`` requests) it adds each other arm's difference
with the published arm to that arm's evidence (Page's CUSUM, held at zero or above, so past
windows that went the published way do not shield a change). An arm whose evidence exceeds
``confidence`` standard deviations of itself (the root of its windows' squares: one window
alone never switches, the windows of a phase are correlated) plus ``tolerance`` of the recency
shadow's hits in those windows is *nominated*. With two arms (recency and learned) that is one
CUSUM of the evidence against what is published.

A nominated arm is not yet published: its shadow won on the contents it built while it was not
published, which the real tiers do not hold. Its **trial** is a shadow forked from the
published arm's (``ShadowTiers.forked``: the real tiers as a switch would leave them) that
follows the arm's snapshots from then on, so its hits count the switch's cost too. Every
nominated arm has a trial of its own (two arms that both win, taking turns at the lead, do not
restart each other's); a trial ends when its arm is no longer nominated. The arm whose trial's
own wins over the published arm (a plain sum since the fork) pass the same margin by the most
is published. At the switch the newly published arm's shadow is forked anew from the published
one's, so the published shadow follows the real tiers' contents, not the arm's history.

It starts in recency: until the sample says a candidate wins, vLLM's default is what runs, so a
workload where they only tie (GPU-only chats, say) gets exactly vLLM's behaviour.

Why arms: a policy's decisions can gain at once and cost later (a host order that keeps one
workflow's copies lets another's go, and the cost comes when that one returns). The shadows see
both, in that order, so the guard may publish such decisions during the gain and leave the real
tiers with the cost. A safer candidate - agentkv's ``filter``, the write filter alone on vLLM's
LRU order, EfficientAgent's decision - gives the guard an arm to win with whose gains do not
come on such credit (docs/RESULTS.md, *The recency guard*).

Because every shadow follows its arm's snapshots while another arm is published, an arm that
starts winning is nominated as soon as its wins clear the margin, and tried without probing
on the real tiers. The shadows hold a running request's blocks, its prompt's and those it
caches as it decodes (``BlocksStored`` on the GPU), until it finishes, as vLLM's pool does.

The real tiers' hits (``PrefixHit``) are compared with the shadow of what was published, as a
check of the shadows' fidelity (``state()``'s ``real_hits`` against ``shadow_hits``); they take no
part in the verdict.

Its cost per event is a hash and a compare per block of a request, and per sampled block each
arm's tiers' updates and the connector's budgeted plan; per snapshot, a pass over each shadow
GPU's blocks (``policyd bench-guard`` measures it).

>>> guard = RecencyGuard(window=4, min_window_requests=1)
>>> guard.configure(gpu_blocks=2, host_blocks=0)
>>> guard.published, guard.learned, guard.state()["switches_to_learned"]
('recency', False, 0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
RECENCY: Final = "recency"  # the arm of vLLM's default: an empty snapshot
FILTER: Final = "filter"  # a policy's write filter alone, on vLLM's order
LEARNED: Final = "learned"  # a policy's full decisions


@dataclass(slots=True)
class GuardCounters:
    windows: int = 0
    learned_windows: int = 0
    recency_windows: int = 0
    filter_windows: int = 0
    switches_to_recency: int = 0
    switches_to_learned: int = 0
    switches_to_filter: int = 0
    sampled_refs: int = 0
    learned_shadow_hits: int = 0  # sampled blocks the learned shadow hit
    default_shadow_hits: int = 0  # and the recency (vLLM's default) shadow
    filter_shadow_hits: int = 0  # and the filter arm's (when the policy has one)
    real_hits: int = 0  # sampled blocks the real tiers hit (requests that reported one)
    shadow_hits: int = 0  # what the shadow of the published decisions hit on those requests
    trials: int = 0  # nominated arms tried (a shadow forked from the published one's)


@dataclass(frozen=True, slots=True)
class WindowRecord:
    """One closed window, as ``RecencyGuard.journal`` keeps it (diagnostics)."""

    published: str  # the arm published during the window
    chosen: str  # the arm published after it
    hits: dict[str, int]  # per arm, the sampled blocks its shadow hit
    real_hits: int  # sampled blocks the real tiers hit, on the requests that reported in it
    shadow_hits: int  # and the shadow of the arm published at their start, on those requests


# per arm: its counters of windows published and of switches to it
_ARM_COUNTERS: Final = {
    RECENCY: ("recency_windows", "switches_to_recency"),
    FILTER: ("filter_windows", "switches_to_filter"),
    LEARNED: ("learned_windows", "switches_to_learned"),
}


class _Evidence:
    """Page's CUSUM of one arm's wins over the published arm, with what its margin needs;
    ``cumulative``: the plain sum instead (a trial's: its losses since the fork count)."""

    __slots__ = ("base", "cumulative", "squares", "total")

    def __init__(self, *, cumulative: bool = False) -> None:
        self.total = self.squares = self.base = 0.0
        self.cumulative = cumulative

    def add(self, difference: float, recency_hits: float) -> None:
        if self.cumulative:
            self.total += difference
            self.squares += difference * difference
            self.base += recency_hits
            return
        self.total = max(0.0, self.total + difference)
        self.squares = self.squares + difference * difference if self.total > 0 else 0.0
        self.base = self.base + recency_hits if self.total else 0.0

    def excess(self, confidence: float, tolerance: float) -> float:
        """How far the evidence is past its margin (positive: a switch)."""
        spread: float = self.squares**0.5
        return self.total - (confidence * spread + tolerance * self.base)


class _Trial:
    """A nominated arm on trial: its shadow forked from the published arm's, the sampled blocks
    it hit in the window so far, and the plain sum of its wins since the fork."""

    __slots__ = ("arm", "evidence", "hits", "shadow")

    def __init__(self, arm: str, shadow: ShadowTiers) -> None:
        self.arm = arm
        self.shadow = shadow
        self.hits = 0
        self.evidence = _Evidence(cumulative=True)


class RecencyGuard:
    """Chooses, window by window, between vLLM's default and the policy's arms (``arms``:
    their names; each arm's snapshots come through ``adopt``). ``pinned``: publish this arm
    (``recency`` or one of ``arms``) throughout, whatever the windows say; the shadows and
    their counters run as ever (to read one arm's shadow against its real tiers).

    ``journal``: set it to a list and every closed window is appended to it
    (``WindowRecord``; ``policyd host-losses --windows`` prints them)."""

    journal: list[WindowRecord] | None = None

    def __init__(
        self,
        *,
        arms: Sequence[str] = (LEARNED,),
        window: int = 1024,
        min_window_requests: int = 8,
        tolerance: float = 0.01,
        confidence: float = 1.0,
        max_shadow_blocks: int = MAX_SHADOW_BLOCKS,
        pinned: str | None = None,
    ) -> None:
        if window < 1 or max_shadow_blocks < 1:
            raise ValueError("window and max_shadow_blocks >= 1")
        if not 0.0 <= tolerance < 1.0 or confidence < 0.0:
            raise ValueError("tolerance in [0, 1), confidence >= 0")
        unknown = set(arms) - set(_ARM_COUNTERS)
        if unknown or RECENCY in arms or len(set(arms)) != len(arms) or not arms:
            raise ValueError(f"arms are distinct names among filter, learned; got {list(arms)}")
        self.window = window
        self.min_window_requests = min_window_requests
        self.tolerance = tolerance
        self.confidence = confidence
        self.max_shadow_blocks = max_shadow_blocks
        self.counters = GuardCounters()
        self.arms: tuple[str, ...] = (RECENCY, *arms)
        if pinned is not None and pinned not in self.arms:
            raise ValueError(f"pinned is one of {', '.join(self.arms)}; got {pinned!r}")
        self.pinned = pinned
        # vLLM's default until the sample says an arm wins
        self.published = RECENCY if pinned is None else pinned
        self.sampler = BlockSampler()
        # only the learned arm's snapshots order the host tier (``ShadowTiers.host_ordered``)
        self.shadows = {arm: ShadowTiers(host_ordered=arm == LEARNED) for arm in self.arms}
        self._active = False  # a tier to shadow
        # request -> (its sampled blocks, the published shadow's hits), until its PrefixHit
        self._pending: dict[str, tuple[tuple[int, ...], int]] = {}
        self._running: dict[str, tuple[int, ...]] = {}  # request -> its sampled blocks
        self._evidence = {arm: _Evidence() for arm in self.arms}
        self._window_refs = self._window_requests = 0
        self._window_hits = dict.fromkeys(self.arms, 0)
        self._reported = (0, 0)  # real and shadow hits counted when the last window closed
        self._trials: dict[str, _Trial] = {}
        # each arm's last snapshot, for a shadow forked for it (a trial, or at a switch)
        self._last: dict[
            str, tuple[PolicySnapshot, Mapping[int, float], Mapping[int, float] | None]
        ] = {}

    @property
    def learned(self) -> bool:
        """The policy's full decisions are published."""
        return self.published == LEARNED

    @property
    def default(self) -> ShadowTiers:
        """The recency shadow: vLLM's default."""
        return self.shadows[RECENCY]

    @property
    def follower(self) -> ShadowTiers:
        """The learned arm's shadow."""
        return self.shadows[LEARNED]

    # -- set-up --------------------------------------------------------------------------------

    def configure(self, *, gpu_blocks: int, host_blocks: int) -> None:
        """The tiers' sizes; the shadows start empty, in vLLM's default."""
        gpu, host = max(gpu_blocks, 0), max(host_blocks, 0)
        reach = gpu + host
        rate = min(1.0, self.max_shadow_blocks / reach) if reach else 1.0
        self.sampler.configure(rate)
        for shadow in self.shadows.values():
            shadow.configure(
                gpu_capacity=round(gpu * rate), host_capacity=round(host * rate), rate=rate
            )
        self._active = reach > 0
        self._pending.clear()
        self._running.clear()
        self._trials = {}

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
            self._finished(event.request_id, self._running.pop(event.request_id, ()))

    def adopt(
        self,
        snapshot: PolicySnapshot,
        scores: Mapping[int, float],
        host_scores: Mapping[int, float] | None = None,
        *,
        arm: str = LEARNED,
    ) -> None:
        """The policy computed ``snapshot`` for ``arm`` (``scores``, ``host_scores``: its two
        orders as maps): that arm's shadow applies it, as the connector would had it been
        published."""
        if self._active:
            self.shadows[arm].adopt(snapshot, scores, host_scores)
            self._last[arm] = (snapshot, scores, host_scores)
            trial = self._trials.get(arm)
            if trial is not None:
                trial.shadow.adopt(snapshot, scores, host_scores)

    def _shadows(self) -> list[ShadowTiers]:
        """Every shadow that follows the traffic: the arms' and the trials'."""
        shadows = list(self.shadows.values())
        shadows.extend(t.shadow for t in self._trials.values())
        return shadows

    def _finished(self, request_id: str, sampled: tuple[int, ...]) -> None:
        for shadow in self._shadows():
            shadow.finish(request_id, sampled)

    def _stored(self, request_id: str, blocks: tuple[int, ...]) -> None:
        """A running request cached more blocks on the GPU (its output, as it decodes): held
        by it in both shadows until it finishes, as they are in vLLM's pool."""
        held = self._running[request_id]
        known = set(held)
        new = tuple(b for i in self.sampler.positions(blocks) if (b := blocks[i]) not in known)
        if new:
            for shadow in self._shadows():
                shadow.hold(new)
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
        hits = {
            arm: shadow.start(event.request_id, wf, sampled, positions, len(blocks))
            for arm, shadow in self.shadows.items()
        }
        for trial in self._trials.values():
            trial.hits += trial.shadow.start(event.request_id, wf, sampled, positions, len(blocks))
        if len(self._pending) >= MAX_OPEN_REQUESTS:  # never reported: forget the oldest
            self._pending.pop(next(iter(self._pending)))
        if len(self._running) >= MAX_OPEN_REQUESTS:  # never finished: its blocks let go
            oldest = next(iter(self._running))
            self._finished(oldest, self._running.pop(oldest))
        self._pending[event.request_id] = (positions, hits[self.published])
        self._running[event.request_id] = sampled
        c = self.counters
        c.sampled_refs += len(sampled)
        c.default_shadow_hits += hits[RECENCY]
        c.learned_shadow_hits += hits.get(LEARNED, 0)
        c.filter_shadow_hits += hits.get(FILTER, 0)
        window_hits = self._window_hits
        for arm, n in hits.items():
            window_hits[arm] += n
        self._window_refs += len(sampled)
        self._window_requests += 1
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
        """Each other arm's difference with the published one added to its evidence (Page's
        CUSUM, held at zero or above); the arms past their margin (``confidence`` standard
        deviations of their evidence and ``tolerance`` of the recency shadow's hits in their
        windows) are nominated, and one is published once its trial passes the same margin
        (``_try``); then every sum starts again. Old wins do not shield a new loss: the sums
        forget what went the published way."""
        published, hits = self.published, self._window_hits
        c = self.counters
        c.windows += 1
        setattr(c, _ARM_COUNTERS[published][0], getattr(c, _ARM_COUNTERS[published][0]) + 1)
        nominated: list[str] = []
        for arm in self.arms:
            if arm == published:
                continue
            evidence = self._evidence[arm]
            evidence.add(hits[arm] - hits[published], hits[RECENCY])
            if evidence.excess(self.confidence, self.tolerance) > 0:
                nominated.append(arm)
        self._window_refs = self._window_requests = 0
        self._window_hits = dict.fromkeys(self.arms, 0)
        if self.pinned is None:
            self._try(nominated, hits)
        if self.journal is not None:
            real, shadow = self._reported
            self.journal.append(
                WindowRecord(
                    published, self.published, hits, c.real_hits - real, c.shadow_hits - shadow
                )
            )
        self._reported = (c.real_hits, c.shadow_hits)

    def _try(self, nominated: list[str], hits: dict[str, int]) -> None:
        """Every trial's window added to its sum; a trial whose arm is no longer past its
        margin ends; of the trials past their own margin, the furthest is published (its arm's
        shadow forked anew from the published one's); a nominated arm without a trial starts
        one, forked from the published arm's shadow."""
        published = self.published
        best, best_excess = None, 0.0
        for arm, trial in list(self._trials.items()):
            trial.evidence.add(trial.hits - hits[published], hits[RECENCY])
            trial.hits = 0
            if arm not in nominated:
                del self._trials[arm]
                continue
            excess = trial.evidence.excess(self.confidence, self.tolerance)
            if excess > best_excess:
                best, best_excess = arm, excess
        if best is not None:
            self._trials = {}
            self.shadows[best] = self._forked(best, self.shadows[published])
            self.published = best
            self._evidence = {arm: _Evidence() for arm in self.arms}
            c = self.counters
            switches = _ARM_COUNTERS[best][1]
            setattr(c, switches, getattr(c, switches) + 1)
            return
        for arm in nominated:
            if arm not in self._trials:
                self.counters.trials += 1
                self._trials[arm] = _Trial(arm, self._forked(arm, self.shadows[published]))

    def _forked(self, arm: str, source: ShadowTiers) -> ShadowTiers:
        """A shadow of ``arm`` holding what ``source`` holds, under the arm's last snapshot."""
        shadow = ShadowTiers.forked(source, host_ordered=arm == LEARNED)
        last = self._last.get(arm)
        if last is not None:
            shadow.adopt(*last)
        return shadow

    def state(self) -> dict[str, object]:
        """For stats and the dashboard."""
        return {
            "mode": self.published,
            "rate": self.rate,
            **asdict(self.counters),
        }
