"""``policyd guard-fidelity``: does each of the recency guard's shadows read its arm's real tiers?

The guard publishes the arm whose shadow hits most, so a shadow that misreads its arm misleads
it. Per point, agentkv is replayed once per arm with that arm published throughout and every
block followed (sample rate 1); printed: the published arm's shadow hits over the hits the
simulator's tiers made on the same blocks (1.000: exact), and the real hit rate of each arm
against LRU's, so a reader sees which arm the guard should pick. Generated workloads run
always; the real traces when ``--traces`` (default ``$AGENTKV_TRACES``) holds them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from experiments.matrix import Source, largest_request, load_source
from policyd.policies import make_policy
from policyd.policies.agentkv import AgentKV
from policyd.policies.guard import FILTER, LEARNED, RECENCY
from policyd.sim.replay import SimConfig, Simulator

ARMS = (RECENCY, FILTER, LEARNED)


@dataclass(frozen=True, slots=True)
class FidelityPoint:
    """A workload (generator, or a trace's first ``source.limit`` workflows) at ``concurrency``,
    GPU and host tiers as large as its largest request."""

    source: Source
    concurrency: int


@dataclass(slots=True)
class Fidelity:
    point: FidelityPoint
    blocks: int
    lru_hit_rate: float
    read: dict[str, float] = field(default_factory=dict)  # arm -> shadow hits / real hits
    vs_lru: dict[str, float] = field(default_factory=dict)  # arm -> real hit rate / LRU's


GENERATED = (
    FidelityPoint(Source("financial"), 8),
    FidelityPoint(Source("code-writing"), 8),
    FidelityPoint(Source("fact-checking"), 8),
    FidelityPoint(Source("group-chat"), 8),
    FidelityPoint(Source("coding-pool"), 8),
)


def trace_points(traces: Path) -> list[FidelityPoint]:
    """The shared real traces at the evaluation matrix's most contended host-tier points."""
    found = [
        (traces / "swebench_minisweagent_200.tar.gz", 12, 12),
        (traces / "who_and_when_captainagent", 12, 12),
        (traces / "mooncake" / "synthetic_trace.jsonl", 500, 16),
    ]
    return [
        FidelityPoint(Source(path.name, str(path), limit), concurrency)
        for path, limit, concurrency in found
        if path.exists()
    ]


def published_throughout(arm: str, shadow_blocks: int) -> AgentKV:
    """agentkv whose guard publishes ``arm`` whatever its windows say, its shadows following
    every block of tiers of ``shadow_blocks`` in all (sample rate 1)."""
    return AgentKV(guard_arm=arm, guard_shadow_blocks=shadow_blocks)


def measure(point: FidelityPoint, streams: int, seed: int) -> Fidelity:
    work = load_source(point.source, seed, streams)
    blocks = largest_request(work)
    config = SimConfig(concurrency=point.concurrency, gpu_blocks=blocks, host_blocks=blocks)
    lru = Simulator(work, make_policy("lru"), config).run().hit_rate
    out = Fidelity(point, blocks, lru)
    for arm in ARMS:
        policy = published_throughout(arm, 2 * blocks)
        report = Simulator(work, policy, config).run()
        assert policy.guard is not None
        c = policy.guard.counters
        out.read[arm] = c.shadow_hits / c.real_hits if c.real_hits else float("nan")
        out.vs_lru[arm] = report.hit_rate / lru if lru else float("nan")
    return out


def table(rows: Sequence[Fidelity]) -> Table:
    t = Table(title="each arm published throughout, every block followed")
    t.add_column("workload")
    t.add_column("C", justify="right")
    t.add_column("GPU = host blocks", justify="right")
    t.add_column("lru hit", justify="right")
    for arm in ARMS:
        t.add_column(f"{arm}: shadow / real", justify="right")
    for arm in ARMS[1:]:
        t.add_column(f"{arm} / lru", justify="right")
    for r in rows:
        t.add_row(
            r.point.source.label,
            str(r.point.concurrency),
            f"{r.blocks:,}",
            f"{r.lru_hit_rate:.3f}",
            *[f"{r.read[a]:.3f}" for a in ARMS],
            *[f"{r.vs_lru[a]:.3f}x" for a in ARMS[1:]],
        )
    return t


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="policyd guard-fidelity", description=__doc__)
    p.add_argument(
        "--traces",
        default=os.environ.get("AGENTKV_TRACES", ""),
        help="a folder of real traces (default $AGENTKV_TRACES; none: generators only)",
    )
    p.add_argument("--streams", type=int, default=8, help="workflows per generated workload")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    progress = Console(stderr=True)
    out = Console() if sys.stdout.isatty() else Console(width=200)
    points = [*GENERATED, *(trace_points(Path(args.traces)) if args.traces else [])]
    rows = []
    for i, point in enumerate(points, 1):
        progress.print(f"{i}/{len(points)} {point.source.label} C={point.concurrency}")
        rows.append(measure(point, args.streams, args.seed))
    out.print(table(rows))
    given = argv if argv is not None else sys.argv[1:]
    out.print(f"reproduce: {shlex.join(['policyd', 'guard-fidelity', *given])}", highlight=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
