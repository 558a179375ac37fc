"""AgentKV's own call trace: JSON Lines that the simulator replays and the daemon can record live.

The first non-blank line is the header, then one line per call, in the order calls were issued::

    {"format": "agentkv-calls", "version": 1, "block_size": 16}
    {"workflow_id": "w1", "agent": "planner", "workflow_type": "fact-checking",
     "block_hashes": [123, 456], "prompt_tokens": 40, "output_tokens": 12, "gap_s": 0.5,
     "output_block_hashes": [789], "hints": {"step": 0}, "last": false, "parallel": false,
     "ts": 12.25}

(one line each). Fields of a call, as ``policyd.workloads.calls.Call``:

* ``workflow_id`` (string), ``agent`` (string), ``block_hashes`` (unsigned 64-bit integers: the
  prompt's full ``block_size``-token blocks as chained hashes), ``prompt_tokens`` (integer, at
  least ``block_size`` per block): required.
* ``workflow_type`` (string, ""), ``output_tokens`` (integer, 0), ``gap_s`` (seconds of tool time
  after the stream's previous call, 0), ``output_block_hashes`` (the blocks the output completes,
  []), ``hints`` (object of string, number, boolean or null values, {}), ``last`` (the workflow's
  final call, false), ``parallel`` (issued together with the previous call, false): optional,
  defaults in brackets.
* ``ts`` (optional number): when the call was issued, monotonic seconds, as a live recording
  notes it; checked, not replayed (the closed loop replays ``gap_s``).

Any other field is an error. Calls are grouped into streams by ``workflow_id`` in order of first
appearance, so a file holds interleaved workflows; two streams of one ``workflow_id`` written
one after the other read back as one. The reader goes line by line and a malformed line raises
``ValueError`` naming the file and its 1-based line number. Hint floats that are not finite are
written as ``Infinity``/``NaN``, as Python's ``json`` does and reads back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Final

from policyd.core.types import BLOCK_SIZE_TOKENS, HintValue
from policyd.workloads.calls import Call, Workload

FORMAT: Final = "agentkv-calls"
VERSION: Final = 1
HEADER: Final = {"format": FORMAT, "version": VERSION, "block_size": BLOCK_SIZE_TOKENS}
_REQUIRED = ("workflow_id", "agent", "block_hashes", "prompt_tokens")
_FIELDS = frozenset(
    (
        *_REQUIRED,
        "workflow_type",
        "output_tokens",
        "gap_s",
        "output_block_hashes",
        "hints",
        "last",
        "parallel",
        "ts",
    )
)
_U64 = 2**64


def call_record(call: Call, ts: float | None = None) -> dict[str, Any]:
    """The JSON object of one call (``ts`` only when given)."""
    record: dict[str, Any] = {
        "workflow_id": call.workflow_id,
        "agent": call.agent,
        "workflow_type": call.workflow_type,
        "block_hashes": list(call.block_hashes),
        "prompt_tokens": call.prompt_tokens,
        "output_tokens": call.output_tokens,
        "gap_s": call.gap_s,
        "output_block_hashes": list(call.output_block_hashes),
        "hints": dict(call.hints),
        "last": call.last,
        "parallel": call.parallel,
    }
    if ts is not None:
        record["ts"] = ts
    return record


def format_call(call: Call, ts: float | None = None) -> str:
    """One call as a line of the format (no newline), for a live recorder to append."""
    return json.dumps(call_record(call, ts), separators=(",", ":"))


def write_calls(path: str | Path, workload: Workload | Iterable[Iterable[Call]]) -> int:
    """Write ``workload``'s calls, stream after stream, with the header; returns the count."""
    written = 0
    with Path(path).open("w", encoding="utf-8") as out:
        out.write(json.dumps(HEADER) + "\n")
        for stream in workload:
            for call in stream:
                out.write(format_call(call) + "\n")
                written += 1
    return written


def _hashes(value: object, name: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or any(type(h) is not int or not 0 <= h < _U64 for h in value):
        raise ValueError(f"{where}: {name!r} must be a list of unsigned 64-bit integers")
    return tuple(value)


def _string(record: dict[str, Any], name: str, where: str, default: str | None = None) -> str:
    value = record.get(name, default)
    if not isinstance(value, str):
        raise ValueError(f"{where}: {name!r} must be a string, got {value!r:.60}")
    return value


def _count(record: dict[str, Any], name: str, where: str, default: int | None = None) -> int:
    value = record.get(name, default)
    if type(value) is not int or value < 0:
        raise ValueError(f"{where}: {name!r} must be a non-negative integer, got {value!r:.60}")
    return value


def _seconds(record: dict[str, Any], name: str, where: str) -> float:
    value = record.get(name, 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{where}: {name!r} must be a non-negative number, got {value!r:.60}")
    return float(value)


def _flag(record: dict[str, Any], name: str, where: str) -> bool:
    value = record.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {name!r} must be true or false, got {value!r:.60}")
    return value


def _hints(value: object, where: str) -> dict[str, HintValue]:
    if not isinstance(value, dict) or not all(
        isinstance(v, str | int | float | bool) or v is None for v in value.values()
    ):
        raise ValueError(f"{where}: 'hints' must be an object of strings, numbers, booleans, null")
    return value


def parse_call(record: object, where: str) -> Call:
    """A call from its JSON object; ``ValueError`` naming ``where`` when malformed."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [name for name in _REQUIRED if name not in record]
    unknown = sorted(set(record) - _FIELDS)
    if missing or unknown:
        raise ValueError(f"{where}: missing fields {missing}, unknown fields {unknown}")
    ts = record.get("ts")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, int | float)):
        raise ValueError(f"{where}: 'ts' must be a number, got {ts!r}")
    try:
        return Call(
            workflow_id=_string(record, "workflow_id", where),
            agent=_string(record, "agent", where),
            workflow_type=_string(record, "workflow_type", where, ""),
            block_hashes=_hashes(record["block_hashes"], "block_hashes", where),
            prompt_tokens=_count(record, "prompt_tokens", where),
            output_tokens=_count(record, "output_tokens", where, 0),
            gap_s=_seconds(record, "gap_s", where),
            output_block_hashes=_hashes(
                record.get("output_block_hashes", []), "output_block_hashes", where
            ),
            hints=_hints(record.get("hints", {}), where),
            last=_flag(record, "last", where),
            parallel=_flag(record, "parallel", where),
        )
    except ValueError as exc:
        if str(exc).startswith(where):
            raise
        raise ValueError(f"{where}: {exc}") from None  # Call's own check: too few tokens


def _check_header(record: object, where: str) -> None:
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{where}: expected the header {json.dumps(HEADER)}")
    if record.get("version") != VERSION:
        raise ValueError(f"{where}: version {record.get('version')!r}; this reader reads {VERSION}")
    if record.get("block_size") != BLOCK_SIZE_TOKENS:
        raise ValueError(
            f"{where}: block_size {record.get('block_size')!r}; "
            f"the simulator's blocks are {BLOCK_SIZE_TOKENS} tokens"
        )


def read_calls(path: str | Path) -> Iterator[Call]:
    """The calls of a call trace, in file order, checked line by line."""
    header_seen = False
    with Path(path).open(encoding="utf-8") as lines:
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            if not header_seen:
                _check_header(record, where)
                header_seen = True
                continue
            yield parse_call(record, where)
    if not header_seen:
        raise ValueError(f"{path}: empty; expected the header {json.dumps(HEADER)}")


def calls_workload(path: str | Path) -> Workload:
    """A call trace as a workload: one stream per ``workflow_id``, in order of first appearance."""
    streams: dict[str, list[Call]] = {}
    for call in read_calls(path):
        streams.setdefault(call.workflow_id, []).append(call)
    return Workload(
        name=f"calls:{Path(path).stem}",
        streams=list(streams.values()),
        description=f"{len(streams)} recorded workflows ({FORMAT} v{VERSION})",
    )
