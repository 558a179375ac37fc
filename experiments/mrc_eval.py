"""Accuracy and cost of the online MRC estimator against exact stack distances, and sizing.

For the 200 SWE-bench trajectories replayed as a pool of A concurrent agents (A = 16, 32, 64) and
for the generated coding pool, it prints: the exact vs estimated MRC mean absolute error (SHARDS
fixed-rate and fixed-size), the estimator's cost per block reference and memory (tracked blocks),
the working set, the capacities reaching 50/80/90/95% of the achievable reuse, the closed-form
check (A - 1) x mean prompt tokens x KV bytes/token, and the host-tier recommendation from the
exact and from the estimated curves.

*The pool* (``interleave``): A tasks run at once, each its calls in order; call k+1 of a task is
issued after call k's generation (``output_tokens`` x the profile's decode time per token) and
the recorded tool gap; a finished task is replaced by the next. The trajectories' gaps are read
with that decode time subtracted (``read_swe(decode_tokens_per_s=)``), so issue times match
the recorded ones. ``--order round-robin`` takes the A tasks' calls in turn instead.

*MAE* is over ``--grid`` capacities evenly spaced from 0 to the exact working set (the capacity
where the exact curve reaches its maximum), as block hit ratios of one LRU tier; the host-tier
MAE is the same for a host tier behind the profile's GPU tier. *Cost* is the wall time of
``Shards.learn_prompt`` over the whole stream divided by its block references (CPython on the
machine at hand, so it moves with its load; the hash filter is vectorised per prompt, only
sampled blocks reach Python code).

Run ``policyd eval-mrc``; ``--plot docs/figures/mrc_eval.png`` draws the curves (the figure
docs/RESULTS.md, *Stack distances, MRC and SHARDS sizing*, shows).
"""

from __future__ import annotations

import argparse
import heapq
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from policyd.core.profiles import HardwareProfile, get_profile
from policyd.models.mrc import (
    COVERAGE_LEVELS,
    GiB,
    MissRatioCurve,
    Sizing,
    mean_absolute_error,
    recommend,
)
from policyd.models.shards import Shards
from policyd.models.stackdist import (
    COLD,
    ReferenceStream,
    effective_distances,
    monotone_violations,
    stack_distances,
)
from policyd.traces.location import SWE_TRAJECTORIES, TRACES_ENV, local_trace, missing_trace_message
from policyd.traces.swe import read_swe
from policyd.workloads.calls import Call, Workload
from policyd.workloads.pool import coding_pool


def interleave(
    workload: Workload,
    agents: int,
    *,
    decode_s_per_token: float,
    order: str = "gaps",
) -> list[Call]:
    """The calls of ``workload`` in the order a pool of ``agents`` concurrent tasks issues them."""
    if agents < 1:
        raise ValueError(f"agents must be >= 1, got {agents}")
    streams = [s for s in workload if s]
    if order == "round-robin":
        out: list[Call] = []
        slots = [[s, 0] for s in range(min(agents, len(streams)))]  # [stream, next call]
        next_stream = len(slots)
        while slots:
            for slot in slots:
                out.append(streams[slot[0]][slot[1]])
                slot[1] += 1
                if slot[1] == len(streams[slot[0]]) and next_stream < len(streams):
                    slot[:] = [next_stream, 0]
                    next_stream += 1
            slots = [slot for slot in slots if slot[1] < len(streams[slot[0]])]
        return out
    if order != "gaps":
        raise ValueError(f"unknown order {order!r}; valid orders: gaps, round-robin")
    heap: list[tuple[float, int, int, int]] = []  # (issue time, tie, stream, call index)
    tie = 0
    for s in range(min(agents, len(streams))):
        heap.append((0.0, tie, s, 0))
        tie += 1
    heapq.heapify(heap)
    next_stream = len(heap)
    out = []
    while heap:
        now, _, s, k = heapq.heappop(heap)
        call = streams[s][k]
        out.append(call)
        done = now + call.output_tokens * decode_s_per_token
        if k + 1 < len(streams[s]):
            heapq.heappush(heap, (done + streams[s][k + 1].gap_s, tie, s, k + 1))
        elif next_stream < len(streams):
            heapq.heappush(heap, (done, tie, next_stream, 0))
            next_stream += 1
        tie += 1
    return out


def load_swe(
    path: Path, *, limit: int | None, decode_tokens_per_s: float, progress: Progress
) -> Workload:
    """The trajectories as a workload, one stream per task (``swe_workload``, with progress)."""
    task = progress.add_task("reading SWE-bench trajectories", total=limit)
    streams = []
    for trajectory in read_swe(path, limit=limit, decode_tokens_per_s=decode_tokens_per_s):
        streams.append(trajectory.calls)
        progress.advance(task)
    progress.update(task, total=len(streams), completed=len(streams))
    return Workload(f"swe:{path.name}", streams, f"{len(streams)} mini-swe-agent trajectories")


@dataclass(frozen=True, slots=True)
class Estimator:
    """One estimator configuration of the benchmark."""

    label: str
    rate: float
    max_tracked_blocks: int | None
    count_correction: bool = True

    def make(self, seed: int) -> Shards:
        return Shards(
            rate=self.rate,
            max_tracked_blocks=self.max_tracked_blocks,
            count_correction=self.count_correction,
            seed=seed,
        )


@dataclass(frozen=True, slots=True)
class EstimateResult:
    """An estimator's figures on one workload, over seeds (``curve``/``sizing``: first seed)."""

    estimator: Estimator
    curve: MissRatioCurve
    sizing: Sizing
    mae: tuple[float, ...]
    host_mae: tuple[float, ...]
    max_error: tuple[float, ...]
    cost_us: tuple[float, ...]
    tracked_blocks: int  # the most over seeds
    timeline_slots: int
    final_rate: float
    capacity_error: tuple[float, ...]  # per seed: worst |C_est / C_exact - 1| over the levels


@dataclass(frozen=True, slots=True)
class Case:
    """One workload replayed as a pool: the exact curve and every estimator's results."""

    name: str
    agents: int
    references: int
    prompts: int
    distinct_blocks: int
    violations: int
    exact_s: float
    exact: MissRatioCurve
    sizing: Sizing
    estimates: tuple[EstimateResult, ...]


@dataclass(frozen=True, slots=True)
class Settings:
    profile: HardwareProfile
    gpu_blocks: int
    host_blocks: int
    coverage: float
    grid_points: int
    seeds: int
    estimators: tuple[Estimator, ...]


def _capacity_error(estimate: Sizing, exact: Sizing) -> float:
    return max(
        abs(estimate.coverage_blocks[c] / exact.coverage_blocks[c] - 1.0)
        for c in exact.coverage_blocks
        if exact.coverage_blocks[c] > 0
    )


def _run_estimator(
    estimator: Estimator,
    prompts: Sequence[tuple[Sequence[int], int]],
    *,
    exact: MissRatioCurve,
    exact_sizing: Sizing,
    agents: int,
    settings: Settings,
    progress: Progress,
    task: TaskID,
) -> EstimateResult:
    grid = np.linspace(0.0, exact.working_set_blocks, settings.grid_points)
    gpu = settings.gpu_blocks
    first: tuple[MissRatioCurve, Sizing] | None = None
    mae, host_mae, max_error, cost_us, capacity_error = [], [], [], [], []
    tracked = slots = 0
    rate = 1.0
    for seed in range(settings.seeds):
        shards = estimator.make(seed)
        elapsed = 0.0
        for start in range(0, len(prompts), 256):
            chunk = prompts[start : start + 256]
            began = time.perf_counter()
            for block_hashes, prompt_tokens in chunk:
                shards.learn_prompt(block_hashes, prompt_tokens)
            elapsed += time.perf_counter() - began
            progress.advance(task, len(chunk))
        curve = shards.curve(exact.kv_bytes_per_block, label=estimator.label)
        sizing = recommend(
            curve,
            agents=agents,
            gpu_blocks=gpu,
            host_blocks=settings.host_blocks,
            coverage=settings.coverage,
        )
        first = first or (curve, sizing)
        mae.append(mean_absolute_error(curve, exact, grid))
        host_mae.append(
            float(
                np.mean(np.abs(curve.host_hit_ratio(grid, gpu) - exact.host_hit_ratio(grid, gpu)))
            )
        )
        max_error.append(float(np.max(np.abs(curve.hit_ratio(grid) - exact.hit_ratio(grid)))))
        cost_us.append(elapsed / max(shards.references, 1) * 1e6)
        capacity_error.append(_capacity_error(sizing, exact_sizing))
        tracked = max(tracked, shards.tracked_blocks)
        slots = max(slots, shards.timeline_slots)
        rate = shards.rate
    assert first is not None
    return EstimateResult(
        estimator=estimator,
        curve=first[0],
        sizing=first[1],
        mae=tuple(mae),
        host_mae=tuple(host_mae),
        max_error=tuple(max_error),
        cost_us=tuple(cost_us),
        tracked_blocks=tracked,
        timeline_slots=slots,
        final_rate=rate,
        capacity_error=tuple(capacity_error),
    )


def evaluate(
    name: str, calls: Sequence[Call], agents: int, settings: Settings, progress: Progress
) -> Case:
    """Exact curve (compiled Mattson) and every estimator on one interleaved workload."""
    prompts = [(c.block_hashes, c.prompt_tokens) for c in calls]
    task = progress.add_task(
        f"{name}: exact", total=len(prompts) * (1 + settings.seeds * len(settings.estimators))
    )
    began = time.perf_counter()
    stream = ReferenceStream.from_calls(calls)
    distances = stack_distances(stream.blocks)
    effective = effective_distances(distances, stream.starts)
    exact = MissRatioCurve.exact(
        effective,
        prompt_tokens=float(stream.prompt_tokens.sum()),
        prompts=stream.prompts,
        kv_bytes_per_block=settings.profile.kv_bytes_per_block,
    )
    exact_s = time.perf_counter() - began
    progress.advance(task, len(prompts))
    exact_sizing = recommend(
        exact,
        agents=agents,
        gpu_blocks=settings.gpu_blocks,
        host_blocks=settings.host_blocks,
        coverage=settings.coverage,
    )
    estimates = []
    for estimator in settings.estimators:
        progress.update(task, description=f"{name}: {estimator.label}")
        estimates.append(
            _run_estimator(
                estimator,
                prompts,
                exact=exact,
                exact_sizing=exact_sizing,
                agents=agents,
                settings=settings,
                progress=progress,
                task=task,
            )
        )
    progress.update(task, description=f"{name}: done")
    return Case(
        name=name,
        agents=agents,
        references=len(stream),
        prompts=stream.prompts,
        distinct_blocks=int(np.count_nonzero(distances == COLD)),
        violations=monotone_violations(distances, stream.starts),
        exact_s=exact_s,
        exact=exact,
        sizing=exact_sizing,
        estimates=tuple(estimates),
    )


# ---- output -------------------------------------------------------------------------------------


def _spread(values: Sequence[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(sum(values) / len(values), fmt)} ({format(max(values), fmt)})"


def accuracy_table(cases: Sequence[Case], settings: Settings) -> Table:
    worst = " (worst)" if settings.seeds > 1 else ""
    gpu_gib = settings.gpu_blocks * settings.profile.kv_bytes_per_block / GiB
    table = Table(
        title=f"MRC accuracy and cost: online estimate vs exact ({settings.seeds} seed(s))",
        caption=(
            f"MAE over {settings.grid_points} capacities from 0 to the exact working set; host "
            f"MAE: host tier behind a {gpu_gib:.0f} GiB GPU tier. cost: CPython wall time per "
            "block reference; tracked blocks and timeline slots bound the memory; viol.: "
            "references whose distance falls toward the tail (the estimator assumes none); C err: "
            "worst |estimated / exact - 1| of the 50/80/90/95% capacities."
        ),
    )
    for column in (
        "workload",
        "refs",
        "viol.",
        "exact s",
        "estimator",
        f"MAE{worst}",
        f"host MAE{worst}",
        f"max err{worst}",
        "µs/ref",
        "tracked (slots)",
        "rate",
        f"C err{worst}",
    ):
        table.add_column(column, justify="left" if column in {"workload", "estimator"} else "right")
    for case in cases:
        for i, est in enumerate(case.estimates):
            table.add_row(
                f"{case.name} A={case.agents}" if i == 0 else "",
                f"{case.references / 1e6:.2f}M" if i == 0 else "",
                str(case.violations) if i == 0 else "",
                f"{case.exact_s:.1f}" if i == 0 else "",
                est.estimator.label,
                _spread(est.mae, ".4f"),
                _spread(est.host_mae, ".4f"),
                _spread(est.max_error, ".3f"),
                _spread(est.cost_us, ".2f"),
                f"{est.tracked_blocks} ({est.timeline_slots})",
                f"{est.final_rate:.4f}",
                _spread(est.capacity_error, ".1%"),
                end_section=i == len(case.estimates) - 1,
            )
    return table


def sizing_table(cases: Sequence[Case], settings: Settings) -> Table:
    kv = settings.profile.kv_bytes_per_block
    cov = settings.coverage
    current = settings.host_blocks * kv / GiB

    def gib(blocks: float) -> str:
        return f"{blocks * kv / GiB:.1f}"

    table = Table(
        title=(
            f"Host-tier sizing ({settings.profile.name}: GPU tier "
            f"{settings.gpu_blocks * kv / GiB:.0f} GiB, current host tier {current:.0f} GiB)"
        ),
        caption=(
            "GiB of one LRU tier reaching 50/80/90/95% of the achievable reuse (block hit ratio "
            "at infinite size); closed form: (A-1) x mean prompt tokens x KV bytes/token; Δ: "
            f"estimated vs exact capacity for the {cov:.0%} target; host rec.: inclusive host "
            "tier for that target, 0 when the GPU tier reaches it; recomp.: prompt tokens "
            "recomputed with GPU + host tier."
        ),
    )
    for column in (
        "workload",
        "curve",
        "achievable",
        "working set",
        *(f"{c:.0%}" for c in COVERAGE_LEVELS),
        "closed form",
        f"Δ {cov:.0%}",
        "host rec.",
        f"recomp. @{current:.0f} GiB",
        "@rec.",
    ):
        table.add_column(column, justify="left" if column in {"workload", "curve"} else "right")
    for case in cases:
        rows = [("exact", case.sizing), *((e.estimator.label, e.sizing) for e in case.estimates)]
        for i, (label, sizing) in enumerate(rows):
            delta = sizing.target_blocks / max(case.sizing.target_blocks, 1) - 1.0
            table.add_row(
                f"{case.name} A={case.agents}" if i == 0 else "",
                label,
                f"{sizing.achievable_hit_ratio:.3f}",
                gib(sizing.working_set_blocks),
                *(gib(sizing.coverage_blocks[c]) for c in COVERAGE_LEVELS),
                gib(sizing.closed_form_blocks) if i == 0 else "",
                "" if i == 0 else f"{delta:+.1%}",
                gib(sizing.recommended_host_blocks)
                if sizing.recommended_host_blocks
                else "0 (GPU)",
                f"{sizing.recomputed_tokens_current / 1e6:.1f}M",
                f"{sizing.recomputed_tokens_recommended / 1e6:.1f}M",
                end_section=i == len(rows) - 1,
            )
    return table


def plot(cases: Sequence[Case], settings: Settings, path: Path) -> None:
    """Exact and estimated curves of every case, with the GPU tier and recommendation marked."""
    import matplotlib  # noqa: PLC0415 - only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    kv = settings.profile.kv_bytes_per_block
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 3.6), squeeze=False)
    for ax, case in zip(axes[0], cases, strict=True):
        top = 1.1 * case.exact.working_set_blocks
        grid = np.linspace(0.0, top, 400)
        ax.plot(grid * kv / GiB, case.exact.hit_ratio(grid), color="black", lw=2, label="exact")
        for est in case.estimates:
            ax.plot(grid * kv / GiB, est.curve.hit_ratio(grid), lw=1, label=est.estimator.label)
        if settings.gpu_blocks < top:
            ax.axvline(settings.gpu_blocks * kv / GiB, color="grey", ls=":", label="GPU tier")
        ax.set_xlim(0.0, top * kv / GiB)
        ax.axvline(
            case.sizing.target_blocks * kv / GiB,
            color="red",
            ls="--",
            lw=1,
            label=f"{settings.coverage:.0%} of reuse (exact)",
        )
        ax.set_title(f"{case.name}, A={case.agents}", fontsize=9)
        ax.set_xlabel("LRU capacity (GiB)")
        ax.set_ylabel("block hit ratio")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="policyd eval-mrc",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument(
        "--traces",
        type=Path,
        default=local_trace(SWE_TRAJECTORIES),
        help=f"SWE-bench trajectories (default: ${TRACES_ENV}/{SWE_TRAJECTORIES})",
    )
    parser.add_argument("--limit", type=int, default=None, help="read only this many trajectories")
    parser.add_argument(
        "--agents",
        type=int,
        nargs="+",
        default=[16, 32, 64],
        help="pool sizes A for the SWE-bench trajectories",
    )
    parser.add_argument("--pool-tasks", type=int, default=200, help="tasks of the generated pool")
    parser.add_argument("--pool-agents", type=int, default=32, help="A for the generated pool")
    parser.add_argument("--order", choices=("gaps", "round-robin"), default="gaps")
    parser.add_argument("--profile", default="h200-llama3.1-8b")
    parser.add_argument("--gpu-gib", type=float, default=None, help="GPU tier (profile's)")
    parser.add_argument(
        "--host-gib", type=float, default=None, help="current host tier (profile's)"
    )
    parser.add_argument("--coverage", type=float, default=0.9, help="sizing target")
    parser.add_argument(
        "--rates", type=float, nargs="+", default=[0.01, 0.05], help="fixed-rate SHARDS rates"
    )
    parser.add_argument(
        "--max-tracked", type=int, nargs="+", default=[8192], help="fixed-size SHARDS s_max"
    )
    parser.add_argument(
        "--initial-rate", type=float, default=0.1, help="fixed-size SHARDS starting rate"
    )
    parser.add_argument("--seeds", type=int, default=1, help="hash salts per estimator")
    parser.add_argument("--grid", type=int, default=256, help="capacities for the MAE")
    parser.add_argument("--seed", type=int, default=0, help="generated pool's seed")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of the curves")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    profile = get_profile(args.profile)
    kv = profile.kv_bytes_per_block
    estimators: list[Estimator] = []
    for rate in args.rates:
        estimators.append(Estimator(f"rate {rate:g}", rate, None))
    if args.rates:
        rate = max(args.rates)
        estimators.append(Estimator(f"rate {rate:g}, no corr.", rate, None, False))
    for s_max in args.max_tracked:
        estimators.append(Estimator(f"s_max {s_max}", args.initial_rate, s_max))
        estimators.append(Estimator(f"s_max {s_max}, no corr.", args.initial_rate, s_max, False))
    settings = Settings(
        profile=profile,
        gpu_blocks=profile.gpu_blocks() if args.gpu_gib is None else int(args.gpu_gib * GiB // kv),
        host_blocks=(
            profile.host_blocks() if args.host_gib is None else int(args.host_gib * GiB // kv)
        ),
        coverage=args.coverage,
        grid_points=args.grid,
        seeds=args.seeds,
        estimators=tuple(estimators),
    )
    console = Console(width=None if sys.stdout.isatty() else 200)
    decode_tokens_per_s = 1.0 / profile.decode_s_per_token
    cases: list[Case] = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        if args.traces is not None and args.traces.exists():
            swe = load_swe(
                args.traces,
                limit=args.limit,
                decode_tokens_per_s=decode_tokens_per_s,
                progress=progress,
            )
            for agents in args.agents:
                calls = interleave(
                    swe, agents, decode_s_per_token=profile.decode_s_per_token, order=args.order
                )
                cases.append(evaluate("swe-bench", calls, agents, settings, progress))
        else:
            why = args.traces or missing_trace_message("--traces", SWE_TRAJECTORIES)
            console.print(f"[yellow]{why} not found: SWE-bench cases skipped")
        pool = coding_pool(seed=args.seed, tasks=args.pool_tasks)
        calls = interleave(
            pool, args.pool_agents, decode_s_per_token=profile.decode_s_per_token, order=args.order
        )
        cases.append(evaluate("generated pool", calls, args.pool_agents, settings, progress))
    console.print(accuracy_table(cases, settings))
    console.print(sizing_table(cases, settings))
    if args.plot is not None:
        plot(cases, settings, args.plot)
        console.print(f"plot: {args.plot}")
    command = shlex.join(["policyd", "eval-mrc", *(argv or sys.argv[1:])])
    console.print(f"reproduce: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
