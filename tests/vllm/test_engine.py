"""AgentKVConnector inside the real vLLM 0.32 engine (CPU platform), against a baseline without
any connector: host-tier hits after GPU eviction with identical tokens, the write filter, retired
workflows evicted first, and a daemon killed and restarted mid-run."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from policyd.core.types import (
    BlocksLoaded,
    BlocksRemoved,
    BlocksStored,
    Event,
    PrefixHit,
    RequestStarted,
    WriteFilter,
)

from .conftest import PHASES, Engine, Prompt, StandInDaemon

pytestmark = pytest.mark.vllm


def started(events: list[Event], prompt: Prompt) -> list[RequestStarted]:
    wf = prompt.params["workflow_id"]
    return [e for e in events if isinstance(e, RequestStarted) and e.workflow_id == wf]


def host_stored(events: list[Event]) -> set[int]:
    return {
        h
        for e in events
        if isinstance(e, BlocksStored) and e.tier == "host"
        for h in e.block_hashes
    }


def apply(daemon: StandInDaemon, engine: Engine, warmups: int = 1, **fields: Any) -> None:
    """Publish a snapshot and let the connector take it before the next phase: the client
    receives it within ~0.1 s and applies it at the next engine step (a warm-up request). The
    connector does a bounded amount of the snapshot's work per scheduler step (12 operations,
    the retired set's recount and the host order's re-keying included): ``warmups`` requests
    give it the steps to finish."""
    daemon.publish(**fields)
    time.sleep(1.0)
    for _ in range(warmups):
        engine.generate([PHASES["offload"][0][0]])


def run_phase(engine: Engine, name: str) -> list[list[tuple[tuple[int, ...], int]]]:
    return [engine.generate(call) for call in PHASES[name]]


def tokens_of(results: list[list[tuple[tuple[int, ...], int]]]) -> list[list[tuple[int, ...]]]:
    return [[out for out, _ in call] for call in results]


def test_host_tier_serves_prefixes_the_gpu_evicted_with_identical_tokens(
    engine: Engine, daemon: StandInDaemon, baseline: dict[str, Any]
) -> None:
    """Scenario: four 10-block prompts through a 24-block GPU pool, twice; no snapshot (LRU).

    The second round finds the evicted prefixes in the host tier: PrefixHit reports host
    blocks, BlocksLoaded events follow, and every generated token equals the baseline's.
    """
    results = run_phase(engine, "offload")
    assert tokens_of(results) == baseline["offload"]
    events = daemon.wait_for(lambda ev: sum(isinstance(e, PrefixHit) for e in ev) >= 8)
    hits = [e for e in events if isinstance(e, PrefixHit)]
    assert len(hits) == 8
    second = hits[4:]
    assert sum(h.host_blocks for h in second) > 0, second
    assert any(isinstance(e, BlocksLoaded) and e.block_hashes for e in events)
    assert sum(cached for _, cached in results[1]) > 0
    # the first round's blocks reached the host tier
    first_blocks = {h for e in events if isinstance(e, RequestStarted) for h in e.block_hashes}
    assert host_stored(events) & first_blocks


def test_write_filter_declines_a_large_refill(
    engine: Engine, daemon: StandInDaemon, baseline: dict[str, Any]
) -> None:
    """Scenario: the daemon says 'fixed, at most 2 new blocks'; a request adding 10 new blocks
    is declined: none of its blocks reaches the host tier, and its tokens are unchanged."""
    apply(daemon, engine, write_filter=WriteFilter(mode="fixed", max_new_blocks=2))
    before = len(daemon.events())
    results = run_phase(engine, "write_filter")
    assert tokens_of(results) == baseline["write_filter"]
    events = daemon.wait_for(
        lambda ev: (
            any(isinstance(e, PrefixHit) for e in ev[before:])
            and any(type(e).__name__ == "RequestFinished" for e in ev[before:])
        )
    )
    (req,) = started(events[before:], PHASES["write_filter"][0][0])
    hit = next(
        e for e in events[before:] if isinstance(e, PrefixHit) and e.request_id == req.request_id
    )
    assert hit.recomputed_blocks > 2  # it really was a large refill
    daemon.wait_for(lambda ev: False, timeout_s=2.0)  # let any store that was made arrive
    assert not host_stored(daemon.events()) & set(req.block_hashes)


def test_retired_workflows_blocks_are_evicted_first(
    engine: Engine, daemon: StandInDaemon, baseline: dict[str, Any]
) -> None:
    """Scenario: workflow wf-old finishes (workflow_done) and the daemon retires it; new prompts
    then fill the host tier: the first host evictions are exactly wf-old's blocks, and its free
    GPU blocks are dropped by the connector."""
    apply(daemon, engine)  # no filter: store everything
    g_call, h_call, fill_call = PHASES["retire"]
    results = [engine.generate(g_call), engine.generate(h_call)]
    events = daemon.wait_for(lambda ev: bool(started(ev, g_call[0])))
    (g_req,) = started(events, g_call[0])
    g_blocks = set(g_req.block_hashes)
    events = daemon.wait_for(lambda ev: g_blocks <= host_stored(ev))
    assert g_blocks <= host_stored(events)
    apply(daemon, engine, warmups=8, retired_workflows=("wf-old",))  # the warm-ups apply it
    mark = len(daemon.events())
    results.append(engine.generate(fill_call))
    assert tokens_of(results) == baseline["retire"]
    events = daemon.wait_for(
        lambda ev: (
            sum(
                len(e.block_hashes)
                for e in ev[mark:]
                if isinstance(e, BlocksRemoved) and e.tier == "host"
            )
            >= len(g_blocks)
        )
    )
    removed_host = [
        h
        for e in events[mark:]
        if isinstance(e, BlocksRemoved) and e.tier == "host"
        for h in e.block_hashes
    ]
    assert set(removed_host[: len(g_blocks)]) == g_blocks, (removed_host, g_blocks)
    removed_gpu = {
        h
        for e in events
        if isinstance(e, BlocksRemoved) and e.tier == "gpu"
        for h in e.block_hashes
    }
    assert removed_gpu <= g_blocks  # lifecycle eviction touches nothing but retired blocks
    assert removed_gpu, "the retired workflow's free GPU blocks were not dropped"


def test_daemon_killed_garbage_and_restart_change_no_output(
    engine: Engine, daemon: StandInDaemon, baseline: dict[str, Any]
) -> None:
    """Scenario: the daemon publishes garbage, then pins and a pressure filter, is SIGKILLed
    while requests run, and comes back: every request completes with the baseline's tokens."""
    daemon.publish_garbage()
    first, second = PHASES["daemon_killed"]
    mark = len(daemon.events())
    daemon.publish(
        write_filter=WriteFilter(mode="conditioned", max_new_blocks=4, pressure=True),
        pin=tuple(started(daemon.events(), first[0])[0].block_hashes[:2]),
    )

    def kill_when_running() -> None:
        daemon.wait_for(lambda ev: any(isinstance(e, PrefixHit) for e in ev[mark:]), 120.0)
        daemon.kill()

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    out_first = engine.generate(first)
    killer.join()
    assert daemon.proc is not None and daemon.proc.poll() is not None  # it died mid-run
    out_second = engine.generate(second)  # no daemon at all
    daemon.start()  # restarted on the same ports: the client reconnects by itself
    out_third = engine.generate(second)
    expected = baseline["daemon_killed"]
    assert [o for o, _ in out_first] == expected[0]
    assert [o for o, _ in out_second] == expected[1]
    assert [o for o, _ in out_third] == expected[1]
    assert daemon.wait_for(lambda ev: len(ev) > mark + 1, 30.0)
