"""The evaluation matrix: agentkv beside every baseline, on every workload, as one command.

    policyd matrix [--traces DIR] [--generators all] [--streams 32] [--max-workflows 48]
                   [--max-requests 500] [--seeds 1] [--jobs 2] [--json PATH] [--plot PNG]

For each workload (every generator, and every trace found in ``--traces`` or ``$AGENTKV_TRACES``)
it picks its points: three concurrencies (4, 16, 64, each at most the workload's streams), three
GPU tiers (the tightest that holds the workload's largest request, twice and four times that),
without a host tier and with one as large as the GPU's. At each point it runs lru, kvflow, pbkv,
efficientagent and agentkv in the simulator that applies only what the connector applies, and
references: ``belady`` (the offline oracle on the same tiers) and, with a host tier,
``belady-one-tier``, Belady on one tier of the GPU's and the host's capacity together (no
placement over the two tiers holds more distinct blocks; ``belady`` on two tiers can fall below
LRU). The ``bound`` is the better of the two: not a proof, since in the simulator the admission
schedule depends on the GPU tier's size, so the one-tier run sees a different interleaving and
two-tier Belady can exceed it. It prints agentkv's hit rate against LRU and the best baseline
and as a fraction of the bound, point by point, and a verdict per goal: at or above LRU (within
0.5%) everywhere, at or above the best baseline where the seeds' spread allows a verdict, at
least 0.9 of the bound at the most contended points.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.table import Table

from experiments.bench import STREAM_PARAMS
from policyd.sim.replay import SimConfig, computed_tokens, simulate
from policyd.traces import READERS, detect_format, load_trace
from policyd.workloads import WORKLOADS, make_workload
from policyd.workloads.calls import Workload

BASELINES: Final = ("lru", "kvflow", "pbkv", "efficientagent")
OURS: Final = "agentkv"
CONCURRENCIES: Final = (4, 16, 64)
GPU_MULTIPLES: Final = (1, 2, 4)  # of the largest request's blocks
BLOCK_TOKENS: Final = SimConfig().block_tokens
LRU_TOLERANCE: Final = 0.005  # "at or above LRU" within this fraction
BOUND_GOAL: Final = 0.9  # of the bound, at the most contended points


@dataclass(frozen=True, slots=True)
class Source:
    """A workload to load: a generator by name, or a trace by path; its first ``limit`` streams."""

    name: str
    path: str | None = None
    limit: int | None = None

    @property
    def label(self) -> str:
        return self.name if self.limit is None else f"{self.name}[:{self.limit}]"


@dataclass(frozen=True, slots=True)
class Point:
    source: Source
    seed: int
    concurrency: int
    gpu_blocks: int
    host_blocks: int


@dataclass(slots=True)
class PointResult:
    point: Point
    hit_rate: dict[str, float] = field(default_factory=dict)  # policies, belady, bound
    seconds: float = 0.0

    @property
    def bound(self) -> float:
        return self.hit_rate["bound" if self.point.host_blocks else "belady"]


@cache
def load_source(source: Source, seed: int, streams: int) -> Workload:
    """The workload (cached per process): a generator with ``streams`` streams, or the trace's
    first ``source.limit`` workflows in the order ``seed`` gives."""
    if source.path is None:
        param = STREAM_PARAMS.get(source.name)
        params: dict[str, object] = {param: streams} if param else {}
        return make_workload(source.name, seed=seed, **params)
    work = load_trace(source.path, seed=seed)
    if source.limit is not None and len(work.streams) > source.limit:
        work = dataclasses.replace(work, streams=list(work.streams)[: source.limit])
    return work


def _single_requests(path: str) -> bool:
    """A trace of single requests in recorded time order (Mooncake): one order, and a limit in
    requests rather than workflows."""
    return not READERS[detect_format(path)].workflows


def largest_request(work: Workload, block_tokens: int = BLOCK_TOKENS) -> int:
    """The GPU blocks the workload's largest request holds while it runs (its computed tokens,
    ``policyd.sim.replay.computed_tokens``, in blocks)."""
    calls = (call for stream in work.streams for call in stream)
    return max(-(-computed_tokens(call) // block_tokens) for call in calls)


def points_of(source: Source, works: Sequence[Workload], seeds: Sequence[int]) -> list[Point]:
    """The workload's points, one per seed (``works[i]`` is its workload at ``seeds[i]``):
    three concurrencies, three GPU tiers, host tier off and on; the tiers from the largest
    request of any seed, so every seed of a point runs at the same capacities."""
    largest = max(largest_request(work) for work in works)
    n_streams = min(len(work.streams) for work in works)
    concurrencies = sorted({min(c, n_streams) for c in CONCURRENCIES})
    return [
        Point(source, seed, c, largest * m, host)
        for c in concurrencies
        for m in GPU_MULTIPLES
        for host in (0, largest * m)
        for seed in seeds
    ]


def run_point(point: Point, streams: int, profile: str) -> PointResult:
    """Every policy and both references at one point (runs in a worker process)."""
    started = time.perf_counter()
    work = load_source(point.source, point.seed, streams)
    config = SimConfig(
        concurrency=point.concurrency,
        gpu_blocks=point.gpu_blocks,
        host_blocks=point.host_blocks,
        profile=profile,
    )
    result = PointResult(point)
    lru = simulate(work, "lru", dataclasses.replace(config, record_requests=True))
    result.hit_rate["lru"] = lru.hit_rate
    for policy in (*BASELINES[1:], OURS):
        result.hit_rate[policy] = simulate(work, policy, config, lru_report=lru).hit_rate
    result.hit_rate["belady"] = simulate(work, "belady", config, lru_report=lru).hit_rate
    if point.host_blocks:
        one_tier = dataclasses.replace(
            config, gpu_blocks=point.gpu_blocks + point.host_blocks, host_blocks=0
        )
        one = simulate(work, "belady", one_tier, lru_report=lru).hit_rate
        result.hit_rate["belady-one-tier"] = one
        result.hit_rate["bound"] = max(one, result.hit_rate["belady"])
    result.seconds = time.perf_counter() - started
    return result


# -- the summary --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verdicts:
    points: int
    at_or_above_lru: int
    worst_vs_lru: tuple[float, str]
    above_best: int
    below_best: int
    no_verdict_best: int
    contended: int
    contended_at_goal: int


def _key(point: Point) -> tuple[str, int, int, int]:
    return (point.source.label, point.concurrency, point.gpu_blocks, point.host_blocks)


def grouped(results: Sequence[PointResult]) -> dict[tuple[str, int, int, int], list[PointResult]]:
    """Results by point, every seed of a point together."""
    out: dict[tuple[str, int, int, int], list[PointResult]] = {}
    for r in results:
        out.setdefault(_key(r.point), []).append(r)
    return out


def _ours_over(results: Sequence[PointResult], den: Callable[[PointResult], float]) -> list[float]:
    """agentkv's hit rate over ``den``'s, one a seed (1 where ``den`` hits nothing)."""
    return [r.hit_rate[OURS] / d if (d := den(r)) > 0 else 1.0 for r in results]


def _lru(r: PointResult) -> float:
    return r.hit_rate["lru"]


def _bound(r: PointResult) -> float:
    return r.bound


def best_baseline(r: PointResult) -> tuple[str, float]:
    return max(((p, r.hit_rate[p]) for p in BASELINES), key=lambda x: x[1])


def versus_best(results: Sequence[PointResult]) -> tuple[float, float, str]:
    """agentkv / the best baseline: mean over seeds, spread (sd; 0 with one seed), and the
    verdict: 'above' / 'below' when the mean is off 1 by more than twice the spread (with one
    seed: by more than the LRU tolerance), else 'level'."""
    ratios = [r.hit_rate[OURS] / b if (b := best_baseline(r)[1]) > 0 else 1.0 for r in results]
    mean = statistics.fmean(ratios)
    sd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    margin = max(2 * sd, LRU_TOLERANCE)
    verdict = "above" if mean > 1 + margin else "below" if mean < 1 - margin else "level"
    return mean, sd, verdict


def verdicts(results: Sequence[PointResult]) -> Verdicts:
    groups = grouped(results)
    vs_lru = {k: min(_ours_over(g, _lru)) for k, g in groups.items()}
    worst_key = min(vs_lru, key=vs_lru.__getitem__)
    best = {k: versus_best(g)[2] for k, g in groups.items()}
    # the most contended points: each workload's tightest GPU tier at its highest concurrency
    contended: dict[tuple[str, bool], tuple[str, int, int, int]] = {}
    for k in groups:
        label = k[0]
        cur = contended.get((label, k[3] > 0))
        if cur is None or (k[2], -k[1]) < (cur[2], -cur[1]):
            contended[(label, k[3] > 0)] = k
    scored = [k for k in contended.values() if all(r.bound > 0 for r in groups[k])]
    at_goal = sum(
        1 for k in scored if statistics.fmean(_ours_over(groups[k], _bound)) >= BOUND_GOAL
    )
    return Verdicts(
        points=len(groups),
        at_or_above_lru=sum(1 for v in vs_lru.values() if v >= 1 - LRU_TOLERANCE),
        worst_vs_lru=(vs_lru[worst_key], _label(worst_key)),
        above_best=sum(1 for v in best.values() if v == "above"),
        below_best=sum(1 for v in best.values() if v == "below"),
        no_verdict_best=sum(1 for v in best.values() if v == "level"),
        contended=len(scored),  # (a point where even the bound hits nothing has no verdict)
        contended_at_goal=at_goal,
    )


def _label(key: tuple[str, int, int, int]) -> str:
    name, c, gpu, host = key
    return f"{name} C={c} gpu={gpu:,} host={host:,}"


def table(results: Sequence[PointResult]) -> Table:
    t = Table(title="agentkv against the baselines and the bound (hit rate, mean over seeds)")
    for col in ("workload", "C", "GPU blk", "host blk", "lru", "best baseline", "agentkv"):
        t.add_column(col, justify="left" if col in ("workload", "best baseline") else "right")
    for col in ("vs lru (min)", "vs best", "bound", "of bound"):
        t.add_column(col, justify="right")
    for key, group in grouped(results).items():
        name, c, gpu, host = key
        means = {p: statistics.fmean(r.hit_rate[p] for r in group) for p in group[0].hit_rate}
        best_name = best_baseline(group[0])[0]
        vs_lru = min(_ours_over(group, _lru))
        vb, sd, verdict = versus_best(group)
        bound = statistics.fmean(r.bound for r in group)
        mark = "" if vs_lru >= 1 - LRU_TOLERANCE else " [red]behind[/red]"
        t.add_row(
            name,
            str(c),
            f"{gpu:,}",
            f"{host:,}",
            f"{means['lru']:.3f}",
            f"{best_name} {means[best_name]:.3f}",
            f"{means[OURS]:.3f}",
            f"{vs_lru:.3f}x{mark}",
            f"{vb:.3f}x" + (f" ±{sd:.3f}" if sd else "") + f" {verdict}",
            f"{bound:.3f}",
            f"{means[OURS] / bound:.2f}" if bound > 0 else "-",
        )
    return t


def summary_lines(v: Verdicts) -> list[str]:
    return [
        f"at or above LRU (within {LRU_TOLERANCE:.1%}): {v.at_or_above_lru} of {v.points} points"
        f" (worst {v.worst_vs_lru[0]:.3f}x at {v.worst_vs_lru[1]})",
        f"against the best baseline: above at {v.above_best}, level (no verdict: within the "
        f"seeds' spread) at {v.no_verdict_best}, below at {v.below_best}",
        f"at least {BOUND_GOAL:.0%} of the bound at the most contended points: "
        f"{v.contended_at_goal} of {v.contended}",
    ]


def plot(results: Sequence[PointResult], path: str, command: str) -> None:
    """agentkv / LRU per point (one dot a seed), by workload; the 0.995 line."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    labels = sorted({r.point.source.label for r in results})
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(labels)), 4.2))
    for i, label in enumerate(labels):
        for r in results:
            if r.point.source.label != label:
                continue
            y = r.hit_rate[OURS] / r.hit_rate["lru"] if r.hit_rate["lru"] > 0 else 1.0
            marker = "o" if r.point.host_blocks else "s"
            ax.scatter(i + (0.15 if r.point.host_blocks else -0.15), y, marker=marker, s=18,
                       color="tab:blue" if r.point.host_blocks else "tab:orange")  # fmt: skip
    ax.axhline(1 - LRU_TOLERANCE, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("agentkv hit rate / LRU's")
    ax.set_title("agentkv / LRU per point and seed (squares: GPU only; circles: host)", fontsize=9)
    fig.text(0.01, 0.01, command, fontsize=6, color="grey")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# -- the command --------------------------------------------------------------------------------


def trace_sources(directory: str | None, limit: int | None, requests: int | None) -> list[Source]:
    """Every trace under ``directory`` a reader recognises (one level deep); its first ``limit``
    workflows, or ``requests`` requests for a trace of single requests."""
    if not directory:
        return []
    out = []
    for entry in sorted(Path(directory).iterdir()):
        candidates = [entry, *sorted(entry.iterdir())] if entry.is_dir() else [entry]
        for path in candidates:
            try:
                detect_format(path)
            except (ValueError, OSError):
                continue
            out.append(
                Source(path.name, str(path), requests if _single_requests(str(path)) else limit)
            )
            break
    return out


def sources_of(args: argparse.Namespace) -> list[Source]:
    names = list(WORKLOADS) if args.generators == "all" else _split(args.generators)
    for name in names:
        if name not in WORKLOADS:
            raise SystemExit(f"unknown generator {name!r}; valid: {', '.join(WORKLOADS)}")
    return [Source(n) for n in names] + trace_sources(
        args.traces, args.max_workflows, args.max_requests
    )


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def run(args: argparse.Namespace, console: Console) -> list[PointResult]:
    points: list[Point] = []
    for source in sources_of(args):
        single = source.path is not None and _single_requests(source.path)
        seeds = [0] if single else list(range(args.seeds))  # single requests: time order only
        works = [load_source(source, seed, args.streams) for seed in seeds]
        points.extend(points_of(source, works, seeds))
    console.print(f"[matrix] {len(points)} points, {args.jobs} processes", style="dim")
    results: list[PointResult] = []
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_point, p, args.streams, args.profile) for p in points]
        for i, future in enumerate(futures, 1):
            r = future.result()
            results.append(r)
            console.print(
                f"[matrix] {i}/{len(points)} {_label(_key(r.point))} seed {r.point.seed}: "
                f"agentkv {r.hit_rate[OURS]:.3f} lru {r.hit_rate['lru']:.3f} "
                f"({r.seconds:.0f} s; {time.perf_counter() - started:.0f} s in all)",
                style="dim",
                highlight=False,
            )
    return results


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="policyd matrix", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--traces",
        default=os.environ.get("AGENTKV_TRACES"),
        help="a folder of real traces (default $AGENTKV_TRACES; none: generators only)",
    )
    ap.add_argument("--generators", default="all", help="comma-separated, or 'all'")
    ap.add_argument("--streams", type=int, default=32, help="streams per generated workload")
    ap.add_argument(
        "--max-workflows",
        type=int,
        default=48,
        help="a trace's first N workflows in each order",
    )
    ap.add_argument(
        "--max-requests",
        type=int,
        default=500,
        help="a trace of single requests (Mooncake): its first N, in time order",
    )
    ap.add_argument("--seeds", type=int, default=1, help="generator seeds / trace orders per point")
    ap.add_argument("--profile", default="h200-llama3.1-8b")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    ap.add_argument("--json", help="also write every point's hit rates here")
    ap.add_argument("--plot", help="agentkv / LRU per point, as a PNG")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(stderr=True)
    out = Console() if sys.stdout.isatty() else Console(width=220)
    command = "policyd matrix " + " ".join(argv if argv is not None else sys.argv[1:])
    results = run(args, console)
    out.print(table(results))
    for line in summary_lines(verdicts(results)):
        out.print(line, highlight=False)
    out.print(f"reproduce: {command}", highlight=False)
    if args.json:
        payload: dict[str, Any] = {
            "command": command,
            "points": [
                {**dataclasses.asdict(r.point), "hit_rate": r.hit_rate, "seconds": r.seconds}
                for r in results
            ],
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))
    if args.plot:
        plot(results, args.plot, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
