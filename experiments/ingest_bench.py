"""``policyd bench-ingest``: measure a ``policyd serve`` process from the outside, over loopback.

* sustained ingest: sender processes PUSH EventBatch frames (block-level events with a few
  request events mixed in) as fast as the daemon takes them for ``--seconds``; the daemon's own
  counters give events received (decoded), applied (to the Engine) and shed per second;
* history rows written per second (the DuckDB writer's counters);
* snapshot latency: publish (the snapshot's ``ts``, the daemon's CLOCK_MONOTONIC, shared by
  processes on one Linux host) -> receive by a SUB socket here;
* HTTP decision latency of ``POST /api/decide/evict``: with a raw keep-alive ``http.client``
  connection and with ``httpx`` (the client's own cost included);
* the daemon's RSS before and after, its history process's included (``/proc/<pid>/status``).

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
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, Final

import httpx
import msgspec
import zmq
from matplotlib.figure import Figure

from policyd.core.memory import rss_bytes
from policyd.core.types import (
    PROTOCOL_VERSION,
    SNAPSHOT_CODEC,
    BlocksRemoved,
    BlocksStored,
    Event,
    PrefixHit,
    RequestFinished,
    RequestStarted,
    WorkflowFinished,
)
from policyd.core.wire import SNAPSHOT_TOPIC
from policyd.daemon.server import READY_PREFIX

TARGET_BLOCK_EVENTS_PER_S: Final = 500_000
SWEEP_DECISIONS: Final = 400  # timed decision requests per run of a --rates sweep
RESIDENT_WINDOW_BLOCKS: Final = 4096  # a sender removes what it stored this many blocks ago
RUN_BLOCKS: Final = 16  # blocks come in runs: 16 stored, then 16 removed, ...
CONCURRENT_WORKFLOWS: Final = 64
CALLS_PER_WORKFLOW: Final = 8
PROMPT_BLOCKS: Final = 4  # block hashes a bench request names
MIN_RING_FRAMES: Final = 16


class _WireBatch(msgspec.Struct):
    """``EventBatch`` with pre-encoded events: the same bytes on the wire (a map with the same
    fields in the same order), built by copying the ring's encoded events instead of encoding
    Python objects per frame."""

    source: str
    seq: int
    events: list[msgspec.Raw]


@dataclass(frozen=True)
class StreamShape:
    """What one sender's stream looks like.

    ``blocks_per_event``: block hashes per BlocksStored / BlocksRemoved event. 16 by default: a
    connector reports a request's new blocks (and an eviction batch) in one event, as vLLM's
    ``BlockStored`` does for the blocks one scheduler step filled (vLLM emits ``BlockRemoved``
    one hash per event; a run of those is what ``--blocks-per-event 1`` models, the worst case).
    ``events_per_frame``: block-level events per frame (request events ride along).
    ``blocks_per_request``: one request (start, prefix hit, finish; every
    ``CALLS_PER_WORKFLOW``-th call also finishes its workflow) per this many block events.
    """

    blocks_per_event: int = 16
    events_per_frame: int = 256
    blocks_per_request: int = 512

    def __post_init__(self) -> None:
        for name in ("blocks_per_event", "events_per_frame", "blocks_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def blocks_per_frame(self) -> int:
        return self.blocks_per_event * self.events_per_frame

    @property
    def run_events(self) -> int:
        """Events of one kind in a row: a run of RUN_BLOCKS blocks (one event if larger)."""
        return max(1, RUN_BLOCKS // self.blocks_per_event)


def block_events(shape: StreamShape, sender: int, ring_frames: int) -> list[list[bytes]]:
    """The ring's block-level events, encoded, per frame: runs of GPU stores of fresh positions
    alternating with runs of removals of the blocks stored ``RESIDENT_WINDOW_BLOCKS`` earlier.
    Positions wrap at the ring's length (the ring is cyclic), so residency stays bounded by
    the window and a removal always names a block its store run stored (except in the first
    window of a run, before anything was stored: those removals are no-ops)."""
    b, run = shape.blocks_per_event, shape.run_events
    run_blocks = b * run
    total_events = ring_frames * shape.events_per_frame
    if total_events % (2 * run):
        raise ValueError("events per frame x ring frames must hold whole store/remove runs")
    period = total_events // 2 * b  # distinct block positions in the ring
    lag = -(-RESIDENT_WINDOW_BLOCKS // run_blocks) * run_blocks
    if period <= lag + run_blocks:
        raise ValueError("the ring is shorter than the residency window")
    base = (sender + 1) << 48
    encode = msgspec.msgpack.Encoder().encode
    frames: list[list[bytes]] = []
    stored = 0  # block positions stored so far
    for f in range(ring_frames):
        out: list[bytes] = []
        for i in range(shape.events_per_frame):
            e = f * shape.events_per_frame + i
            if (e // run) % 2 == 0:
                pos = stored
                stored += b
                out.append(
                    encode(
                        BlocksStored(ts=0.0, tier="gpu", block_hashes=_hashes(base, pos, b, period))
                    )
                )
            else:  # the blocks of the matching event of a store run ``lag`` blocks ago
                pos = (e // (2 * run)) * run_blocks + (e % run) * b - lag
                out.append(
                    encode(
                        BlocksRemoved(
                            ts=0.0, tier="gpu", block_hashes=_hashes(base, pos, b, period)
                        )
                    )
                )
        frames.append(out)  # fmt: skip
    return frames


def _hashes(base: int, pos: int, n: int, period: int) -> tuple[int, ...]:
    return tuple(base + (p % period) for p in range(pos, pos + n))


def ring_frames_for(shape: StreamShape) -> int:
    """Frames in a sender's ring: enough that positions wrap well after the residency window,
    and whole store/remove runs."""
    need = -(-8 * RESIDENT_WINDOW_BLOCKS // shape.blocks_per_frame)
    frames = max(MIN_RING_FRAMES, need)
    while (frames * shape.events_per_frame) % (2 * shape.run_events):
        frames += 1
    return frames


class FrameSource:
    """One sender's frames: the ring's encoded block events plus fresh request events and a
    fresh ``seq`` per frame; ``next()`` costs a msgpack copy, not an encode per event."""

    def __init__(self, shape: StreamShape, sender: int) -> None:
        self.shape = shape
        self.sender = sender
        self.ring = [[msgspec.Raw(e) for e in frame] for frame in
                     block_events(shape, sender, ring_frames_for(shape))]  # fmt: skip
        self._encode = msgspec.msgpack.Encoder().encode
        self._event = msgspec.msgpack.Encoder().encode
        self.seq = 0
        self.blocks_sent = 0  # block events in the frames built so far
        self.requests = 0
        self.source = f"bench-{sender}"

    def next(self) -> tuple[bytes, int, int]:
        """The next frame, its events and its block events."""
        shape = self.shape
        block_raw = self.ring[self.seq % len(self.ring)]
        self.seq += 1
        self.blocks_sent += shape.blocks_per_frame
        due = self.blocks_sent // shape.blocks_per_request - self.requests
        extra = [msgspec.Raw(self._event(e)) for r in range(due)
                 for e in self._request(self.requests + r)]  # fmt: skip
        self.requests += due
        events = extra + block_raw if extra else block_raw
        frame = self._encode((PROTOCOL_VERSION, _WireBatch(self.source, self.seq, events)))
        return frame, len(events), shape.blocks_per_frame

    def _request(self, r: int) -> list[Event]:
        """Request ``r``: one of ``CONCURRENT_WORKFLOWS`` round-robin workflows, each finishing
        after ``CALLS_PER_WORKFLOW`` calls; its prompt names ``PROMPT_BLOCKS`` fresh hashes."""
        slot, rnd = r % CONCURRENT_WORKFLOWS, r // CONCURRENT_WORKFLOWS
        wid = f"s{self.sender}-w{slot}-g{rnd // CALLS_PER_WORKFLOW}"
        rid = f"s{self.sender}-r{r}"
        base = ((self.sender + 1) << 48) + (1 << 40) + r * PROMPT_BLOCKS
        events: list[Event] = [
            RequestStarted(ts=0.0, request_id=rid, workflow_id=wid,
                           agent=f"agent{rnd % CALLS_PER_WORKFLOW % 3}", workflow_type="bench",
                           block_hashes=tuple(range(base, base + PROMPT_BLOCKS)),
                           prompt_tokens=16 * PROMPT_BLOCKS),
            PrefixHit(ts=0.0, request_id=rid, gpu_blocks=2, host_blocks=1, recomputed_blocks=1),
            RequestFinished(ts=0.0, request_id=rid, output_tokens=8),
        ]  # fmt: skip
        if rnd % CALLS_PER_WORKFLOW == CALLS_PER_WORKFLOW - 1:
            events.append(WorkflowFinished(ts=0.0, workflow_id=wid))
        return events


@dataclass(frozen=True)
class SenderSpec:
    shape: StreamShape
    seconds: float
    rate_blocks_per_s: float | None  # None: as fast as the socket takes frames


def _sender(endpoint: str, sender: int, spec: SenderSpec, out: Any) -> None:
    """One sender process: PUSH frames without blocking; report (frames, events, block
    events, again, started, ended) - the times on CLOCK_MONOTONIC, shared by processes on one
    host. A frame the socket refuses (high-water mark) is retried, never waited on."""
    source = FrameSource(spec.shape, sender)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 64)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    time.sleep(0.2)
    frames = events = blocks = again = 0
    rate = spec.rate_blocks_per_s
    frame, n, nb = source.next()
    started = time.monotonic()
    deadline = started + spec.seconds
    while (now := time.monotonic()) < deadline:
        if rate is not None and blocks > rate * (now - started):
            time.sleep(0.0005)
            continue
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            again += 1
            time.sleep(0.0002)
            continue
        frames += 1
        events += n
        blocks += nb
        frame, n, nb = source.next()
    ended = time.monotonic()
    sock.close()
    ctx.term()
    out.put((frames, events, blocks, again, started, ended))


def _daemon_rss_bytes(pid: int) -> int | None:
    """The RSS of the daemon and of its child processes (its history writer's): the memory it
    takes, wherever it runs."""
    own = rss_bytes(pid)
    if own is None:
        return None
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return own + sum(rss_bytes(int(child)) or 0 for child in children)


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_serve(
    db: Path, policy: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """``policyd serve`` on ephemeral loopback ports (``env`` on top of ours), once it said it
    is ready: the process and its ready line's fields."""
    cmd = [
        sys.executable, "-m", "policyd.cli", "serve", "--db", str(db),
        "--events", "tcp://127.0.0.1:*", "--snapshots", "tcp://127.0.0.1:*",
        "--http-port", "0", "--policy", policy, "--log-level", "WARNING",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )
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


DRAIN_POLL_S: Final = 0.02  # stats polls while the backlog drains after the senders stop
DECISION_BUDGET_S: Final = 30.0  # each of the two latency phases stops after this long


def _decision_latency(http_url: str, n: int) -> dict[str, Any]:
    """p50/p99 of POST /api/decide/evict, raw keep-alive http.client and httpx: ``n`` and
    ``n // 4`` requests, each phase cut at ``DECISION_BUDGET_S`` (a daemon still draining a
    backlog answers slowly; the counts say how many were timed)."""
    body = json.dumps({"tier": "gpu", "candidates": list(range(64)), "n_blocks": 8})
    host_port = http_url.removeprefix("http://")
    host, _, port = host_port.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    raw: list[float] = []
    stop_at = time.monotonic() + DECISION_BUDGET_S
    for _ in range(n):
        if time.monotonic() > stop_at:
            break
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
        stop_at = time.monotonic() + DECISION_BUDGET_S
        for _ in range(max(1, n // 4)):
            if time.monotonic() > stop_at:
                break
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
        "raw_requests": len(raw),
        "httpx_requests": len(via_httpx),
    }


def _say(message: str) -> None:
    print(message, flush=True)


def _block_counts(st: dict[str, Any]) -> tuple[int, int, int]:
    return st["block_events_received"], st["block_events_applied"], st["block_events_shed"]


def run_bench(
    *,
    seconds: float,
    shape: StreamShape = StreamShape(),
    senders: int = 1,
    rate: float | None = None,
    db: Path | None = None,
    policy: str = "pbkv",
    block_sample_rate: float | None = None,
    decisions: int = 2000,
    sample_s: float = 5.0,
    say: Any = _say,
) -> dict[str, Any]:
    """Start ``policyd serve``, drive it from ``senders`` processes for ``seconds``, and
    return the figures (see the module docstring); ``sample_s``: seconds between progress
    lines, each with the daemon's RSS (the series is in the result)."""
    tmp = None
    if db is None:
        tmp = tempfile.TemporaryDirectory(prefix="policyd-bench-")
        db = Path(tmp.name) / "bench.duckdb"
    proc, ready = start_serve(db, policy)
    http_url = ready["http_url"]
    client = httpx.Client(base_url=http_url, timeout=30)
    try:
        if block_sample_rate is not None:
            client.put(
                "/api/settings", json={"block_sample_rate": block_sample_rate}
            ).raise_for_status()
        time.sleep(1.0)
        rss_before = _daemon_rss_bytes(proc.pid)
        say(f"policyd serve pid {proc.pid} at {http_url}; RSS {(rss_before or 0) / 2**20:.0f} MiB")
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, SNAPSHOT_TOPIC)
        sub.connect(ready["snapshots"])
        queue: Any = mp.get_context("spawn").Queue()
        spec = SenderSpec(shape, seconds, rate / senders if rate is not None else None)
        procs = [
            mp.get_context("spawn").Process(target=_sender, args=(ready["events"], i, spec, queue))
            for i in range(senders)
        ]
        before = _get_stats(client)
        t0 = time.monotonic()
        for p in procs:
            p.start()
        latencies: list[float] = []
        series: list[dict[str, Any]] = [_sample(0.0, before, proc.pid, os.getloadavg()[0])]
        last = t0
        prev = before
        peak_queue = 0
        while any(p.is_alive() for p in procs):
            while sub.poll(50):
                frames = sub.recv_multipart()
                snap = SNAPSHOT_CODEC.decode(frames[1])
                latencies.append(time.monotonic() - snap.ts)
            now = time.monotonic()
            if now - last >= sample_s:
                st = _get_stats(client)
                peak_queue = max(peak_queue, st["ingest_queue_depth"])
                point = _sample(now - t0, st, proc.pid, os.getloadavg()[0])
                series.append(point)
                rx, ap, _ = (
                    (a - b) / (now - last)
                    for a, b in zip(_block_counts(st), _block_counts(prev), strict=True)
                )
                say(
                    f"  {now - t0:6.1f}s: block events received {rx:,.0f}/s, applied "
                    f"{ap:,.0f}/s, shed {st['block_shed_rate']:.1%} (cumulative), queue "
                    f"{st['ingest_queue_depth']} (256-event frames), "
                    f"RSS {point['rss_mib']:.0f} MiB, load {point['load_1m']:.1f}"
                )
                prev, last = st, now
        at_end = _get_stats(client)  # what the daemon had taken when the senders stopped
        sent = [queue.get() for _ in procs]
        # the senders' own sending window (spawned processes take a while to import)
        window_s = max(s[5] for s in sent) - min(s[4] for s in sent)
        # the backlog drains after the senders stop: the applied rates count until the queue is
        # seen empty, polled often so that the poll's interval does not count as Engine time
        drain_deadline = time.monotonic() + 60
        while True:
            empty = _get_stats(client)["ingest_queue_frames"] == 0
            seen = time.monotonic()  # after the answer: the drain is not counted short
            if empty or seen >= drain_deadline:
                break
            time.sleep(DRAIN_POLL_S)
        drained_s = max(seen - min(s[4] for s in sent), window_s)
        for p in procs:
            p.join()
        after = _get_stats(client)
        hist_before = sum(before["history"]["rows_written"].values())
        hist_after = sum(after["history"]["rows_written"].values())
        backlog = after["ingest_queue_depth"]
        say(f"measuring decision latency ({decisions} raw + {decisions // 4} httpx requests, "
            f"at most {DECISION_BUDGET_S:.0f} s each; queue depth {backlog})")  # fmt: skip
        decision = _decision_latency(http_url, decisions)
        decision["queue_depth_at_start"] = backlog
        rss_after = _daemon_rss_bytes(proc.pid)
        series.append(_sample(time.monotonic() - t0, _get_stats(client), proc.pid,
                              os.getloadavg()[0]))  # fmt: skip
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

    def delta(key: str, end: dict[str, Any] = after) -> int:
        return int(end[key] - before[key])

    blocks_rx = delta("block_events_received", at_end)
    blocks_all = delta("block_events_received")
    blocks_shed = delta("block_events_shed")
    events_rx = delta("events_received", at_end)
    loads = [p["load_1m"] for p in series]
    rates = [p["history_block_sample_rate"] for p in series]
    rates = [rate for rate in rates if rate is not None]
    return {
        "seconds": seconds,
        "blocks_per_event": shape.blocks_per_event,
        "events_per_frame": shape.events_per_frame,
        "blocks_per_request": shape.blocks_per_request,
        "senders": senders,
        "policy": policy,
        "block_sample_rate": 1.0 if block_sample_rate is None else block_sample_rate,
        "window_s": window_s,
        "drained_s": drained_s,
        "sent_block_events": sum(s[2] for s in sent),
        "received_block_events": blocks_all,
        "applied_block_events": delta("block_events_applied"),
        "frames_dropped": delta("frames_dropped"),
        "receiver_waits": delta("receiver_waits"),
        "receiver_wait_s": float(after["receiver_wait_s"] - before["receiver_wait_s"]),
        "sent_frames_per_s": sum(s[0] for s in sent) / window_s,
        "sent_events_per_s": sum(s[1] for s in sent) / window_s,
        "sent_block_events_per_s": sum(s[2] for s in sent) / window_s,
        "sender_again": sum(s[3] for s in sent),
        "received_frames_per_s": delta("frames", at_end) / window_s,
        "received_events_per_s": events_rx / window_s,
        "received_block_events_per_s": blocks_rx / window_s,
        "applied_events_per_s": delta("events") / drained_s,
        "applied_block_events_per_s": delta("block_events_applied") / drained_s,
        "requests_per_s": delta("requests") / drained_s,
        "shed_block_events": blocks_shed,
        "block_shed_rate": blocks_shed / blocks_all if blocks_all else 0.0,
        "shed_events": delta("events_shed"),
        "malformed_frames": delta("malformed_frames"),
        "seq_gaps": delta("seq_gaps"),
        "peak_queue_frames": peak_queue,
        "target_block_events_per_s": TARGET_BLOCK_EVENTS_PER_S,
        "received_ratio_to_target": blocks_rx / window_s / TARGET_BLOCK_EVENTS_PER_S,
        "applied_ratio_to_target": delta("block_events_applied")
        / drained_s
        / TARGET_BLOCK_EVENTS_PER_S,
        "history_rows_per_s": (hist_after - hist_before) / drained_s,
        "history_rows_dropped": after["history"]["rows_dropped"],
        # the block rows' sample rate: lowest seen while the writer was behind, and at the end
        "history_block_rate_min": min(rates, default=None),
        "history_block_rate_end": after["history"].get("block_sample_rate"),
        "history_block_rate_changes": after["history"].get("block_sample_rate_changes"),
        "history_rows_rejected": after["history"]["rows_rejected"],
        # event batches the writer stepped aside before, the Engine being behind
        "history_deferrals": after["history"].get("deferrals", 0)
        - before["history"].get("deferrals", 0),
        "history_last_error": after["history"]["last_error"],
        "snapshot_latency_p50_ms": (_pct(latencies, 0.5) or 0) * 1000,
        "snapshot_latency_p99_ms": (_pct(latencies, 0.99) or 0) * 1000,
        "snapshots_received": len(latencies),
        "decision": decision,
        "rss_before_mib": (rss_before or 0) / 2**20,
        "rss_after_mib": (rss_after or 0) / 2**20,
        "rss_series": series,
        "load_1m_mean": sum(loads) / len(loads),
        "load_1m_max": max(loads),
        "cpu_count": os.cpu_count(),
    }


def _sample(t_s: float, st: dict[str, Any], pid: int, load_1m: float) -> dict[str, Any]:
    """One point of the series: time, the daemon's RSS and counters, the machine's load."""
    return {
        "t_s": round(t_s, 2),
        "rss_mib": (_daemon_rss_bytes(pid) or 0) / 2**20,
        "block_events_received": st["block_events_received"],
        "block_events_applied": st["block_events_applied"],
        "block_events_shed": st["block_events_shed"],
        "ingest_queue_frames": st["ingest_queue_frames"],
        "ingest_queue_depth": st["ingest_queue_depth"],
        "history_queue_rows": st["history"]["queue_rows"],
        "history_block_sample_rate": st["history"].get("block_sample_rate"),
        "history_db_bytes": st["history"]["db_bytes"],
        "duckdb_memory_mib": (st["history"].get("duckdb_memory_bytes") or 0) / 2**20,
        "requests": st["requests"],
        "state": st["state_sizes"],
        "load_1m": load_1m,
    }


def render(r: dict[str, Any]) -> str:
    d = r["decision"]
    target = r["target_block_events_per_s"]
    return "\n".join([
        f"ingest ({r['senders']} sender(s), {r['blocks_per_event']} block hashes per block "
        f"event, {r['events_per_frame']} block-level events per frame, a request per "
        f"{r['blocks_per_request']} block events, {r['seconds']:.0f} s, policy {r['policy']}, "
        f"{r['cpu_count']} CPUs, load average {r['load_1m_mean']:.1f} mean / "
        f"{r['load_1m_max']:.1f} max):",
        f"  offered {r['sent_block_events_per_s']:,.0f} block events/s "
        f"({r['sent_events_per_s']:,.0f} events/s, {r['sent_frames_per_s']:,.0f} frames/s) "
        f"over {r['window_s']:.0f} s; sender retries at the high-water mark "
        f"{r['sender_again']:,} (never blocked)",
        f"  received {r['received_block_events_per_s']:,.0f} block events/s "
        f"({r['received_ratio_to_target']:.2f}x the {target:,} target; "
        f"{r['received_events_per_s']:,.0f} events/s, {r['received_frames_per_s']:,.0f} frames/s)",
        f"  applied to the Engine {r['applied_block_events_per_s']:,.0f} block events/s "
        f"({r['applied_ratio_to_target']:.2f}x the target; {r['applied_events_per_s']:,.0f} "
        f"events/s, {r['requests_per_s']:,.0f} requests/s); shed {r['block_shed_rate']:.1%} of "
        f"block events ({r['shed_block_events']:,}); frames "
        f"{r['frames_dropped']:,} cut at the hard bound; seq gaps {r['seq_gaps']}; the receiver "
        f"waited for room {r.get('receiver_waits', 0):,} times, "
        f"{r.get('receiver_wait_s', 0.0):.1f} s in all",
        f"  history rows written {r['history_rows_per_s']:,.0f} rows/s (block rows sampled at "
        f"{_rates(r)}; dropped {r['history_rows_dropped']:,}, rejected "
        f"{r['history_rows_rejected']:,}; writer stepped aside for the Engine "
        f"{r.get('history_deferrals', 0):,} times; last error {r['history_last_error']})",
        f"  snapshot publish->receive p50 {r['snapshot_latency_p50_ms']:.2f} ms, p99 "
        f"{r['snapshot_latency_p99_ms']:.2f} ms ({r['snapshots_received']} snapshots)",
        f"  POST /api/decide/evict raw keep-alive p50 {d['raw_p50_ms']:.2f} ms, p99 "
        f"{d['raw_p99_ms']:.2f} ms ({d['raw_requests']}); httpx p50 {d['httpx_p50_ms']:.2f} ms, "
        f"p99 {d['httpx_p99_ms']:.2f} ms ({d['httpx_requests']}); queue depth at the start "
        f"{d['queue_depth_at_start']}",
        f"  daemon RSS (with its history process) {r['rss_before_mib']:.0f} MiB before, "
        f"{r['rss_after_mib']:.0f} MiB after "
        f"({len(r['rss_series'])} samples, max {max(p['rss_mib'] for p in r['rss_series']):.0f}"
        " MiB)",
        f"  daemon state, last / max sample: {_state_line(r['rss_series'])}",
    ])  # fmt: skip


def _state_line(series: Sequence[dict[str, Any]]) -> str:
    """The in-memory structures' sizes at the last sample and their maxima over the run."""
    states = [p["state"] for p in series if p.get("state")]
    if not states:
        return "not sampled"
    return ", ".join(
        f"{name.replace('_', ' ')} {states[-1][name]:,} / {max(s[name] for s in states):,}"
        for name in states[-1]
    )


def plot_rss(r: dict[str, Any], path: Path) -> None:
    """The daemon's RSS and the applied block-event rate over the run, as a PNG."""
    series = r["rss_series"]
    t = [p["t_s"] for p in series]
    fig = Figure(figsize=(8, 7.5))
    top, middle, bottom = fig.subplots(3, 1, sharex=True)
    top.plot(t, [p["rss_mib"] for p in series], marker=".", color="tab:blue", label="RSS")
    top.plot(t, [p.get("duckdb_memory_mib", 0.0) for p in series], color="tab:gray",
             label="of which DuckDB's buffer pool (capped by memory_limit)")  # fmt: skip
    top.legend(fontsize=7, loc="lower right")
    top.set_ylabel("daemon memory (MiB)")
    top.set_ylim(bottom=0)
    top.grid(alpha=0.3)
    held = {  # what the daemon holds in memory, in thousands
        "workflows tracked": [p.get("state", {}).get("workflows", 0) for p in series],
        "blocks tracked": [p.get("state", {}).get("blocks_tracked", 0) for p in series],
        "history rows queued": [p["history_queue_rows"] for p in series],
        "ingest queue depth (frames)": [p["ingest_queue_depth"] for p in series],
    }
    for label, values in held.items():
        middle.plot(t, [v / 1000 for v in values], label=label)
    middle.set_ylabel("held (thousands)")
    middle.set_yscale("symlog", linthresh=1.0)
    middle.legend(fontsize=7, loc="upper left")
    middle.grid(alpha=0.3)
    rates = [0.0] + [
        (b["block_events_applied"] - a["block_events_applied"]) / max(1e-9, b["t_s"] - a["t_s"])
        for a, b in pairwise(series)
    ]
    bottom.plot(t, [x / 1000 for x in rates], color="tab:green", label="block events applied")
    bottom.set_ylabel("block events/s (thousands)")
    bottom.set_xlabel("seconds since the senders started")
    bottom.grid(alpha=0.3)
    requests = [0.0] + [
        (b.get("requests", 0) - a.get("requests", 0)) / max(1e-9, b["t_s"] - a["t_s"])
        for a, b in pairwise(series)
    ]
    twin = bottom.twinx()
    twin.plot(t, requests, color="tab:orange", label="requests applied")
    twin.set_ylabel("requests/s")
    bottom.legend(handles=[*bottom.get_lines(), *twin.get_lines()], fontsize=7, loc="upper right")
    fig.suptitle(
        f"policyd bench-ingest --seconds {r['seconds']:.0f}: {r['blocks_per_event']} hashes per "
        f"event, policy {r['policy']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


KEPT_UP_SHED: Final = 0.001  # at most this share of block events shed ...
KEPT_UP_DRAIN_S: Final = 5.0  # ... and the backlog gone this soon after the senders stop


def kept_up(r: dict[str, Any]) -> bool:
    """Whether a run's daemon sustained the offered rate: (almost) nothing shed, and what was
    queued when the senders stopped applied within ``KEPT_UP_DRAIN_S``."""
    drain_s = r["drained_s"] - r["window_s"]
    return bool(r["block_shed_rate"] <= KEPT_UP_SHED and drain_s <= KEPT_UP_DRAIN_S)


def _rates(r: dict[str, Any]) -> str:
    """The history's block-row sample rate over a run: the setting, or (adaptive sampling
    lowered it) the setting, the lowest and the last, e.g. ``1 (min 0.125, end 0.5)``."""
    low, end = r.get("history_block_rate_min"), r.get("history_block_rate_end")
    setting = f"{r['block_sample_rate']:g}"
    if low is None or end is None or (low >= r["block_sample_rate"] and end >= low):
        return setting
    return f"{setting} (min {low:g}, end {end:g})"


def render_sweep(runs: Sequence[dict[str, Any]]) -> str:
    """One line per offered rate, then the highest rate the daemon kept up with."""
    lines = [
        "sustained ingest, one fresh daemon per offered rate:",
        f"  {'offered/s':>11} {'x target':>8} {'applied':>8} {'shed':>6} {'drain s':>7} "
        f"{'load':>4} {'history rows dropped':>20} {'history block rate':>24}  kept up   "
        "(applied: share of the block events sent)",
    ]
    for r in runs:
        sent = r["sent_block_events"]
        applied = r["applied_block_events"] / sent if sent else 0.0
        lines.append(
            f"  {r['sent_block_events_per_s']:11,.0f} "
            f"{r['sent_block_events_per_s'] / TARGET_BLOCK_EVENTS_PER_S:8.2f} {applied:8.1%} "
            f"{r['block_shed_rate']:6.1%} {r['drained_s'] - r['window_s']:7.1f} "
            f"{r['load_1m_mean']:4.1f} {r['history_rows_dropped']:20,} "
            f"{_rates(r):>24}  {'yes' if kept_up(r) else 'no'}"
        )
    best = max((r["sent_block_events_per_s"] for r in runs if kept_up(r)), default=None)
    target = TARGET_BLOCK_EVENTS_PER_S
    lines.append(
        f"  sustained: {best:,.0f} block events/s = {best / target:.2f}x the {target:,} target"
        if best is not None
        else f"  sustained: none of the offered rates (shed > {KEPT_UP_SHED:.1%} or backlog "
        f"> {KEPT_UP_DRAIN_S:.0f} s at every one)"
    )
    return "\n".join(lines)


def sweep_main(args: argparse.Namespace, argv: Sequence[str], shape: StreamShape) -> int:
    """``--rates R1,R2,...``: a fresh daemon per offered rate, then which rates it sustained."""
    rates = [float(r) for r in str(args.rates).split(",") if r.strip()]
    if not rates or min(rates) <= 0:
        raise SystemExit(f"--rates needs positive block events/s, got {args.rates!r}")
    command = "policyd " + " ".join(shlex.quote(a) for a in argv)
    runs = []
    for i, rate in enumerate(rates, 1):
        _say(f"[{i}/{len(rates)}] offering {rate:,.0f} block events/s for {args.seconds:.0f} s")
        runs.append(
            run_bench(
                seconds=args.seconds,
                shape=shape,
                senders=args.senders,
                rate=rate,
                policy=args.policy,
                block_sample_rate=args.block_sample_rate,
                sample_s=args.sample_s,
                decisions=SWEEP_DECISIONS,
            )
        )
        print(render(runs[-1]))
    print(render_sweep(runs))
    print(f"reproduce: {command}")
    if args.json:
        doc = {"command": command, "runs": runs, "kept_up": [kept_up(r) for r in runs]}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def bench_main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    shape = StreamShape(
        blocks_per_event=args.blocks_per_event,
        events_per_frame=args.batch,
        blocks_per_request=args.blocks_per_request,
    )
    if args.rates:
        return sweep_main(args, argv, shape)
    command = "policyd " + " ".join(shlex.quote(a) for a in argv)
    result = run_bench(
        seconds=args.seconds,
        shape=shape,
        senders=args.senders,
        rate=args.rate,
        db=args.db,
        policy=args.policy,
        block_sample_rate=args.block_sample_rate,
        sample_s=args.sample_s,
    )
    print(render(result))
    print(f"reproduce: {command}")
    result["command"] = command
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot_rss(result, Path(args.plot))
        print(f"RSS plot: {args.plot}")
    return 0
