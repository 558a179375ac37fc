"""``policyd host-losses``: the event log follows the host tier exactly, and the fates of LRU's
host hits add up."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import pytest

from experiments.host_losses import (
    EVICTED,
    EVICTED_AS,
    GPU,
    HOST,
    EventLog,
    compare,
    logged_replay,
    main,
)
from experiments.matrix import Source, largest_request, load_source
from policyd.core.engine import Engine
from policyd.policies import make_policy
from policyd.policies.guard import RecencyGuard, WindowRecord
from policyd.sim.cache import HostOrderQueue
from policyd.sim.replay import SimConfig, Simulator
from policyd.workloads.calls import Workload


@pytest.fixture(scope="module")
def financial() -> tuple[Workload, SimConfig]:
    work = load_source(Source("financial"), 0, 6)
    blocks = largest_request(work)
    return work, SimConfig(concurrency=6, gpu_blocks=blocks, host_blocks=blocks)


def test_the_log_holds_what_the_host_tier_holds(financial: tuple[Workload, SimConfig]) -> None:
    work, config = financial
    policy = make_policy("agentkv", guard=False)
    log: EventLog | None = None

    def engine(clock: Callable[[], float]) -> EventLog:
        nonlocal log
        log = EventLog(Engine(policy, clock=clock))
        return log

    sim = Simulator(work, policy, config, engine=engine)
    assert log is not None and isinstance(sim.host.queue, HostOrderQueue)
    log.watch(sim.host.queue.order)
    report = sim.run()
    resident = {b for b, stays in log.stays.items() if stays[-1].removed_seq is None}
    assert resident == set(sim.host.queue)
    evicted = [s for stays in log.stays.values() for s in stays if s.removed_seq is not None]
    assert len(evicted) == report.host_evicted_blocks > 0
    assert {s.evicted_as for s in evicted} <= set(EVICTED_AS)
    assert sum(r.host_hit for r in log.requests.values()) == report.host_hit_blocks


def test_lru_against_itself_keeps_every_host_hit(financial: tuple[Workload, SimConfig]) -> None:
    work, config = financial
    a, _ = logged_replay(work, "lru", config)
    b, _ = logged_replay(work, "lru", config)
    losses = compare(a, b)
    assert losses.lru_host_hits > 0
    assert losses.classes == {HOST: losses.lru_host_hits}


def test_the_fates_add_up_to_lrus_host_hits(financial: tuple[Workload, SimConfig]) -> None:
    work, config = financial
    lru, _ = logged_replay(work, "lru", config)
    other, _ = logged_replay(work, "agentkv[guard=false]", config)
    losses = compare(lru, other)
    assert losses.lru_host_hits == sum(r.host_hit for r in lru.requests.values()) > 0
    assert len(losses.evicted) == losses.classes[EVICTED]
    for stay, needed_ts in losses.evicted:  # evicted before the request that needed it
        assert stay.removed_ts is not None and stay.stored_ts <= stay.removed_ts <= needed_ts
    served = losses.classes[HOST] + losses.classes[GPU]
    assert sum(losses.lost_by_agent.values()) == losses.lru_host_hits - served


def test_the_command_prints_its_tables_and_refuses_bad_input(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--streams", "4", "--concurrency", "4", "--gpu-blocks", "2108"]
    assert main([*argv, "--host-blocks", "2108", "--policy", "efficientagent"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("financial, C=4, 2,108 GPU + 2,108 host blocks: hit rate lru ")
    for fate in ("host hit", "never written", "resident behind a miss", "learned order, scored"):
        assert fate in out
    assert "reproduce: policyd host-losses --streams 4" in out
    bad_input = (
        ["--host-blocks", "0"],
        ["--policy", "nope"],
        ["--policy", "lru[x=1]"],
        ["--policy", "agentkv[guard_arm=best]"],
    )
    for bad in bad_input:
        with pytest.raises(SystemExit):
            main([*argv, *bad])


def test_the_guards_windows_add_up_to_its_counters(financial: tuple[Workload, SimConfig]) -> None:
    """``--windows``: one record per closed window, the arm chosen after one window is the arm
    published in the next, and the hits add up to the guard's own counters."""
    work, config = financial
    windows: list[WindowRecord] = []
    policy = make_policy("agentkv")
    guard = policy.guard  # type: ignore[attr-defined]
    assert isinstance(guard, RecencyGuard)
    guard.journal = windows
    Simulator(work, policy, config).run()
    c = guard.counters
    assert len(windows) == c.windows > 1
    assert windows[0].published == "recency"
    assert all(a.chosen == b.published for a, b in pairwise(windows))
    assert sum(w.hits["recency"] for w in windows) <= c.default_shadow_hits
    assert sum(w.real_hits for w in windows) <= c.real_hits
    for arm in ("recency", "filter", "learned"):
        assert sum(w.published == arm for w in windows) == getattr(c, f"{arm}_windows")


def test_the_command_prints_the_guards_windows(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--streams", "4", "--concurrency", "4", "--gpu-blocks", "2108"]
    assert main([*argv, "--host-blocks", "2108", "--policy", "agentkv", "--windows"]) == 0
    out = capsys.readouterr().out
    assert "the recency guard's windows" in out and "published shadow" in out
    assert main([*argv, "--host-blocks", "2108", "--policy", "lru", "--windows"]) == 0
    assert "the recency guard's windows" not in capsys.readouterr().out
