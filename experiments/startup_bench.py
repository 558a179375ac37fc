"""``policyd bench-cli``: how long the command line takes to start, beside Python itself.

    policyd bench-cli [--runs 7]

Runs each command ``--runs`` times in a fresh process (after one unmeasured run, so that every
file is in the page cache) and prints the median wall time, side by side with ``python -c
pass`` measured in the same loop: ``policyd --help``, ``policyd sql --help`` and a one-row
``policyd sql`` over an empty history file. The target: at most ``TARGET_S`` for ``--help``
and ``sql`` on an idle machine; on a loaded one, read the ratio to Python's own start.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

TARGET_S: Final = 0.5
CLI: Final = (sys.executable, "-m", "policyd.cli")


def _commands(db: Path) -> dict[str, list[str]]:
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "policyd --help": [*CLI, "--help"],
        "policyd sql --help": [*CLI, "sql", "--help"],
        'policyd sql "SELECT 1"': [*CLI, "sql", "SELECT 1", "--db", str(db)],
    }


def _wall_s(command: Sequence[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def measure(runs: int) -> dict[str, list[float]]:
    """Wall seconds of each command, ``runs`` times, interleaved (one round: every command)."""
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-cli-") as tmp:
        db = Path(tmp) / "history.duckdb"
        subprocess.run([*CLI, "migrate", "--db", str(db)], check=True, stdout=subprocess.DEVNULL)
        commands = _commands(db)
        for command in commands.values():
            _wall_s(command)  # warm the page cache
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(runs):
            for name, command in commands.items():
                times[name].append(_wall_s(command))
    return times


def render(times: dict[str, list[float]]) -> str:
    base = statistics.median(times["python -c pass"])
    lines = ["| command | median wall s | vs python -c pass | target |", "|---|---|---|---|"]
    for name, values in times.items():
        median = statistics.median(values)
        target = (
            "-"
            if name == "python -c pass"
            else (f"<= {TARGET_S} s: {'met' if median <= TARGET_S else 'NOT met'}")
        )
        lines.append(f"| {name} | {median:.3f} | {median / base:.1f}x | {target} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="policyd bench-cli",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--runs", type=int, default=7, help="timed runs of each command (default 7)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    times = measure(args.runs)
    print(render(times))
    print(f"(median of {args.runs} runs each, interleaved)")
    print(f"reproduce: policyd bench-cli --runs {args.runs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
