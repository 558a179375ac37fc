"""Mooncake traces (kvcache-ai/Mooncake, FAST '25): one JSON object per line,
``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``.

Each hash id names a 512-token block of the prompt, and equal ids mean an identical prefix up to
and including that block. vLLM caches 16-token blocks, so 512-block ``x`` becomes 32 chained
16-token blocks whose content is ``mooncake:{x}:{j}``; only the full 16-token blocks within
``input_length`` get a hash (the last 512-block may be partial, and a partial 16-token tail is
never cached). The reader streams: memory is one line plus a bounded memo of recent 512-blocks.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

from policyd.core.types import BLOCK_SIZE_TOKENS
from policyd.workloads.calls import ROOT_HASH, Call, Workload, chain_hash, sequential

MOONCAKE_BLOCK_TOKENS = 512
SUB_BLOCKS = MOONCAKE_BLOCK_TOKENS // BLOCK_SIZE_TOKENS  # 16-token blocks per Mooncake block
MEMO_BLOCKS = 16_384  # 512-blocks whose 32 hashes are kept (~20 MB): prompts share prefixes


class _SubBlockHashes:
    """The 32 chained 16-token hashes of 512-block ``x`` after ``parent``, memoised (LRU):
    a 512-block referenced again after the same parent (a shared prefix) is hashed once while it
    stays among the ``capacity`` most recently used, not once per reference."""

    def __init__(self, capacity: int = MEMO_BLOCKS) -> None:
        self.capacity = capacity
        self._memo: OrderedDict[tuple[int, int], tuple[int, ...]] = OrderedDict()

    def __call__(self, parent: int, x: int) -> tuple[int, ...]:
        key = (parent, x)
        memo = self._memo
        hashes = memo.get(key)
        if hashes is not None:
            memo.move_to_end(key)
            return hashes
        out: list[int] = []
        for j in range(SUB_BLOCKS):
            parent = chain_hash(parent, f"mooncake:{x}:{j}".encode())
            out.append(parent)
        hashes = memo[key] = tuple(out)
        if len(memo) > self.capacity:
            memo.popitem(last=False)
        return hashes


def _int_field(record: dict[str, object], name: str, line_no: int) -> int:
    value = record.get(name)
    if type(value) is not int or value < 0:
        raise ValueError(f"line {line_no}: {name!r} must be a non-negative integer, got {value!r}")
    return value


def _call(record: object, index: int, line_no: int, sub_blocks: _SubBlockHashes) -> Call:
    if not isinstance(record, dict):
        raise ValueError(f"line {line_no}: expected a JSON object, got {type(record).__name__}")
    input_tokens = _int_field(record, "input_length", line_no)
    output_tokens = _int_field(record, "output_length", line_no)
    timestamp_ms = record.get("timestamp")
    if isinstance(timestamp_ms, bool) or not isinstance(timestamp_ms, int | float):
        raise ValueError(f"line {line_no}: 'timestamp' must be a number, got {timestamp_ms!r}")
    ids = record.get("hash_ids")
    if not isinstance(ids, list) or any(type(x) is not int for x in ids):
        raise ValueError(f"line {line_no}: 'hash_ids' must be a list of integers, got {ids!r:.80}")
    n_blocks = input_tokens // BLOCK_SIZE_TOKENS
    needed = -(-n_blocks // SUB_BLOCKS)
    covered = -(-input_tokens // MOONCAKE_BLOCK_TOKENS)
    if not needed <= len(ids) <= covered:
        raise ValueError(
            f"line {line_no}: input_length {input_tokens} needs {covered} hash ids "
            f"(at least {needed}), got {len(ids)}"
        )
    hashes: list[int] = []
    parent = ROOT_HASH
    for x in ids[:needed]:
        chain = sub_blocks(parent, x)
        hashes.extend(chain[: n_blocks - len(hashes)])
        parent = chain[-1]
    return Call(
        workflow_id=f"req{index}",
        agent="mooncake",
        block_hashes=tuple(hashes),
        prompt_tokens=input_tokens,
        output_tokens=output_tokens,
        workflow_type="mooncake",
        hints={"timestamp_ms": timestamp_ms},
        last=True,
    )


def read_mooncake(path: str | Path, limit: int | None = None) -> Iterator[Call]:
    """The calls of a Mooncake JSONL trace in file order (blank lines skipped), at most ``limit``.

    A malformed line raises ``ValueError`` naming its (1-based) line number.
    """
    sub_blocks = _SubBlockHashes()
    with Path(path).open(encoding="utf-8") as lines:
        records = ((n, line) for n, line in enumerate(lines, 1) if line.strip())
        for index, (line_no, line) in enumerate(islice(records, limit)):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"line {line_no}: not JSON ({exc.msg})") from None
            yield _call(record, index, line_no, sub_blocks)


def mooncake_workload(path: str | Path, limit: int | None = None) -> Workload:
    """A Mooncake trace as a workload of one-call streams (replayed in file order at
    concurrency 1; the timestamps are kept as hints, the closed loop does not use them)."""
    return sequential(read_mooncake(path, limit), name=f"mooncake:{Path(path).stem}")
