"""The ``policyd`` command line.

Contract: building the parser (``policyd --help``, or any subcommand's parsing) imports only the
standard library and light vocabulary (``policyd.core.names``, the workload and profile names); each
handler imports what its command runs when it runs (``policyd bench-cli`` measures the start).
The benchmarks and evaluations are named here only as module strings, imported by ``importlib``
when their command runs: the package never imports them otherwise (tests/test_layers.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policyd.cli import bench as cli_bench
from policyd.cli import daemon as cli_daemon
from policyd.cli import history as cli_history
from policyd.core.names import TRACE_FORMATS
from policyd.workloads import WORKLOADS

if TYPE_CHECKING:
    from rich.console import Console

# subcommands with a parser of their own (their module's ``main``), imported only when run
OWN_PARSERS: dict[str, tuple[str, str]] = {
    "bench-guard": (
        "experiments.guard_cost",
        "the recency guard's cost per event beside the engine's",
    ),
    "guard-fidelity": (
        "experiments.guard_fidelity",
        "does each recency-guard shadow read its arm's real tiers?",
    ),
    "bench-flood": (
        "experiments.flood_bench",
        "a daemon's decision latency, idle and during a flood of unfinished requests",
    ),
    "bench-soak": (
        "experiments.soak_bench",
        "a long run of valid traffic with invalid frames mixed in: RSS, nothing lost",
    ),
    "throughput": (
        "experiments.throughput",
        "what-if replay speed, block references/s, beside kvcache-simulator and libCacheSim",
    ),
    "bench-cli": ("experiments.startup_bench", "how long `policyd` takes to start, beside Python"),
    "bench-history": (
        "experiments.history_bench",
        "the history writer's rows a second and its cost",
    ),
    "eval-predictor": (
        "experiments.predictor_eval",
        "next-agent accuracy at steps 1..3, cost per call",
    ),
    "route": (
        "policyd.fleet.router_service",
        "the fleet's router: which replica holds a workflow's prefix (HTTP, fed over NATS)",
    ),
    "fleet-sim": (
        "experiments.fleet_sim",
        "N simulated replicas behind round-robin, sticky, prefix- and workflow-aware routers",
    ),
    "eval-fleet": (
        "experiments.fleet_learning",
        "a cold replica's next-agent accuracy with and without the fleet's learning",
    ),
    "eval-mrc": ("experiments.mrc_eval", "the online miss-ratio curve against the exact one"),
    "eval-efficientagent": (
        "experiments.efficientagent_eval",
        "EfficientAgent's host-tier experiment on SWE-bench trajectories",
    ),
    "engine-prompts": (
        "policyd.traces.engine_prompts",
        "real traces' prompts as token ids for the vLLM engine replay",
    ),
    "engine-check": (
        "policyd.sim.engine_check",
        "the simulator against a recorded vLLM engine run (connector.replay --record)",
    ),
    "screenshots": (
        "experiments.screenshots",
        "every dashboard page in headless Chromium, checked not blank",
    ),
    "host-losses": (
        "experiments.host_losses",
        "which of LRU's host-tier hits another policy loses, and why",
    ),
    "matrix": (
        "experiments.matrix",
        "agentkv against every baseline and the bound on every workload",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="policyd", description="AgentKV policy daemon and simulator"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    cli_bench.add_parser(sub)

    trace = sub.add_parser("trace", help="inspect agent traces")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    stats = trace_sub.add_parser(
        "stats", help="a trace's shape: calls, agents, prompts, reuse, gaps"
    )
    stats.add_argument("path", help="trace file or directory, or a generator name")
    stats.add_argument("--format", choices=sorted(TRACE_FORMATS), help="skip format detection")
    stats.add_argument("--seed", type=int, default=0, help="seed, for a generator name")
    traces_dest = "folder (default: $AGENTKV_TRACES, else ~/.cache/agentkv/traces)"
    get = trace_sub.add_parser(
        "get", help="download a public trace from its source, checked against pinned SHA-256s"
    )
    get.add_argument("name", help="a trace `policyd trace list` names")
    get.add_argument("--dest", type=Path, help=traces_dest)
    check = trace_sub.add_parser("verify", help="check a local copy against the pinned SHA-256s")
    check.add_argument("name", help="a trace `policyd trace list` names")
    check.add_argument("--path", type=Path, help="the copy (default: its place in the folder)")
    check.add_argument("--dest", type=Path, help=traces_dest)
    known = trace_sub.add_parser("list", help="the traces `get` knows: source, licence, state")
    known.add_argument("--dest", type=Path, help=traces_dest)

    for name, (_, what) in OWN_PARSERS.items():
        own = sub.add_parser(name, help=f"{what} (policyd {name} -h)", add_help=False)
        own.add_argument("args", nargs=argparse.REMAINDER)
    cli_history.add_parsers(sub)
    cli_daemon.add_parsers(sub)
    return parser


def _console() -> Console:
    """Tables are wide: never fold them to 80 columns when piped to a file or CI log."""
    from rich.console import Console  # noqa: PLC0415 - see the module's contract

    console = Console()
    return console if console.is_terminal else Console(width=200)


def _experiment(module: str, name: str) -> Any:
    """``name`` from the benchmark or evaluation module ``module``, imported now: the package
    names them only as strings, so that it never imports them but to run one (see the module's
    contract; tests/test_layers.py)."""
    return getattr(importlib.import_module(module), name)


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    return int(_experiment("experiments.bench", "command")(args, argv))


def _bench_ingest(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.stages:
        return int(_experiment("experiments.ingest_cost", "stages_main")(args, argv))
    return int(_experiment("experiments.ingest_bench", "bench_main")(args, argv))


def _trace(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.trace_command != "stats":
        return _trace_fetch(args)
    from policyd.traces import load_trace, render_stats, trace_stats  # noqa: PLC0415
    from policyd.workloads import make_workload  # noqa: PLC0415

    if args.path in WORKLOADS:
        workload = make_workload(args.path, seed=args.seed)
    else:
        workload = load_trace(args.path, args.format)
    _console().print(render_stats(trace_stats(workload)))
    return 0


def _trace_fetch(args: argparse.Namespace) -> int:
    from policyd.traces import fetch  # noqa: PLC0415
    from policyd.traces.location import traces_folder  # noqa: PLC0415

    folder = traces_folder(args.dest)
    if args.trace_command == "list":
        print(fetch.listing(folder))
        return 0
    try:
        src = fetch.source(args.name)
        if args.trace_command == "get":
            print(fetch.get(src, folder))
        else:
            path = args.path or folder / src.published
            fetch.verify(path, src.manifest())
            print(f"{path}: every file matches its pinned SHA-256")
    except fetch.TraceFetchError as exc:
        print(f"policyd trace {args.trace_command}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in OWN_PARSERS:  # its own parser: flags pass through unparsed here
        module = importlib.import_module(OWN_PARSERS[argv[0]][0])
        try:
            return int(module.main(argv[1:]) or 0)
        except (ValueError, OSError) as exc:  # bad input: a line, not a traceback
            print(f"policyd {argv[0]}: error: {exc}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    commands = {
        "bench": _bench,
        "bench-ingest": _bench_ingest,
        "trace": _trace,
    }
    commands.update(cli_history.COMMANDS)
    commands.update(cli_daemon.COMMANDS)
    try:
        return commands[args.command](args, argv)
    except ValueError as exc:
        print(f"policyd {args.command}: error: {exc}", file=sys.stderr)
        return 2
