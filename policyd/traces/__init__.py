"""Readers of real traces into workloads. ``READERS`` maps a format name to its reader;
``load_trace(path)`` detects the format from the path and, for JSON Lines, the first line.

* ``swe``: mini-swe-agent ``*.traj.json``, one stream per task; a ``*.traj.json`` file, a tar
  archive, or a directory holding ``*.traj.json`` files.
* ``who-and-when``: Who&When group chats, one stream per file; a ``.json`` file or a directory
  of them.
* ``mooncake``: Mooncake request trace, one call per stream; ``.jsonl`` whose first line has
  ``hash_ids``.
* ``calls``: AgentKV's own call trace (``jsonl.py``); ``.jsonl`` whose first line is the
  ``agentkv-calls`` header.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from policyd.traces.jsonl import FORMAT as CALLS_FORMAT
from policyd.traces.jsonl import calls_workload, read_calls, write_calls
from policyd.traces.mooncake import mooncake_workload
from policyd.traces.stats import TraceStats, render_stats, trace_stats
from policyd.traces.swe import TRAJ_SUFFIX, read_swe, swe_workload
from policyd.traces.whowhen import read_whowhen, whowhen_workload
from policyd.workloads.calls import Workload


@dataclass(frozen=True, slots=True)
class TraceReader:
    name: str
    load: Callable[[Path], Workload]
    help: str
    # its streams are independent workflows, in an order that says nothing about when they ran
    # (a seed may reorder them); False: one request per stream in recorded time order
    workflows: bool = True


READERS: dict[str, TraceReader] = {
    r.name: r
    for r in (
        TraceReader("swe", swe_workload, "mini-swe-agent *.traj.json (file, directory, tar)"),
        TraceReader("who-and-when", whowhen_workload, "Who&When group chats (.json, directory)"),
        TraceReader("mooncake", mooncake_workload, "Mooncake JSONL with hash_ids", False),
        TraceReader("calls", calls_workload, f"AgentKV call trace JSONL ({CALLS_FORMAT})"),
    )
}


def _first_record(path: Path) -> object:
    with path.open(encoding="utf-8") as lines:
        for line_no, line in enumerate(lines, 1):
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{line_no}: not JSON ({exc.msg})") from None
    raise ValueError(f"{path}: empty")


def detect_format(path: str | Path) -> str:
    """The name of the reader for ``path``; ``ValueError`` when none fits."""
    path = Path(path)
    if path.is_dir():
        if next(path.rglob(f"*{TRAJ_SUFFIX}"), None) is not None:
            return "swe"
        if next(path.glob("*.json"), None) is not None:
            return "who-and-when"
        raise ValueError(f"{path}: a directory with neither *{TRAJ_SUFFIX} nor *.json files")
    if not path.is_file():
        raise ValueError(f"{path}: no such file or directory")
    if path.name.endswith(TRAJ_SUFFIX):
        return "swe"
    if path.suffix == ".json":
        return "who-and-when"
    if path.suffix == ".jsonl":
        first = _first_record(path)
        if isinstance(first, dict) and first.get("format") == CALLS_FORMAT:
            return "calls"
        if isinstance(first, dict) and "hash_ids" in first:
            return "mooncake"
        raise ValueError(
            f"{path}:1: neither an {CALLS_FORMAT} header nor a Mooncake record (hash_ids)"
        )
    if tarfile.is_tarfile(path):
        return "swe"
    raise ValueError(
        f"{path}: unknown trace format; readers: "
        + "; ".join(f"{r.name} ({r.help})" for r in READERS.values())
    )


def load_trace(path: str | Path, format: str | None = None, *, seed: int = 0) -> Workload:
    """The workload of the trace at ``path``, read by ``format`` or the detected reader; with
    a ``seed`` other than 0 its workflows arrive in another order (``Workload.reordered``). A
    trace of single requests in time order (Mooncake) has no such order: a seed is refused."""
    name = format or detect_format(path)
    try:
        reader = READERS[name]
    except KeyError:
        raise ValueError(
            f"unknown trace format {name!r}; valid formats: {', '.join(sorted(READERS))}"
        ) from None
    if seed and not reader.workflows:
        raise ValueError(
            f"{path}: a {name} trace is single requests in recorded time order; it cannot be "
            f"replayed in another order (seed {seed}): replay it with seed 0"
        )
    return reader.load(Path(path)).reordered(seed)


__all__ = [
    "READERS",
    "TraceReader",
    "TraceStats",
    "detect_format",
    "load_trace",
    "read_calls",
    "read_swe",
    "read_whowhen",
    "render_stats",
    "trace_stats",
    "write_calls",
]
