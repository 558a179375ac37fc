"""A daemon full of replay data for the dashboard's tests and screenshots (not used by the app).

``policyd demo`` (``policyd.daemon.demo.run_demo``) replays generated agent workflows through a real
daemon - real sockets, the real HTTP API, a real DuckDB history - until they all finish. The
dashboard's predictions page is about workflows still running, so ``start_live_daemon`` then
replays the first half of a few more workflows over the same wire and leaves them mid-flight
(their ``WorkflowFinished`` is held back; the daemon's idle timeout is minutes away), and asks
the daemon for a few synchronous decisions over HTTP, so that the decision log holds more than
retirements.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec

from policyd.core.client import DaemonClient
from policyd.core.types import EventBatch, WorkflowFinished
from policyd.core.wire import Endpoints
from policyd.daemon.demo import DEFAULT_WORKLOADS, DemoRun, RemoteEngine, demo_workload, run_demo
from policyd.daemon.server import RunningDaemon
from policyd.policies import make_policy
from policyd.sim.replay import SimConfig, Simulator
from policyd.workloads.calls import Workload

LIVE_PREFIX = "live-"


class _MidFlightEngine(RemoteEngine):
    """Forwards a replay's events to the daemon but never says a workflow finished."""

    def apply(self, batch: EventBatch) -> None:
        kept = tuple(e for e in batch.events if not isinstance(e, WorkflowFinished))
        super().apply(msgspec.structs.replace(batch, events=kept))


def half_workflows(workflows: int, seed: int) -> Workload:
    """``workflows`` demo workflows cut after half their calls, ids prefixed ``live-``."""
    workload = demo_workload(DEFAULT_WORKLOADS, workflows, seed)
    streams = [
        [
            dataclasses.replace(call, workflow_id=LIVE_PREFIX + call.workflow_id, last=False)
            for call in stream[: max(2, len(stream) // 2)]
        ]
        for stream in workload.streams
    ]
    return Workload(name=f"{workload.name} (mid-flight)", streams=streams)


def leave_mid_flight(
    daemon: RunningDaemon, *, workflows: int = 6, seed: int = 1, timeout_s: float = 30.0
) -> list[str]:
    """Replay half of ``workflows`` new workflows into ``daemon``; returns their ids once the
    daemon reports them active."""
    workload = half_workflows(workflows, seed)
    ids = sorted({stream[0].workflow_id for stream in workload.streams if stream})
    client = DaemonClient(
        "ui-mid-flight",
        Endpoints(events=daemon.events_endpoint, snapshots=daemon.snapshots_endpoint),
    )
    before = _taken(daemon)
    try:
        sim = Simulator(
            workload,
            make_policy("lru"),
            SimConfig(concurrency=len(ids)),
            engine=lambda sim_now: _MidFlightEngine(
                client, sim_now, speedup=math.inf, policy="lru"
            ),
        )
        sim.run()
        if not client.flush(timeout_s):
            raise RuntimeError("the mid-flight events did not leave the client")
        sent = client.stats()["sent_events"]
    finally:
        client.close(1.0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        received, settled = _taken(daemon)
        with daemon.service.lock:
            active = set(daemon.service.engine.state.workflows)
        # every event sent was received and applied (or shed), so the daemon's views - sizing
        # above all - no longer move under a reader
        done = received - before[0] >= sent and settled - before[1] >= received - before[0]
        if done and set(ids) <= active:
            return ids
        time.sleep(0.05)
    raise RuntimeError(f"the daemon did not report {ids} active within {timeout_s:g} s")


def _taken(daemon: RunningDaemon) -> tuple[int, int]:
    """Events the daemon received, and events it is done with (applied, shed or dropped)."""
    service = daemon.service
    counters = service.queue.counters
    with service.lock:
        applied = service.counts["events"]
    return counters.events_received, applied + counters.events_shed + counters.events_dropped


def ask_decisions(http_url: str, workload: Workload, *, timeout_s: float = 10.0) -> int:
    """Ask the daemon for synchronous evict / admit / prefetch decisions over HTTP about the
    blocks of ``workload`` (as another engine would); returns how many it answered. Each
    answer is a decision row with its reason in the history."""
    calls = [call for stream in workload.streams for call in stream]
    answered = 0
    with httpx.Client(base_url=http_url, timeout=timeout_s) as http:
        for index, call in enumerate(calls[:8]):
            hashes = [h for h in call.block_hashes if 0 <= h < 2**64][:64]
            for path, body in (
                ("/api/decide/admit", {"request_id": f"probe-{index}", "block_hashes": hashes}),
                ("/api/decide/evict", {"tier": "host", "candidates": hashes, "n_blocks": 4}),
                ("/api/decide/prefetch", {"budget_blocks": 16}),
            ):
                http.post(path, json=body).raise_for_status()
                answered += 1
    return answered


def start_live_daemon(
    db: Path,
    *,
    workflows: int = 16,
    seconds: float = 8.0,
    active: int = 6,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> tuple[DemoRun, list[str]]:
    """A kept-serving demo daemon plus ``active`` workflows left mid-flight; stop it with
    ``run.stop()``. It runs pbkv, whose decisions of every kind fill the dashboard's pages
    (agentkv, the daemon's default, publishes vLLM's default until its decisions win)."""
    run = run_demo(
        workflows=workflows,
        seconds=seconds,
        db=db,
        seed=seed,
        policy="pbkv",
        keep_serving=True,
        progress=progress,
    )
    assert run.daemon is not None
    try:
        # a prefetch budget and a conditioned write filter, so that pin / prefetch decisions
        # are made too (recorded as settings changes, like an operator's)
        errors = run.daemon.service.update_settings(
            {"prefetch_budget_blocks": 32, "write_filter_mode": "conditioned"}, actor="ui-demo"
        )
        if errors:
            raise RuntimeError(f"the daemon refused the demo's settings: {errors}")
        live = leave_mid_flight(run.daemon, workflows=active, seed=seed + 1)
        ask_decisions(run.daemon.http_url, half_workflows(active, seed + 1))
        run.daemon.service.refresh_sizing()  # of the settled state, not the last periodic one
        # close the interval holding the mid-flight traffic now: later periodic rows see no
        # new blocks, so a reader's cache history no longer grows under it
        run.daemon.service.cache_stats.record()
        run.daemon.service.publish_history()
    except BaseException:
        run.stop()
        raise
    return run, live
