"""``policyd bench-soak``: a ``policyd serve`` process fed valid traffic with invalid frames mixed
in, for a long time (issue #32): is RSS flat, is every valid event applied, is every invalid one
counted?

One sender, one source for valid traffic: ``--frames-per-s`` frames a second, of which
``--invalid-share`` (default 20%) are invalid, in rotation:

* ``garbage``: random bytes (malformed: counted in ``malformed_frames``);
* ``truncated``: the first half of a valid frame (malformed);
* ``bad-events``: a decodable frame (a source of its own) whose events are all out of range -
  NaN times, negative and huge counts, prefix hits past their prompt (``events_invalid``);
* ``duplicate``: the last valid frame sent again (``seq_duplicates``, not applied).

Valid traffic is whole workflows (three requests: start, prefix hit, blocks stored, finish; then
the workflow's end and its blocks removed), so what the daemon holds stays bounded and RSS
should stay flat. At the end it waits for the backlog, then compares the daemon's counters with
what was sent. ``--seconds`` sets the duration (600 by default; docs/DAEMON.md, *Fault and fuzz
suite, soak*, reports such runs).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import httpx

from experiments.flood_bench import AGENTS, Sender
from experiments.ingest_bench import _daemon_rss_bytes, start_serve
from policyd.core.memory import rss_bytes
from policyd.core.types import (
    BATCH_CODEC,
    BlocksRemoved,
    BlocksStored,
    Event,
    EventBatch,
    PrefixHit,
    RequestFinished,
    RequestStarted,
    WorkflowFinished,
)
from policyd.core.validate import MAX_BLOCKS_PER_EVENT

INVALID_KINDS = ("garbage", "truncated", "bad-events", "duplicate")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="policyd bench-soak",
        description="a long run of valid traffic with invalid frames mixed in: RSS, valid events "
        "applied, invalid ones counted",
    )
    p.add_argument("--seconds", type=float, default=600.0, help="duration (default 600)")
    p.add_argument("--frames-per-s", type=float, default=50.0, help="frames a second (50)")
    p.add_argument("--invalid-share", type=float, default=0.2, help="share invalid (0.2)")
    p.add_argument("--workflows-per-frame", type=int, default=4, help="valid workflows a frame")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return p


def workflow(w: int) -> list[Event]:
    out: list[Event] = []
    base = w * 64
    stored: list[int] = []
    for i, agent in enumerate(AGENTS):
        rid = f"soak{w}.{i}"
        blocks = tuple(range(base, base + 8 + 4 * i))
        out += [
            RequestStarted(ts=float(w), request_id=rid, workflow_id=f"soak{w}", agent=agent,
                           workflow_type="soak", block_hashes=blocks,
                           prompt_tokens=16 * len(blocks)),
            PrefixHit(ts=float(w), request_id=rid, gpu_blocks=min(8, len(blocks)), host_blocks=0,
                      recomputed_blocks=len(blocks) - min(8, len(blocks))),
            BlocksStored(ts=float(w), tier="gpu", block_hashes=blocks[len(stored):],
                         request_id=rid),
            RequestFinished(ts=float(w), request_id=rid, output_tokens=16),
        ]  # fmt: skip
        stored = list(blocks)
    out.append(WorkflowFinished(ts=float(w), workflow_id=f"soak{w}"))
    out.append(BlocksRemoved(ts=float(w), tier="gpu", block_hashes=tuple(stored)))
    return out


TOO_MANY: Final = BlocksStored(ts=0.0, tier="gpu", block_hashes=(1,) * (MAX_BLOCKS_PER_EVENT + 1))


def bad_events(n: int) -> list[Event]:
    """``n`` events, each out of range in one way (policyd/core/validate.py)."""
    kinds: list[Event] = [
        PrefixHit(ts=0.0, request_id="x", gpu_blocks=-1, host_blocks=0, recomputed_blocks=0),
        PrefixHit(ts=0.0, request_id="x", gpu_blocks=2**63, host_blocks=0, recomputed_blocks=0),
        WorkflowFinished(ts=float("nan"), workflow_id="x"),
        RequestFinished(ts=float("inf"), request_id="x"),
        BlocksStored(ts=0.0, tier="gpu", block_hashes=(-5,)),
        RequestStarted(ts=0.0, request_id="x", workflow_id="w", agent="a", prompt_tokens=-1),
    ]
    return [kinds[i % len(kinds)] for i in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    rnd = random.Random(args.seed)
    sent: Counter[str] = Counter()
    rss: list[tuple[float, float, float]] = []  # (t, daemon + history MB, daemon MB)
    with tempfile.TemporaryDirectory(prefix="policyd-soak-") as tmp:
        proc, ready = start_serve(Path(tmp) / "h.duckdb", "pbkv")
        url = ready["http_url"]
        sender = Sender(ready["events"])
        bad_seq = 0
        last_valid: bytes | None = None
        w = 0
        invalid_every = 1.0 / args.invalid_share if args.invalid_share > 0 else float("inf")
        start = time.monotonic()
        next_sample = start
        period = 1.0 / args.frames_per_s
        frame_no = 0
        try:
            with httpx.Client(base_url=url, timeout=60) as http:
                while (now := time.monotonic()) - start < args.seconds:
                    if now >= next_sample:
                        total = (_daemon_rss_bytes(proc.pid) or 0) / 2**20
                        own = (rss_bytes(proc.pid) or 0) / 2**20
                        rss.append((now - start, total, own))
                        next_sample += args.sample_s
                    frame_no += 1
                    if args.invalid_share > 0 and frame_no % round(invalid_every) == 0:
                        kind = INVALID_KINDS[(frame_no // round(invalid_every)) % 4]
                        if kind == "garbage":
                            sender.sock.send(rnd.randbytes(rnd.randint(1, 2000)))
                        elif kind == "truncated" and last_valid is not None:
                            sender.sock.send(last_valid[: len(last_valid) // 2])
                        elif kind == "duplicate" and last_valid is not None:
                            sender.sock.send(last_valid)
                        else:
                            kind = "bad-events"
                            bad_seq += 1
                            events = bad_events(rnd.randint(1, 32))
                            if bad_seq % 50 == 0:  # now and then an event of 2^20 + 1 hashes
                                events.append(TOO_MANY)
                            batch = EventBatch("soak-bad", bad_seq, tuple(events))
                            sender.sock.send(BATCH_CODEC.encode(batch))
                            sent["invalid_events"] += len(events)
                        sent[kind] += 1
                    else:
                        events = []
                        for _ in range(args.workflows_per_frame):
                            events += workflow(w)
                            w += 1
                        sender.seq += 1
                        frame = BATCH_CODEC.encode(EventBatch("soak", sender.seq, tuple(events)))
                        sender.sock.send(frame)
                        last_valid = frame
                        sent["valid_frames"] += 1
                        sent["valid_events"] += len(events)
                    delay = start + frame_no * period - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                elapsed = time.monotonic() - start
                deadline = time.monotonic() + 120
                stats = http.get("/api/stats").json()
                while time.monotonic() < deadline:  # the backlog applied
                    stats = http.get("/api/stats").json()
                    if stats["ingest_queue_frames"] == 0 and stats["frames"] >= frame_no:
                        break
                    time.sleep(0.5)
                time.sleep(1.0)
                stats = http.get("/api/stats").json()
                total = (_daemon_rss_bytes(proc.pid) or 0) / 2**20
        finally:
            sender.close()
            proc.terminate()
            proc.wait(timeout=120)
    malformed_sent = sent["garbage"] + sent["truncated"]
    return {
        "seconds": elapsed,
        "frames_per_s": args.frames_per_s,
        "invalid_share": args.invalid_share,
        "sent": dict(sent),
        "daemon": {
            "frames": stats["frames"],
            "events_applied": stats["events"],
            "malformed_frames": stats["malformed_frames"],
            "events_invalid": stats["events_invalid"],
            "events_invalid_by_reason": stats["events_invalid_by_reason"],
            "seq_duplicates": stats["seq_duplicates"],
            "events_shed": stats["events_shed"],
            "frames_dropped": stats["frames_dropped"],
        },
        "valid_events_lost": sent["valid_events"] - stats["events"],
        "malformed_uncounted": malformed_sent - stats["malformed_frames"],
        "invalid_events_uncounted": sent["invalid_events"] - stats["events_invalid"],
        "duplicates_uncounted": sent["duplicate"] - stats["seq_duplicates"],
        "rss_samples": rss,
        "rss_end_mb": total,
    }


def _slope(samples: Sequence[tuple[float, float, float]], idx: int) -> float:
    """MB per minute over the second half of the run (least squares)."""
    half = [s for s in samples if s[0] >= samples[-1][0] / 2] if samples else []
    if len(half) < 2:
        return 0.0
    xs, ys = [s[0] for s in half], [s[idx] for s in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs) or 1.0
    return 60.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def render(r: dict[str, Any]) -> str:
    s, d = r["sent"], r["daemon"]
    rss = r["rss_samples"]
    first = rss[min(1, len(rss) - 1)] if rss else (0.0, 0.0, 0.0)
    peak = max((x[1] for x in rss), default=0.0)
    invalid_frames = sum(s.get(k, 0) for k in INVALID_KINDS)
    total_frames = invalid_frames + s.get("valid_frames", 0)
    lines = [
        f"soak: {r['seconds']:.0f} s at {r['frames_per_s']:g} frames/s, "
        f"{invalid_frames:,} of {total_frames:,} frames invalid "
        f"({invalid_frames / max(1, total_frames):.0%}: "
        + ", ".join(f"{k} {s.get(k, 0):,}" for k in INVALID_KINDS)
        + ")",
        f"valid events: sent {s.get('valid_events', 0):,}, applied {d['events_applied']:,} "
        f"(lost {r['valid_events_lost']:,}; shed {d['events_shed']}, frames dropped "
        f"{d['frames_dropped']})",
        f"invalid: malformed frames sent {s.get('garbage', 0) + s.get('truncated', 0):,}, "
        f"counted {d['malformed_frames']:,}; out-of-range events sent "
        f"{s.get('invalid_events', 0):,}, counted {d['events_invalid']:,} "
        f"{d['events_invalid_by_reason']}; duplicates sent {s.get('duplicate', 0):,}, "
        f"counted {d['seq_duplicates']:,}",
        f"RSS (daemon + history process): {first[1]:.0f} MB at {first[0]:.0f} s, peak "
        f"{peak:.0f} MB, end {r['rss_end_mb']:.0f} MB; slope over the second half "
        f"{_slope(rss, 1):+.2f} MB/min (daemon alone {_slope(rss, 2):+.2f} MB/min)",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args)
    print(render(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    lost = result["valid_events_lost"] or result["malformed_uncounted"]
    return 1 if lost or result["invalid_events_uncounted"] else 0
