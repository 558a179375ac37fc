"""``policyd host-losses``: which of LRU's host-tier hits another policy loses, and why.

Both policies replay the same workload on the same tiers; every event each replay sends to its
engine is logged (``EventLog``). For every prompt block LRU loaded from its host tier, the other
policy's replay of the same request says what became of that block:

* ``host hit`` / ``GPU hit`` - it was served there too;
* ``never written`` - it was not on the host tier at any time before the request (the write
  filter declined it, or vLLM's all-or-nothing store found no room);
* ``evicted`` - written, then evicted before the request; split by whether the snapshot the host
  order followed named the block when it was written (a block it does not name takes the
  snapshot's default score, so it sorts with the first victims), with the score it was written
  under, how long it stayed and how long after its eviction the request needed it;
* ``resident behind a miss`` - on the host tier, but after a block of the prefix that was not.

A policy that loses none of LRU's host hits and adds some is ahead on the host tier; the classes
say which of its decisions (the write filter or the host order) pays for a shortfall.

With ``--windows`` (a policy with a recency guard) the guard's windows are printed too: the arm
published in each and the one chosen after it, each arm's shadow hits, and the sampled blocks the
real tiers hit against what the shadow of the published arm hit on the same requests - where
the two part, the real tiers pay for something no shadow follows (a switch's cost).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from experiments.matrix import Source, load_source
from policyd.core.engine import Engine
from policyd.core.types import (
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    PolicySnapshot,
    PrefixHit,
    RequestStarted,
)
from policyd.policies import make_policy, policy_variant
from policyd.policies.guard import RecencyGuard, WindowRecord
from policyd.sim.cache import HostOrderQueue
from policyd.sim.link import EngineCounters, SimEngine
from policyd.sim.replay import SimConfig, Simulator
from policyd.tiers.host_order import RETIRED, HostOrder, Priority
from policyd.workloads.calls import Workload

HOST, GPU, NEVER, EVICTED, BEHIND = (
    "host hit",
    "GPU hit",
    "never written",
    "evicted",
    "resident behind a miss",
)
# why the host order took a block, from the priority it was taken at: no host order in the
# snapshot (vLLM's default or the write filter alone: LRU), retired first, or the learned order
# at the snapshot's default score (a block no snapshot it was ranked under named) or above it
BY_RECENCY, AS_RETIRED, AT_DEFAULT, BY_SCORE = (
    "LRU order",
    "retired",
    "learned order, default score",
    "learned order, scored",
)
EVICTED_AS = (BY_RECENCY, AS_RETIRED, AT_DEFAULT, BY_SCORE)


@dataclass(slots=True)
class RequestSeen:
    """A request as its replay admitted it: ``seq`` orders it among every logged event."""

    seq: int
    ts: float
    agent: str
    blocks: tuple[int, ...]
    gpu_hit: int = 0
    host_hit: int = 0


@dataclass(slots=True)
class HostStay:
    """One residence of a block in the host tier: written at ``stored_*``, evicted at
    ``removed_*`` (None: still there). ``score``: its host-order score when written (None: the
    tier is plain LRU); ``named``: the snapshot in effect gave it a score of its own."""

    stored_seq: int
    stored_ts: float
    score: float | None
    named: bool
    removed_seq: int | None = None
    removed_ts: float | None = None
    evicted_as: str = ""  # the order that evicted it (``EVICTED_AS``)
    # taken at a score the snapshot in effect no longer gives it (the walk had not reached it)
    stale: bool = False


class EventLog:
    """A ``SimEngine`` that forwards every batch to ``engine`` and logs requests and host-tier
    residences. ``order``: the replay's host order, read for each written block's score (set
    once the replay's tiers exist; None for a plain LRU tier)."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.order: HostOrder[int] | None = None
        self.requests: dict[str, RequestSeen] = {}
        self.stays: dict[int, list[HostStay]] = {}
        # evicted block -> why, and whether its score was stale, until its ``BlocksRemoved``
        self._why: dict[int, tuple[str, bool]] = {}
        self._seq = 0

    @property
    def state(self) -> EngineCounters:
        return self.engine.state

    def snapshot(self) -> PolicySnapshot:
        return self.engine.snapshot()

    def prefetch(self, budget_blocks: int) -> list[int]:
        return self.engine.prefetch(budget_blocks)

    def apply(self, batch: EventBatch) -> object:
        for event in batch.events:
            self._seq += 1
            if isinstance(event, RequestStarted):
                self.requests[event.request_id] = RequestSeen(
                    self._seq, event.ts, event.agent, event.block_hashes
                )
            elif isinstance(event, PrefixHit):
                seen = self.requests[event.request_id]
                seen.gpu_hit, seen.host_hit = event.gpu_blocks, event.host_blocks
            elif isinstance(event, BlocksStored) and event.tier == "host":
                for block in event.block_hashes:
                    self._stored(block, event.ts)
            elif isinstance(event, BlocksRemoved) and event.tier == "host":
                for block in event.block_hashes:
                    stay = self.stays[block][-1]
                    stay.removed_seq, stay.removed_ts = self._seq, event.ts
                    stay.evicted_as, stay.stale = self._why.pop(block, (BY_RECENCY, False))
        return self.engine.apply(batch)

    def _stored(self, block: int, ts: float) -> None:
        score: float | None = None
        named = False
        order = self.order
        if order is not None:
            priority = order.priority(block)
            view = order.view
            score = priority[1] if priority is not None else None
            named = view is not None and block in view.host_scores
        self.stays.setdefault(block, []).append(HostStay(self._seq, ts, score, named))

    def watch(self, order: HostOrder[int]) -> None:
        """Read ``order`` for each written block's score and each evicted block's reason."""
        self.order = order
        order.evicted = self._taken

    def _taken(self, entries: list[tuple[Priority, int]]) -> None:
        view = self.order.view if self.order is not None else None
        for (cls, score, _), block in entries:
            stale = False
            if cls == RETIRED:
                why = AS_RETIRED
            elif view is None or not view.host_scores:
                why = BY_RECENCY
            else:
                why = AT_DEFAULT if score == view.default_score else BY_SCORE
                stale = score != view.host_score(block)
            self._why[block] = (why, stale)

    def stay_before(self, block: int, seq: int) -> HostStay | None:
        """The block's last residence written before event ``seq`` (None: never written)."""
        last = None
        for stay in self.stays.get(block, ()):
            if stay.stored_seq >= seq:
                break
            last = stay
        return last


def logged_replay(
    work: Workload,
    label: str,
    config: SimConfig,
    *,
    windows: list[WindowRecord] | None = None,
) -> tuple[EventLog, float]:
    """Replay ``work`` under the policy ``label`` (``name`` or ``name[param=value,...]``) with
    its events logged; the log and the replay's hit rate. ``windows``: filled with the
    policy's recency guard's windows, where it has one."""
    name, params = policy_variant(label)
    policy = make_policy(name, **params)
    guard = getattr(policy, "guard", None)
    if windows is not None and isinstance(guard, RecencyGuard):
        guard.journal = windows
    logs: list[EventLog] = []

    def engine(clock: Callable[[], float]) -> SimEngine:
        logs.append(EventLog(Engine(policy, clock=clock)))
        return logs[0]

    sim = Simulator(work, policy, config, engine=engine)
    log = logs[0]
    queue = sim.host.queue
    if isinstance(queue, HostOrderQueue):
        log.watch(queue.order)
    return log, sim.run().hit_rate


@dataclass(slots=True)
class Losses:
    """What became, in the other replay, of each block LRU's replay loaded from its host tier."""

    classes: Counter[str] = field(default_factory=Counter)
    evicted: list[tuple[HostStay, float]] = field(default_factory=list)  # (its stay, reuse ts)
    lost_by_agent: Counter[str] = field(default_factory=Counter)  # who needed a lost block
    lru_stay_s: list[float] = field(default_factory=list)  # LRU: written to the reuse

    @property
    def lru_host_hits(self) -> int:
        return sum(self.classes.values())


def compare(lru: EventLog, other: EventLog) -> Losses:
    out = Losses()
    for rid, seen in lru.requests.items():
        if not seen.host_hit:
            continue
        theirs = other.requests[rid]
        for i in range(seen.gpu_hit, seen.gpu_hit + seen.host_hit):
            block = seen.blocks[i]
            stay = lru.stay_before(block, seen.seq)
            if stay is not None:
                out.lru_stay_s.append(seen.ts - stay.stored_ts)
            kind, theirs_stay = _fate(other, theirs, i)
            out.classes[kind] += 1
            if kind not in (HOST, GPU):
                out.lost_by_agent[theirs.agent] += 1
            if kind == EVICTED:
                assert theirs_stay is not None
                out.evicted.append((theirs_stay, theirs.ts))
    return out


def _fate(log: EventLog, seen: RequestSeen, i: int) -> tuple[str, HostStay | None]:
    """What became of the request's ``i``-th block in ``log``'s replay, and the block's last
    host residence before the request (None when served, or never written)."""
    if i < seen.gpu_hit:
        return GPU, None
    if i < seen.gpu_hit + seen.host_hit:
        return HOST, None
    stay = log.stay_before(seen.blocks[i], seen.seq)
    if stay is None:
        return NEVER, None
    if stay.removed_seq is not None and stay.removed_seq < seen.seq:
        return EVICTED, stay
    return BEHIND, stay


def _quartiles(values: Iterable[float]) -> str:
    data = sorted(values)
    if not data:
        return "-"
    if len(data) == 1:
        return f"{data[0]:.2f}"
    q1, q2, q3 = statistics.quantiles(data, n=4)
    return f"{q1:.2f} / {q2:.2f} / {q3:.2f}"


def tables(losses: Losses, label: str) -> list[Table]:
    total = losses.lru_host_hits or 1
    fates = Table(title=escape(f"LRU's host-tier hits, in {label}'s replay"))
    fates.add_column("fate")
    fates.add_column("blocks", justify="right")
    fates.add_column("share", justify="right")
    for kind in (HOST, GPU, NEVER, EVICTED, BEHIND):
        n = losses.classes[kind]
        fates.add_row(kind, f"{n:,}", f"{n / total:.1%}")
    fates.add_row("all", f"{losses.lru_host_hits:,}", "")

    evicted = Table(title="the evicted ones (seconds of simulated time, quartiles)")
    evicted.add_column("evicted as")
    for column in ("blocks", "not named when written", "stale score", "score when written"):
        evicted.add_column(column, justify="right")
    for column in ("written -> evicted", "evicted -> needed", "written -> needed"):
        evicted.add_column(column, justify="right")
    for why in EVICTED_AS:
        rows = [(s, t) for s, t in losses.evicted if s.evicted_as == why]
        evicted.add_row(
            why,
            f"{len(rows):,}",
            f"{sum(not s.named for s, _ in rows):,}",
            f"{sum(s.stale for s, _ in rows):,}",
            _quartiles(s.score for s, _ in rows if s.score is not None),
            _quartiles(s.removed_ts - s.stored_ts for s, _ in rows if s.removed_ts is not None),
            _quartiles(t - s.removed_ts for s, t in rows if s.removed_ts is not None),
            _quartiles(t - s.stored_ts for s, t in rows),
        )
    evicted.add_row(
        "(LRU's hits)",
        f"{len(losses.lru_stay_s):,}",
        *[""] * 5,
        _quartiles(losses.lru_stay_s),
    )

    agents = Table(title="the lost blocks by the agent that needed them")
    agents.add_column("agent")
    agents.add_column("blocks", justify="right")
    for agent, n in losses.lost_by_agent.most_common(6):
        agents.add_row(agent, f"{n:,}")
    return [fates, evicted, agents]


def window_table(windows: Sequence[WindowRecord]) -> Table:
    """The guard's windows, one row each, and their totals."""
    arms = list(windows[0].hits) if windows else []
    table = Table(title="the recency guard's windows (sampled blocks)")
    for column in ("window", "published", "then"):
        table.add_column(column)
    for column in (*[f"{arm} shadow" for arm in arms], "real tiers", "published shadow"):
        table.add_column(column, justify="right")
    for i, w in enumerate(windows, 1):
        table.add_row(
            str(i),
            w.published,
            w.chosen if w.chosen != w.published else "",
            *[f"{w.hits[arm]:,}" for arm in arms],
            f"{w.real_hits:,}",
            f"{w.shadow_hits:,}",
        )
    table.add_row(
        "all",
        "",
        "",
        *[f"{sum(w.hits[arm] for w in windows):,}" for arm in arms],
        f"{sum(w.real_hits for w in windows):,}",
        f"{sum(w.shadow_hits for w in windows):,}",
    )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="policyd host-losses", description=__doc__)
    p.add_argument("--workload", default="financial", help="a generator name or a trace path")
    p.add_argument("--seed", type=int, default=0, help="generator seed, or a trace's order")
    p.add_argument("--streams", type=int, default=8, help="workflows of a generated workload")
    p.add_argument("--limit", type=int, help="a trace's first workflows only")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--gpu-blocks", type=int, default=2108)
    p.add_argument("--host-blocks", type=int, default=2108)
    p.add_argument("--policy", default="agentkv[guard=false]", help="name or name[param=value]")
    p.add_argument(
        "--windows",
        action="store_true",
        help="also print the policy's recency guard's windows (agentkv with its guard)",
    )
    args = p.parse_args(argv)
    if args.host_blocks <= 0:
        p.error("--host-blocks must be positive: the comparison is of host-tier hits")
    try:
        name, params = policy_variant(args.policy)
        make_policy(name, **params)
    except (TypeError, ValueError) as exc:
        p.error(str(exc))
    path = Path(args.workload)
    source = (
        Source(path.name, str(path), args.limit)
        if path.exists()
        else Source(args.workload, None, args.limit)
    )
    work = load_source(source, args.seed, args.streams)
    config = SimConfig(
        concurrency=args.concurrency, gpu_blocks=args.gpu_blocks, host_blocks=args.host_blocks
    )
    progress = Console(stderr=True)
    progress.print(f"replaying {source.label} under lru")
    lru_log, lru_rate = logged_replay(work, "lru", config)
    progress.print(escape(f"replaying {source.label} under {args.policy}"))
    windows: list[WindowRecord] = []
    other_log, other_rate = logged_replay(
        work, args.policy, config, windows=windows if args.windows else None
    )
    if args.windows and not windows:
        progress.print(escape(f"{args.policy} has no recency guard, or it closed no window"))
    out = Console() if sys.stdout.isatty() else Console(width=200)
    out.print(
        escape(
            f"{source.label}, C={args.concurrency}, {args.gpu_blocks:,} GPU + {args.host_blocks:,} "
            f"host blocks: hit rate lru {lru_rate:.4f}, {args.policy} {other_rate:.4f} "
            f"({other_rate / lru_rate if lru_rate else float('nan'):.3f}x)"
        ),
        highlight=False,
    )
    for table in tables(compare(lru_log, other_log), args.policy):
        out.print(table)
    if windows:
        out.print(window_table(windows))
    given = argv if argv is not None else sys.argv[1:]
    out.print(
        escape(f"reproduce: {shlex.join(['policyd', 'host-losses', *given])}"), highlight=False
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
