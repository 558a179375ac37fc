"""How fast the history writer appends, and how long a snapshot takes: ``policyd
bench-history [--rows N]``. Prints figures; asserts nothing (the machine is shared).

Three paths, each through a real History on a temporary file, timed from the first call to the
end of ``flush()``: event batches of block accesses (numpy fan-out, one Arrow table per write),
request lifecycles (start row, then an UPDATE for the prefix hit and finish), and ``record()``
of dict rows (converted column by column). Then one ``publish_snapshot()`` of the result.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from policyd.core.types import BlocksStored, EventBatch, PrefixHit, RequestFinished, RequestStarted
from policyd.history.store import History, HistoryConfig

BLOCKS_PER_EVENT = 256


def _block_batches(rows: int) -> list[EventBatch]:
    events = [
        BlocksStored(
            ts=float(i),
            tier="gpu",
            block_hashes=tuple(range(i * BLOCKS_PER_EVENT, (i + 1) * BLOCKS_PER_EVENT)),
        )
        for i in range(max(1, rows // BLOCKS_PER_EVENT))
    ]
    return [EventBatch(source="bench", seq=i, events=(e,)) for i, e in enumerate(events)]


def _request_batches(requests: int) -> list[EventBatch]:
    starts = [
        RequestStarted(ts=0.0, request_id=f"r{i}", workflow_id=f"w{i % 50}", agent="a")
        for i in range(requests)
    ]
    ends = [
        e
        for i in range(requests)
        for e in (
            PrefixHit(ts=1.0, request_id=f"r{i}", gpu_blocks=1, host_blocks=2, recomputed_blocks=3),
            RequestFinished(ts=2.0, request_id=f"r{i}", output_tokens=10),
        )
    ]
    chunk = 256
    batches = [
        EventBatch("bench", i, tuple(starts[i : i + chunk])) for i in range(0, requests, chunk)
    ]
    return batches + [
        EventBatch("bench", i, tuple(ends[i : i + chunk])) for i in range(0, len(ends), chunk)
    ]


def _timed(history: History, feed: list[EventBatch], *, flush_between: bool = False) -> float:
    started = time.perf_counter()
    half = len(feed) // 2
    for i, batch in enumerate(feed):
        if flush_between and i == half:
            history.flush(timeout_s=600)  # starts on disk before their updates
        history.record_batch(batch, received_ts=time.time())
    history.flush(timeout_s=600)
    return time.perf_counter() - started


def _line(label: str, n: int, unit: str, elapsed_s: float, note: str = "") -> None:
    rate = n / elapsed_s if elapsed_s > 0 else float("inf")
    print(f"{label:<15} {n:>10,} {unit:<5} {elapsed_s:7.2f} s {rate:>12,.0f} {unit}/s {note}")


def run(rows: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        config = HistoryConfig(
            db_path=Path(folder) / "bench.duckdb",
            queue_max_rows=10 * rows + 1_000_000,
            snapshot_interval_s=None,
        )
        with History(config) as history:
            _timed(history, _block_batches(BLOCKS_PER_EVENT))  # warm-up: first-use imports
            blocks = _block_batches(rows)
            n_blocks = len(blocks) * BLOCKS_PER_EVENT
            elapsed = _timed(history, blocks)
            _line("block accesses", n_blocks, "rows", elapsed)

            requests = max(1, rows // 20)
            elapsed = _timed(history, _request_batches(requests), flush_between=True)
            _line("requests", requests, "reqs", elapsed, "(start row, then an UPDATE)")

            dict_rows = [
                {
                    "ts": time.time(),
                    "kind": "evict",
                    "tier": "gpu",
                    "n_blocks": 4,
                    "reason": "bench",
                }
                for _ in range(rows // 4)
            ]
            started = time.perf_counter()
            for i in range(0, len(dict_rows), 1000):
                history.record("decisions", dict_rows[i : i + 1000])
            history.flush(timeout_s=600)
            elapsed = time.perf_counter() - started
            _line("record() dicts", len(dict_rows), "rows", elapsed)

            started = time.perf_counter()
            path = history.publish_snapshot()
            elapsed = time.perf_counter() - started
            print(f"snapshot        {path.stat().st_size / 2**20:>10.1f} MiB  {elapsed:7.2f} s")
            stats = history.stats()
            print(f"rows written {stats['rows_written']}, dropped {stats['rows_dropped']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="policyd bench-history", description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000, help="block-access rows to append")
    args = parser.parse_args(argv)
    run(args.rows)


if __name__ == "__main__":
    main()
