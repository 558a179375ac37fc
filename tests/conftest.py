"""Shared Hypothesis strategies and a recording replay harness for the policyd test suites.

Strategies cover every event type, ``EventBatch`` and ``PolicySnapshot`` (values the wire can
carry: 64-bit block hashes, finite or infinite floats, no NaN since NaN != NaN), and small
workloads whose prompts share prefixes the way agent prompts do. ``replay`` runs the simulator
with an Engine that records every batch it is fed, so tests check the cache from the outside.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import strategies as st

from policyd.core.engine import Clock, Engine, EngineState
from policyd.core.types import (
    AllBlocksCleared,
    BlocksLoaded,
    BlocksRemoved,
    BlocksStored,
    Event,
    EventBatch,
    PolicySnapshot,
    PrefixHit,
    RequestFinished,
    RequestStarted,
    ScoredBlocks,
    WorkflowFinished,
    WriteFilter,
)
from policyd.policies import POLICIES, FutureIndex, Policy, make_policy
from policyd.sim.cache import RunningSpace
from policyd.sim.replay import SimConfig, Simulator
from policyd.sim.report import Report
from policyd.workloads.calls import Call, PromptBuilder, Workload
from policyd.workloads.synthetic import synthetic_agents

# ---- vocabulary strategies ---------------------------------------------------------------------

texts = st.text(st.characters(codec="utf-8"), max_size=12)
u64 = st.integers(min_value=0, max_value=2**64 - 1)
i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
floats = st.floats(allow_nan=False)
timestamps = st.floats(min_value=0.0, max_value=1e9, allow_nan=False)
block_hashes = st.lists(u64, max_size=8).map(tuple)
tiers = st.sampled_from(["gpu", "host"])
optional_ids = st.none() | texts
hint_values = st.none() | st.booleans() | i64 | floats | texts
hints = st.dictionaries(texts, hint_values, max_size=4)

request_started = st.builds(
    RequestStarted,
    ts=timestamps,
    request_id=texts,
    workflow_id=texts,
    agent=texts,
    workflow_type=texts,
    block_hashes=block_hashes,
    prompt_tokens=st.integers(0, 2**31),
    hints=hints,
    session_id=optional_ids,
)
prefix_hits = st.builds(
    PrefixHit,
    ts=timestamps,
    request_id=texts,
    gpu_blocks=st.integers(0, 2**31),
    host_blocks=st.integers(0, 2**31),
    recomputed_blocks=st.integers(0, 2**31),
)
blocks_stored = st.builds(
    BlocksStored, ts=timestamps, tier=tiers, block_hashes=block_hashes, request_id=optional_ids
)
blocks_removed = st.builds(BlocksRemoved, ts=timestamps, tier=tiers, block_hashes=block_hashes)
blocks_loaded = st.builds(
    BlocksLoaded, ts=timestamps, block_hashes=block_hashes, request_id=optional_ids
)
all_cleared = st.builds(AllBlocksCleared, ts=timestamps, tier=tiers)
request_finished = st.builds(
    RequestFinished, ts=timestamps, request_id=texts, output_tokens=st.integers(0, 2**31)
)
workflow_finished = st.builds(
    WorkflowFinished,
    ts=timestamps,
    workflow_id=texts,
    reason=st.sampled_from(["client", "idle"]),
)
EVENT_STRATEGIES: dict[type, st.SearchStrategy[Event]] = {
    RequestStarted: request_started,
    PrefixHit: prefix_hits,
    BlocksStored: blocks_stored,
    BlocksRemoved: blocks_removed,
    BlocksLoaded: blocks_loaded,
    AllBlocksCleared: all_cleared,
    RequestFinished: request_finished,
    WorkflowFinished: workflow_finished,
}
events: st.SearchStrategy[Event] = st.one_of(*EVENT_STRATEGIES.values())
batches = st.builds(
    EventBatch,
    source=texts,
    seq=u64,
    events=st.lists(events, max_size=6).map(tuple),
)
snapshots = st.builds(
    PolicySnapshot,
    version=i64,
    ts=timestamps,
    ttl_s=floats,
    policy=texts,
    scores=st.lists(st.builds(ScoredBlocks, floats, block_hashes), max_size=4).map(tuple),
    default_score=floats,
    retired_workflows=st.lists(texts, max_size=4).map(tuple),
    write_filter=st.builds(
        WriteFilter,
        mode=st.sampled_from(["none", "fixed", "conditioned"]),
        max_new_blocks=i64,
        pressure=st.booleans(),
    ),
    pin=block_hashes,
    stage=block_hashes,
)

# ---- workloads ---------------------------------------------------------------------------------

# one length per name (same name, same blocks); whole blocks are common so that repeated prompts
# are often fully cached, where vLLM's last-token rule bites
SYSTEM_TOKENS = {"sysA": 48, "sysB": 64, "sysC": 7}
SEGMENT_TOKENS = (0, 5, 16, 23, 32)


@st.composite
def small_workloads(draw: st.DrawFn) -> Workload:
    """A few streams whose prompts share system prompts and messages across streams, grow
    within a stream, and sometimes repeat an earlier prompt exactly (fully cached prompts)."""
    streams: list[list[Call]] = []
    for s in range(draw(st.integers(1, 5))):
        wid = f"w{s}"
        builder = PromptBuilder()
        system = draw(st.sampled_from(sorted(SYSTEM_TOKENS)))
        builder.extend(system, SYSTEM_TOKENS[system])
        earlier: list[PromptBuilder] = []
        calls: list[Call] = []
        for k in range(draw(st.integers(1, 5))):
            repeat = draw(st.booleans())
            if earlier and repeat:
                prompt = draw(st.sampled_from(earlier)).copy()
            else:
                builder.extend(
                    draw(st.sampled_from(["m0", "m1", "m2"])), draw(st.sampled_from(SEGMENT_TOKENS))
                )
                prompt = builder.copy()
            earlier.append(prompt.copy())
            output_tokens = draw(st.sampled_from(SEGMENT_TOKENS))
            after = prompt.copy()
            output = tuple(after.extend(f"out:{wid}:{k}", output_tokens))
            if draw(st.booleans()):  # the next message follows this call's output
                builder = after
            calls.append(
                Call(
                    workflow_id=wid,
                    agent=draw(st.sampled_from(["planner", "coder"])),
                    block_hashes=tuple(prompt.hashes),
                    prompt_tokens=prompt.tokens,
                    output_tokens=output_tokens,
                    gap_s=draw(st.sampled_from([0.0, 0.01, 0.5])),
                    workflow_type="small",
                    output_block_hashes=output,
                    hints={"step": k},
                )
            )
        streams.append(calls)
    return Workload(name="small", streams=streams)


@st.composite
def synthetic_workloads(draw: st.DrawFn) -> Workload:
    """The seeded synthetic multi-agent workload, scaled down to a few dozen calls."""
    return synthetic_agents(
        seed=draw(st.integers(0, 2**32 - 1)),
        workflows=draw(st.integers(2, 10)),
        min_steps=2,
        max_steps=6,
        system_tokens=(32, 200),
        context_tokens=(16, 200),
        message_tokens=(8, 80),
        output_tokens=(0, 60),
        mean_gap_s=0.2,
    )


workloads = st.one_of(small_workloads(), synthetic_workloads())


def max_physical_blocks(workload: Workload) -> int:
    """GPU blocks the largest call needs while it runs (prompt and output)."""
    return max(-(-(c.prompt_tokens + c.output_tokens) // 16) for s in workload for c in s)


@st.composite
def sim_cases(
    draw: st.DrawFn, running_space: RunningSpace = "shared"
) -> tuple[Workload, SimConfig]:
    """A workload and a replay configuration whose GPU holds its largest call."""
    workload = draw(workloads)
    need = max(1, max_physical_blocks(workload))
    config = SimConfig(
        concurrency=draw(st.integers(1, 4)),
        gpu_blocks=need + draw(st.sampled_from([0, 1]) | st.integers(0, 3 * need)),
        host_blocks=draw(st.sampled_from([0, 1, need // 2, 2 * need, 10 * need])),
        running_space=running_space,
        recompute_last_token=draw(st.booleans()),
        snapshot_interval_s=0.05,
        prefetch_budget_blocks=draw(st.sampled_from([0, 4])),
        offload_prompt_only=draw(st.booleans()),
    )
    return workload, config


# ---- policies ----------------------------------------------------------------------------------


def call_order(report: Report, workload: Workload) -> list[tuple[str, Sequence[int]]]:
    """The order calls reached the cache in a recorded replay, each with its blocks."""
    order: list[tuple[str, Sequence[int]]] = []
    for rec in report.records:
        stream, index = (int(x) for x in rec.request_id.split("."))
        call = workload.streams[stream][index]
        order.append((rec.request_id, call.block_hashes + call.output_block_hashes))
    return order


def build_policy(name: str, order: Sequence[tuple[str, Sequence[int]]] = ()) -> Policy:
    """Any registered policy; an oracle is given the future ``order`` of calls."""
    if POLICIES[name].ordering != "oracle":
        return make_policy(name)
    return make_policy(name, future=FutureIndex(order))


# ---- a replay recorded from the outside ----------------------------------------------------------


class RecordingEngine(Engine):
    """An Engine that keeps every batch it is fed, in order."""

    def __init__(self, policy: Policy, *, clock: Clock) -> None:
        super().__init__(policy, clock=clock)  # the simulator's own engine's settings
        self.batches: list[EventBatch] = []

    def apply(self, batch: EventBatch) -> bool:
        self.batches.append(batch)
        return super().apply(batch)


@dataclass
class Replay:
    sim: Simulator
    report: Report
    engine: RecordingEngine
    events: list[Event] = field(default_factory=list)


def replay(
    workload: Workload,
    policy_name: str,
    config: SimConfig,
    engine_cls: type[RecordingEngine] = RecordingEngine,
) -> Replay:
    """Run one replay with a recording Engine (given to the simulator as its engine)."""
    order: list[tuple[str, Sequence[int]]] = []
    if POLICIES[policy_name].ordering == "oracle":  # the future: an LRU replay's call order
        recording = dataclasses.replace(config, record_requests=True)
        order = call_order(Simulator(workload, make_policy("lru"), recording).run(), workload)
    policy = build_policy(policy_name, order)
    sim = Simulator(workload, policy, config, engine=lambda clock: engine_cls(policy, clock=clock))
    engine = sim.engine
    assert isinstance(engine, RecordingEngine)
    report = sim.run()
    events = [event for batch in engine.batches for event in batch.events]
    return Replay(sim, report, engine, events)


# ---- Engine invariants ---------------------------------------------------------------------------


def check_ownership(state: EngineState) -> None:
    """``owners`` and each workflow's ``blocks`` are one relation seen from both sides."""
    for wid, wf in state.workflows.items():
        for block in wf.blocks:
            assert wid in state.owners.get(block, ()), (wid, block)
    for block, holders in state.owners.items():
        assert holders, block
        for wid in holders:
            assert block in state.workflows[wid].blocks, (wid, block)
    assert state.active_count == len(state.active_workflows())  # kept incrementally
