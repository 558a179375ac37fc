"""A fleet simulation: N replicas behind a router, each its own GPU + host tier and policy.

    python -m experiments.fleet_sim [--workloads code-writing,coding-pool,...] [--replicas 2,4,8]
                                    [--routers workflow,prefix,sticky,round-robin] [--policy lru]
                                    [--quick] [--json PATH] [--plot PNG]

For each workload, router and fleet size N it routes every call of the workload, in the order
the fleet's streams issue them (``arrivals``: N x ``--concurrency`` workflows at once, a call of
each in turn, a fan-out's calls in ``arrival_order``), with the router of
``policyd.fleet.routing`` that the routing service runs, so the simulation credits only what
that router decides. The routers see only what a real one could know at that time:

* ``round-robin`` and ``sticky`` (rendezvous hashing of the workflow id) read nothing;
* ``prefix`` (llm-d's) and ``workflow`` (AgentKV's) read a ``PrefixIndex`` fed, for each
  replica, by ``ShadowCache``: the router's own approximation of what the replica holds, an LRU
  over the prompt blocks of every call routed to it, of the replica's GPU + host capacity (the
  most recent ``gpu_blocks`` on the GPU tier, the rest on the host tier), and by each call's
  workflow record (``PrefixIndex.call``);
* every router gets the same loads (``LoadWindow``, the one definition of load here).

Routing splits the workload into one sub-workload per replica (``split``: stream s of replica r
holds the calls of the workload's stream s routed to r, in stream order), and each replica is
replayed independently by ``policyd.sim.replay.simulate`` under ``--policy`` at the same
capacities for every router: ``--gpu-multiple`` and ``--host-multiple`` times the workload's
largest request (``experiments.matrix.largest_request``), ``--concurrency`` streams at once.
What the replicas do not model: a workflow's call k+1 routed to another replica than call k
waits there only for its own tool gap, not for call k to finish elsewhere.

Per router and N, summed over replicas: the hit rate (GPU + host blocks hit / prompt blocks),
the recomputed prompt tokens, the makespan (the last replica's finish, simulated seconds), the
load imbalance (max over replicas of routed prompt tokens / their mean), and the calls the load
rule moved off the best prefix holder (``spill``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.table import Table

from experiments.matrix import Source, largest_request, load_source, trace_sources
from policyd.core.names import ONLINE_POLICY_NAMES
from policyd.fleet.routing import (
    DEFAULT_SLACK,
    ROUTERS,
    PrefixAware,
    PrefixIndex,
    RouteQuery,
    Router,
    WorkflowAware,
    make_router,
)
from policyd.sim.replay import SimConfig, simulate
from policyd.sim.report import Report
from policyd.traces import READERS, detect_format
from policyd.workloads import WORKLOADS
from policyd.workloads.calls import Call, Workload, arrival_order

DEFAULT_REPLICAS: Final = (2, 4, 8)
DEFAULT_GENERATORS: Final = ("code-writing", "coding-pool")
DEFAULT_PLOT: Final = "docs/figures/fleet-sim.png"
TRACE_FORMATS_WITH_WORKFLOWS: Final = ("swe", "who-and-when")


# -- what the router knows -------------------------------------------------------------------


class LoadWindow:
    """The fleet's load, the one definition every router gets: a replica's load is the prompt
    tokens of the calls routed to it among the fleet's last ``window`` routed calls (``window``
    = the streams the fleet runs at once: about the calls in flight in a closed loop)."""

    def __init__(self, replicas: Sequence[str], window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._loads = dict.fromkeys(replicas, 0.0)
        self._recent: deque[tuple[str, int]] = deque()
        self._window = window

    @property
    def loads(self) -> dict[str, float]:
        """Replica -> its load now (a copy)."""
        return dict(self._loads)

    def routed(self, replica: str, prompt_tokens: int) -> None:
        """A call of ``prompt_tokens`` went to ``replica``; the oldest leaves the window."""
        self._recent.append((replica, prompt_tokens))
        self._loads[replica] += prompt_tokens
        if len(self._recent) > self._window:
            old, tokens = self._recent.popleft()
            self._loads[old] -= tokens


class ShadowCache:
    """The router's approximation of one replica's cache: the blocks of the prompts routed to
    it, least recently routed evicted first (a prompt's tail before its head, as vLLM frees
    them), the most recent ``gpu_blocks`` on the GPU tier and the next ``host_blocks`` on the
    host tier. ``touch`` reports every change to ``index`` under ``replica``."""

    def __init__(
        self, replica: str, index: PrefixIndex, *, gpu_blocks: int, host_blocks: int
    ) -> None:
        self.replica = replica
        self.index = index
        self.gpu_blocks = gpu_blocks
        self.host_blocks = host_blocks
        self._gpu: OrderedDict[int, None] = OrderedDict()
        self._host: OrderedDict[int, None] = OrderedDict()
        index.replica(replica)

    def __len__(self) -> int:
        return len(self._gpu) + len(self._host)

    def touch(self, block_hashes: Sequence[int]) -> None:
        """The replica served a prompt of ``block_hashes``: they become the most recent."""
        gpu, host = self._gpu, self._host
        stored: list[int] = []
        promoted: list[int] = []
        for h in reversed(block_hashes):  # the head last: the most recent, evicted last
            if h in gpu:
                gpu.move_to_end(h)
                continue
            gpu[h] = None
            stored.append(h)
            if h in host:
                del host[h]
                promoted.append(h)
        demoted = [gpu.popitem(last=False)[0] for _ in range(len(gpu) - self.gpu_blocks)]
        for h in demoted:
            host[h] = None
        evicted = [host.popitem(last=False)[0] for _ in range(len(host) - self.host_blocks)]
        index, name = self.index, self.replica
        index.removed(name, promoted, "host")
        index.stored(name, stored, "gpu")
        index.removed(name, demoted, "gpu")
        index.stored(name, demoted, "host")
        index.removed(name, evicted, "host")


def replica_names(n: int) -> list[str]:
    """The fleet's replicas, ``r00`` .. (their name order is the routers' tie order)."""
    return [f"r{i:02d}" for i in range(n)]


class FleetRouter:
    """One router over a fleet of ``n`` replicas, with what it reads: the loads and, for the
    routers that read an index, a ``ShadowCache`` per replica feeding it. ``route(call)``
    returns the replica's position (0..n-1) and updates everything the router learns from it."""

    def __init__(
        self,
        router: str,
        n: int,
        *,
        gpu_blocks: int,
        host_blocks: int,
        window: int,
        slack: float = DEFAULT_SLACK,
    ) -> None:
        self.names = replica_names(n)
        self._position = {name: i for i, name in enumerate(self.names)}
        self.index = PrefixIndex(clock=lambda: 0.0)
        self.router: Router = make_router(router, self.index, slack=slack)
        self.load = LoadWindow(self.names, window)
        self._reads_index = isinstance(self.router, PrefixAware | WorkflowAware)
        self.shadows = [
            ShadowCache(name, self.index, gpu_blocks=gpu_blocks, host_blocks=host_blocks)
            for name in self.names
        ]
        self.reasons: Counter[str] = Counter()

    def route(self, call: Call) -> int:
        query = RouteQuery(call.workflow_id, call.agent, call.block_hashes, call.prompt_tokens)
        decision = self.router.choose(query, self.load.loads)
        self.reasons[decision.reason] += 1
        replica = self._position[decision.replica]
        self.load.routed(decision.replica, call.prompt_tokens)
        if self._reads_index:
            self.shadows[replica].touch(call.block_hashes)
            self.index.call(decision.replica, call.workflow_id, call.agent, call.block_hashes)
        return replica


# -- routing a workload ----------------------------------------------------------------------

Position = tuple[int, int]  # (stream, call index in the stream)


def _positions(stream: Sequence[Call]) -> list[int]:
    """The indices of ``stream``'s calls in ``arrival_order``."""
    by_id: dict[int, deque[int]] = {}
    for i, call in enumerate(stream):
        by_id.setdefault(id(call), deque()).append(i)
    return [by_id[id(call)].popleft() for call in arrival_order(stream)]


def arrivals(workload: Workload, active: int) -> Iterator[Position]:
    """The workload's calls in the order a fleet running ``active`` streams at once issues
    them: the streams in the workload's order, a call of each active one in turn (a fan-out's
    calls in ``arrival_order``), the next stream when one ends. Every call exactly once."""
    if active < 1:
        raise ValueError(f"active must be >= 1, got {active}")
    pending = ((s, _positions(stream)) for s, stream in enumerate(workload.streams) if stream)
    running: list[tuple[int, list[int], int]] = []
    exhausted = False
    while True:
        while not exhausted and len(running) < active:
            nxt = next(pending, None)
            if nxt is None:
                exhausted = True
            else:
                running.append((nxt[0], nxt[1], 0))
        if not running:
            return
        still = []
        for s, order, k in running:
            yield s, order[k]
            if k + 1 < len(order):
                still.append((s, order, k + 1))
        running = still


@dataclass(slots=True)
class Routing:
    """Where each call went: ``replica_of[(stream, index)]``, and the router's tally."""

    replicas: int
    replica_of: dict[Position, int] = field(default_factory=dict)
    reasons: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


def route_workload(
    workload: Workload,
    router: str,
    n: int,
    *,
    concurrency: int,
    gpu_blocks: int,
    host_blocks: int,
    slack: float = DEFAULT_SLACK,
) -> Routing:
    """Route every call of ``workload`` over ``n`` replicas, in ``arrivals`` order with
    ``n * concurrency`` streams at once (also the ``LoadWindow``)."""
    started = time.perf_counter()
    fleet = FleetRouter(
        router,
        n,
        gpu_blocks=gpu_blocks,
        host_blocks=host_blocks,
        window=n * concurrency,
        slack=slack,
    )
    out = Routing(n)
    for s, k in arrivals(workload, n * concurrency):
        out.replica_of[(s, k)] = fleet.route(workload.streams[s][k])
    out.reasons = fleet.reasons
    out.seconds = time.perf_counter() - started
    return out


def split(workload: Workload, routing: Routing) -> list[Workload]:
    """One sub-workload per replica: its stream s holds the calls of ``workload``'s stream s
    routed to it, in stream order (streams with none left out, the workload's order kept).
    Every call is in exactly one sub-workload."""
    per_replica: list[list[tuple[Call, ...]]] = [[] for _ in range(routing.replicas)]
    for s, stream in enumerate(workload.streams):
        parts: list[list[Call]] = [[] for _ in range(routing.replicas)]
        for k, call in enumerate(stream):
            parts[routing.replica_of[(s, k)]].append(call)
        for r, part in enumerate(parts):
            if part:
                per_replica[r].append(tuple(part))
    return [
        Workload(f"{workload.name}@{name}", streams, workload.description)
        for name, streams in zip(replica_names(routing.replicas), per_replica, strict=True)
    ]


# -- one fleet run ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """One run: a workload, a router, N replicas, and each replica's settings."""

    source: Source
    router: str
    replicas: int
    concurrency: int
    gpu_blocks: int
    host_blocks: int
    policy: str = "lru"
    profile: str = "h200-llama3.1-8b"
    streams: int = 32
    slack: float = DEFAULT_SLACK


@dataclass(slots=True)
class FleetResult:
    """What a fleet run measured, summed over its replicas."""

    spec: FleetSpec
    calls: int = 0
    prompt_blocks: int = 0
    gpu_hit_blocks: int = 0
    host_hit_blocks: int = 0
    recomputed_tokens: int = 0
    makespan_s: float = 0.0
    routed_tokens: list[int] = field(default_factory=list)
    replica_calls: list[int] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    route_s: float = 0.0
    sim_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        hits = self.gpu_hit_blocks + self.host_hit_blocks
        return hits / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def imbalance(self) -> float:
        """Max over replicas of routed prompt tokens / their mean (1: even)."""
        tokens = self.routed_tokens
        mean = sum(tokens) / len(tokens) if tokens else 0.0
        return max(tokens) / mean if mean > 0 else 1.0

    def add(self, report: Report, routed_tokens: int, calls: int) -> None:
        self.calls += calls
        self.prompt_blocks += report.prompt_blocks
        self.gpu_hit_blocks += report.gpu_hit_blocks
        self.host_hit_blocks += report.host_hit_blocks
        self.recomputed_tokens += report.recomputed_tokens
        self.makespan_s = max(self.makespan_s, report.makespan_s)
        self.routed_tokens.append(routed_tokens)
        self.replica_calls.append(calls)

    def to_json(self) -> dict[str, Any]:
        spec = dataclasses.asdict(self.spec)
        spec["workload"] = self.spec.source.label
        del spec["source"]
        return {
            **spec,
            "calls": self.calls,
            "prompt_blocks": self.prompt_blocks,
            "gpu_hit_blocks": self.gpu_hit_blocks,
            "host_hit_blocks": self.host_hit_blocks,
            "hit_rate": self.hit_rate,
            "recomputed_tokens": self.recomputed_tokens,
            "makespan_s": self.makespan_s,
            "imbalance": self.imbalance,
            "routed_tokens": self.routed_tokens,
            "replica_calls": self.replica_calls,
            "reasons": self.reasons,
            "route_s": self.route_s,
            "sim_s": self.sim_s,
        }


def run_fleet(workload: Workload, spec: FleetSpec) -> FleetResult:
    """Route ``workload`` per ``spec`` and replay each replica's share with ``simulate``."""
    routing = route_workload(
        workload,
        spec.router,
        spec.replicas,
        concurrency=spec.concurrency,
        gpu_blocks=spec.gpu_blocks,
        host_blocks=spec.host_blocks,
        slack=spec.slack,
    )
    config = SimConfig(
        concurrency=spec.concurrency,
        gpu_blocks=spec.gpu_blocks,
        host_blocks=spec.host_blocks,
        profile=spec.profile,
    )
    result = FleetResult(spec, reasons=dict(routing.reasons), route_s=routing.seconds)
    started = time.perf_counter()
    for part in split(workload, routing):
        calls = [c for stream in part.streams for c in stream]
        tokens = sum(c.prompt_tokens for c in calls)
        report = simulate(part, spec.policy, config) if calls else None
        if report is None:
            result.routed_tokens.append(0)
            result.replica_calls.append(0)
        else:
            result.add(report, tokens, len(calls))
    result.sim_s = time.perf_counter() - started
    return result


def run_spec(spec: FleetSpec) -> FleetResult:
    """``run_fleet`` on the spec's workload (loaded once per process; a worker's entry)."""
    return run_fleet(load_source(spec.source, 0, spec.streams), spec)


# -- the command -----------------------------------------------------------------------------


def _split_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _has_workflows(source: Source) -> bool:
    return source.path is not None and READERS[detect_format(source.path)].workflows


def sources_of(args: argparse.Namespace) -> list[Source]:
    """The workloads: ``--workloads`` (generator names, or names of traces under
    ``--traces``), else the default generators and every trace of workflows (SWE-bench
    trajectories, Who&When chats) under ``--traces``."""
    traces = [s for s in trace_sources(args.traces, args.max_workflows, None) if _has_workflows(s)]
    if not args.workloads:
        return [Source(g) for g in DEFAULT_GENERATORS] + traces
    by_name = {s.name: s for s in traces}
    out = []
    for name in _split_list(args.workloads):
        if name in WORKLOADS:
            out.append(Source(name))
            continue
        match = [s for key, s in by_name.items() if key == name or key.startswith(name)]
        if len(match) != 1:
            known = ", ".join([*WORKLOADS, *by_name])
            raise SystemExit(f"unknown workload {name!r}; valid: {known}")
        out.append(match[0])
    return out


def specs_of(args: argparse.Namespace, console: Console) -> list[FleetSpec]:
    """Every (workload, N, router) run, the capacities per replica from the workload."""
    specs: list[FleetSpec] = []
    for source in sources_of(args):
        work = load_source(source, 0, args.streams)
        largest = largest_request(work)
        gpu, host = largest * args.gpu_multiple, largest * args.host_multiple
        console.print(
            f"[fleet] {source.label}: {len(work.streams)} streams, {work.calls} calls, "
            f"{work.block_refs:,} block refs; per replica gpu {gpu:,} host {host:,} blocks",
            style="dim",
            highlight=False,
        )
        specs.extend(
            FleetSpec(
                source,
                router,
                n,
                args.concurrency,
                gpu,
                host,
                policy=args.policy,
                profile=args.profile,
                streams=args.streams,
                slack=args.slack,
            )
            for n in args.replicas
            for router in args.routers
        )
    return specs


def run(specs: Sequence[FleetSpec], jobs: int, console: Console) -> list[FleetResult]:
    """Every spec, in ``jobs`` processes (1: in this one), with a progress line each."""
    started = time.perf_counter()
    results: list[FleetResult] = []

    def report(i: int, r: FleetResult) -> None:
        s = r.spec
        console.print(
            f"[fleet] {i}/{len(specs)} {s.source.label} N={s.replicas} {s.router}: hit "
            f"{r.hit_rate:.3f} (route {r.route_s:.1f} s, replay {r.sim_s:.1f} s; "
            f"{time.perf_counter() - started:.0f} s in all)",
            style="dim",
            highlight=False,
        )

    if jobs <= 1:
        for i, spec in enumerate(specs, 1):
            results.append(run_spec(spec))
            report(i, results[-1])
        return results
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for i, result in enumerate(pool.map(run_spec, specs), 1):
            results.append(result)
            report(i, result)
    return results


def table(results: Sequence[FleetResult]) -> Table:
    policy = results[0].spec.policy if results else "lru"
    t = Table(title=f"fleet of N replicas ({policy} on each) per router")
    for col in ("workload", "N", "router"):
        t.add_column(col, justify="right" if col == "N" else "left")
    for col in ("hit rate", "recomputed tok", "makespan s", "imbalance", "spills"):
        t.add_column(col, justify="right")
    previous = None
    for r in results:
        s = r.spec
        if previous is not None and (previous.source, previous.replicas) != (s.source, s.replicas):
            t.add_section()
        previous = s
        t.add_row(
            s.source.label,
            str(s.replicas),
            s.router,
            f"{r.hit_rate:.3f}",
            f"{r.recomputed_tokens:,}",
            f"{r.makespan_s:,.1f}",
            f"{r.imbalance:.2f}",
            str(r.reasons.get("spill", 0)),
        )
    return t


def plot(results: Sequence[FleetResult], path: str, command: str) -> None:
    """Hit rate against N, a line per router, a panel per workload."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    labels = list(dict.fromkeys(r.spec.source.label for r in results))
    routers = list(dict.fromkeys(r.spec.router for r in results))
    fig, axes = plt.subplots(
        1, len(labels), figsize=(3.6 * len(labels), 3.4), squeeze=False, sharey=True
    )
    for ax, label in zip(axes[0], labels, strict=True):
        for router in routers:
            points = sorted(
                (r.spec.replicas, r.hit_rate)
                for r in results
                if r.spec.source.label == label and r.spec.router == router
            )
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=router)
        ns = sorted({r.spec.replicas for r in results})
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("replicas N")
        ax.set_title(label, fontsize=8)
    axes[0][0].set_ylabel("hit rate (GPU + host)")
    axes[0][-1].legend(fontsize=7)
    fig.text(0.01, 0.01, command, fontsize=5, color="grey")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(x) for x in _split_list(text))
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"positive integers, comma-separated: {text!r}")
    return values


def _routers(text: str) -> tuple[str, ...]:
    names = tuple(_split_list(text))
    unknown = [n for n in names if n not in ROUTERS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"routers among {', '.join(ROUTERS)}: {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="policyd fleet-sim", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workloads",
        help="comma-separated generator or trace names (default: "
        f"{', '.join(DEFAULT_GENERATORS)} and the traces of workflows under --traces)",
    )
    ap.add_argument(
        "--traces",
        default=os.environ.get("AGENTKV_TRACES"),
        help="a folder of real traces (default $AGENTKV_TRACES; none: generators only)",
    )
    ap.add_argument("--replicas", type=_ints, default=DEFAULT_REPLICAS, help="fleet sizes N")
    ap.add_argument("--routers", type=_routers, default=ROUTERS, help="comma-separated")
    ap.add_argument("--policy", choices=ONLINE_POLICY_NAMES, default="lru", help="per replica")
    ap.add_argument("--concurrency", type=int, default=4, help="streams at once per replica")
    ap.add_argument("--streams", type=int, default=64, help="streams per generated workload")
    ap.add_argument("--max-workflows", type=int, default=64, help="a trace's first N workflows")
    ap.add_argument(
        "--gpu-multiple",
        type=int,
        default=2,
        help="GPU blocks per replica, x the workload's largest request",
    )
    ap.add_argument("--host-multiple", type=int, default=2, help="host blocks, likewise")
    ap.add_argument(
        "--slack",
        type=float,
        default=DEFAULT_SLACK,
        help="prefix and workflow routers skip a replica above slack x the mean load",
    )
    ap.add_argument("--profile", default="h200-llama3.1-8b")
    ap.add_argument(
        "--quick", action="store_true", help="small: 8 streams or workflows, concurrency 2"
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    ap.add_argument("--json", help="also write every run's figures here")
    ap.add_argument("--plot", default=DEFAULT_PLOT, help="hit rate vs N per router, PNG")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.streams, args.max_workflows, args.concurrency = 8, 8, 2
    console = Console(stderr=True)
    out = Console() if sys.stdout.isatty() else Console(width=200)
    words = list(argv) if argv is not None else sys.argv[1:]
    command = "python -m experiments.fleet_sim " + shlex.join(words)
    results = run(specs_of(args, console), args.jobs, console)
    out.print(table(results))
    if args.json:
        payload = {"command": command, "runs": [r.to_json() for r in results]}
        Path(args.json).write_text(json.dumps(payload, indent=1))
    if args.plot:
        plot(results, args.plot, command)
        out.print(f"plot: {args.plot}", highlight=False)
    out.print(f"reproduce: {command}", highlight=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
