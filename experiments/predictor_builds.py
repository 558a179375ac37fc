"""The predictor compiled (Cython, ``setup.py``) against the same source interpreted: cost per
call side by side, and proof that both serve the same forecasts.

Given a compiled install of the project (``AGENTKV_COMPILE=1 pip install --no-deps --target DIR
.``; ``make bench-predictor`` builds one and runs this), every workload is replayed by
``experiments.predictor_eval`` in a subprocess that imports the project from that install, once
compiled and once with ``AGENTKV_INTERPRETED=1`` (the same files, the source run instead),
alternating the builds' order from round to round. Each run reports its cost per call in units
of a reference loop timed beside it (see ``predictor_eval``); a build's figure is the median
over its rounds, and the ratio compares the two builds' figures from the same run of this
command. The forecasts' SHA-256 must be the same for both builds and every round: the command
exits 1 naming the workloads where they differ.

Run ``python -m experiments.predictor_builds DIR`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from experiments.predictor_eval import TARGET_US, WORKLOADS
from policyd.models.predictor import compiled_modules
from policyd.traces.location import TRACES_ENV, WHO_AND_WHEN, local_trace

BUILDS = ("interpreted", "compiled")


def run_build(
    install: Path, build: str, workload: str, options: Sequence[str], out: Path
) -> dict[str, Any]:
    """One ``predictor_eval`` run of ``workload`` in ``install`` as ``build``: its record."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(install), env.get("PYTHONPATH")]))
    env["AGENTKV_INTERPRETED"] = "1" if build == "interpreted" else "0"
    command = [
        sys.executable,
        "-m",
        "experiments.predictor_eval",
        "--workloads",
        workload,
        *options,
        "--json",
        str(out),
    ]
    # (run from the scratch directory: ``-m`` puts the working directory first on the path,
    # where a checkout's own policyd would shadow the install's)
    done = subprocess.run(
        command, env=env, cwd=out.parent, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}"
        )
    (record,) = json.loads(out.read_text())
    if record["build"] != build:
        raise RuntimeError(
            f"{install} ran {record['build']} where {build} was asked for: is it a compiled "
            "install (AGENTKV_COMPILE=1 pip install --no-deps --target DIR .)?"
        )
    return dict(record)


def compare(
    records: dict[tuple[str, str], list[dict[str, Any]]], workloads: Sequence[str]
) -> tuple[Table, list[str]]:
    """The side-by-side table, and the workloads whose builds served different forecasts."""
    quietest = min(min(record["reference_us"]) for runs in records.values() for record in runs)
    out = Table(title="Predictor cost per call (predict + learn): compiled vs interpreted")
    out.add_column("workload", no_wrap=True, min_width=14)
    for name in (
        "build",
        "rounds",
        "@1",
        "@2",
        "@3",
        "µs/call mean",
        "x ref (rounds)",
        f"µs at min ref (target {TARGET_US:.0f})",
        "compiled / interpreted",
        "same forecasts",
    ):
        out.add_column(name, justify="right")
    differ: list[str] = []
    for workload in workloads:
        ratio = {b: statistics.median(r["ratio"] for r in records[workload, b]) for b in BUILDS}
        digests = {r["forecasts"] for b in BUILDS for r in records[workload, b]}
        same = len(digests) == 1
        if not same:
            differ.append(workload)
        for build in BUILDS:
            runs = records[workload, build]
            first = build == BUILDS[0]
            ratios = sorted(r["ratio"] for r in runs)
            out.add_row(
                workload if first else "",
                build,
                str(len(runs)),
                *(f"{a:.3f}" for a in runs[0]["ours"][:3]),
                f"{statistics.median(r['mean_us'] for r in runs):.0f}",
                f"{ratio[build]:.1f} ({ratios[0]:.1f}-{ratios[-1]:.1f})",
                f"{ratio[build] * quietest:.0f}",
                "" if first else f"{ratio['compiled'] / ratio['interpreted']:.2f}x",
                "" if first else ("yes" if same else "NO"),
            )
    return out, differ


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.predictor_builds",
        description="The compiled predictor's cost per call against the interpreted one's.",
    )
    parser.add_argument(
        "install",
        type=Path,
        help="a compiled install of the project (AGENTKV_COMPILE=1 pip install --no-deps "
        "--target DIR .)",
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}"
    )
    parser.add_argument("--workflows", type=int, default=1000, help="per generated workload")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each build per workload")
    parser.add_argument(
        "--whowhen",
        type=Path,
        default=local_trace(WHO_AND_WHEN),
        help=f"Who&When chats directory (default: ${TRACES_ENV}/{WHO_AND_WHEN})",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    install = args.install.resolve()
    package = install / "policyd" / "models" / "predictor"
    if not (package / "__init__.py").exists():
        parser.error(f"{install} holds no install of policyd")
    compiled, stale = compiled_modules(package)
    if not compiled:
        parser.error(
            f"{install} is not compiled (no extension modules in {package}): build it with "
            "AGENTKV_COMPILE=1 pip install --no-deps --target DIR ."
        )
    if stale:
        parser.error(f"{install}: {', '.join(stale)} changed since compiled: build it again")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}: choose from {', '.join(WORKLOADS)}")
    # the child's own default would look for the traces beside the install
    options = ["--workflows", str(args.workflows)]
    if args.whowhen is not None:
        options += ["--whowhen", str(args.whowhen.resolve())]

    console = Console(width=max(160, Console().width))
    records: dict[tuple[str, str], list[dict[str, Any]]] = {
        (w, b): [] for w in workloads for b in BUILDS
    }
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with (
        tempfile.TemporaryDirectory() as scratch,
        Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as progress,
    ):
        task = progress.add_task("runs", total=args.rounds * len(workloads) * len(BUILDS))
        for round_ in range(args.rounds):
            for workload in workloads:
                order = BUILDS if round_ % 2 == 0 else BUILDS[::-1]
                for build in order:
                    progress.update(task, description=f"round {round_ + 1} {workload} {build}")
                    out = Path(scratch) / f"{workload}-{build}-{round_}.json"
                    records[workload, build].append(
                        run_build(install, build, workload, options, out)
                    )
                    progress.advance(task)
    table, differ = compare(records, workloads)
    console.print(table)
    console.print(
        "@1..@3: top-1 accuracy per step (prequential); x ref: cost per call in units of a "
        "reference loop timed beside it, median over rounds (their range); µs at min ref: x ref "
        "times the quietest reference timing of this run; same forecasts: SHA-256 of every "
        "forecast served, equal across builds and rounds"
    )
    given = sys.argv[1:] if argv is None else argv
    command = ["python", "-m", "experiments.predictor_builds", *given]
    console.print(f"reproduce: {shlex.join(command)}", soft_wrap=True)
    if differ:
        console.print(f"[red]the builds served different forecasts on {', '.join(differ)}[/red]")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
