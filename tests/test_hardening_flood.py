"""Issue #32, point 3: requests that never finish expire after the request timeout even while
others run; a flood of unfinished requests keeps the Engine's state (and so what a snapshot
or a decision walks) bounded. Engine units on a fake clock, then a real daemon, then the
benchmark command's smoke run (figures printed, no threshold here). Last, a sender whose clock
never advances keeps the policy's time windows bounded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import zmq

from experiments.flood_bench import flood_events
from policyd.core.engine import Engine
from policyd.core.types import BATCH_CODEC, EventBatch, RequestFinished, RequestStarted
from policyd.daemon import views
from policyd.daemon.server import start_daemon
from policyd.policies import make_policy
from policyd.policies.efficientagent import WorkingSet
from policyd.policies.pacing import WorkflowPacing
from tests.test_daemon import settings_for, wait_for
from tests.test_engine import FakeClock, started


def engine(clock: FakeClock, **kw: object) -> Engine:
    return Engine(make_policy("pbkv"), clock=clock, idle_timeout_s=60.0, **kw)  # type: ignore[arg-type]


def test_an_unfinished_request_expires_while_others_run() -> None:
    clock = FakeClock()
    e = engine(clock, request_timeout_s=100.0)
    e.apply_event(started("lost", "w1", [1, 2, 3]))
    for t in range(1, 400):  # another workflow keeps running requests the whole time
        clock.now = float(t)
        e.apply_event(started(f"busy{t}", "w2", [10, 11]))
        e.apply_event(RequestFinished(ts=float(t), request_id=f"busy{t}"))
        e.tick()
    state = e.state
    assert "lost" not in state.requests and state.counters.requests_expired == 1
    assert "w1" not in state.workflows or state.workflows["w1"].done  # then idled out
    assert state.running_refs == {}  # its blocks are no longer counted as in use


def test_a_flood_of_unfinished_requests_keeps_the_state_bounded() -> None:
    clock = FakeClock()
    e = engine(clock, max_requests=300, max_workflows=200)
    for i, event in enumerate(flood_events(20_000)):
        clock.now = float(i)
        e.apply(EventBatch("flood", i + 1, (event,)))
    state = e.state
    assert len(state.requests) <= 300
    assert len([w for w in state.workflows.values() if not w.done]) <= 200
    assert len(state.workflows) <= 300  # finished ones go once none of their blocks is cached
    assert state.counters.workflows_evicted >= 20_000 - 200
    assert set(state.running_refs) <= {b for r in state.requests.values() for b in r.block_hashes}


def test_a_flood_of_new_workflows_does_not_push_out_established_ones() -> None:
    clock = FakeClock()
    e = engine(clock, max_workflows=50)
    for w in range(10):  # established: two calls each, idle now
        for i in range(2):
            e.apply_event(started(f"e{w}.{i}", f"est{w}", [w * 100 + i]))
            e.apply_event(RequestFinished(ts=0.0, request_id=f"e{w}.{i}"))
    for i, event in enumerate(flood_events(5000)):
        clock.now = 10.0 + i
        e.apply(EventBatch("flood", i + 1, (event,)))
    state = e.state
    assert all(not state.workflows[f"est{w}"].done for w in range(10))
    assert state.active_count == 50 and state.counters.workflows_evicted == 5000 - 40


def test_the_daemon_expires_unfinished_requests_and_bounds_a_flood(tmp_path: Path) -> None:
    running = start_daemon(
        settings_for(
            tmp_path,
            request_timeout_s=1.0,
            tick_interval_s=0.1,
            max_running_requests=500,
            max_active_workflows=100,
        )
    )
    try:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(running.events_endpoint)
        flood = flood_events(3000)
        for i in range(0, len(flood), 256):
            batch = EventBatch("flood", i // 256 + 1, tuple(flood[i : i + 256]))
            push.send(BATCH_CODEC.encode(batch))
        service = running.service
        assert wait_for(lambda: views.stats(service)["requests"] == 3000)
        stats = views.stats(service)
        assert stats["workflows_active"] <= 100 and stats["workflows_evicted"] >= 2900
        assert stats["state_sizes"]["requests_running"] <= 100
        assert wait_for(lambda: views.stats(service)["state_sizes"]["requests_running"] == 0)
        assert views.stats(service)["requests_expired"] >= 1
        assert service.ready()["ready"]
        push.close(0)
        ctx.term()
    finally:
        running.stop()


def test_the_flood_benchmark_prints_idle_and_flood_side_by_side() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "policyd.cli", "bench-flood", "--flood", "600",
         "--workflows", "40", "--active", "8", "--decisions", "40",
         "--max-active-workflows", "64", "--request-timeout-s", "2"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    text = out.stdout
    assert "idle" in text and "flood" in text and "p99 flood / idle:" in text
    assert "requests expired" in text


def test_a_clock_that_never_advances_keeps_the_policy_windows_bounded() -> None:
    """A sender whose every event carries one time (ts 0, as the ingest bench's do) never lets
    anything leave agentkv's time windows: the reference rate's window holds one entry per
    distinct time and the working set at most ``max_workflows`` workflows, the least recently
    seen going first - what a real clock would have expired, and no more, goes."""
    pacing = WorkflowPacing(window_s=60.0, max_entries=64)
    working = WorkingSet(window_s=60.0, max_workflows=100)
    for i in range(5000):
        event = RequestStarted(ts=0.0, request_id=f"r{i}", workflow_id=f"w{i}", agent="a",
                               block_hashes=(i, i + 1), prompt_tokens=32)  # fmt: skip
        pacing.observe(event)
        working.observe(event)
    assert len(pacing._refs) == 1
    assert pacing.reference_rate_blocks_per_s() == 5000 * 2 / 60.0  # nothing lost
    assert working.active_workflows(0.0) == 100
    assert list(working._workflow_seen_ts) == [f"w{i}" for i in range(4900, 5000)]
    # distinct times that never leave the window: the oldest entries go past the bound
    for i in range(1, 201):
        pacing.observe(RequestStarted(ts=i * 1e-6, request_id=f"t{i}", workflow_id="w",
                                      agent="a", block_hashes=(i,), prompt_tokens=16))  # fmt: skip
    assert len(pacing._refs) == 64
    assert pacing.reference_rate_blocks_per_s() == 64 / 60.0


def test_the_window_entries_merged_by_time_give_the_same_rate() -> None:
    """Requests at one time merged into one entry: the reference rate at every step is what a
    window of one entry per request gives."""
    pacing = WorkflowPacing(window_s=5.0)
    kept: list[tuple[float, int]] = []
    for i in range(400):
        ts = float(i // 7)  # seven requests a second, at whole seconds
        blocks = 1 + i % 5
        pacing.observe(RequestStarted(ts=ts, request_id=f"r{i}", workflow_id=f"w{i % 9}",
                                      agent="a", block_hashes=tuple(range(blocks)),
                                      prompt_tokens=16 * blocks))  # fmt: skip
        kept.append((ts, blocks))
        if i % 13 == 0:
            horizon = ts - 5.0
            expected = sum(b for t, b in kept if t >= horizon) / 5.0
            assert pacing.reference_rate_blocks_per_s() == expected
    assert len({t for t, _ in pacing._refs}) == len(pacing._refs) < 400 // 7  # one per time
