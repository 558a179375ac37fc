"""A cold replica's next-agent accuracy, with and without the fleet's learning.

A fleet of ``--replicas`` warm replicas serves the first workflows of a workload (round-robin
by workflow, ``--concurrency`` at a time on each); each learns as a daemon does and, every
``--delta-every`` calls, takes its learning as a ``LearningDelta`` (``policyd.fleet.deltas``),
encoded to its wire form and decoded again, as JetStream would carry it. Then a cold replica
joins and serves the workflows that follow. Three cold replicas are compared on the same
calls:

* ``alone`` - a fresh predictor: what a replica that joins a fleet without fleet learning has;
* ``fleet`` - a fresh predictor that merged every warm replica's deltas first (the transition
  counts; its context models and mixtures start fresh);
* ``one replica`` - a predictor that itself learnt every call the fleet served (the bound: as
  if the whole fleet's traffic had gone through this one replica).

Each is scored on its first ``--calls`` calls: before each call, the agent it forecast as the
next one (``predict_next_for_new`` for a workflow's first call, else step 1 of ``predict``)
against the agent called. Generated workloads run over ``--seeds``; the Who&When chats over as
many trace orders (the chats shuffled per seed); mean and min..max are reported.

Run ``policyd eval-fleet`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from experiments.predictor_eval import WORKLOADS, interleave, load
from policyd.cli.arguments import int_list
from policyd.fleet.deltas import FleetLearning, FleetOutbox, decode
from policyd.models.predictor import END, Predictor
from policyd.models.shards import Shards
from policyd.traces.location import WHO_AND_WHEN, local_trace
from policyd.workloads.calls import Workload

ARMS = ("alone", "fleet", "one replica")


class WarmReplica:
    """A replica of the fleet: a predictor that learns the calls it serves, and its outbox."""

    def __init__(self, name: str) -> None:
        self.predictor = Predictor(roll_out_unserved=False)
        shards = Shards(rate=1.0)
        self.learning = FleetLearning(self.predictor, lambda: shards)
        self.outbox = FleetOutbox(name, "eval")

    def learn(self, workload: Workload, concurrency: int, delta_every: int) -> Iterator[bytes]:
        """Serve ``workload``'s workflows; yield each sealed delta's wire form."""
        for n, (call, pos, ended) in enumerate(interleave(workload, concurrency), start=1):
            if ended:
                self.predictor.observe_finished(call.workflow_id)
            else:
                self.predictor.observe_call(
                    call.workflow_id, call.workflow_type, call.agent, call.hints, float(pos)
                )
            if n % delta_every == 0:
                yield from self._sealed()
        yield from self._sealed()

    def _sealed(self) -> Iterator[bytes]:
        self.outbox.seal(self.learning)
        for _, payload in self.outbox.sealed:
            yield payload
        self.outbox.sealed.clear()


def first_calls_accuracy(
    predictor: Predictor, workload: Workload, concurrency: int, calls: int
) -> tuple[int, int]:
    """Top-1 hits and calls scored over the first ``calls`` calls ``predictor`` serves."""
    hits = scored = 0
    for call, pos, ended in interleave(workload, concurrency):
        if scored >= calls:
            break
        wid = call.workflow_id
        if ended:
            predictor.observe_finished(wid)
            continue
        if pos == 0:
            guess = predictor.predict_next_for_new(call.workflow_type, call.hints).top(1)
        else:
            guess = predictor.predict(wid).top(1)
        hits += guess == call.agent and guess != END
        scored += 1
        predictor.observe_call(wid, call.workflow_type, call.agent, call.hints, float(pos))
    return hits, scored


def split(workload: Workload, warm_share: float, replicas: int) -> tuple[list[Workload], Workload]:
    """The first ``warm_share`` of the workflows round-robin over ``replicas`` warm replicas,
    and the rest for the cold replica."""
    streams = workload.streams
    cut = max(replicas, int(len(streams) * warm_share))
    warm = [
        Workload(f"{workload.name}-r{i}", list(streams[i:cut:replicas])) for i in range(replicas)
    ]
    return warm, Workload(f"{workload.name}-cold", list(streams[cut:]))


@dataclass
class Point:
    workload: str
    seed: int
    accuracy: dict[str, float]
    scored: int
    deltas: int
    delta_bytes: int


def run_point(workload: Workload, seed: int, args: argparse.Namespace) -> Point:
    warm, cold = split(workload, args.warm_share, args.replicas)
    fleet_cold = Predictor(roll_out_unserved=False)
    merger = FleetLearning(fleet_cold, lambda: Shards(rate=1.0))
    one = Predictor(roll_out_unserved=False)
    deltas = delta_bytes = 0
    for i, share in enumerate(warm):
        for payload in WarmReplica(f"r{i}").learn(share, args.concurrency, args.delta_every):
            merger.merge(decode(payload))
            deltas += 1
            delta_bytes += len(payload)
        for call, pos, ended in interleave(share, args.concurrency):
            if ended:
                one.observe_finished(call.workflow_id)
            else:
                one.observe_call(
                    call.workflow_id, call.workflow_type, call.agent, call.hints, float(pos)
                )
    accuracy: dict[str, float] = {}
    scored = 0
    for arm, predictor in zip(
        ARMS, (Predictor(roll_out_unserved=False), fleet_cold, one), strict=True
    ):
        hits, scored = first_calls_accuracy(predictor, cold, args.concurrency, args.calls)
        accuracy[arm] = hits / scored if scored else float("nan")
    return Point(workload.name, seed, accuracy, scored, deltas, delta_bytes)


def workloads(args: argparse.Namespace, seed: int) -> Iterator[Workload]:
    whowhen = args.whowhen or local_trace(WHO_AND_WHEN)
    for name in args.workloads:
        if name == "who-and-when":
            if whowhen is None:
                continue
            yield load(name, args.workflows, seed, whowhen).reordered(seed)
        else:
            yield load(name, args.workflows, seed, None)


def summary_table(points: Sequence[Point], calls: int) -> Table:
    table = Table(title=f"A cold replica's next-agent accuracy over its first {calls} calls")
    table.add_column("workload")
    for arm in ARMS:
        table.add_column(arm, justify="right")
    table.add_column("fleet gain", justify="right")
    table.add_column("deltas (KiB)", justify="right")
    by_workload: dict[str, list[Point]] = {}
    for p in points:
        by_workload.setdefault(p.workload, []).append(p)
    for name, group in by_workload.items():
        cells = []
        for arm in ARMS:
            values = [p.accuracy[arm] for p in group]
            spread = f" ({min(values):.2f}..{max(values):.2f})" if len(values) > 1 else ""
            cells.append(f"{statistics.fmean(values):.3f}{spread}")
        gain = statistics.fmean(p.accuracy["fleet"] - p.accuracy["alone"] for p in group)
        kib = statistics.fmean(p.delta_bytes for p in group) / 1024
        deltas = statistics.fmean(p.deltas for p in group)
        table.add_row(name, *cells, f"{gain:+.3f}", f"{deltas:.0f} ({kib:.0f})")
    return table


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="policyd eval-fleet",
        description="A cold replica's next-agent accuracy over its first calls, with and "
        "without the fleet's learning (docs/FLEET.md).",
    )
    p.add_argument(
        "--workloads",
        type=lambda s: s.split(","),
        default=list(WORKLOADS),
        help=f"comma-separated, from {', '.join(WORKLOADS)} (default: all; who-and-when "
        "where the trace is found)",
    )
    p.add_argument("--workflows", type=int, default=400, help="per generated workload")
    p.add_argument("--seeds", type=int_list(), default=[0, 1, 2], help="seeds / trace orders")
    p.add_argument("--replicas", type=int, default=3, help="warm replicas (default 3)")
    p.add_argument("--warm-share", type=float, default=0.75, help="workflows the fleet serves")
    p.add_argument("--concurrency", type=int, default=8, help="active workflows per replica")
    p.add_argument("--calls", type=int, default=100, help="cold replica's calls scored")
    p.add_argument("--delta-every", type=int, default=200, help="calls between two deltas")
    p.add_argument("--whowhen", type=Path, help="Who&When folder (default: $AGENTKV_TRACES)")
    p.add_argument("--json", metavar="PATH", help="also write every point as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        print(f"policyd eval-fleet: unknown workload(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    console = Console()
    points: list[Point] = []
    for seed in args.seeds:
        for workload in workloads(args, seed):
            point = run_point(workload, seed, args)
            console.print(
                f"  {workload.name} seed {seed}: "
                + ", ".join(f"{a} {v:.3f}" for a, v in point.accuracy.items())
            )
            points.append(point)
    if not points:
        print("policyd eval-fleet: no workload to run", file=sys.stderr)
        return 2
    console.print(summary_table(points, args.calls))
    console.print(f"reproduce: policyd eval-fleet {shlex.join(argv or sys.argv[1:])}")
    if args.json:
        records: list[dict[str, Any]] = [p.__dict__ for p in points]
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
