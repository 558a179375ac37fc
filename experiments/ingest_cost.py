"""``policyd bench-ingest --stages``: the CPU cost of each stage of the daemon's ingest path,
in-process, one stage after the other on the bench's own frames.

``policyd bench-ingest`` measures a running daemon whose threads share one interpreter lock
(and, here, two cores with other work); this says what each stage would sustain alone on one
core: decode (``BATCH_CODEC``), the queue's offer (range checks, counting, coalescing; no
shedding: the queue is drained after every frame), the Engine with the service's hooks (policy,
predictor, SHARDS, prediction log), and the history writer's fan-out and DuckDB append. CPU time
(``time.process_time``, which includes DuckDB's own threads), with the daemon's GC settings.
With the history in its own process (``history_writer``, the default) the daemon's part is the
hand-over of each frame; the fan-out and the append are the history process's, on its own
interpreter lock.
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from experiments.ingest_bench import FrameSource, StreamShape
from policyd.core.types import BATCH_CODEC
from policyd.daemon.ingest import Received
from policyd.daemon.service import Service, _tune_gc
from policyd.daemon.settings import DaemonSettings
from policyd.history import History, HistoryConfig
from policyd.history.process import HistoryProcess

STAGE_BLOCK_EVENTS = 800_000  # per measurement, whatever the packaging


def stage_costs(
    shape: StreamShape,
    *,
    frames: int | None = None,
    policy: str = "pbkv",
    block_sample_rate: float = 1.0,
) -> dict[str, Any]:
    """CPU seconds per stage for ``frames`` frames of ``shape`` (default: enough for
    ``STAGE_BLOCK_EVENTS`` block events), and the block events per second each stage (and all
    of them in a row) would sustain on one core."""
    _tune_gc()  # as the daemon runs
    if frames is None:
        frames = -(-STAGE_BLOCK_EVENTS // shape.blocks_per_frame)
    source = FrameSource(shape, 0)
    raw = [source.next()[0] for _ in range(frames)]
    blocks = frames * shape.blocks_per_frame
    cpu: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.process_time()
        out = fn()
        cpu[name] = time.process_time() - t0
        return out

    with tempfile.TemporaryDirectory(prefix="policyd-stages-") as tmp:
        settings = DaemonSettings.load(
            {"db": Path(tmp) / "service.duckdb", "events": "tcp://127.0.0.1:*",
             "snapshots": "tcp://127.0.0.1:*", "http_port": 0, "policy": policy}
        )  # fmt: skip
        service = Service(settings)
        queue = service.queue
        batches = timed("decode", lambda: [BATCH_CODEC.decode(f) for f in raw])
        writer = service.history
        if isinstance(writer, HistoryProcess):  # the receiver hands frames over as received
            writer.start()

            def hand_over() -> None:
                for frame in raw:
                    writer.record_frame(frame, 0.0)

            timed("hand-over to the history process", hand_over)
        recorded = isinstance(writer, HistoryProcess)

        def offer_all() -> list[Received]:
            out: list[Received] = []
            for batch in batches:
                queue.offer(batch, 0.0, recorded=recorded)
                out += queue.take(10**9, 0.0)
            return out

        items = timed("offer (count, coalesce)", offer_all)
        timed("Engine + service hooks", lambda: service.worker.apply_items(items))
        history = History(
            HistoryConfig(db_path=Path(tmp) / "history.duckdb", flush_interval_s=1e6,
                          retention_interval_s=1e6, snapshot_interval_s=None,
                          block_sample_rate=block_sample_rate)
        )  # fmt: skip
        history.start()
        try:
            fanout, pending = history._writer.fanout, history._writer.pending

            def fan_out() -> None:
                for item in items:
                    fanout.add(pending, item.batch, 0.0)

            timed("history fan-out", fan_out)
            timed("history DuckDB append", history._writer.write_pending)
        finally:
            history.close()
            service.history.close()
    total = sum(cpu.values())
    return {
        "blocks_per_event": shape.blocks_per_event,
        "blocks_per_request": shape.blocks_per_request,
        "policy": policy,
        "block_sample_rate": block_sample_rate,
        "frames": frames,
        "block_events": blocks,
        "requests": service.counts["requests"],
        "cpu_s": cpu,
        "block_events_per_cpu_s": {k: blocks / v if v else None for k, v in cpu.items()},
        "all_stages_block_events_per_cpu_s": blocks / total if total else None,
    }


def render_costs(r: dict[str, Any]) -> str:
    lines = [
        f"ingest stages, in-process ({r['frames']} frames, {r['block_events']:,} block events "
        f"at {r['blocks_per_event']} per event, {r['requests']} requests, policy {r['policy']}, "
        f"history block rows sampled at {r['block_sample_rate']}):"
    ]
    for name, seconds in r["cpu_s"].items():
        rate = r["block_events_per_cpu_s"][name]
        lines.append(
            f"  {name:26s} {seconds * 1000:8.0f} ms CPU -> {rate or 0:12,.0f} block events/s"
        )
    lines.append(
        f"  {'all stages on one core':26s} {sum(r['cpu_s'].values()) * 1000:8.0f} ms CPU -> "
        f"{r['all_stages_block_events_per_cpu_s'] or 0:12,.0f} block events/s"
    )
    return "\n".join(lines)


def stages_main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    shape = StreamShape(
        blocks_per_event=args.blocks_per_event,
        events_per_frame=args.batch,
        blocks_per_request=args.blocks_per_request,
    )
    rate = args.block_sample_rate if args.block_sample_rate is not None else 1.0
    costs = stage_costs(shape, policy=args.policy, block_sample_rate=rate)
    command = "policyd " + " ".join(shlex.quote(a) for a in argv)
    print(render_costs(costs))
    print(f"reproduce: {command}")
    if args.json:
        Path(args.json).write_text(json.dumps({**costs, "command": command}, indent=2) + "\n")
    return 0
