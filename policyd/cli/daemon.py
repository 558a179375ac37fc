"""``policyd serve`` / ``policyd demo`` / ``policyd bench-ingest``: the daemon's subcommands.

``add_parsers(subparsers)`` declares them and ``COMMANDS`` maps each to its handler
``(args, argv) -> exit code`` (``bench-ingest``'s, a benchmark's, is policyd/cli/__init__.py's);
policyd/cli/__init__.py registers both. Contract: importing this module and building its parsers
import neither the daemon nor the policies (nor pydantic); a handler imports what it runs.
``policyd serve``'s flags are generated from the daemon's settings (``serve_parser()``), so they
are built only when ``serve`` runs: ``add_parsers`` declares a stub that passes them through.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from policyd.core.names import ONLINE_POLICY_NAMES
from policyd.workloads import WORKLOADS

Handler = Callable[[argparse.Namespace, Sequence[str]], int]


SERVE_HELP = "run the policy daemon (event ingest, snapshots, history, HTTP API)"
SERVE_DESCRIPTION = (
    "Every flag is one of the daemon's settings, also read from POLICYD_<NAME> in the "
    "environment and from the settings file --config names (TOML or JSON): defaults < file < "
    "environment < flags. docs/DAEMON.md has the full settings table."
)


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # `policyd serve`'s flags come from the daemon's settings declaration, which imports
    # pydantic: the stub takes them unparsed ('+' prefixes: a leading '--db' is no option of
    # its own) and _serve parses them with serve_parser() (see the module's contract).
    serve = sub.add_parser(
        "serve", help=SERVE_HELP, description=SERVE_DESCRIPTION, add_help=False, prefix_chars="+"
    )
    serve.add_argument("flags", nargs=argparse.REMAINDER, help="policyd serve --help")

    demo = sub.add_parser(
        "demo",
        help="start the daemon and replay a generated agent workload through it",
        description="Replays workflows through a simulated vLLM connector that speaks the "
        "real wire protocol, so the history, predictions and sizing fill up.",
    )
    demo.add_argument(
        "--workload",
        default="fact-checking,code-writing",
        help=f"comma-separated generators ({', '.join(sorted(WORKLOADS))})",
    )
    demo.add_argument("--db", type=Path, help="history file (default ./policyd-history.duckdb)")
    demo.add_argument(
        "--seconds", type=float, default=40.0, help="replay wall-clock budget (default 40)"
    )
    demo.add_argument("--speedup", type=float, default=None, help="simulated s per wall s")
    demo.add_argument("--workflows", type=int, default=40, help="workflows in total (default 40)")
    demo.add_argument("--concurrency", type=int, default=8)
    demo.add_argument("--policy", choices=ONLINE_POLICY_NAMES, default="agentkv")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--http-port", type=int, default=0, help="HTTP port (default: a free one)")
    demo.add_argument(
        "--keep-serving", action="store_true", help="keep the daemon up after the replay"
    )

    bench = sub.add_parser(
        "bench-ingest",
        help="measure a `policyd serve` process: ingest rate, snapshot and decision latency, RSS",
    )
    bench.add_argument("--seconds", type=float, default=60.0, help="sustained phase (default 60)")
    bench.add_argument(
        "--batch", type=int, default=256, help="block-level events per frame (default 256)"
    )
    bench.add_argument(
        "--blocks-per-event",
        type=int,
        default=16,
        help="block hashes per BlocksStored/BlocksRemoved event (default 16: a request's new "
        "blocks or an eviction batch in one event; 1 is the worst case)",
    )
    bench.add_argument(
        "--blocks-per-request",
        type=int,
        default=512,
        help="one request (start, hit, finish) per this many block events (default 512)",
    )
    bench.add_argument("--senders", type=int, default=1, help="sender processes (default 1)")
    bench.add_argument(
        "--rate", type=float, default=None, help="target block events/s, all senders (default: max)"
    )
    bench.add_argument(
        "--rates",
        default=None,
        help="comma-separated offered rates (block events/s): a fresh daemon per rate, then "
        "the highest it sustained (nothing shed, backlog gone within 5 s)",
    )
    bench.add_argument("--db", type=Path, help="history file (default: a temporary directory)")
    bench.add_argument("--policy", choices=ONLINE_POLICY_NAMES, default="pbkv")
    bench.add_argument(
        "--block-sample-rate",
        type=float,
        default=None,
        help="set the daemon's history block_sample_rate before the run (default: its own, 1.0)",
    )
    bench.add_argument(
        "--sample-s", type=float, default=5.0, help="seconds between progress/RSS samples"
    )
    bench.add_argument(
        "--stages",
        action="store_true",
        help="instead: the CPU cost of each ingest stage, in-process (no daemon, no sockets)",
    )
    bench.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    bench.add_argument("--plot", metavar="PATH", help="also plot RSS over the run (PNG)")


def serve_parser() -> argparse.ArgumentParser:
    """``policyd serve``'s parser: a flag ``--<name-with-dashes>`` per daemon setting
    (``DaemonSettings.setting_fields()``: its type, choices and help, its environment variable
    named), ``None`` when not given; a switch is ``store_const`` True. And ``--log-level``."""
    from policyd.daemon.settings import DaemonSettings  # noqa: PLC0415 - see the module's contract

    parser = argparse.ArgumentParser(prog="policyd serve", description=SERVE_DESCRIPTION)
    for setting in DaemonSettings.setting_fields():
        flag = "--" + setting.name.replace("_", "-")
        text = f"{setting.help} [{DaemonSettings.env_name(setting.name)}]".replace("%", "%%")
        if setting.type is bool:
            parser.add_argument(
                flag, dest=setting.name, action="store_const", const=True, help=text
            )
        else:
            parser.add_argument(
                flag, dest=setting.name, type=setting.type, choices=setting.choices, help=text
            )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return parser


def _serve(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from policyd.daemon.settings import DaemonSettings  # noqa: PLC0415 - see the module's contract

    flags = vars(serve_parser().parse_args(args.flags))  # (--help ends here, the daemon unread)
    log_level = str(flags.pop("log_level"))
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if flags.get("token"):
        logging.getLogger("policyd").warning(
            "--token puts the secret on the command line, where ps shows it to every local "
            "user: prefer --token-file or POLICYD_API_TOKEN"
        )
    try:
        settings = DaemonSettings.load(flags)
    except ValueError as exc:
        print(f"policyd serve: {exc}", file=sys.stderr)
        return 2
    from policyd.daemon.server import serve  # noqa: PLC0415

    return serve(settings)


def _demo(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from policyd.daemon.demo import demo_main  # noqa: PLC0415 - see the module's contract

    return demo_main(args, argv)


COMMANDS: dict[str, Handler] = {
    "serve": _serve,
    "demo": _demo,
}
