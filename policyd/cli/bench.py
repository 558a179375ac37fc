"""``policyd bench``'s flags: the one declaration of them, for ``policyd bench`` and its alias
(``python -m`` on the benchmark's module).

Contract: importing this module costs nothing beyond the standard library and light vocabulary
(the policy, workload and profile names): ``policyd --help`` builds this parser. The command
itself is the benchmark module's ``command``, which policyd/cli/__init__.py imports when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from policyd.cli.arguments import fraction_list, int_at_least, int_list, tier_list
from policyd.core.names import POLICY_NAMES, split_policies
from policyd.core.profiles import PROFILES
from policyd.tiers.gpu import DEFAULT_STEP_OPS
from policyd.workloads import WORKLOADS

HELP = "replay workloads through the two-tier cache model under each policy"
DESCRIPTION = (
    "Policies x workloads x concurrency x capacities x seeds; belady is always run alongside so "
    "every policy is reported as a fraction of the oracle, and agentkv (and each variant of it "
    "run) against the best baseline. With --from-json, the tables (and --plot) of a stored run, "
    "without running it again."
)
DEFAULT_WORKLOADS = ("synthetic",)
DEFAULT_CONCURRENCY = (8, 32)
SWEEP_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128)


def _policies(text: str) -> list[str]:
    """Policy names, or variants ``name[param=value,...]`` (their parameters are checked when
    the run is specified: that needs the policies' classes, which this module does not import).
    """
    labels = split_policies(text)
    unknown = [label for label in labels if label.partition("[")[0] not in POLICY_NAMES]
    if unknown or not labels:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(unknown) or text!r}; "
            f"valid: {', '.join(sorted(POLICY_NAMES))}"
        )
    return labels


def _workloads(text: str) -> list[str]:
    items = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in items if v not in WORKLOADS and not Path(v).exists()]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad) or repr(text)}: neither a workload generator "
            f"({', '.join(sorted(WORKLOADS))}) nor an existing trace path"
        )
    return items


def _step_ops(text: str) -> int | None:
    if text == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'all', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("--step-ops must be >= 1, or 'all'")
    return value


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """Every flag of ``policyd bench``."""
    bench.add_argument(
        "--workload",
        type=_workloads,
        default=None,
        help=f"comma-separated generator names ({', '.join(sorted(WORKLOADS))}) or trace paths "
        "(mini-swe-agent tar/dir, Who&When json/dir, Mooncake jsonl, AgentKV calls jsonl); "
        f"default {','.join(DEFAULT_WORKLOADS)}",
    )
    bench.add_argument(
        "--policies",
        type=_policies,
        default=["lru", "belady"],
        help=f"comma-separated, from: {', '.join(sorted(POLICY_NAMES))} (default lru,belady); a "
        "variant with other parameters runs beside the default as name[param=value,...], e.g. "
        "agentkv[guard=false]",
    )
    bench.add_argument(
        "--concurrency",
        type=int_list(1),
        default=None,
        help=f"comma-separated; default {','.join(map(str, DEFAULT_CONCURRENCY))} "
        f"({','.join(map(str, SWEEP_CONCURRENCY))} with --sweep)",
    )
    bench.add_argument(
        "--gpu-blocks",
        type=int_list(),
        default=[4096],
        help="comma-separated GPU tier sizes, blocks (default 4096)",
    )
    bench.add_argument(
        "--host-blocks",
        type=tier_list(),
        default=[0, 16384],
        help="comma-separated host tier sizes: blocks, or a multiple of each GPU tier size "
        "('1x': as large as the GPU's; default 0,16384)",
    )
    bench.add_argument(
        "--streams",
        type=int_at_least(1),
        default=None,
        help="streams (workflows, tasks, chats) per generated workload instead of each "
        "generator's default, e.g. smaller ones for a quick comparison",
    )
    bench.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="h200-llama3.1-8b",
        help="hardware profile of the cost model (default h200-llama3.1-8b)",
    )
    bench.add_argument(
        "--seed",
        type=int_list(),
        default=[0],
        help="comma-separated: every point is run once per seed (its own generated workloads; "
        "a trace's workflows in another order of arrival, 0 the recorded one); with several, a "
        "table over the seeds follows",
    )
    bench.add_argument(
        "--noise",
        type=fraction_list(),
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
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="replays in N worker processes at once (default 1: in this process); the same "
        "reports, sooner on a machine with the cores",
    )
    bench.add_argument(
        "--sweep",
        choices=["concurrency"],
        help="sweep concurrency (default 1,2,4,...,128 unless --concurrency is given) and plot it",
    )
    bench.add_argument(
        "--plot",
        metavar="PNG",
        help="with --sweep, where the sweep's plot goes (default docs/figures/sweep-*.png); "
        "else agentkv / the best baseline per point and seed, as a chart",
    )
    bench.add_argument(
        "--from-json",
        metavar="PATH[,PATH...]",
        help="print the tables of a run stored with --json instead of running (and --plot it); "
        "several runs of the same points with other seeds are read as one",
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``bench`` on the ``policyd`` subcommand parser."""
    add_arguments(sub.add_parser("bench", help=HELP, description=DESCRIPTION))


def build_parser() -> argparse.ArgumentParser:
    """``policyd bench``'s parser on its own (for its ``python -m`` alias)."""
    parser = argparse.ArgumentParser(prog="policyd bench", description=DESCRIPTION)
    add_arguments(parser)
    return parser
