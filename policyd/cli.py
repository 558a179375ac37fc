"""The ``policyd`` command line.

Contract: building the parser (``policyd --help``, or any subcommand's parsing) imports only the
standard library and light vocabulary (``policyd.names``, the workload and profile names); each
handler imports what its command runs when it runs (``policyd bench-cli`` measures the start).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from policyd import cli_daemon, cli_history
from policyd.arguments import fraction_list, int_list
from policyd.names import POLICY_NAMES, TRACE_FORMATS
from policyd.sim.profiles import PROFILES
from policyd.tiers.gpu import DEFAULT_STEP_OPS
from policyd.workloads import WORKLOADS

if TYPE_CHECKING:
    from rich.console import Console

_ints = int_list()
_fractions = fraction_list()


def _names(valid: Sequence[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        unknown = [n for n in names if n not in valid]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(unknown) or text!r}; valid: {', '.join(sorted(valid))}"
            )
        return names

    return parse


def _workloads(text: str) -> list[str]:
    items = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in items if v not in WORKLOADS and not Path(v).exists()]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad) or repr(text)}: neither a workload generator "
            f"({', '.join(sorted(WORKLOADS))}) nor an existing trace path"
        )
    return items


# subcommands with a parser of their own (their module's ``main``), imported only when run
OWN_PARSERS: dict[str, tuple[str, str]] = {
    "bench-guard": ("policyd.guard_cost", "the recency guard's cost per event beside the engine's"),
    "bench-flood": (
        "policyd.flood_bench",
        "a daemon's decision latency, idle and during a flood of unfinished requests",
    ),
    "bench-soak": (
        "policyd.soak_bench",
        "a long run of valid traffic with invalid frames mixed in: RSS, nothing lost",
    ),
    "bench-cli": ("policyd.startup_bench", "how long `policyd` takes to start, beside Python"),
    "bench-history": ("policyd.history.bench", "the history writer's rows a second and its cost"),
    "eval-predictor": (
        "policyd.predictor_eval",
        "next-agent accuracy at steps 1..3, cost per call",
    ),
    "eval-mrc": ("policyd.mrc_eval", "the online miss-ratio curve against the exact one"),
    "eval-efficientagent": (
        "policyd.efficientagent_eval",
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
    "matrix": (
        "policyd.matrix",
        "agentkv against every baseline and the bound on every workload",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="policyd", description="AgentKV policy daemon and simulator"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser(
        "bench",
        help="replay workloads through the two-tier cache model under each policy",
        description="Policies x workloads x concurrency x capacities; belady is always run "
        "alongside so every policy is reported as a fraction of the oracle.",
    )
    bench.add_argument(
        "--workload",
        type=_workloads,
        default=["synthetic"],
        help=f"comma-separated generator names ({', '.join(sorted(WORKLOADS))}) or trace paths "
        "(mini-swe-agent tar/dir, Who&When json/dir, Mooncake jsonl, AgentKV calls jsonl)",
    )
    bench.add_argument(
        "--policies",
        type=_names(POLICY_NAMES, "policy"),
        default=["lru", "belady"],
        help=f"comma-separated, from: {', '.join(sorted(POLICY_NAMES))}",
    )
    bench.add_argument(
        "--concurrency", type=_ints, default=None, help="default 8,32; e.g. 8,32,128"
    )
    bench.add_argument("--gpu-blocks", type=_ints, default=[4096], help="GPU tier sizes, blocks")
    bench.add_argument("--host-blocks", type=_ints, default=[0, 16384], help="host tier sizes")
    bench.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="h200-llama3.1-8b",
        help="hardware profile of the cost model",
    )
    bench.add_argument(
        "--seed",
        type=int,
        default=0,
        help="workload generator seed (a trace: its workflows in another order; 0 as recorded)",
    )
    bench.add_argument(
        "--noise",
        type=_fractions,
        default=[],
        help="also run pbkv with these fractions of random predictions, e.g. 0,0.5,1 "
        "(the degradation curve; lru is the floor)",
    )
    bench.add_argument(
        "--max-ranked-blocks",
        type=int,
        default=None,
        help="the connector's cap on GPU blocks a snapshot re-ranks (agentkv_max_ranked_blocks; "
        "default 2048, or the whole pool if smaller)",
    )
    bench.add_argument(
        "--max-pinned-blocks",
        type=int,
        default=None,
        help="the connector's cap on GPU blocks a snapshot pins (agentkv_max_pinned_blocks; "
        "default 1%% of the GPU pool)",
    )
    bench.add_argument(
        "--step-ops",
        type=_step_ops,
        default=DEFAULT_STEP_OPS,
        help="GPU plan operations the connector performs per scheduler step "
        f"(agentkv_step_ops; default {DEFAULT_STEP_OPS}; 'all': each plan whole when adopted)",
    )
    bench.add_argument(
        "--json", metavar="PATH", help="also write the results as JSON ('-' = stdout)"
    )
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument(
        "--sweep",
        choices=["concurrency"],
        help="sweep concurrency (default 1,2,4,...,128 unless --concurrency is given) and plot it",
    )
    bench.add_argument(
        "--plot", metavar="PNG", help="where the sweep's plot goes (default docs/sweep-*.png)"
    )

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

    tput = sub.add_parser(
        "throughput",
        help="simulator throughput in block references per second (lru and belady)",
    )
    tput.add_argument("--refs", type=int, default=1_000_000, help="trace size in block references")
    tput.add_argument("--concurrency", type=int, default=16)
    tput.add_argument("--seed", type=int, default=0)
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


def _step_ops(text: str) -> int | None:
    if text == "all":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("--step-ops must be >= 1, or 'all'")
    return value


SWEEP_CONCURRENCY = [1, 2, 4, 8, 16, 32, 64, 128]


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from policyd.bench import (  # noqa: PLC0415 - see the module's contract
        BenchSpec,
        bench_json,
        plot_sweep,
        render_table,
        reproduce_command,
        run_bench,
        write_json,
    )

    concurrency = args.concurrency or (SWEEP_CONCURRENCY if args.sweep else [8, 32])
    spec = BenchSpec(
        workloads=args.workload,
        policies=args.policies,
        concurrency=concurrency,
        gpu_blocks=args.gpu_blocks,
        host_blocks=args.host_blocks,
        profile=args.profile,
        seed=args.seed,
        noise=args.noise,
        max_ranked_blocks=args.max_ranked_blocks,
        max_pinned_blocks=args.max_pinned_blocks,
        step_ops=args.step_ops,
    )
    console = _console()
    command = reproduce_command(argv)
    reports = run_bench(spec, show_progress=not args.no_progress)
    if args.json != "-":
        console.print(render_table(reports, f"policyd bench - profile {spec.profile}"))
        console.print(f"reproduce: {command}")
    if args.json:
        write_json(bench_json(reports, spec, command), args.json)
    if args.sweep:
        path = args.plot or f"docs/figures/sweep-concurrency-{'-'.join(spec.workloads)}.png"
        plot_sweep(reports, path, command)
        if args.json != "-":
            console.print(f"plot: {path}")
    return 0


def _throughput(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from policyd.bench import reproduce_command  # noqa: PLC0415 - see the module's contract
    from policyd.throughput import measure_throughput, render_throughput  # noqa: PLC0415

    console = _console()
    result = measure_throughput(refs=args.refs, concurrency=args.concurrency, seed=args.seed)
    console.print(render_throughput(result))
    console.print(f"reproduce: {reproduce_command(argv)}")
    return 0


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

    folder = fetch.traces_folder(args.dest)
    if args.trace_command == "list":
        print(fetch.listing(folder))
        return 0
    try:
        src = fetch.source(args.name)
        if args.trace_command == "get":
            print(fetch.get(src, folder))
        else:
            path = args.path or folder / src.published
            fetch.verify(path, src.manifest(), frozenset({"LICENSE"}))
            print(f"{path}: every file matches its pinned SHA-256")
    except fetch.TraceFetchError as exc:
        print(f"policyd trace {args.trace_command}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in OWN_PARSERS:  # its own parser: flags pass through unparsed here
        module = importlib.import_module(OWN_PARSERS[argv[0]][0])
        return int(module.main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    commands = {"bench": _bench, "throughput": _throughput, "trace": _trace}
    commands.update(cli_history.COMMANDS)
    commands.update(cli_daemon.COMMANDS)
    try:
        return commands[args.command](args, argv)
    except ValueError as exc:
        print(f"policyd {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
