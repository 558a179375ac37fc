"""Invariants of the simulator and the Engine, checked from the outside on recorded event streams.

Every registered policy is replayed over seeded synthetic workloads and small random ones, at
several capacities and concurrencies. The checks rebuild each tier's residency from the events
alone (``BlocksStored``/``BlocksLoaded`` add, ``BlocksRemoved``/``AllBlocksCleared`` drop), so
they hold the simulator to what it tells the Engine, and the Engine to what it was told.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from policyd.core.engine import Clock, EngineState
from policyd.core.queues import KeyedQueue, LruQueue
from policyd.core.types import (
    BLOCK_SIZE_TOKENS,
    AllBlocksCleared,
    BlocksLoaded,
    BlocksRemoved,
    BlocksStored,
    Event,
    EventBatch,
    PrefixHit,
    RequestFinished,
    RequestStarted,
    Tier,
)
from policyd.policies import POLICIES, Policy
from policyd.sim.cache import HostOrderQueue, RunningSpace
from policyd.sim.replay import SimConfig
from policyd.workloads.calls import Call, Workload
from tests.conftest import RecordingEngine, check_ownership, replay, sim_cases

POLICY_NAMES = sorted(POLICIES)
# Replays are the costly part: no shrinking (generated workloads are small already, and each bug
# found here gets a hand-made minimal replay among the golden scenarios at the end of the file).
SIM_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
RUNNING_SPACES = ("shared", "separate")
cases = pytest.mark.parametrize("running_space", RUNNING_SPACES)
policies = pytest.mark.parametrize("policy_name", POLICY_NAMES)


class Residency:
    """Which blocks each tier holds, rebuilt from events only, read as the Engine reads them
    (a ``BlocksLoaded`` puts blocks on the GPU)."""

    def __init__(self) -> None:
        self.tiers: dict[Tier, set[int]] = {"gpu": set(), "host": set()}

    def apply(self, event: Event) -> None:
        if isinstance(event, BlocksStored):
            self.tiers[event.tier].update(event.block_hashes)
        elif isinstance(event, BlocksLoaded):
            self.tiers["gpu"].update(event.block_hashes)
        elif isinstance(event, BlocksRemoved):
            self.tiers[event.tier].difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.tiers[event.tier].clear()


def walk(events: list[Event]) -> Iterator[tuple[Event, Residency]]:
    """Each event with the residency just *before* it (then applies it)."""
    residency = Residency()
    for event in events:
        yield event, residency
        residency.apply(event)


def hit_limit(started: RequestStarted, config: SimConfig) -> int:
    n = len(started.block_hashes)
    if config.recompute_last_token:
        return min(n, (started.prompt_tokens - 1) // BLOCK_SIZE_TOKENS)
    return n


# ---- a. running requests keep their blocks -------------------------------------------------------


@cases
@policies
@SIM_SETTINGS
@given(data=st.data())
def test_no_policy_evicts_a_block_of_a_running_request(
    policy_name: str, running_space: RunningSpace, data: st.DataObject
) -> None:
    """A running request holds its GPU prefix hit and the prompt blocks stored on the GPU for
    it (``BlocksStored(tier="gpu", request_id=...)``); none may leave the GPU before it ends.

    A block past the first miss that the GPU already caches (or that it declines to cache) is
    recomputed or loaded into the request's own scratch copy, as vLLM does, so the cached copy
    is not the request's and may be evicted meanwhile (``policyd.sim.cache``'s docstring)."""
    workload, config = data.draw(sim_cases(running_space), label="case")
    run = replay(workload, policy_name, config)
    prompt: dict[str, RequestStarted] = {}
    held: dict[str, set[int]] = {}
    for event, residency in walk(run.events):
        if isinstance(event, RequestStarted):
            prompt[event.request_id] = event
            held[event.request_id] = set()
        elif isinstance(event, PrefixHit):
            hit = prompt[event.request_id].block_hashes[: event.gpu_blocks]
            assert set(hit) <= residency.tiers["gpu"]
            held[event.request_id].update(hit)
        elif isinstance(event, BlocksStored) and event.tier == "gpu" and event.request_id in held:
            rid = event.request_id
            held[rid].update(set(prompt[rid].block_hashes).intersection(event.block_hashes))
        elif isinstance(event, BlocksRemoved) and event.tier == "gpu":
            for rid, blocks in held.items():
                evicted = blocks.intersection(event.block_hashes)
                assert not evicted, f"{policy_name} evicted {evicted} of running request {rid}"
        elif isinstance(event, RequestFinished):
            held.pop(event.request_id)
    assert not held, "every request finished"
    assert len(prompt) == workload.calls


# ---- b. a prefix is used up to its first missing block, never past it -------------------------


@cases
@policies
@SIM_SETTINGS
@given(data=st.data())
def test_prefix_hits_stop_at_the_first_missing_block(
    policy_name: str, running_space: RunningSpace, data: st.DataObject
) -> None:
    workload, config = data.draw(sim_cases(running_space), label="case")
    run = replay(workload, policy_name, config)
    started: RequestStarted | None = None
    hits = 0
    for event, residency in walk(run.events):
        if isinstance(event, RequestStarted):
            started = event
            continue
        if not isinstance(event, PrefixHit):
            continue
        assert started is not None and started.request_id == event.request_id
        blocks = started.block_hashes
        g, h = event.gpu_blocks, event.host_blocks
        limit = hit_limit(started, config)
        gpu, host = residency.tiers["gpu"], residency.tiers["host"]
        assert g >= 0 and h >= 0 and event.recomputed_blocks >= 0
        assert g + h <= len(blocks)
        assert g <= limit, "the GPU hit obeys vLLM's last-token rule"
        assert set(blocks[:g]) <= gpu, "the GPU prefix was GPU-resident"
        assert set(blocks[g : g + h]) <= host, "the host run was host-resident"
        if g < limit:
            assert blocks[g] not in gpu, "the GPU prefix stopped before a resident block"
        if g + h < len(blocks):
            assert blocks[g + h] not in host, "the host run stopped before a resident block"
        hits += 1
        started = None
    assert hits == workload.calls


# ---- c. the wire codec changes nothing the Engine knows ------------------------------------------


def engine_view(state: EngineState) -> dict[str, object]:
    """Everything the Engine knows, as plain comparable values."""
    return {
        "workflows": {
            wid: (
                w.workflow_type,
                w.started_ts,
                w.last_ts,
                tuple(w.agents),
                w.running,
                w.done,
                frozenset(w.blocks),
            )
            for wid, w in state.workflows.items()
        },
        "requests": {
            rid: (
                r.workflow_id,
                r.agent,
                r.block_hashes,
                r.prompt_tokens,
                r.started_ts,
                r.hints,
                r.hit,
            )
            for rid, r in state.requests.items()
        },
        "resident": {tier: frozenset(blocks) for tier, blocks in state.resident.items()},
        "owners": {block: frozenset(wfs) for block, wfs in state.owners.items()},
        "recency": dict(state.recency),
        "counters": state.counters,
        "last_seq": dict(state.last_seq),
    }


class ViewRecordingEngine(RecordingEngine):
    """Also keeps what the Engine knew after each batch."""

    def __init__(self, policy: Policy, *, clock: Clock) -> None:
        super().__init__(policy, clock=clock)
        self.views: list[dict[str, object]] = []

    def apply(self, batch: EventBatch) -> bool:
        applied = super().apply(batch)
        self.views.append(engine_view(self.state))
        return applied


@cases
@policies
@SIM_SETTINGS
@given(data=st.data())
def test_codec_roundtrip_leaves_the_engine_state_unchanged(
    policy_name: str, running_space: RunningSpace, data: st.DataObject
) -> None:
    """The same replay with every batch encoded and decoded on the way: the Engine knows the
    same things after every batch, and the report has the same figures."""
    workload, config = data.draw(sim_cases(running_space), label="case")
    direct = replay(workload, policy_name, config, ViewRecordingEngine)
    wired = replay(
        workload,
        policy_name,
        dataclasses.replace(config, codec_roundtrip=True),
        ViewRecordingEngine,
    )
    assert isinstance(direct.engine, ViewRecordingEngine)
    assert isinstance(wired.engine, ViewRecordingEngine)
    assert len(wired.engine.views) == len(direct.engine.views) > 0
    for after_wire, after_direct in zip(wired.engine.views, direct.engine.views, strict=True):
        assert after_wire == after_direct
    assert engine_view(wired.engine.state) == engine_view(direct.engine.state)
    assert wired.engine.batches == direct.engine.batches
    timing = ("wall_s", "refs_per_s")
    figures = {k: v for k, v in direct.report.to_json().items() if k not in timing}
    assert {k: v for k, v in wired.report.to_json().items() if k not in timing} == figures
    assert direct.report.requests == workload.calls


# ---- d. conservation and capacity -------------------------------------------------------------


@cases
@policies
@SIM_SETTINGS
@given(data=st.data())
def test_blocks_are_conserved_and_tiers_stay_within_capacity(
    policy_name: str, running_space: RunningSpace, data: st.DataObject
) -> None:
    workload, config = data.draw(sim_cases(running_space), label="case")
    run = replay(workload, policy_name, config)
    gpu_capacity, host_capacity = run.report.gpu_blocks, run.report.host_blocks
    prompt_blocks: dict[str, int] = {}
    gpu_hits = host_hits = 0
    residency = Residency()
    for event in run.events:
        residency.apply(event)
        if isinstance(event, RequestStarted):
            prompt_blocks[event.request_id] = len(event.block_hashes)
        elif isinstance(event, PrefixHit):
            served = event.gpu_blocks + event.host_blocks + event.recomputed_blocks
            assert served == prompt_blocks[event.request_id]
            gpu_hits += event.gpu_blocks
            host_hits += event.host_blocks
        assert len(residency.tiers["gpu"]) <= gpu_capacity, event
        assert len(residency.tiers["host"]) <= host_capacity, event
    r = run.report
    assert r.prompt_blocks == sum(prompt_blocks.values()) == workload.block_refs
    assert (r.gpu_hit_blocks, r.host_hit_blocks) == (gpu_hits, host_hits)
    # what the events say the tiers hold is what the cache model holds
    assert residency.tiers["gpu"] == set(run.sim.gpu.refs)
    host_queue = run.sim.host.queue
    assert isinstance(host_queue, LruQueue | KeyedQueue | HostOrderQueue)
    assert residency.tiers["host"] == set(host_queue)
    assert run.engine.state.resident == residency.tiers


# ---- e. the Engine's memory is bounded by what is resident ---------------------------------------


@cases
@policies
@SIM_SETTINGS
@given(data=st.data())
def test_engine_memory_is_bounded_by_what_is_resident(
    policy_name: str, running_space: RunningSpace, data: st.DataObject
) -> None:
    """After a replay every request and workflow has finished: what the Engine still remembers
    (owners, recency, workflows) is only what some tier still holds."""
    workload, config = data.draw(sim_cases(running_space), label="case")
    run = replay(workload, policy_name, config)
    state = run.engine.state
    check_ownership(state)
    resident = state.resident["gpu"] | state.resident["host"]
    assert not state.requests
    assert set(state.owners) <= resident
    assert set(state.recency) <= resident
    prompt_blocks = {b for stream in workload for call in stream for b in call.block_hashes}
    for block in resident & prompt_blocks:
        assert state.is_retired(block), f"resident prompt block {block} lost its owners"
        assert block in state.recency, f"resident prompt block {block} lost its recency"
    for wf in state.workflows.values():
        assert wf.done and wf.running == 0
        assert wf.blocks and wf.blocks <= resident, wf.workflow_id
    assert state.counters.workflows_started == state.counters.workflows_finished
    assert state.counters.workflows_finished == len(workload.streams)
    assert state.counters.seq_gaps == 0
    assert state.counters.unknown_requests == 0


# ---- golden scenarios ----------------------------------------------------------------------------


def test_loaded_blocks_the_gpu_does_not_cache_are_not_reported_resident() -> None:
    """Scenario: ``running_space="separate"``, a 2-block GPU and a roomy host tier. Call 1
    computes blocks 11-14: the GPU caches 11, 12 (then it is full of referenced blocks) and the
    host stores all four. Call 2 repeats the prompt: 11, 12 hit on the GPU, 13, 14 are loaded
    from the host, and the full GPU cannot cache them. The events must not leave the Engine
    believing 13 and 14 are GPU-resident: no later event would ever remove them."""
    call = Call(workflow_id="w", agent="a", block_hashes=(11, 12, 13, 14), prompt_tokens=65)
    config = SimConfig(concurrency=1, gpu_blocks=2, host_blocks=10, running_space="separate")
    run = replay(Workload(name="golden", streams=[[call, call]]), "lru", config)
    assert set(run.sim.gpu.refs) == {11, 12}
    assert run.engine.state.resident["gpu"] == {11, 12}


def test_a_repeated_fully_cached_prompt_keeps_its_blocks_owned() -> None:
    """Scenario: shared space, a 2-block GPU, no host tier. Call 1 caches blocks 11, 12 and
    frees them tail first (12 heads the eviction queue). Call 2 repeats the 32-token prompt:
    vLLM's last-token rule limits the hit to 11, allocating its new block evicts the cached 12,
    and the call stores 12 again. When the workflow ends, both resident blocks must be retired
    (owned by the finished workflow) and ranked by recency."""
    call = Call(workflow_id="w", agent="a", block_hashes=(11, 12), prompt_tokens=32)
    config = SimConfig(concurrency=1, gpu_blocks=2, host_blocks=0)
    run = replay(Workload(name="golden", streams=[[call, call]]), "lru", config)
    removed = [e for e in run.events if isinstance(e, BlocksRemoved)]
    assert removed == [BlocksRemoved(ts=removed[0].ts, tier="gpu", block_hashes=(12,))]
    state = run.engine.state
    assert state.resident["gpu"] == {11, 12}
    assert sorted(state.retired_blocks("gpu")) == [11, 12]
    assert set(state.recency) == {11, 12}
