"""The Engine: workflow lifecycle, ownership, residency, sequence gaps and bounded memory.

The Engine reads no clock but the one it is given: these tests inject a fake clock and tick it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policyd.core.engine import Engine, EngineState
from policyd.core.types import (
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
    WorkflowFinished,
)
from policyd.policies import make_policy
from policyd.policies.lru import LRU
from tests.conftest import check_ownership


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class RecordingLRU(LRU):
    """LRU that remembers every event it observed."""

    def __init__(self) -> None:
        self.observed: list[Event] = []

    def observe(self, event: Event, state: EngineState) -> None:
        self.observed.append(event)


def make_engine(clock: FakeClock | None = None, idle_timeout_s: float = 60.0) -> Engine:
    return Engine(make_policy("lru"), clock=clock or FakeClock(), idle_timeout_s=idle_timeout_s)


def started(
    rid: str, wid: str, blocks: Sequence[int], *, ts: float = 0.0, agent: str = "coder"
) -> RequestStarted:
    return RequestStarted(
        ts=ts,
        request_id=rid,
        workflow_id=wid,
        agent=agent,
        workflow_type="swe",
        block_hashes=tuple(blocks),
        prompt_tokens=16 * len(blocks) + 1,
        hints={"step": 1},
    )


def stored(tier: Tier, blocks: Sequence[int], rid: str | None = None) -> BlocksStored:
    return BlocksStored(ts=0.0, tier=tier, block_hashes=tuple(blocks), request_id=rid)


def removed(tier: Tier, blocks: Sequence[int]) -> BlocksRemoved:
    return BlocksRemoved(ts=0.0, tier=tier, block_hashes=tuple(blocks))


def finished(rid: str, ts: float = 0.0) -> RequestFinished:
    return RequestFinished(ts=ts, request_id=rid)


def wf_done(wid: str, ts: float = 0.0) -> WorkflowFinished:
    return WorkflowFinished(ts=ts, workflow_id=wid)


def feed(engine: Engine, *events: Event, source: str = "test") -> None:
    seq = engine.state.last_seq.get(source, 0) + 1
    engine.apply(EventBatch(source=source, seq=seq, events=events))


# ---- lifecycle ---------------------------------------------------------------------------------


def test_request_started_creates_the_workflow_and_the_request() -> None:
    engine = make_engine()
    feed(engine, started("r1", "w1", [1, 2, 3], ts=5.0, agent="planner"))
    state = engine.state
    wf = state.workflows["w1"]
    assert (wf.workflow_type, wf.started_ts, wf.last_ts) == ("swe", 5.0, 5.0)
    assert wf.agents == ["planner"] and wf.running == 1 and not wf.done
    assert wf.blocks == {1, 2, 3}
    req = state.requests["r1"]
    assert (req.workflow_id, req.agent, req.block_hashes) == ("w1", "planner", (1, 2, 3))
    assert req.prompt_tokens == 49 and req.hints == {"step": 1} and req.hit is None
    assert state.owners == {1: {"w1"}, 2: {"w1"}, 3: {"w1"}}
    assert state.counters.workflows_started == 1
    assert state.active_workflows() == [wf]


def test_calls_of_a_workflow_accumulate_agents_and_running_requests() -> None:
    engine = make_engine()
    feed(
        engine,
        started("r1", "w1", [1, 2], ts=1.0, agent="planner"),
        started("r2", "w1", [1, 2, 3], ts=2.0, agent="coder"),
        PrefixHit(ts=2.0, request_id="r2", gpu_blocks=2, host_blocks=0, recomputed_blocks=1),
    )
    wf = engine.state.workflows["w1"]
    assert wf.agents == ["planner", "coder"] and wf.running == 2 and wf.last_ts == 2.0
    assert wf.blocks == {1, 2, 3}
    assert engine.state.counters.workflows_started == 1
    hit = engine.state.requests["r2"].hit
    assert hit is not None and hit.gpu_blocks == 2
    feed(engine, finished("r1", ts=3.0))
    assert wf.running == 1 and wf.last_ts == 3.0 and "r1" not in engine.state.requests


def test_events_about_unknown_requests_are_counted_not_fatal() -> None:
    engine = make_engine()
    feed(
        engine,
        PrefixHit(ts=0.0, request_id="ghost", gpu_blocks=0, host_blocks=0, recomputed_blocks=0),
        finished("ghost"),
        wf_done("nobody"),
    )
    assert engine.state.counters.unknown_requests == 2
    assert engine.state.counters.events == 3
    assert engine.state.workflows == {}


def test_workflow_finished_marks_it_done_once() -> None:
    engine = make_engine()
    feed(engine, started("r1", "w1", [1]), stored("gpu", [1], "r1"), finished("r1"))
    feed(engine, wf_done("w1", ts=9.0))
    wf = engine.state.workflows["w1"]  # kept: its block is still cached
    assert wf.done and wf.last_ts == 9.0
    assert engine.state.active_workflows() == []
    feed(engine, wf_done("w1", ts=10.0))
    assert engine.state.counters.workflows_finished == 1
    assert wf.last_ts == 9.0


def test_a_workflow_with_nothing_cached_is_forgotten_when_it_finishes() -> None:
    engine = make_engine()
    feed(engine, started("r1", "w1", [1, 2]), finished("r1"), wf_done("w1"))
    state = engine.state
    assert state.workflows == {} and state.owners == {} and state.recency == {}


def test_a_workflow_id_reused_after_it_finished_starts_a_new_life() -> None:
    engine = make_engine()
    feed(engine, started("r1", "w1", [1], agent="a"), stored("gpu", [1]), finished("r1"))
    feed(engine, wf_done("w1"))
    feed(engine, started("r2", "w1", [1, 2], agent="b"))
    wf = engine.state.workflows["w1"]
    assert not wf.done and wf.agents == ["b"] and wf.running == 1
    assert engine.state.counters.workflows_started == 2
    assert not engine.state.is_retired(1)


def test_idle_workflow_is_inferred_finished_after_the_timeout() -> None:
    """Scenario: a workflow's last request ends at t=1000 (the Engine's clock) and the client
    never says it is done. While a request runs nothing is inferred, however long it takes; 60 s
    after the last request ended (and not a moment before) ``tick`` emits an idle
    ``WorkflowFinished``, applies it, and the policy observes it. A second tick infers nothing
    new. Idleness is measured on the Engine's clock, not the source's timestamps (``ts=10``)."""
    clock = FakeClock()
    policy = RecordingLRU()
    engine = Engine(policy, clock=clock, idle_timeout_s=60.0)
    feed(engine, started("r1", "w1", [1], ts=0.0), stored("gpu", [1], "r1"))
    clock.now = 1000.0
    assert engine.tick() == [], "a running request keeps its workflow alive"
    feed(engine, finished("r1", ts=10.0))
    clock.now = 1059.9
    assert engine.tick() == []
    clock.now = 1060.0
    inferred = engine.tick()
    assert inferred == [WorkflowFinished(ts=1060.0, workflow_id="w1", reason="idle")]
    assert policy.observed[-1] == inferred[0]
    wf = engine.state.workflows["w1"]
    assert wf.done
    assert engine.state.counters.idle_finishes == 1
    assert engine.state.counters.workflows_finished == 1
    clock.now = 5000.0
    assert engine.tick() == []
    assert engine.state.counters.idle_finishes == 1


def test_idle_inference_uses_only_the_injected_clock() -> None:
    """Scenario: the source's timestamps say nothing about when events arrived (another clock):
    w2's request ends at Engine time 3 although its event is stamped 100."""
    clock = FakeClock(now=0.0)
    engine = make_engine(clock, idle_timeout_s=5.0)
    feed(engine, started("r1", "w1", [1]), finished("r1", ts=0.0), started("r2", "w2", [2]))
    clock.now = 3.0
    feed(engine, finished("r2", ts=100.0))
    clock.now = 6.0
    assert [e.workflow_id for e in engine.tick()] == ["w1"]
    clock.now = 8.0
    assert [e.workflow_id for e in engine.tick()] == ["w2"]


# ---- ownership -----------------------------------------------------------------------------------


def test_a_block_referenced_by_two_workflows_is_shared_and_retired_when_both_are_done() -> None:
    """Scenario: two workflows share a system prompt (blocks 1, 2) and each has its own tail
    (3 for w1, 4 for w2). All is cached on the GPU. When w1 finishes only its own tail retires;
    the shared prefix retires when w2 finishes too."""
    engine = make_engine()
    feed(
        engine,
        started("r1", "w1", [1, 2, 3]),
        stored("gpu", [1, 2, 3], "r1"),
        started("r2", "w2", [1, 2, 4]),
        stored("gpu", [4], "r2"),
        finished("r1"),
        finished("r2"),
    )
    state = engine.state
    assert state.owners[1] == state.owners[2] == {"w1", "w2"}
    assert state.owners[3] == {"w1"} and state.owners[4] == {"w2"}
    assert state.retired_blocks("gpu") == []
    feed(engine, wf_done("w1"))
    assert sorted(state.retired_blocks("gpu")) == [3]
    assert not state.is_retired(1) and not state.is_retired(4)
    feed(engine, wf_done("w2"))
    assert sorted(state.retired_blocks("gpu")) == [1, 2, 3, 4]
    assert state.retired_blocks("host") == []


def test_owner_sets_are_shared_between_blocks_yet_change_per_block() -> None:
    """A request's new blocks share one owner set (none is built per block); a workflow that
    takes some of them changes only theirs, and one forgotten leaves the others' intact."""
    engine = make_engine()
    feed(engine, started("r1", "w1", [1, 2, 3]))
    owners = engine.state.owners
    assert owners[1] is owners[2] is owners[3]
    feed(engine, started("r2", "w2", [2, 3, 4]))
    assert owners == {1: {"w1"}, 2: {"w1", "w2"}, 3: {"w1", "w2"}, 4: {"w2"}}
    assert owners[2] is owners[3]  # regrouped once, not per block
    feed(engine, finished("r1"), wf_done("w1"))  # nothing of w1 cached: forgotten
    assert owners == {2: {"w2"}, 3: {"w2"}, 4: {"w2"}}
    check_ownership(engine.state)
    feed(engine, finished("r2"))
    assert owners == {} and engine.state.running_refs == {}


def test_a_block_nobody_referenced_is_never_retired() -> None:
    engine = make_engine()
    feed(engine, stored("gpu", [7]))
    assert not engine.state.is_retired(7)
    assert engine.state.retired_blocks("gpu") == []


def test_blocks_referenced_together_rank_deepest_first() -> None:
    """vLLM frees a request's blocks tail first, so its deepest block is the least recent;
    a later reference makes blocks more recent than everything before it."""
    engine = make_engine()
    feed(engine, started("r1", "w1", [1, 2, 3]), started("r2", "w2", [9]))
    recency = engine.state.recency
    assert recency[3] < recency[2] < recency[1] < recency[9]
    feed(engine, stored("gpu", [1, 2, 3, 9]), finished("r1"), finished("r2"))
    assert engine.victims("gpu", [1, 2, 3, 9], 2) == [3, 2]
    feed(engine, started("r3", "w1", [1, 2]))
    assert engine.victims("gpu", [1, 2, 3, 9], 4) == [3, 9, 2, 1]


# ---- residency -----------------------------------------------------------------------------------


def test_residency_follows_stored_removed_loaded_and_cleared_per_tier() -> None:
    engine = make_engine()
    resident = engine.state.resident
    feed(engine, stored("gpu", [1, 2, 3]), stored("host", [2, 3, 4]))
    assert resident == {"gpu": {1, 2, 3}, "host": {2, 3, 4}}
    feed(engine, removed("gpu", [1, 3]), removed("host", [99]))
    assert resident == {"gpu": {2}, "host": {2, 3, 4}}
    feed(engine, BlocksLoaded(ts=0.0, block_hashes=(3, 4)))
    assert resident == {"gpu": {2, 3, 4}, "host": {2, 3, 4}}
    feed(engine, AllBlocksCleared(ts=0.0, tier="host"))
    assert resident == {"gpu": {2, 3, 4}, "host": set()}
    feed(engine, AllBlocksCleared(ts=0.0, tier="gpu"))
    assert resident == {"gpu": set(), "host": set()}


def test_a_block_leaving_one_tier_keeps_its_owner_while_another_tier_holds_it() -> None:
    engine = make_engine()
    feed(engine, started("r1", "w1", [1]), stored("gpu", [1]), stored("host", [1]))
    feed(engine, finished("r1"), wf_done("w1"), removed("gpu", [1]))
    state = engine.state
    assert state.owners == {1: {"w1"}} and 1 in state.recency and "w1" in state.workflows
    assert state.retired_blocks("host") == [1]
    feed(engine, removed("host", [1]))
    assert state.owners == {} and state.recency == {} and state.workflows == {}


# ---- sequence gaps -------------------------------------------------------------------------------


def test_sequence_gaps_are_counted_per_source() -> None:
    engine = make_engine()
    empty: tuple[Event, ...] = ()
    for source, seq in [("a", 1), ("a", 2), ("b", 7), ("a", 4), ("b", 8), ("a", 5), ("b", 8)]:
        engine.apply(EventBatch(source=source, seq=seq, events=empty))
    counters = engine.state.counters
    assert counters.seq_gaps == 1  # a: 2 -> 4
    assert counters.seq_duplicates == 1  # b: 8 -> 8 (a replay), counted apart (issue #32)
    assert counters.batches == 7  # applied: drop_stale is off
    assert engine.state.last_seq == {"a": 5, "b": 8}


def test_duplicates_regressions_and_restarts_are_told_apart_and_stale_ones_dropped() -> None:
    engine = make_engine()
    engine.drop_stale = True
    empty: tuple[Event, ...] = ()
    applied = [
        engine.apply(EventBatch(source="a", seq=seq, events=empty)) for seq in (5, 6, 6, 3, 9, 1, 2)
    ]
    assert applied == [True, True, False, False, True, True, True]
    c = engine.state.counters
    assert (c.seq_gaps, c.seq_duplicates, c.seq_regressions, c.seq_restarts) == (1, 1, 1, 1)
    assert c.stale_batches_dropped == 2 and c.batches == 5


def test_the_per_source_table_is_bounded() -> None:
    engine = make_engine()
    engine.max_sources = 100
    empty: tuple[Event, ...] = ()
    for i in range(20_000):
        engine.apply(EventBatch(source=f"s{i}", seq=1, events=empty))
    assert len(engine.state.last_seq) == 100
    assert engine.state.counters.sources_forgotten == 19_900
    assert "s19999" in engine.state.last_seq  # the most recently heard are kept


def test_the_first_batch_of_a_source_is_never_a_gap() -> None:
    engine = make_engine()
    engine.apply(EventBatch(source="late", seq=1000, events=()))
    assert engine.state.counters.seq_gaps == 0


# ---- decisions out -------------------------------------------------------------------------------


def test_snapshots_are_versioned_and_stamped_with_the_injected_clock() -> None:
    clock = FakeClock(now=3.5)
    engine = Engine(make_policy("lru"), clock=clock, snapshot_ttl_s=2.0)
    first = engine.snapshot()
    clock.now = 4.0
    second = engine.snapshot()
    assert (first.version, first.ts, first.ttl_s, first.policy) == (1, 3.5, 2.0, "lru")
    assert (second.version, second.ts) == (2, 4.0)


class GreedyPrefetch(LRU):
    def prefetch(self, budget_blocks: int, state: EngineState) -> list[int]:
        return sorted(state.resident["host"])


def test_prefetch_never_exceeds_the_budget_whatever_the_policy_returns() -> None:
    engine = Engine(GreedyPrefetch(), clock=FakeClock())
    feed(engine, stored("host", [1, 2, 3, 4]))
    assert engine.prefetch(2) == [1, 2]
    assert engine.prefetch(0) == []


# ---- bounded memory ------------------------------------------------------------------------------


def test_memory_shrinks_back_once_blocks_leave_every_tier_and_workflows_finish() -> None:
    """Scenario: two workflows run, cache blocks on both tiers, finish; then the tiers drop the
    blocks (evictions on one tier, a reset of the other). Nothing of them may stay behind."""
    engine = make_engine()
    feed(
        engine,
        started("r1", "w1", [1, 2, 3]),
        stored("gpu", [1, 2, 3], "r1"),
        stored("host", [1, 2, 3], "r1"),
        started("r2", "w2", [1, 2, 4]),
        stored("gpu", [4], "r2"),
        finished("r1"),
        finished("r2"),
        wf_done("w1"),
        wf_done("w2"),
    )
    state = engine.state
    assert len(state.owners) == 4 and len(state.workflows) == 2
    feed(engine, removed("gpu", [4, 3, 2, 1]))
    assert set(state.owners) == {1, 2, 3}, "host copies keep their owners"
    assert "w2" in state.workflows, "w2 still owns host blocks 1, 2"
    feed(engine, AllBlocksCleared(ts=0.0, tier="host"))
    assert state.owners == {} and state.recency == {} and state.workflows == {}
    assert state.requests == {}


def test_blocks_of_a_finished_request_that_no_tier_kept_are_forgotten() -> None:
    engine = make_engine()
    feed(engine, started("r1", "w1", [1, 2, 3]), stored("gpu", [1], "r1"), finished("r1"))
    state = engine.state
    assert set(state.owners) == {1} and set(state.recency) == {1}
    assert state.workflows["w1"].blocks == {1}


def test_a_block_evicted_and_restored_while_its_request_runs_keeps_its_owner() -> None:
    """Scenario: a request's last prompt block is cached but past vLLM's hit limit (the last
    token is always recomputed); allocating the request's new blocks evicts that very cached
    copy, and the request stores the block again when it computes it. The simulator emits
    exactly this for a fully cached prompt of k*16 tokens under GPU pressure. The block is
    resident and referenced by a running request of w1: it must keep w1 as its owner and a
    recency, so that it retires when w1 finishes."""
    engine = make_engine()
    feed(engine, started("r1", "w1", [1, 2]), stored("gpu", [1, 2], "r1"), finished("r1"))
    feed(
        engine,
        started("r2", "w1", [1, 2]),
        PrefixHit(ts=0.0, request_id="r2", gpu_blocks=1, host_blocks=0, recomputed_blocks=1),
        removed("gpu", [2]),
        stored("gpu", [2], "r2"),
    )
    state = engine.state
    assert state.owners.get(2) == frozenset({"w1"})
    assert 2 in state.recency
    feed(engine, finished("r2"), wf_done("w1"))
    assert sorted(state.retired_blocks("gpu")) == [1, 2]


# ---- random event streams -----------------------------------------------------------------------

BLOCKS = st.lists(st.integers(0, 11), max_size=5, unique=True)


@st.composite
def event_streams(draw: st.DrawFn) -> list[Event]:
    """Plausible connector streams over a dozen blocks: requests start and finish, blocks come
    and go on both tiers, workflows finish once none of their requests runs."""
    events: list[Event] = []
    running: dict[str, str] = {}
    for i in range(draw(st.integers(0, 40))):
        kind = draw(st.sampled_from(["start", "finish", "store", "remove", "load", "clear", "wf"]))
        if kind == "start":
            wid = draw(st.sampled_from(["w0", "w1", "w2"]))
            running[f"r{i}"] = wid
            events.append(started(f"r{i}", wid, draw(BLOCKS), ts=float(i)))
        elif kind == "finish" and running:
            rid = draw(st.sampled_from(sorted(running)))
            del running[rid]
            events.append(finished(rid, ts=float(i)))
        elif kind == "store":
            owner = draw(st.none() | st.sampled_from(sorted(running) or ["none"]))
            events.append(stored(draw(st.sampled_from(["gpu", "host"])), draw(BLOCKS), owner))
        elif kind == "remove":
            events.append(removed(draw(st.sampled_from(["gpu", "host"])), draw(BLOCKS)))
        elif kind == "load":
            events.append(BlocksLoaded(ts=float(i), block_hashes=tuple(draw(BLOCKS))))
        elif kind == "clear":
            events.append(
                AllBlocksCleared(ts=float(i), tier=draw(st.sampled_from(["gpu", "host"])))
            )
        elif kind == "wf":  # the client says a workflow is done after its last request
            idle = sorted({"w0", "w1", "w2"}.difference(running.values()))
            if idle:
                events.append(wf_done(draw(st.sampled_from(idle)), ts=float(i)))
    return events


@settings(max_examples=100, deadline=None)
@given(events=event_streams())
def test_random_streams_keep_ownership_consistent_and_leave_nothing_behind(
    events: list[Event],
) -> None:
    engine = make_engine()
    state = engine.state
    for event in events:
        engine.apply_event(event)
        check_ownership(state)
        resident = state.resident["gpu"] | state.resident["host"]
        running = {b for r in state.requests.values() for b in r.block_hashes}
        assert set(state.owners) <= resident | running
        assert set(state.recency) <= resident | running
    # the end of everything: requests end, workflows finish, both tiers drop all they hold
    for rid in list(state.requests):
        engine.apply_event(finished(rid))
    for wid in list(state.workflows):
        engine.apply_event(wf_done(wid))
    engine.apply_event(AllBlocksCleared(ts=0.0, tier="gpu"))
    engine.apply_event(AllBlocksCleared(ts=0.0, tier="host"))
    assert state.owners == {} and state.recency == {} and state.workflows == {}
    assert state.requests == {}


@settings(max_examples=100, deadline=None)
@given(events=event_streams())
def test_blocks_of_running_requests_of_active_workflows_keep_owner_and_recency(
    events: list[Event],
) -> None:
    """What a running request references stays known: every block of it is owned by its
    (active) workflow and has a recency, whatever the tiers did meanwhile."""
    engine = make_engine()
    state = engine.state
    for event in events:
        engine.apply_event(event)
        for req in state.requests.values():
            wf = state.workflows.get(req.workflow_id)
            if wf is None or wf.done:
                continue
            for block in req.block_hashes:
                assert req.workflow_id in state.owners.get(block, ()), (req.request_id, block)
                assert block in state.recency, (req.request_id, block)


@pytest.mark.parametrize("n_workflows", [1, 50])
def test_memory_of_many_finished_workflows_is_reclaimed(n_workflows: int) -> None:
    engine = make_engine()
    for w in range(n_workflows):
        blocks = [1000 * w + i for i in range(8)]
        feed(
            engine,
            started(f"r{w}", f"w{w}", blocks),
            stored("gpu", blocks, f"r{w}"),
            finished(f"r{w}"),
            wf_done(f"w{w}"),
        )
        feed(engine, removed("gpu", blocks))
    state = engine.state
    assert state.owners == {} and state.recency == {} and state.workflows == {}
    assert state.counters.workflows_finished == n_workflows
