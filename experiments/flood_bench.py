"""``policyd bench-flood``: decision latency of a ``policyd serve`` process, idle and during a
flood of requests that never finish (issue #32, point 3), side by side.

1. start ``policyd serve`` (a process of its own, a temporary history) with the bounds given;
2. warm it with ``--workflows`` workflows (planner -> coder -> tester), so that the predictor
   is trained and PBKV publishes scores; the last ``--active`` are left active (not finished),
   as an agent server's are between calls;
3. idle: ``--decisions`` POST /api/decide/evict, timed one by one on a keep-alive connection;
4. flood: ``--flood`` RequestStarted events, each of a new workflow, none ever finished, sent as
   fast as the socket takes them; once the daemon has applied them all, the same decisions again
   (the flood's state held: the request timeout is far off);
5. with ``--request-timeout-s`` short enough, wait for it and report what expired.

The figures: p50 / p99 / max of each phase, the ratio of the p99s, the daemon's RSS (with its
history process) and what its state holds (active workflows, running requests). No threshold
is checked here: the command prints figures (docs/DAEMON.md, *Requests that never finish*,
reports them).
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import zmq

from experiments.ingest_bench import _daemon_rss_bytes, _pct, start_serve
from policyd.core.types import (
    BATCH_CODEC,
    BlocksStored,
    Event,
    EventBatch,
    PrefixHit,
    RequestFinished,
    RequestStarted,
    WorkflowFinished,
)
from policyd.core.wire import MAX_EVENTS_PER_BATCH

AGENTS = ("planner", "coder", "tester")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="policyd bench-flood",
        description="decision latency of a `policyd serve` process idle and during a flood of "
        "requests that never finish, side by side",
    )
    p.add_argument("--flood", type=int, default=20_000, help="unfinished requests (20000)")
    p.add_argument("--workflows", type=int, default=300, help="warm-up workflows (300)")
    p.add_argument("--active", type=int, default=64, help="of them, left active (not finished): 64")
    p.add_argument("--decisions", type=int, default=2000, help="decisions timed per phase")
    p.add_argument("--policy", default="pbkv")
    p.add_argument(
        "--request-timeout-s", type=float, default=None, help="the daemon's request timeout"
    )
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--max-active-workflows", type=int, default=None)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return p


def warm_events(n: int, active: int = 0) -> list[Event]:
    """``n`` workflows of three calls each; the last ``active`` of them not finished (they
    stay active, as an agent server's are between calls)."""
    out: list[Event] = []
    for w in range(n):
        for i, agent in enumerate(AGENTS):
            rid = f"warm{w}.{i}"
            blocks = tuple(range(w * 1000, w * 1000 + 8 + i))
            out += [
                RequestStarted(ts=float(w), request_id=rid, workflow_id=f"warm{w}", agent=agent,
                               workflow_type="bench", block_hashes=blocks,
                               prompt_tokens=16 * len(blocks)),
                PrefixHit(ts=float(w), request_id=rid, gpu_blocks=2, host_blocks=1,
                          recomputed_blocks=len(blocks) - 3),
                BlocksStored(ts=float(w), tier="gpu", block_hashes=blocks, request_id=rid),
                RequestFinished(ts=float(w), request_id=rid, output_tokens=4),
            ]  # fmt: skip
        if w < n - active:
            out.append(WorkflowFinished(ts=float(w), workflow_id=f"warm{w}"))
    return out


def flood_events(n: int) -> list[Event]:
    base = 1 << 40
    return [
        RequestStarted(ts=0.0, request_id=f"flood{i}", workflow_id=f"flood-w{i}",
                       agent=AGENTS[i % 3], workflow_type="bench",
                       block_hashes=tuple(range(base + i * 8, base + i * 8 + 8)),
                       prompt_tokens=128)
        for i in range(n)
    ]  # fmt: skip


class Sender:
    def __init__(self, endpoint: str) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 5000)
        self.sock.connect(endpoint)
        self.seq = 0

    def send(self, events: Sequence[Event]) -> None:
        for i in range(0, len(events), MAX_EVENTS_PER_BATCH):
            self.seq += 1
            chunk = tuple(events[i : i + MAX_EVENTS_PER_BATCH])
            self.sock.send(BATCH_CODEC.encode(EventBatch("bench-flood", self.seq, chunk)))

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _wait_applied(client: httpx.Client, key: str, target: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.get("/api/stats").json()[key] >= target:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the daemon did not reach {key} = {target} within {timeout_s:.0f} s")


def time_decisions(http_url: str, n: int) -> list[float]:
    body = json.dumps({"tier": "gpu", "candidates": list(range(64)), "n_blocks": 8})
    host, _, port = http_url.removeprefix("http://").rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    out: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request("POST", "/api/decide/evict", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        out.append(time.perf_counter() - t0)
        if resp.status != 200:
            raise RuntimeError(f"decide/evict answered {resp.status}")
    conn.close()
    return out


def _phase(name: str, lat: list[float], stats: dict[str, Any], pid: int) -> dict[str, Any]:
    sizes = stats["state_sizes"]
    return {
        "phase": name,
        "decisions": len(lat),
        "p50_ms": (_pct(lat, 0.5) or 0.0) * 1000,
        "p99_ms": (_pct(lat, 0.99) or 0.0) * 1000,
        "max_ms": max(lat, default=0.0) * 1000,
        "rss_mb": (_daemon_rss_bytes(pid) or 0) / 2**20,
        "workflows_active": stats["workflows_active"],
        "requests_running": sizes["requests_running"],
        "workflows_tracked": sizes["workflows"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = {}
    for flag, var in (
        ("request_timeout_s", "POLICYD_REQUEST_TIMEOUT_S"),
        ("max_running_requests", "POLICYD_MAX_RUNNING_REQUESTS"),
        ("max_active_workflows", "POLICYD_MAX_ACTIVE_WORKFLOWS"),
    ):
        if getattr(args, flag) is not None:
            env[var] = str(getattr(args, flag))
    with tempfile.TemporaryDirectory(prefix="policyd-flood-") as tmp:
        proc, ready = start_serve(Path(tmp) / "h.duckdb", args.policy, env)
        url = ready["http_url"]
        sender = Sender(ready["events"])
        phases = []
        try:
            with httpx.Client(base_url=url, timeout=60) as client:
                warm = warm_events(args.workflows, args.active)
                sender.send(warm)
                _wait_applied(client, "events", len(warm))
                time.sleep(1.0)  # a snapshot or two with the trained predictor
                lat = time_decisions(url, args.decisions)
                phases.append(_phase("idle", lat, client.get("/api/stats").json(), proc.pid))
                started = time.monotonic()
                sender.send(flood_events(args.flood))
                _wait_applied(client, "requests", 3 * args.workflows + args.flood)
                flood_s = time.monotonic() - started
                lat = time_decisions(url, args.decisions)
                stats = client.get("/api/stats").json()
                phases.append(_phase("flood", lat, stats, proc.pid))
                result: dict[str, Any] = {
                    "flood": args.flood,
                    "flood_applied_s": flood_s,
                    "settings": env,
                    "phases": phases,
                    "p99_ratio": phases[1]["p99_ms"] / max(1e-9, phases[0]["p99_ms"]),
                    "requests_evicted": stats["requests_evicted"],
                    "workflows_evicted": stats["workflows_evicted"],
                }
                timeout = args.request_timeout_s
                if timeout is not None and timeout <= 120:
                    time.sleep(timeout + 2.5)  # past the timeout and a tick
                    stats = client.get("/api/stats").json()
                    result["after_timeout"] = _phase("after timeout", [], stats, proc.pid)
                    result["requests_expired"] = stats["requests_expired"]
        finally:
            sender.close()
            proc.terminate()
            proc.wait(timeout=60)
    return result


def render(r: dict[str, Any]) -> str:
    lines = [
        f"flood: {r['flood']:,} RequestStarted never finished, applied in "
        f"{r['flood_applied_s']:.1f} s; settings {r['settings'] or 'defaults'}",
        f"{'phase':<14}{'decisions':>10}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
        f"{'RSS MB':>9}{'active wf':>11}{'running req':>13}",
    ]
    rows = list(r["phases"]) + ([r["after_timeout"]] if "after_timeout" in r else [])
    for p in rows:
        lines.append(
            f"{p['phase']:<14}{p['decisions']:>10}{p['p50_ms']:>9.2f}{p['p99_ms']:>9.2f}"
            f"{p['max_ms']:>9.2f}{p['rss_mb']:>9.0f}{p['workflows_active']:>11,}"
            f"{p['requests_running']:>13,}"
        )
    lines.append(
        f"p99 flood / idle: {r['p99_ratio']:.2f}x; requests evicted {r['requests_evicted']:,}, "
        f"workflows evicted {r['workflows_evicted']:,}"
        + (f", requests expired {r['requests_expired']:,}" if "requests_expired" in r else "")
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args)
    print(render(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
