"""``policyd serve`` / ``policyd demo`` / ``policyd bench-ingest``: the daemon's subcommands.

``add_parsers(subparsers)`` declares them and ``COMMANDS`` maps each to its handler
``(args, argv) -> exit code`` (``bench-ingest``'s, a benchmark's, is policyd/cli/__init__.py's);
policyd/cli/__init__.py registers both. Contract: importing this module and building its parsers
import neither the daemon nor the policies; a handler imports what it runs.
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


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser(
        "serve",
        help="run the policy daemon (event ingest, snapshots, history, HTTP API)",
        description="Every flag also reads POLICYD_<NAME> from the environment "
        "(flags win); see docs/DAEMON.md for the full settings table.",
    )
    serve.add_argument("--db", type=Path, help="history DuckDB file [POLICYD_DB]")
    serve.add_argument("--events", help="PULL endpoint for event batches [POLICYD_EVENTS]")
    serve.add_argument("--snapshots", help="PUB endpoint for snapshots [POLICYD_SNAPSHOTS]")
    serve.add_argument("--http-host", help="HTTP bind address [POLICYD_HTTP_HOST]")
    serve.add_argument("--http-port", type=int, help="HTTP port [POLICYD_HTTP_PORT]")
    serve.add_argument("--policy", choices=ONLINE_POLICY_NAMES, help="policy [POLICYD_POLICY]")
    serve.add_argument(
        "--token-file",
        type=Path,
        help="file holding the bearer token for admin routes and SQL [POLICYD_TOKEN_FILE]; "
        "or set POLICYD_API_TOKEN",
    )
    serve.add_argument(
        "--token",
        help="the bearer token itself: visible to every local user in ps; prefer --token-file "
        "or POLICYD_API_TOKEN",
    )
    serve.add_argument(
        "--allow-open-http",
        action="store_const",
        const=True,
        help="serve the HTTP API on a non-loopback address without a token (refused "
        "otherwise) [POLICYD_ALLOW_OPEN_HTTP]",
    )
    serve.add_argument("--profile", help="hardware profile (KV bytes/block) [POLICYD_PROFILE]")
    serve.add_argument("--gpu-blocks", type=int, help="GPU KV blocks [POLICYD_GPU_BLOCKS]")
    serve.add_argument("--vllm-events", help="vLLM KV-events endpoint [POLICYD_VLLM_EVENTS]")
    serve.add_argument("--vllm-replay", help="vLLM KV-events replay endpoint")
    serve.add_argument("--vllm-topic", help="vLLM KV-events topic [POLICYD_VLLM_TOPIC]")
    serve.add_argument("--checkpoint-dir", type=Path, help="model checkpoint directory")
    serve.add_argument("--checkpoint-interval-s", type=float, help="seconds between checkpoints")
    serve.add_argument("--log-level", default="INFO", help="logging level (default INFO)")

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
    demo.add_argument("--policy", choices=ONLINE_POLICY_NAMES, default="pbkv")
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


def _serve(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from policyd.daemon.server import serve  # noqa: PLC0415 - see the module's contract
    from policyd.daemon.settings import DaemonSettings  # noqa: PLC0415

    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    overrides = {
        "db": args.db,
        "events": args.events,
        "snapshots": args.snapshots,
        "http_host": args.http_host,
        "http_port": args.http_port,
        "policy": args.policy,
        "token": args.token,
        "token_file": args.token_file,
        "allow_open_http": args.allow_open_http,
        "profile": args.profile,
        "gpu_blocks": args.gpu_blocks,
        "vllm_events": args.vllm_events,
        "vllm_replay": args.vllm_replay,
        "vllm_topic": args.vllm_topic,
        "checkpoint_dir": args.checkpoint_dir,
        "checkpoint_interval_s": args.checkpoint_interval_s,
    }
    if args.token:
        logging.getLogger("policyd").warning(
            "--token puts the secret on the command line, where ps shows it to every local "
            "user: prefer --token-file or POLICYD_API_TOKEN"
        )
    try:
        settings = DaemonSettings.load(overrides)
    except ValueError as exc:
        print(f"policyd serve: {exc}", file=sys.stderr)
        return 2
    return serve(settings)


def _demo(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from policyd.daemon.demo import demo_main  # noqa: PLC0415 - see the module's contract

    return demo_main(args, argv)


COMMANDS: dict[str, Handler] = {
    "serve": _serve,
    "demo": _demo,
}
