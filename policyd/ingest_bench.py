"""``policyd bench-ingest``: measure a ``policyd serve`` process from the outside, over loopback.

* sustained ingest: sender processes PUSH EventBatch frames (block-level events with a few
  request events mixed in) as fast as the daemon takes them for ``--seconds``; the daemon's own
  counters give events received (decoded), applied (to the Engine) and shed per second;
* history rows written per second (the DuckDB writer's counters);
* snapshot latency: publish (the snapshot's ``ts``, the daemon's CLOCK_MONOTONIC, shared by
  processes on one Linux host) -> receive by a SUB socket here;
* HTTP decision latency of ``POST /api/decide/evict``: with a raw keep-alive ``http.client``
  connection and with ``httpx`` (which adds ~1 ms per call, DESIGN.md §4);
* the daemon's RSS before and after (``/proc/<pid>/status``).

Figures are printed with their ratio to the targets and the command that reproduces them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import httpx
import zmq

from policyd.daemon.server import READY_PREFIX
from policyd.types import (
    BATCH_CODEC,
    SNAPSHOT_CODEC,
    BlocksRemoved,
    BlocksStored,
    Event,
    EventBatch,
    PrefixHit,
    RequestFinished,
    RequestStarted,
    WorkflowFinished,
)
from policyd.wire import SNAPSHOT_TOPIC

TARGET_EVENTS_PER_S: Final = 500_000
RESIDENT_WINDOW: Final = 4096  # a sender evicts what it stored about this many events ago
# (a multiple of 2 x RUN_EVENTS, so that every removal names a block a store run stored)


CONCURRENT_WORKFLOWS: Final = 64
CALLS_PER_WORKFLOW: Final = 8
EVENTS_PER_REQUEST: Final = 512  # one request's start, hit and finish per this many events
RUN_EVENTS: Final = 16  # block events come in runs: 16 stores, then 16 removals, ...


def _frames_for(sender: int, batch: int, seq: int, cursor: int) -> tuple[bytes, int]:
    """One frame of about ``batch`` events: per ``EVENTS_PER_REQUEST`` events one request
    (start, prefix hit, finish) of one of ``CONCURRENT_WORKFLOWS`` round-robin workflows, each
    finishing after ``CALLS_PER_WORKFLOW`` calls; the rest are GPU block stores and removals of
    a sliding window of fresh hashes, one hash per event, in runs of ``RUN_EVENTS`` (as a
    connector reports a request's blocks together); the Engine's residency stays bounded."""
    base = (sender + 1) << 48
    events: list[Event] = []
    for _ in range(batch):
        cursor += 1
        if cursor % EVENTS_PER_REQUEST == 0:
            r = cursor // EVENTS_PER_REQUEST
            slot, rnd = r % CONCURRENT_WORKFLOWS, r // CONCURRENT_WORKFLOWS
            wid = f"s{sender}-w{slot}-g{rnd // CALLS_PER_WORKFLOW}"
            rid = f"s{sender}-r{r}"
            hashes = tuple(base + cursor - k for k in range(4))
            events.append(
                RequestStarted(ts=0.0, request_id=rid, workflow_id=wid,
                               agent=f"agent{rnd % CALLS_PER_WORKFLOW % 3}",
                               workflow_type="bench", block_hashes=hashes, prompt_tokens=64)
            )  # fmt: skip
            events.append(PrefixHit(ts=0.0, request_id=rid, gpu_blocks=2, host_blocks=1,
                                    recomputed_blocks=1))  # fmt: skip
            events.append(RequestFinished(ts=0.0, request_id=rid, output_tokens=8))
            if rnd % CALLS_PER_WORKFLOW == CALLS_PER_WORKFLOW - 1:
                events.append(WorkflowFinished(ts=0.0, workflow_id=wid))
        elif (cursor // RUN_EVENTS) % 2:
            events.append(BlocksStored(ts=0.0, tier="gpu", block_hashes=(base + cursor,)))
        else:  # evict the block stored in the matching slot of a run RESIDENT_WINDOW ago
            gone = base + cursor - RUN_EVENTS - RESIDENT_WINDOW
            events.append(BlocksRemoved(ts=0.0, tier="gpu", block_hashes=(gone,)))
    frame = BATCH_CODEC.encode(EventBatch(source=f"bench-{sender}", seq=seq, events=tuple(events)))
    return frame, cursor


def _sender(endpoint: str, sender: int, spec: tuple[int, float, float | None], out: Any) -> None:
    """One sender process: PUSH frames without blocking; report (frames, events, again,
    started, ended) - the times on CLOCK_MONOTONIC, shared by processes on one host.
    ``spec`` is (events per batch, seconds, target events/s or None)."""
    batch, seconds, rate = spec
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 64)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    time.sleep(0.2)
    frames = events = again = 0
    seq, cursor = 1, 0
    frame: bytes | None = None
    n = 0
    started = time.monotonic()
    deadline = started + seconds
    while (now := time.monotonic()) < deadline:
        if rate is not None and events > rate * (now - started):
            time.sleep(0.0005)
            continue
        if frame is None:
            frame, cursor = _frames_for(sender, batch, seq, cursor)
            n = len(BATCH_CODEC.decode(frame).events)
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            again += 1
            time.sleep(0.0002)
            continue
        frames += 1
        events += n
        seq += 1
        frame = None
    ended = time.monotonic()
    sock.close()
    ctx.term()
    out.put((frames, events, again, started, ended))


def _rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _start_serve(db: Path, policy: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    cmd = [
        sys.executable, "-m", "policyd.cli", "serve", "--db", str(db),
        "--events", "tcp://127.0.0.1:*", "--snapshots", "tcp://127.0.0.1:*",
        "--http-port", "0", "--policy", policy, "--log-level", "WARNING",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(READY_PREFIX):
            return proc, json.loads(line[len(READY_PREFIX) :])
    proc.kill()
    raise RuntimeError(f"`{' '.join(cmd)}` did not report ready (exit code {proc.poll()})")


def _get_stats(client: httpx.Client) -> dict[str, Any]:
    """GET /api/stats, retried once on a transport error (a reset idle connection)."""
    try:
        return dict(client.get("/api/stats").json())
    except httpx.TransportError:
        return dict(client.get("/api/stats").json())


def _decision_latency(http_url: str, n: int) -> dict[str, Any]:
    """p50/p99 of POST /api/decide/evict, raw keep-alive http.client and httpx."""
    body = json.dumps({"tier": "gpu", "candidates": list(range(64)), "n_blocks": 8})
    host_port = http_url.removeprefix("http://")
    host, _, port = host_port.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    raw: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request("POST", "/api/decide/evict", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        raw.append(time.perf_counter() - t0)
        if resp.status != 200:
            raise RuntimeError(f"decide/evict answered {resp.status}")
    conn.close()
    via_httpx: list[float] = []
    with httpx.Client(base_url=http_url, timeout=10) as client:
        for _ in range(max(1, n // 4)):
            t0 = time.perf_counter()
            headers = {"Content-Type": "application/json"}
            client.post("/api/decide/evict", content=body, headers=headers).raise_for_status()
            via_httpx.append(time.perf_counter() - t0)
    ms = 1000.0
    return {
        "raw_p50_ms": (_pct(raw, 0.5) or 0) * ms,
        "raw_p99_ms": (_pct(raw, 0.99) or 0) * ms,
        "httpx_p50_ms": (_pct(via_httpx, 0.5) or 0) * ms,
        "httpx_p99_ms": (_pct(via_httpx, 0.99) or 0) * ms,
        "requests": len(raw) + len(via_httpx),
    }


def _say(message: str) -> None:
    print(message, flush=True)


def run_bench(
    *,
    seconds: float,
    batch: int,
    senders: int = 1,
    rate: float | None = None,
    db: Path | None = None,
    policy: str = "pbkv",
    decisions: int = 2000,
    say: Any = _say,
) -> dict[str, Any]:
    tmp = None
    if db is None:
        tmp = tempfile.TemporaryDirectory(prefix="policyd-bench-")
        db = Path(tmp.name) / "bench.duckdb"
    proc, ready = _start_serve(db, policy)
    http_url = ready["http_url"]
    client = httpx.Client(base_url=http_url, timeout=30)
    try:
        time.sleep(1.0)
        rss_before = _rss_bytes(proc.pid)
        say(f"policyd serve pid {proc.pid} at {http_url}; RSS {(rss_before or 0) / 2**20:.0f} MiB")
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, SNAPSHOT_TOPIC)
        sub.connect(ready["snapshots"])
        queue: Any = mp.get_context("spawn").Queue()
        procs = [
            mp.get_context("spawn").Process(
                target=_sender, args=(ready["events"], i, (batch, seconds, rate), queue)
            )
            for i in range(senders)
        ]
        before = _get_stats(client)
        t0 = time.monotonic()
        for p in procs:
            p.start()
        latencies: list[float] = []
        last = t0
        prev = before
        peak_queue = 0
        while any(p.is_alive() for p in procs):
            while sub.poll(50):
                frames = sub.recv_multipart()
                snap = SNAPSHOT_CODEC.decode(frames[1])
                latencies.append(time.monotonic() - snap.ts)
            now = time.monotonic()
            if now - last >= 5.0:
                st = _get_stats(client)
                peak_queue = max(peak_queue, st["ingest_queue_frames"])
                rate_rx = (st["events_received"] - prev["events_received"]) / (now - last)
                rate_ap = (st["events"] - prev["events"]) / (now - last)
                say(
                    f"  {now - t0:6.1f}s: received {rate_rx:,.0f} ev/s, applied {rate_ap:,.0f} "
                    f"ev/s, shed {st['shed_rate']:.1%}, queue {st['ingest_queue_frames']} frames"
                )
                prev, last = st, now
        at_end = _get_stats(client)  # what the daemon had taken when the senders stopped
        sent = [queue.get() for _ in procs]
        for p in procs:
            p.join()
        # the senders' own sending window (spawned processes take a while to import)
        window_s = max(s[4] for s in sent) - min(s[3] for s in sent)
        # the backlog drains after the senders stop: give it a moment, then read the counters
        drain_deadline = time.monotonic() + 60
        while time.monotonic() < drain_deadline:
            st = _get_stats(client)
            if st["ingest_queue_frames"] == 0:
                break
            time.sleep(0.5)
        drained_s = time.monotonic() - min(s[3] for s in sent)
        after = _get_stats(client)
        hist_before = sum(before["history"]["rows_written"].values())
        hist_after = sum(after["history"]["rows_written"].values())
        say(f"measuring decision latency ({decisions} raw + {decisions // 4} httpx requests)")
        decision = _decision_latency(http_url, decisions)
        rss_after = _rss_bytes(proc.pid)
        sub.close()
        ctx.term()
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        if tmp is not None:
            tmp.cleanup()
    sent_events = sum(s[1] for s in sent)
    received = at_end["events_received"] - before["events_received"]
    applied = after["events"] - before["events"]
    shed = after["events_shed"] - before["events_shed"]
    return {
        "seconds": seconds,
        "batch": batch,
        "senders": senders,
        "policy": policy,
        "sent_events": sent_events,
        "sent_events_per_s": sent_events / window_s,
        "window_s": window_s,
        "sender_again": sum(s[2] for s in sent),
        "received_events_per_s": received / window_s,
        "applied_events_per_s": applied / drained_s,
        "shed_events": shed,
        "shed_rate": shed / received if received else 0.0,
        "malformed_frames": after["malformed_frames"] - before["malformed_frames"],
        "peak_queue_frames": peak_queue,
        "target_events_per_s": TARGET_EVENTS_PER_S,
        "ratio_to_target": received / window_s / TARGET_EVENTS_PER_S,
        "history_rows_per_s": (hist_after - hist_before) / drained_s,
        "history_rows_dropped": after["history"]["rows_dropped"],
        "snapshot_latency_p50_ms": (_pct(latencies, 0.5) or 0) * 1000,
        "snapshot_latency_p99_ms": (_pct(latencies, 0.99) or 0) * 1000,
        "snapshots_received": len(latencies),
        "decision": decision,
        "rss_before_mib": (rss_before or 0) / 2**20,
        "rss_after_mib": (rss_after or 0) / 2**20,
        "cpu_count": os.cpu_count(),
    }


def render(r: dict[str, Any]) -> str:
    d = r["decision"]
    return "\n".join([
        f"ingest ({r['senders']} sender(s), batches of {r['batch']}, {r['seconds']:.0f} s, "
        f"policy {r['policy']}, {r['cpu_count']} CPUs):",
        f"  offered {r['sent_events_per_s']:,.0f} events/s over {r['window_s']:.0f} s; received "
        f"{r['received_events_per_s']:,.0f} events/s "
        f"({r['ratio_to_target']:.2f}x the {r['target_events_per_s']:,} target); applied to "
        f"the Engine {r['applied_events_per_s']:,.0f} events/s; shed {r['shed_rate']:.1%} "
        f"({r['shed_events']:,} block events); sender retries (HWM) {r['sender_again']:,}",
        f"  history rows written {r['history_rows_per_s']:,.0f} rows/s "
        f"(dropped {r['history_rows_dropped']:,})",
        f"  snapshot publish->receive p50 {r['snapshot_latency_p50_ms']:.2f} ms, p99 "
        f"{r['snapshot_latency_p99_ms']:.2f} ms ({r['snapshots_received']} snapshots)",
        f"  POST /api/decide/evict raw keep-alive p50 {d['raw_p50_ms']:.2f} ms, p99 "
        f"{d['raw_p99_ms']:.2f} ms; httpx p50 {d['httpx_p50_ms']:.2f} ms, p99 "
        f"{d['httpx_p99_ms']:.2f} ms",
        f"  daemon RSS {r['rss_before_mib']:.0f} MiB before, {r['rss_after_mib']:.0f} MiB after",
    ])  # fmt: skip


def bench_main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    result = run_bench(
        seconds=args.seconds,
        batch=args.batch,
        senders=args.senders,
        rate=args.rate,
        db=args.db,
        policy=args.policy,
    )
    print(render(result))
    command = "policyd " + " ".join(shlex.quote(a) for a in argv)
    print(f"reproduce: {command}")
    if args.json:
        result["command"] = command
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
