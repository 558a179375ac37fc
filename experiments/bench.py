"""``policyd bench``: policies x workloads x concurrency x capacities x seeds, measured in one run.

Every point also replays ``belady`` on the same workload and capacities, so each policy's hit rate
is reported as a fraction of the oracle's, and agentkv against the best baseline. The command line
that reproduces a run is printed with its tables and stored in its JSON. ``command`` is the
command (``policyd.cli.bench`` declares its flags); ``python -m experiments.bench`` is an alias.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import multiprocessing
import multiprocessing.queues
import queue
import shlex
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from matplotlib.figure import Figure
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from scipy import stats

from policyd.cli.arguments import gpu_multiple
from policyd.cli.bench import (
    DEFAULT_CONCURRENCY,
    DEFAULT_WORKLOADS,
    SWEEP_CONCURRENCY,
    build_parser,
)
from policyd.policies import policy_variant
from policyd.sim.replay import SimConfig, simulate
from policyd.sim.report import Report
from policyd.tiers.gpu import DEFAULT_STEP_OPS
from policyd.traces import load_trace
from policyd.workloads import WORKLOADS, make_workload
from policyd.workloads.calls import Workload

WorkloadLoader = Callable[[str], Workload]


def ours_labels(reports: Iterable[Report]) -> list[str]:
    """``agentkv`` and its variants among the ``reports``' policies, in the order run (each is
    compared with the baselines); ``["agentkv"]`` when none ran."""
    labels = dict.fromkeys(r.policy for r in reports if r.policy.partition("[")[0] == "agentkv")
    return list(labels) or ["agentkv"]


@dataclass(frozen=True, slots=True)
class BenchSpec:
    workloads: Sequence[str]
    policies: Sequence[str]
    concurrency: Sequence[int]
    gpu_blocks: Sequence[int | None]
    # blocks, or a multiple of each point's GPU tier ("1x": as large; ``tier_list``)
    host_blocks: Sequence[int | str | None]
    profile: str
    seed: int = 0
    snapshot_interval_s: float = 1.0
    # pbkv rerun with this fraction of its predictions replaced by random ones (degradation)
    noise: Sequence[float] = ()
    # generated workloads: this many streams (workflows / tasks) instead of each default
    streams: int | None = None
    # the connector's GPU caps (None: its defaults, fractions of the pool)
    max_ranked_blocks: int | None = None
    max_pinned_blocks: int | None = None
    step_ops: int | None = DEFAULT_STEP_OPS  # plan operations per scheduling round (None: all)

    def __post_init__(self) -> None:
        if any(not 0.0 <= x <= 1.0 for x in self.noise):
            raise ValueError(f"noise levels must be in [0, 1], got {list(self.noise)}")
        if self.noise and "pbkv" not in self.policies:
            raise ValueError("--noise degrades pbkv's predictor: add pbkv to the policies")
        for label in self.policies:
            policy_variant(label)  # (raises on an unknown policy or parameter)
        for host in self.host_blocks:
            if isinstance(host, str):
                gpu_multiple(host)  # (raises when it is not one)
                if None in self.gpu_blocks:
                    raise ValueError(f"a host tier of {host} the GPU's needs GPU tier sizes")

    def points(self) -> list[tuple[str, int, int | None, int | None]]:
        """Every (workload, concurrency, GPU blocks, host blocks), the host tier's size in
        blocks (a multiple of the GPU tier's taken of each GPU size)."""
        return [
            (workload, concurrency, gpu, _blocks(host, gpu))
            for workload, concurrency, gpu, host in itertools.product(
                self.workloads, self.concurrency, self.gpu_blocks, self.host_blocks
            )
        ]


def _blocks(host: int | str | None, gpu: int | None) -> int | None:
    """A host tier size in blocks: ``host``, or its multiple of ``gpu`` ("2x": twice)."""
    if not isinstance(host, str):
        return host
    assert gpu is not None  # (BenchSpec refuses a multiple without GPU sizes)
    return round(gpu_multiple(host) * gpu)


# the parameter each generator takes for its number of streams
STREAM_PARAMS = {
    "fact-checking": "workflows",
    "code-writing": "workflows",
    "financial": "workflows",
    "synthetic": "workflows",
    "coding-pool": "tasks",
    "mixed": "streams",
    "group-chat": "chats",
}


def default_loader(seed: int, streams: int | None = None) -> WorkloadLoader:
    """A generator by name (seeded, ``streams`` streams when given), else a real trace by path
    (``policyd.traces``), its workflows in recorded order at seed 0 and shuffled by any other."""

    def load(name: str) -> Workload:
        if name in WORKLOADS:
            params = {STREAM_PARAMS[name]: streams} if streams and name in STREAM_PARAMS else {}
            return make_workload(name, seed=seed, **params)
        return load_trace(name, seed=seed)

    return load


@dataclass(frozen=True, slots=True)
class Replay:
    """One policy's replay at one point of a spec: the policy as the spec labels it (a variant,
    a noise level), the registered policy and its parameters, and the replay's settings."""

    point: int  # its index in ``spec.points()``
    workload: str
    label: str
    policy: str
    params: dict[str, Any] | None
    config: SimConfig


def replays(spec: BenchSpec) -> list[Replay]:
    """Every replay of ``spec``, point by point: lru first (its order of calls seeds belady's
    oracle, so it records its requests), then belady, the other policies, pbkv's noise levels."""
    lru_first = ["lru"] if "lru" in spec.policies else []
    policies = list(dict.fromkeys([*lru_first, "belady", *spec.policies]))
    out: list[Replay] = []
    for i, (name, concurrency, gpu_blocks, host_blocks) in enumerate(spec.points()):
        config = SimConfig(
            concurrency=concurrency,
            gpu_blocks=gpu_blocks,
            host_blocks=host_blocks,
            profile=spec.profile,
            snapshot_interval_s=spec.snapshot_interval_s,
            max_ranked_blocks=spec.max_ranked_blocks,
            max_pinned_blocks=spec.max_pinned_blocks,
            step_ops=spec.step_ops,
        )
        for label in policies:
            base_name, params = policy_variant(label)
            recording = dataclasses.replace(config, record_requests=label == "lru")
            out.append(Replay(i, name, label, base_name, params or None, recording))
        out += [
            Replay(i, name, f"pbkv noise={level:g}", "pbkv", {"noise": level}, config)
            for level in spec.noise
        ]
    return out


def replay(
    run: Replay, workload: Workload, lru: Report | None, progress: Callable[[int], None] | None
) -> Report:
    """``run`` on ``workload``; belady takes the order of calls from ``lru``'s records."""
    report = simulate(
        workload,
        run.policy,
        run.config,
        progress=progress,
        lru_report=lru if run.policy == "belady" else None,
        policy_params=run.params,
    )
    report.policy = run.label
    return report


# a worker process's state: the workloads it has loaded, and where it reports calls replayed
_WORKER_WORKLOADS: dict[tuple[str, int, int | None], Workload] = {}
_WORKER_CALLS: list[multiprocessing.queues.Queue[int]] = []


def _start_worker(calls: multiprocessing.queues.Queue[int]) -> None:
    _WORKER_CALLS.append(calls)


def _replay_in_worker(run: Replay, seed: int, streams: int | None, lru: Report | None) -> Report:
    """``replay`` in a worker process, the workload loaded there once (``default_loader``),
    the calls it replays put on the queue the worker was started with as it goes."""
    key = (run.workload, seed, streams)
    workload = _WORKER_WORKLOADS.get(key)
    if workload is None:
        workload = _WORKER_WORKLOADS[key] = default_loader(seed, streams)(run.workload)
    return replay(run, workload, lru, _WORKER_CALLS[0].put)


def run_bench(
    spec: BenchSpec,
    *,
    load: WorkloadLoader | None = None,
    console: Console | None = None,
    show_progress: bool = True,
    jobs: int = 1,
) -> list[Report]:
    """Run every point of ``spec``; returns one report per (point, policy), belady included.
    ``jobs`` > 1 runs the replays in that many worker processes (each loads the workloads it
    replays; belady starts once its point's lru has run): the same reports, in the same order.
    """
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}")
    if jobs > 1 and load is not None:
        raise ValueError("replays in worker processes load the workloads by name: no custom load")
    load = load or default_loader(spec.seed, spec.streams)
    loaded = {name: load(name) for name in spec.workloads}
    runs = replays(spec)
    total_calls = sum(loaded[run.workload].calls for run in runs)
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("calls"),
        TimeElapsedColumn(),
        console=console or Console(stderr=True),
        disable=not show_progress,
        transient=True,
    )
    done: dict[tuple[int, str], Report] = {}
    with progress:
        task = progress.add_task("replaying", total=total_calls)
        if jobs == 1:
            for run in runs:
                description = f"{run.workload} C={run.config.concurrency} {run.label}"
                progress.update(task, description=escape(description))
                report = replay(
                    run,
                    loaded[run.workload],
                    done.get((run.point, "lru")),
                    lambda n: progress.advance(task, n),
                )
                _keep(done, run, report)
        else:
            progress.update(task, description=f"{len(runs)} replays in {jobs} processes")
            _run_in_processes(
                spec,
                runs,
                jobs,
                lambda run, report: _keep(done, run, report),
                lambda n: progress.advance(task, n),
            )
    return _by_point(spec, runs, done)


def _keep(done: dict[tuple[int, str], Report], run: Replay, report: Report) -> None:
    """``run``'s report; once its point's belady has run, lru's records are needed no more."""
    done[run.point, run.label] = report
    lru = done.get((run.point, "lru")) if run.policy == "belady" else None
    if lru is not None:
        lru.records.clear()


def _run_in_processes(
    spec: BenchSpec,
    runs: Sequence[Replay],
    jobs: int,
    finished: Callable[[Replay, Report], None],
    replayed: Callable[[int], None],
) -> None:
    """Every run in ``jobs`` worker processes (spawned: no fork of this process's threads),
    each belady once its point's lru has finished; ``finished`` as each one does, and
    ``replayed`` with the calls the workers report as they go."""
    lru_points = {run.point for run in runs if run.label == "lru"}
    waiting = {run.point: run for run in runs if run.policy == "belady" and run.point in lru_points}
    context = multiprocessing.get_context("spawn")
    calls: multiprocessing.queues.Queue[int] = context.Queue()

    def drain() -> None:
        while True:
            try:
                replayed(calls.get_nowait())
            except queue.Empty:
                return

    with ProcessPoolExecutor(
        max_workers=jobs, mp_context=context, initializer=_start_worker, initargs=(calls,)
    ) as pool:
        pending: dict[Future[Report], Replay] = {}

        def submit(run: Replay, lru: Report | None) -> None:
            pending[pool.submit(_replay_in_worker, run, spec.seed, spec.streams, lru)] = run

        for run in runs:
            if waiting.get(run.point) is not run:  # (belady waits for its point's lru)
                submit(run, None)
        try:
            while pending:
                complete, _ = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                drain()
                for future in complete:
                    run = pending.pop(future)
                    report = future.result()
                    if run.label == "lru" and run.point in waiting:
                        submit(waiting.pop(run.point), report)
                    finished(run, report)
        except BaseException:  # a replay failed (or ^C): the others are not waited for
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    drain()  # (what the last replays put before they returned)


def _by_point(
    spec: BenchSpec, runs: Sequence[Replay], done: Mapping[tuple[int, str], Report]
) -> list[Report]:
    """The reports in the spec's order, each as a fraction of its point's belady (none holds
    records: only lru's did, dropped by ``_keep`` once its point's belady ran)."""
    points: dict[int, dict[str, Report]] = {}  # (``runs`` are in the points' order)
    for run in runs:
        points.setdefault(run.point, {})[run.label] = done[run.point, run.label]
    reports: list[Report] = []
    labels = [*spec.policies, *(f"pbkv noise={x:g}" for x in spec.noise)]
    for point in points.values():
        best = point["belady"].hit_rate
        for report in point.values():
            report.belady_fraction = report.hit_rate / best if best > 0 else None
        reports.extend(point[p] for p in labels if p in point)
        if "belady" not in spec.policies:
            reports.append(point["belady"])
    return reports


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:,.1f}"


def render_table(reports: Sequence[Report], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in (
        "workload",
        "C",
        "GPU blk",
        "host blk",
        "policy",
        "hit GPU",
        "hit host",
        "hit all",
        "of belady",
        "recomputed Mtok",
        "host W GB",
        "host R GB",
        "makespan s",
        "p50 s",
        "p99 s",
    ):
        # (a variant's label, agentkv[param=value], is folded onto more lines, never cut)
        table.add_column(
            column,
            justify="left" if column in ("workload", "policy") else "right",
            overflow="fold" if column == "policy" else "ellipsis",
            min_width=min(32, max((len(r.policy) for r in reports), default=6))
            if column == "policy"
            else None,
        )
    for r in reports:
        table.add_row(
            r.workload,
            str(r.concurrency),
            f"{r.gpu_blocks:,}",
            f"{r.host_blocks:,}",
            r.policy,
            f"{r.gpu_hit_rate:.3f}",
            f"{r.host_hit_rate:.3f}",
            f"{r.hit_rate:.3f}",
            "-" if r.belady_fraction is None else f"{r.belady_fraction:.3f}",
            f"{r.recomputed_tokens / 1e6:,.2f}",
            _gb(r.host_write_bytes),
            _gb(r.host_read_bytes),
            f"{r.makespan_s:,.1f}",
            f"{r.latency_p50_s:.2f}",
            f"{r.latency_p99_s:.2f}",
        )
    return table


def reproduce_command(argv: Sequence[str]) -> str:
    return "policyd " + shlex.join(argv)


def bench_json(reports: Sequence[Report], spec: BenchSpec, command: str) -> dict[str, Any]:
    return {
        "command": command,
        "measured_at_unix_s": time.time(),
        "spec": {
            "workloads": list(spec.workloads),
            "policies": list(spec.policies),
            "concurrency": list(spec.concurrency),
            "gpu_blocks": list(spec.gpu_blocks),
            "host_blocks": list(spec.host_blocks),
            "profile": spec.profile,
            "seed": spec.seed,
            "streams": spec.streams,
        },
        "results": [r.to_json() for r in reports],
    }


def write_json(payload: dict[str, Any], path: str) -> None:
    text = json.dumps(payload, indent=2)
    if path == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")


def plot_sweep(reports: Sequence[Report], path: str, command: str) -> None:
    """Hit rate and modelled makespan against concurrency, one column per workload."""
    workloads = list(dict.fromkeys(r.workload for r in reports))
    fig = Figure(figsize=(4.2 * len(workloads), 6.4))
    axes = fig.subplots(2, len(workloads), squeeze=False, sharex="col")
    for col, name in enumerate(workloads):
        rows = [r for r in reports if r.workload == name]
        hit_ax, time_ax = axes[0][col], axes[1][col]
        for policy in dict.fromkeys(r.policy for r in rows):
            series = sorted((r.concurrency, r) for r in rows if r.policy == policy)
            xs = [c for c, _ in series]
            style = "--" if policy == "belady" else "-"
            hit_ax.plot(xs, [r.hit_rate for _, r in series], style, marker="o", label=policy)
            oracle = {r.concurrency: r.makespan_s for r in rows if r.policy == "belady"}
            time_ax.plot(
                xs,
                [r.makespan_s / oracle[c] if oracle.get(c) else float("nan") for c, r in series],
                style,
                marker="o",
                label=policy,
            )
        first = rows[0]
        hit_ax.set_title(f"{name}\nGPU {first.gpu_blocks:,} blk, host {first.host_blocks:,} blk")
        hit_ax.set_ylim(0, 1)
        hit_ax.set_ylabel("prompt blocks hit (GPU + host)")
        time_ax.set_ylabel("modelled makespan / belady's")
        time_ax.set_xlabel("concurrent workflows")
        for ax in (hit_ax, time_ax):
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        hit_ax.legend(fontsize=8)
    fig.suptitle(f"concurrency sweep - {command}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- agentkv against the best baseline ----------------------------------------------------------

BASELINES = ("lru", "kvflow", "pbkv", "efficientagent")


Point = tuple[str, int, int, int]  # workload, concurrency, GPU blocks, host blocks


def _versus(reports: Sequence[Report], ours: str) -> Iterator[tuple[Point, Report, list[Report]]]:
    """Per point, in order: the report of ``ours`` and the baselines' (points missing either
    are left out)."""
    by_point: dict[Point, list[Report]] = {}
    for r in reports:
        by_point.setdefault((r.workload, r.concurrency, r.gpu_blocks, r.host_blocks), []).append(r)
    for point, here in by_point.items():
        mine = next((r for r in here if r.policy == ours), None)
        base = [r for r in here if r.policy in BASELINES]
        if mine is not None and base:
            yield point, mine, base


def versus_best(reports: Sequence[Report], ours: str = "agentkv") -> Table:
    """Per point: ``ours`` against the best baseline by hit rate and by modelled makespan."""
    table = Table(title=f"{ours} vs the best baseline per point", title_justify="left")
    for column in (
        "workload",
        "C",
        "host blk",
        f"{ours} hit",
        "best baseline hit",
        "hit ratio",
        f"{ours} of belady",
        f"{ours} makespan s",
        "best baseline makespan s",
        "speedup",
    ):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for point, mine, base in _versus(reports, ours):
        best_hit = max(base, key=lambda r: r.hit_rate)
        best_time = min(base, key=lambda r: r.makespan_s)
        table.add_row(
            point[0],
            str(point[1]),
            f"{point[3]:,}",
            f"{mine.hit_rate:.3f}",
            f"{best_hit.hit_rate:.3f} ({best_hit.policy})",
            f"{mine.hit_rate / best_hit.hit_rate:.3f}x" if best_hit.hit_rate else "-",
            "-" if mine.belady_fraction is None else f"{mine.belady_fraction:.3f}",
            f"{mine.makespan_s:,.1f}",
            f"{best_time.makespan_s:,.1f} ({best_time.policy})",
            f"{best_time.makespan_s / mine.makespan_s:.3f}x" if mine.makespan_s else "-",
        )
    return table


@dataclass(frozen=True, slots=True)
class SeedSummary:
    """One point over the seeds: the mean hit rate of ``ours``, the baseline with the best mean
    (the one fixed policy a user would have picked for this workload) and that mean, per seed
    ``ours`` / that seed's best baseline (the hindsight choice), and per seed ``ours`` / the
    best-mean baseline on that seed (``paired``: the same workload, so the seed's own
    difficulty cancels)."""

    mean: float
    best_policy: str
    best_mean: float
    ratios: dict[int, float]
    paired: dict[int, float]

    @property
    def ratio(self) -> float:
        return self.mean / self.best_mean if self.best_mean else float("nan")

    def interval(self, confidence: float = 0.95) -> tuple[float, float, float] | None:
        """The mean of the ``paired`` ratios and its Student-t confidence interval over the
        seeds, (mean, low, high); None with fewer than two seeds. An interval wholly below 1
        says ``ours`` is behind that baseline beyond the seed-to-seed spread, wholly above 1
        ahead of it; one containing 1 cannot tell them apart on these seeds."""
        values = list(self.paired.values())
        if len(values) < 2:
            return None
        mean = statistics.fmean(values)
        half = stats.t.ppf(0.5 + confidence / 2, len(values) - 1) * statistics.stdev(values)
        half /= math.sqrt(len(values))
        return mean, mean - half, mean + half


def seed_summaries(
    by_seed: Mapping[int, Sequence[Report]], ours: str = "agentkv"
) -> dict[Point, SeedSummary]:
    """``SeedSummary`` per point of the runs ``by_seed`` (seed -> its reports)."""
    hits: dict[Point, dict[str, dict[int, float]]] = {}
    ratios: dict[Point, dict[int, float]] = {}
    for seed, reports in by_seed.items():
        for point, mine, base in _versus(reports, ours):
            for r in (mine, *base):
                hits.setdefault(point, {}).setdefault(r.policy, {})[seed] = r.hit_rate
            best = max(r.hit_rate for r in base)
            ratios.setdefault(point, {})[seed] = mine.hit_rate / best if best else 1.0
    out: dict[Point, SeedSummary] = {}
    for point, by_policy in hits.items():
        means = {policy: statistics.fmean(by.values()) for policy, by in by_policy.items()}
        mean = means.pop(ours)
        best_policy = max(means, key=means.__getitem__)
        own, theirs = by_policy[ours], by_policy[best_policy]
        paired = {
            seed: own[seed] / theirs[seed] if theirs[seed] else 1.0
            for seed in own
            if seed in theirs
        }
        out[point] = SeedSummary(mean, best_policy, means[best_policy], ratios[point], paired)
    return out


def across_seeds(by_seed: Mapping[int, Sequence[Report]], ours: str = "agentkv") -> Table:
    """Per point, over the seeds (each a different generated workload): ``ours``' mean hit rate
    against the baseline with the best mean, and per seed against that seed's best baseline:
    on how many seeds ``ours`` is at least as good, and its lowest ratio; and the paired ratio
    to the best-mean baseline seed by seed, with its 95% interval (``SeedSummary``)."""
    table = Table(
        title=f"{ours} vs the best baseline over {len(by_seed)} seeds "
        f"({', '.join(map(str, by_seed))})",
        title_justify="left",
    )
    for column in (
        "workload",
        "C",
        "host blk",
        f"{ours} hit mean",
        "best baseline hit mean",
        "ratio of means",
        "paired ratio (95% CI)",
        "seeds >= best",
        "lowest seed ratio",
    ):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for point, summary in seed_summaries(by_seed, ours).items():
        ratios = summary.ratios.values()
        table.add_row(
            point[0],
            str(point[1]),
            f"{point[3]:,}",
            f"{summary.mean:.4f}",
            f"{summary.best_mean:.4f} ({summary.best_policy})",
            f"{summary.ratio:.4f}x",
            _interval_cell(summary.interval()),
            f"{sum(ratio >= 1.0 for ratio in ratios)} of {len(ratios)}",
            f"{min(ratios):.4f}x",
        )
    return table


def _interval_cell(interval: tuple[float, float, float] | None) -> str:
    if interval is None:
        return "-"
    mean, low, high = interval
    return f"{mean:.4f}x ({low:.3f}-{high:.3f})"


def plot_versus(by_seed: Mapping[int, Sequence[Report]], path: str, command: str) -> None:
    """agentkv / the best baseline's hit rate per point: one marker per seed (against that
    seed's best), a bar for the seed means (against the baseline with the best mean) and, with
    two seeds or more, the paired ratio to that baseline with its 95% interval."""
    summaries = seed_summaries(by_seed)
    points = list(summaries)
    fig = Figure(figsize=(max(6.0, 1.1 * len(points) + 2) + 2.0, 4.2))
    ax = fig.subplots()
    xs = range(len(points))
    ax.bar(
        xs,
        [summaries[p].ratio - 1.0 for p in points],
        bottom=1.0,
        color="#cfd8e3",
        label="seed means (vs the best mean)",
    )
    many = len(by_seed) > 10  # (one colour each would fill the legend: one marker for all)
    for i, seed in enumerate(by_seed):
        ys = [summaries[p].ratios.get(seed, float("nan")) for p in points]
        if many:
            label = f"each of the {len(by_seed)} seeds" if i == 0 else None
            ax.plot(xs, ys, "o", color="#4c72b0", alpha=0.5, label=label)
        else:
            ax.plot(xs, ys, "o", label=f"seed {seed}")
    intervals = [(x, summaries[p].interval()) for x, p in zip(xs, points, strict=True)]
    shown = [(x, i) for x, i in intervals if i is not None]
    if shown:
        ax.errorbar(
            [x for x, _ in shown],
            [i[0] for _, i in shown],
            yerr=[[i[0] - i[1] for _, i in shown], [i[2] - i[0] for _, i in shown]],
            fmt="_",
            color="black",
            capsize=4,
            label="paired ratio to the best mean, 95% CI",
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(
        list(xs), [f"{_wrapped(w)}\nC={c}, host {h:,}" for w, c, _, h in points], fontsize=7
    )
    ax.set_ylabel("agentkv hit rate / best baseline's")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the data
    width = fig.get_figwidth()
    fig.suptitle("\n".join(textwrap.wrap(command, int(width * 16))), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _wrapped(workload: str, width: int = 20) -> str:
    """A workload's name on lines of about ``width`` (a trace's is its format and path).

    >>> print(_wrapped("who-and-when:who_and_when_captainagent"))
    who-and-when:
    who_and_when_captainagent
    """
    return "\n".join(textwrap.wrap(workload.replace(":", ": "), width, break_long_words=False))


def reports_from_jsons(paths: Sequence[str]) -> tuple[dict[int, list[Report]], str]:
    """The reports by seed of runs stored with ``--json``, and the command that made them:
    one run, or several of the same points with other seeds (e.g. seeds 0-9 and 10-19 run
    apart) read as one, their commands joined by ``&&``.

    Raises ``ValueError`` naming the file for one that is not such a run, for runs whose
    settings differ (anything but the seeds: their points, policies or generated workloads'
    size would be mixed) and for a seed in two of them."""
    merged: dict[int, list[Report]] = {}
    commands: list[str] = []
    first: tuple[str, dict[str, Any]] | None = None
    where: dict[int, str] = {}
    for path in paths:
        by_seed, command, spec = _stored_run(path)
        if first is None:
            first = path, spec
        elif spec != first[1]:
            keys = sorted(
                k for k in spec.keys() | first[1].keys() if spec.get(k) != first[1].get(k)
            )
            raise ValueError(
                f"{path}: not runs of the same points as {first[0]} (differs in "
                f"{', '.join(keys)}); only runs that differ in their seeds are read as one"
            )
        for seed, reports in by_seed.items():
            if seed in merged:
                raise ValueError(f"{path}: seed {seed} is in {where[seed]} too")
            merged[seed], where[seed] = reports, path
        commands.append(command)
    return merged, " && ".join(commands)


def _stored_run(path: str) -> tuple[dict[int, list[Report]], str, dict[str, Any]]:
    """A stored run's reports by seed (rows without a seed, a single-seed run's, take the
    spec's), its command and its settings but the seed."""
    try:
        with open(path, encoding="utf-8") as f:
            payload = json.load(f)
        rows = payload["results"]
        spec = dict(payload.get("spec", {}))
        spec_seed = spec.pop("seed", 0)
        default_seed = spec_seed if isinstance(spec_seed, int) else 0
        fields = {f.name for f in dataclasses.fields(Report)}
        by_seed: dict[int, list[Report]] = {}
        for row in rows:
            report = Report(**{k: v for k, v in row.items() if k in fields})
            by_seed.setdefault(int(row.get("seed", default_seed)), []).append(report)
        command = str(payload.get("command", ""))
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from e
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a bench JSON (--json output): {e!r:.120}") from e
    if not by_seed:
        raise ValueError(f"{path}: no results in it")
    return by_seed, command, spec


def _compared(reports: Iterable[Report]) -> list[str]:
    """``agentkv`` and its variants that ran beside a baseline at some point (each gets a table
    against the best baseline; a run of neither gets none)."""
    reports = list(reports)
    return [ours for ours in ours_labels(reports) if next(_versus(reports, ours), None)]


def _print_seed(console: Console, reports: Sequence[Report], title: str) -> None:
    """One seed's runs: the policies' table and agentkv (and each variant of it run) against
    the best baseline."""
    console.print(render_table(reports, title))
    for ours in _compared(reports):
        console.print(versus_best(reports, ours))


def _title(profile: str, seed: int, seeds: int) -> str:
    title = f"policyd bench - profile {profile}"
    return title if seeds == 1 else f"{title}, seed {seed}"


def command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``policyd bench`` (its flags: ``policyd.cli.bench``): every point once per seed, the
    policies' tables, agentkv against the best baseline (per seed and, with several, over the
    seeds), the command that reproduces it, and ``--json``, ``--plot``, ``--sweep``'s plot; or,
    with ``--from-json``, a stored run's tables without running it again. ``argv`` is the
    command line from ``bench`` on. Raises ``ValueError`` for flags that do not go together."""
    # (wide tables stay whole in a terminal and a log; no markup: a variant's label has brackets)
    probe = Console()
    console = Console(width=max(160 if probe.is_terminal else 200, probe.width), markup=False)
    quiet = args.json == "-"  # (stdout is the JSON's)
    by_seed: dict[int, list[Report]] = {}
    specs: list[BenchSpec] = []
    if args.from_json:
        given = [
            flag
            for flag, value in (
                ("--json", args.json),
                ("--workload", args.workload),
                ("--concurrency", args.concurrency),
                ("--sweep", args.sweep),
            )
            if value
        ]
        if given:
            raise ValueError(f"--from-json re-reads a stored run: it takes no {', '.join(given)}")
        paths = [path for path in args.from_json.split(",") if path]
        if not paths:
            raise ValueError("--from-json takes a path, or several separated by commas")
        by_seed, reproduce = reports_from_jsons(paths)
        profile = next(iter(by_seed.values()))[0].profile
        for seed, reports in by_seed.items():
            _print_seed(console, reports, _title(profile, seed, len(by_seed)))
    else:
        seeds: list[int] = list(dict.fromkeys(args.seed))
        if args.sweep and len(seeds) > 1:
            raise ValueError("--sweep plots one seed's run: give --seed a single value")
        concurrency = args.concurrency or list(
            SWEEP_CONCURRENCY if args.sweep else DEFAULT_CONCURRENCY
        )
        specs = [
            BenchSpec(
                workloads=args.workload or list(DEFAULT_WORKLOADS),
                policies=args.policies,
                concurrency=concurrency,
                gpu_blocks=args.gpu_blocks,
                host_blocks=args.host_blocks,
                profile=args.profile,
                seed=seed,
                noise=args.noise,
                streams=args.streams,
                max_ranked_blocks=args.max_ranked_blocks,
                max_pinned_blocks=args.max_pinned_blocks,
                step_ops=args.step_ops,
            )
            for seed in seeds
        ]
        reproduce = reproduce_command(argv)
        for spec in specs:  # (each seed's tables as soon as it has run)
            reports = by_seed[spec.seed] = run_bench(
                spec, show_progress=not args.no_progress, jobs=args.jobs
            )
            if not quiet:
                _print_seed(console, reports, _title(spec.profile, spec.seed, len(specs)))
    if not quiet:
        if len(by_seed) > 1:
            for ours in _compared(r for reports in by_seed.values() for r in reports):
                console.print(across_seeds(by_seed, ours))
        console.print(f"reproduce: {reproduce}")
    plot = args.plot
    if args.sweep:
        plot = plot or f"docs/figures/sweep-concurrency-{'-'.join(specs[0].workloads)}.png"
        plot_sweep(by_seed[specs[0].seed], plot, reproduce)
    elif plot:
        plot_versus(by_seed, plot, reproduce)
    if plot and not quiet:
        console.print(f"plot: {plot}")
    if args.json:
        payload = bench_json([], specs[0], reproduce)
        payload["spec"]["seed"] = specs[0].seed if len(specs) == 1 else [s.seed for s in specs]
        payload["results"] = [
            {**r.to_json(), "seed": seed} for seed, reports in by_seed.items() for r in reports
        ]
        write_json(payload, args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments.bench``: an alias of ``policyd bench``, its flags and command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return command(args, ["bench", *argv])
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    raise SystemExit(main())
