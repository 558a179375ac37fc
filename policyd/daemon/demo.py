"""``policyd demo``: a daemon fed by a simulated vLLM, so that everything fills up as in service.

The daemon runs in this process (``start_daemon``: real sockets, the real HTTP API, the history
file). The "vLLM" is ``policyd.sim``'s two-tier cache simulator replaying generated agent
workflows; its Engine is swapped for ``RemoteEngine``, which ships every event batch over the
real wire with ``DaemonClient`` and answers the simulator's snapshot and prefetch questions from
the newest snapshot the daemon published - exactly what a connector does. Simulated time is
paced against the wall clock (``speedup`` simulated seconds per second), so snapshots are as
stale as they would be.

``run_demo(..., keep_serving=True)`` returns a handle with ``http_url`` and ``stop()`` - what
the dashboard's tests use to get a daemon with real replay data (docs/DAEMON.md).
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from policyd.core.client import DaemonClient
from policyd.core.profiles import get_profile
from policyd.core.types import EventBatch, PolicySnapshot
from policyd.core.wire import Endpoints
from policyd.daemon.server import RunningDaemon, start_daemon
from policyd.daemon.settings import DaemonSettings
from policyd.daemon.views import stats as daemon_stats
from policyd.history import default_db_path
from policyd.policies import make_policy
from policyd.sim.replay import SimConfig, Simulator, simulate
from policyd.sim.report import Report
from policyd.workloads import make_workload
from policyd.workloads.calls import Workload

GiB = 1024**3
DEFAULT_WORKLOADS = ("fact-checking", "code-writing")


@dataclass(slots=True)
class _Counters:
    events: int = 0


@dataclass(slots=True)
class _State:
    counters: _Counters = field(default_factory=_Counters)


class RemoteEngine:
    """Stands in for the simulator's Engine: the decisions come from a daemon over the wire.

    The simulator calls ``apply`` (events out), reads ``state.counters.events``, and asks for
    ``snapshot()`` and ``prefetch(budget)``; with no fresh snapshot it gets an empty one (plain
    LRU, store everything), as a connector falls back when the daemon is silent.
    """

    def __init__(
        self,
        client: DaemonClient,
        sim_now: Callable[[], float],
        *,
        speedup: float,
        policy: str,
        on_pace: Callable[[float], None] | None = None,
    ) -> None:
        self.client = client
        self.sim_now = sim_now
        self.speedup = speedup
        self.policy = policy
        self.on_pace = on_pace
        self.state = _State()
        self.started_wall = time.monotonic()
        self.snapshots_used = 0
        self.snapshots_missing = 0

    def apply(self, batch: EventBatch) -> None:
        target = self.started_wall + self.sim_now() / self.speedup
        delay = target - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        if self.on_pace is not None:
            self.on_pace(self.sim_now())
        self.client.send_many(batch.events)
        self.state.counters.events += len(batch.events)

    def snapshot(self) -> PolicySnapshot:
        snap = self.client.snapshot()
        now = self.sim_now()
        if snap is None:
            self.snapshots_missing += 1
            return PolicySnapshot(version=0, ts=now, ttl_s=math.inf, policy=self.policy)
        self.snapshots_used += 1
        return msgspec.structs.replace(snap, ts=now)  # the simulator dates it in its own time

    def prefetch(self, budget_blocks: int) -> list[int]:
        snap = self.client.snapshot()
        return list(snap.stage[:budget_blocks]) if snap is not None else []


@dataclass
class DemoRun:
    """The outcome of a demo; ``stop()`` shuts the daemon down when it was kept serving."""

    summary: dict[str, Any]
    daemon: RunningDaemon | None = None

    @property
    def http_url(self) -> str | None:
        return self.daemon.http_url if self.daemon is not None else None

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()


def demo_workload(names: Sequence[str], workflows: int, seed: int) -> Workload:
    """``workflows`` workflows split over the named generators, interleaved."""
    per = max(1, workflows // len(names))
    parts = [make_workload(n, seed=seed, workflows=per).streams for n in names]
    streams = [s for group in zip(*parts, strict=False) for s in group]
    return Workload(name="+".join(names), streams=streams)


def _ratio(n: float, d: float) -> float | None:
    return n / d if d else None


def run_demo(
    *,
    workloads: Sequence[str] = DEFAULT_WORKLOADS,
    workflows: int = 40,
    db: Path | None = None,
    seconds: float = 40.0,
    speedup: float | None = None,
    concurrency: int = 8,
    gpu_blocks: int = 3000,
    host_blocks: int = 8192,
    policy: str = "agentkv",
    seed: int = 0,
    keep_serving: bool = False,
    http_port: int = 0,
    settings: DaemonSettings | None = None,
    progress: Callable[[str], None] | None = None,
) -> DemoRun:
    """Start a daemon, replay the workload through it, and summarise.

    ``speedup`` defaults to what fits the replay in about ``seconds`` (from a quick in-process
    LRU replay of the same workload, which is also the summary's baseline)."""
    say = progress or (lambda _msg: None)
    workload = demo_workload(workloads, workflows, seed)
    config = SimConfig(concurrency=concurrency, gpu_blocks=gpu_blocks, host_blocks=host_blocks)
    say(f"workload {workload.name}: {len(workload.streams)} workflows, {workload.calls} calls")
    baseline = simulate(workload, "lru", config)
    if speedup is None:
        speedup = max(1.0, baseline.makespan_s / max(1.0, 0.8 * seconds))
    db = db if db is not None else default_db_path()
    base = settings or DaemonSettings.load()
    daemon_settings = base.replace(
        db=db,
        events="tcp://127.0.0.1:*",
        snapshots="tcp://127.0.0.1:*",
        http_port=http_port,
        policy=policy,
        gpu_blocks=gpu_blocks,
        stats_interval_s=min(base.stats_interval_s, 2.0),
        sizing_interval_s=min(base.sizing_interval_s, 5.0),
    )
    daemon = start_daemon(daemon_settings)
    service = daemon.service
    kvb = get_profile(config.profile).kv_bytes_per_block
    service.update_settings(
        {"host_tier_gib": host_blocks * kvb / GiB, "history_publish_interval_s": 10.0},
        actor="demo",
    )
    say(f"daemon: {daemon.http_url} (events {daemon.events_endpoint}), history {db}")
    client = DaemonClient(
        "demo-sim", Endpoints(events=daemon.events_endpoint, snapshots=daemon.snapshots_endpoint)
    )
    started = time.monotonic()
    last_report = [started]

    def pace(sim_s: float) -> None:
        now = time.monotonic()
        if now - last_report[0] >= 3.0:
            last_report[0] = now
            st = daemon_stats(service)
            acc = st["prediction_accuracy"].get("1")
            say(
                f"  {now - started:5.1f}s wall, {sim_s:6.1f}s simulated: "
                f"{st['requests']} requests, {st['events']} events applied, "
                f"step-1 accuracy {acc if acc is None else round(acc, 3)}"
            )

    try:
        sim = Simulator(
            workload,
            make_policy(policy),
            config,
            engine=lambda sim_now: RemoteEngine(
                client, sim_now, speedup=speedup, policy=policy, on_pace=pace
            ),
        )
        remote = sim.engine
        assert isinstance(remote, RemoteEngine)
        report = sim.run()
        client.flush(10.0)
        _wait_applied(service, remote.state.counters.events, timeout_s=30.0)
        service.refresh_sizing()
        service.publish_history()
        summary = _summary(
            report,
            baseline=baseline,
            daemon=daemon,
            client=client,
            remote=remote,
            wall_s=time.monotonic() - started,
        )
        summary["speedup"] = speedup
    except BaseException:
        client.close(0.5)
        daemon.stop()
        raise
    client.close(1.0)
    if keep_serving:
        return DemoRun(summary, daemon)
    daemon.stop()
    return DemoRun(summary)


def _wait_applied(service: Any, events: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with service.lock:
            applied = service.counts["events"]
        if applied >= events and not len(service.queue):
            return
        time.sleep(0.05)


def _summary(
    report: Report,
    *,
    baseline: Report,
    daemon: RunningDaemon,
    client: DaemonClient,
    remote: RemoteEngine,
    wall_s: float,
) -> dict[str, Any]:
    service = daemon.service
    st = daemon_stats(service)
    sizing = service.sizing_view
    hist = st["history"]
    snapshot_path = hist.get("snapshot_path")

    def hits(r: Report) -> dict[str, float | None]:
        return {
            "gpu": _ratio(r.gpu_hit_blocks, r.prompt_blocks),
            "host": _ratio(r.host_hit_blocks, r.prompt_blocks),
            "total": _ratio(r.gpu_hit_blocks + r.host_hit_blocks, r.prompt_blocks),
        }

    return {
        "wall_s": wall_s,
        "policy": report.policy,
        "requests": report.requests,
        "prompt_blocks": report.prompt_blocks,
        "hit_ratio": hits(report),
        "lru_hit_ratio": hits(baseline),
        "recomputed_tokens": report.recomputed_tokens,
        "lru_recomputed_tokens": baseline.recomputed_tokens,
        "simulated_s": report.makespan_s,
        "events_sent": client.stats()["sent_events"],
        "events_dropped": client.stats()["dropped_events"],
        "daemon_events": st["events"],
        "snapshots_used": remote.snapshots_used,
        "snapshots_missing": remote.snapshots_missing,
        "prediction_accuracy": st["prediction_accuracy"],
        "sizing": {
            "working_set_gib": sizing.get("working_set_gib"),
            "recommended_host_gib": sizing.get("recommended_host_gib"),
            "current_host_gib": sizing.get("current_host_gib"),
            "reason": sizing.get("reason"),
        },
        "db": str(service.settings.db),
        "snapshot_path": snapshot_path,
        "http_url": daemon.http_url,
        "history_rows": hist.get("rows_written"),
    }


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def render_summary(s: dict[str, Any]) -> str:
    hr, lru = s["hit_ratio"], s["lru_hit_ratio"]
    acc = ", ".join(f"step {k}: {_fmt(v)}" for k, v in s["prediction_accuracy"].items())
    sz = s["sizing"]
    snap = s["snapshot_path"]
    lines = [
        f"demo finished in {s['wall_s']:.1f} s ({s['simulated_s']:.0f} s simulated, "
        f"speedup {s['speedup']:.1f}x)",
        f"requests: {s['requests']}, prompt blocks {s['prompt_blocks']}; events sent "
        f"{s['events_sent']} (dropped {s['events_dropped']}), applied by the daemon "
        f"{s['daemon_events']}",
        f"hit ratio under {s['policy']} via the daemon: gpu {_fmt(hr['gpu'])}, host "
        f"{_fmt(hr['host'])}, total {_fmt(hr['total'])}",
        f"same replay under plain LRU (in-process): gpu {_fmt(lru['gpu'])}, host "
        f"{_fmt(lru['host'])}, total {_fmt(lru['total'])}",
        f"recomputed prompt tokens: {s['recomputed_tokens']:,} vs LRU "
        f"{s['lru_recomputed_tokens']:,}",
        f"next-agent prediction accuracy (rolling top-1): {acc}",
        f"host-tier sizing: working set {_fmt(sz['working_set_gib'])} GiB, recommended "
        f"{_fmt(sz['recommended_host_gib'])} GiB (current {_fmt(sz['current_host_gib'])} GiB): "
        f"{sz['reason']}",
        f"history: {s['db']}; published snapshot: {snap}",
        "query it: policyd sql "
        + shlex.quote(
            "select agent, count(*) as calls, avg(gpu_hit_blocks + host_hit_blocks) "
            "as hit_blocks from requests group by agent order by calls desc"
        )
        + (f" --db {shlex.quote(str(s['db']))}" if s["db"] else ""),
    ]
    return "\n".join(lines)


def demo_main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    names = [n.strip() for n in str(args.workload).split(",") if n.strip()]

    def say(msg: str) -> None:
        print(msg, flush=True)

    run = run_demo(
        workloads=names,
        workflows=args.workflows,
        db=args.db,
        seconds=args.seconds,
        speedup=args.speedup,
        concurrency=args.concurrency,
        policy=args.policy,
        seed=args.seed,
        keep_serving=args.keep_serving,
        http_port=args.http_port,
        progress=say,
    )
    print(render_summary(run.summary), flush=True)
    if run.daemon is not None:
        print(f"daemon still serving at {run.http_url} (Ctrl-C to stop)", flush=True)
        try:
            while True:
                time.sleep(1.0)
        except KeyboardInterrupt:
            pass
        finally:
            run.stop()
    print(f"reproduce: policyd {' '.join(shlex.quote(a) for a in argv)}", file=sys.stderr)
    return 0


__all__ = ["DemoRun", "RemoteEngine", "demo_workload", "render_summary", "run_demo"]
