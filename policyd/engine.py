"""The Engine: the pure core of AgentKV. Events in, state and decisions out.

It mirrors what the cache holds from the events a connector (or the simulator) sends: which
workflows are active and which agents they called, which requests run, which blocks each tier
holds and which workflows own them. Decisions come from one pluggable policy; the Engine does no
I/O and reads no clock but the one it is given, so the daemon, the simulator and the tests run the
very same object.

Memory stays bounded by what is resident or running: a block's ownership is dropped once no tier
holds it, and finished workflows are forgotten once none of their blocks remain.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import count, islice, repeat
from typing import TYPE_CHECKING

from policyd.types import (
    TIERS,
    Admit,
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
    Tier,
    WorkflowFinished,
)

if TYPE_CHECKING:
    from policyd.policies.base import Policy

Clock = Callable[[], float]
MAX_SOURCES = 4096  # sources whose last sequence number the Engine keeps


@dataclass(slots=True)
class WorkflowState:
    workflow_id: str
    workflow_type: str
    started_ts: float
    last_ts: float  # the source's timestamp of the last event
    last_seen_s: float = 0.0  # the Engine's clock when the last event arrived (idle inference)
    agents: list[str] = field(default_factory=list)  # agent of each call, in order
    running: int = 0
    done: bool = False
    blocks: set[int] = field(default_factory=set)
    # each agent's latest prompt in this workflow: what its next call will start with
    agent_blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(slots=True)
class RequestState:
    request_id: str
    workflow_id: str
    agent: str
    block_hashes: tuple[int, ...]
    prompt_tokens: int
    started_ts: float
    hints: dict[str, object]
    hit: PrefixHit | None = None
    started_s: float = 0.0  # the Engine's clock when it started (request timeout)


@dataclass(slots=True)
class Counters:
    events: int = 0
    batches: int = 0
    seq_gaps: int = 0  # a batch's seq past the next expected one (batches lost)
    seq_duplicates: int = 0  # a batch's seq equal to the last one (sent twice)
    seq_regressions: int = 0  # a batch's seq below the last one (out of order, or forged)
    seq_restarts: int = 0  # seq back to 0 or 1 after more: the source restarted
    stale_batches_dropped: int = 0  # duplicates and regressions not applied (drop_stale)
    sources_forgotten: int = 0  # sources evicted from the bounded per-source table
    requests_expired: int = 0  # requests dropped after request_timeout_s without finishing
    requests_evicted: int = 0  # running requests past max_requests, oldest first, finished
    workflows_evicted: int = 0  # active workflows past max_workflows, least recent, finished
    unknown_requests: int = 0
    workflows_started: int = 0
    workflows_finished: int = 0
    idle_finishes: int = 0


class EngineState:
    """What the Engine knows. Policies read it; only the Engine writes it."""

    def __init__(self) -> None:
        self.workflows: dict[str, WorkflowState] = {}
        self.requests: dict[str, RequestState] = {}
        self.resident: dict[Tier, set[int]] = {tier: set() for tier in TIERS}
        self.owners: dict[int, set[str]] = {}  # block -> workflows that referenced it
        self.recency: dict[int, int] = {}  # block -> sequence of its last reference
        self.running_refs: Counter[int] = Counter()  # block -> running requests using it
        # the blocks every prompt of an agent starts with, across workflows (its system prompt
        # as the cache sees it), and the workflow that prompt came from
        self.agent_prefix: dict[str, tuple[int, ...]] = {}
        self._agent_prefix_source: dict[str, str] = {}
        self.counters = Counters()
        self.active_count = 0  # workflows not done (kept as they change: bounds are O(1))
        self.last_seq: dict[str, int] = {}
        self._ticks = count(1)

    # -- queries policies use ------------------------------------------------------------------

    def active_workflows(self) -> list[WorkflowState]:
        return [w for w in self.workflows.values() if not w.done]

    def is_retired(self, block: int) -> bool:
        """True when every workflow that referenced the block has finished."""
        owners = self.owners.get(block)
        if not owners:
            return False
        workflows = self.workflows
        return all(w not in workflows or workflows[w].done for w in owners)

    def retired_blocks(self, tier: Tier) -> list[int]:
        return [b for b in self.resident[tier] if self.is_retired(b)]

    # -- updates -------------------------------------------------------------------------------

    def learn_agent_prefix(self, agent: str, workflow_id: str, blocks: tuple[int, ...]) -> None:
        """Shrink the agent's shared prefix to what this prompt has in common with it (prompts
        of the same workflow are not compared: they share the workflow's context too)."""
        prefix = self.agent_prefix.get(agent)
        if prefix is None:
            self.agent_prefix[agent] = blocks
            self._agent_prefix_source[agent] = workflow_id
            return
        if self._agent_prefix_source[agent] == workflow_id or blocks[: len(prefix)] == prefix:
            return
        lo, hi = 0, min(len(prefix), len(blocks))  # binary search on slice equality (C speed)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks[:mid] == prefix[:mid]:
                lo = mid
            else:
                hi = mid - 1
        self.agent_prefix[agent] = prefix[:lo]
        self._agent_prefix_source[agent] = ""

    def touch(self, blocks: Sequence[int]) -> None:
        """Record a reference. Blocks get sequence numbers tail first, as vLLM frees them, so
        that among blocks referenced together the deepest is the least recent."""
        start = next(self._ticks)
        self._ticks = count(start + len(blocks) + 1)
        self.recency.update(zip(reversed(blocks), range(start, start + len(blocks)), strict=True))

    def forget_blocks(self, blocks: Iterable[int]) -> None:
        """Drop bookkeeping of blocks that no tier holds any more (set operations and ``map``
        keep this off the per-block interpreter path: it runs for every eviction)."""
        running = self.running_refs
        gone = {
            b
            for b in set(blocks).difference(self.resident["gpu"], self.resident["host"])
            if b not in running
        }
        if not gone:
            return
        deque(map(self.recency.pop, gone, repeat(None)), maxlen=0)
        holders = [h for h in map(self.owners.pop, gone, repeat(None)) if h]
        if not holders:
            return
        workflows = self.workflows
        for wf in set().union(*holders):
            state = workflows.get(wf)
            if state is not None:
                state.blocks.difference_update(gone)
                if state.done and not state.blocks:
                    del workflows[wf]


class Engine:
    """Feeds events to the state and to the policy; answers decisions.

    ``idle_timeout_s``: a workflow with no running request for this long is inferred finished.
    ``hook``: called with each event after the state and the policy saw it (the daemon's
    bookkeeping).
    ``drop_stale``: batches whose sequence number is a duplicate or a regression of their
    source's are counted and not applied (the daemon); otherwise counted and applied.
    ``max_sources``: sources whose last sequence number is kept (least recently heard first
    out), so a flood of source names cannot grow the table.
    ``request_timeout_s``: a request running this long is finished by ``tick`` (it never
    finished: a lost RequestFinished, a crashed sender, a flood), whatever else runs, so its
    workflow can go idle. ``max_requests`` / ``max_workflows``: past this many running requests
    / active workflows, the oldest request / least recently seen workflow is finished at once
    (counted), so that the state a policy walks per snapshot and per decision stays bounded
    under a flood (workflows of a single call are finished first, so a flood of new workflows
    pushes out its own, not the established ones). None: no bound (the simulator's default).
    """

    def __init__(
        self,
        policy: Policy,
        *,
        clock: Clock = time.monotonic,
        snapshot_ttl_s: float = 5.0,
        idle_timeout_s: float = 600.0,
        hook: Callable[[Event], None] | None = None,
        drop_stale: bool = False,
        max_sources: int = MAX_SOURCES,
        request_timeout_s: float | None = None,
        max_requests: int | None = None,
        max_workflows: int | None = None,
    ) -> None:
        self.policy = policy
        self.drop_stale = drop_stale
        self.max_sources = max_sources
        self.request_timeout_s = request_timeout_s
        self.max_requests = max_requests
        self.max_workflows = max_workflows
        self.hook = hook
        self.clock = clock
        self.snapshot_ttl_s = snapshot_ttl_s
        self.idle_timeout_s = idle_timeout_s
        self.state = EngineState()
        self._snapshot_version = 0
        self._handlers: dict[type, Callable[[EngineState, Event, float], None]] = {
            RequestStarted: _on_request_started,
            PrefixHit: _on_prefix_hit,
            BlocksStored: _on_blocks_stored,
            BlocksRemoved: _on_blocks_removed,
            BlocksLoaded: _on_blocks_loaded,
            AllBlocksCleared: _on_all_cleared,
            RequestFinished: _on_request_finished,
            WorkflowFinished: _on_workflow_finished,
        }

    # -- events in -----------------------------------------------------------------------------

    def check_seq(self, batch: EventBatch) -> bool:
        """Count the batch's sequence number against its source's last: a gap, a duplicate, a
        regression or a restart (back to 0 or 1), each counted apart. False when the batch is
        a duplicate or a regression and ``drop_stale`` is set: it is not to be applied. The
        per-source table keeps at most ``max_sources`` sources, the least recently heard
        forgotten first (counted)."""
        state, c = self.state, self.state.counters
        table, source, seq = state.last_seq, batch.source, batch.seq
        last = table.pop(source, None)
        fresh = True
        if last is not None and seq != last + 1:
            if seq > last:
                c.seq_gaps += 1
            elif 0 <= seq <= 1 and seq < last:
                c.seq_restarts += 1
            elif seq == last:
                c.seq_duplicates += 1
                fresh = False
            else:
                c.seq_regressions += 1
                fresh = False
        if not fresh and self.drop_stale:
            assert last is not None
            table[source] = last
            c.stale_batches_dropped += 1
            return False
        table[source] = seq
        if len(table) > self.max_sources:
            del table[next(iter(table))]  # the least recently heard source
            c.sources_forgotten += 1
        return True

    def apply(self, batch: EventBatch) -> bool:
        """Apply a batch; False when it was not applied (a stale batch, ``drop_stale``)."""
        state = self.state
        if not self.check_seq(batch):
            return False
        state.counters.batches += 1
        # apply_event per event, inlined (one clock read per batch: it arrived at once)
        events = batch.events
        now = self.clock()
        handlers, observe, hook = self._handlers, self.policy.observe, self.hook
        for event in events:
            handlers[type(event)](state, event, now)
            observe(event, state)
            if hook is not None:
                hook(event)
        state.counters.events += len(events)
        if self.max_requests is not None and len(state.requests) > self.max_requests:
            self._evict_requests(len(state.requests) - self.max_requests)
        if self.max_workflows is not None and state.active_count > self.max_workflows:
            self._evict_workflows()
        return True

    def _finish_requests(self, requests: Sequence[RequestState]) -> None:
        for req in requests:
            self.apply_event(RequestFinished(ts=req.started_ts, request_id=req.request_id))

    def _evict_requests(self, excess: int) -> None:
        oldest = list(islice(self.state.requests.values(), excess))
        self.state.counters.requests_evicted += len(oldest)
        self._finish_requests(oldest)

    def _evict_workflows(self) -> None:
        """Finish the least recently seen active workflows past ``max_workflows`` (called
        only when more are active)."""
        assert self.max_workflows is not None
        active = [w for w in self.state.workflows.values() if not w.done]
        excess = len(active) - self.max_workflows
        if excess <= 0:
            return
        # workflows of one call go first (a flood of new workflows evicts its own, not the
        # established ones), then the least recently seen
        active.sort(key=lambda w: (len(w.agents) > 1, w.last_seen_s))
        victims = {w.workflow_id for w in active[:excess]}
        self._finish_requests([r for r in self.state.requests.values() if r.workflow_id in victims])
        now = self.clock()
        self.state.counters.workflows_evicted += len(victims)
        for wf in active[:excess]:
            self.apply_event(WorkflowFinished(ts=now, workflow_id=wf.workflow_id, reason="idle"))

    def apply_event(self, event: Event) -> None:
        self._handlers[type(event)](self.state, event, self.clock())
        self.state.counters.events += 1
        self.policy.observe(event, self.state)
        if self.hook is not None:
            self.hook(event)

    def tick(self) -> list[WorkflowFinished]:
        """Finish requests running past ``request_timeout_s``; infer finished workflows after
        ``idle_timeout_s`` without a running request."""
        now = self.clock()
        timeout = self.request_timeout_s
        if timeout is not None:
            expired = []
            for req in self.state.requests.values():  # in start order: the oldest first
                if now - req.started_s < timeout:
                    break
                expired.append(req)
            self.state.counters.requests_expired += len(expired)
            self._finish_requests(expired)
        inferred = [
            WorkflowFinished(ts=now, workflow_id=w.workflow_id, reason="idle")
            for w in self.state.workflows.values()
            if not w.done and w.running == 0 and now - w.last_seen_s >= self.idle_timeout_s
        ]
        for event in inferred:
            self.state.counters.idle_finishes += 1
            self.apply_event(event)
        return inferred

    # -- decisions out -------------------------------------------------------------------------

    def snapshot(self) -> PolicySnapshot:
        self._snapshot_version += 1
        return self.policy.snapshot(
            self.state, now=self.clock(), version=self._snapshot_version, ttl_s=self.snapshot_ttl_s
        )

    def victims(self, tier: Tier, candidates: Sequence[int], n_blocks: int) -> list[int]:
        """Which ``n_blocks`` of ``candidates`` to evict from ``tier`` now (synchronous path)."""
        return self.policy.victims(tier, candidates, n_blocks, self.state)

    def admit(self, request_id: str, block_hashes: Sequence[int]) -> Admit:
        """Which of a request's new blocks to write to the host tier."""
        return self.policy.admit(request_id, block_hashes, self.state)

    def prefetch(self, budget_blocks: int) -> list[int]:
        """Host-resident blocks to load into free GPU space, at most ``budget_blocks``."""
        return self.policy.prefetch(budget_blocks, self.state)[:budget_blocks]


# ---- event handlers (pure functions of state and event) ----------------------------------------


def _on_request_started(state: EngineState, ev: Event, now: float) -> None:
    assert isinstance(ev, RequestStarted)
    wf = state.workflows.get(ev.workflow_id)
    if wf is None:
        wf = WorkflowState(ev.workflow_id, ev.workflow_type, ev.ts, ev.ts)
        state.workflows[ev.workflow_id] = wf
        state.counters.workflows_started += 1
        state.active_count += 1
    elif wf.done:  # a workflow id reused after it finished: a new life
        wf.done = False
        wf.agents.clear()
        state.counters.workflows_started += 1
        state.active_count += 1
    wf.agents.append(ev.agent)
    wf.last_ts = ev.ts
    wf.last_seen_s = now
    wf.running += 1
    blocks = ev.block_hashes
    state.running_refs.update(dict.fromkeys(blocks).keys())
    new = set(blocks).difference(wf.blocks)
    if new:
        wf.blocks.update(new)
        owners = state.owners
        wid = ev.workflow_id
        shared = {block for block in new if block in owners}
        for block in shared:
            owners[block].add(wid)
        owners.update({block: {wid} for block in new.difference(shared)})
    state.touch(blocks)
    wf.agent_blocks[ev.agent] = blocks
    state.learn_agent_prefix(ev.agent, ev.workflow_id, blocks)
    state.requests.pop(ev.request_id, None)  # a restarted id goes to the end (oldest first)
    state.requests[ev.request_id] = RequestState(
        ev.request_id, ev.workflow_id, ev.agent, blocks, ev.prompt_tokens, ev.ts, dict(ev.hints),
        started_s=now,
    )  # fmt: skip


def _on_prefix_hit(state: EngineState, ev: Event, now: float) -> None:
    assert isinstance(ev, PrefixHit)
    req = state.requests.get(ev.request_id)
    if req is None:
        state.counters.unknown_requests += 1
        return
    req.hit = ev


def _on_blocks_stored(state: EngineState, ev: Event, now: float) -> None:
    assert isinstance(ev, BlocksStored)
    state.resident[ev.tier].update(ev.block_hashes)


def _on_blocks_removed(state: EngineState, ev: Event, now: float) -> None:
    assert isinstance(ev, BlocksRemoved)
    state.resident[ev.tier].difference_update(ev.block_hashes)
    state.forget_blocks(ev.block_hashes)


def _on_blocks_loaded(state: EngineState, ev: Event, now: float) -> None:
    assert isinstance(ev, BlocksLoaded)
    state.resident["gpu"].update(ev.block_hashes)


def _on_all_cleared(state: EngineState, ev: Event, now: float) -> None:
    assert isinstance(ev, AllBlocksCleared)
    dropped = list(state.resident[ev.tier])
    state.resident[ev.tier].clear()
    state.forget_blocks(dropped)


def _on_request_finished(state: EngineState, ev: Event, now: float) -> None:
    assert isinstance(ev, RequestFinished)
    req = state.requests.pop(ev.request_id, None)
    if req is None:
        state.counters.unknown_requests += 1
        return
    wf = state.workflows.get(req.workflow_id)
    if wf is not None:
        wf.running = max(0, wf.running - 1)
        wf.last_ts = ev.ts
        wf.last_seen_s = now
    running = state.running_refs
    left = {b: running[b] - 1 for b in dict.fromkeys(req.block_hashes)}
    dict.update(running, left)  # set the counts (Counter.update would add them)
    deque(map(running.pop, [b for b, n in left.items() if n == 0]), maxlen=0)
    # blocks the request used that no tier kept (bypassed, or never stored) are forgotten now
    resident = state.resident
    gone = set(req.block_hashes).difference(resident["gpu"], resident["host"])
    if gone:
        state.forget_blocks(gone)


def _on_workflow_finished(state: EngineState, ev: Event, now: float) -> None:
    assert isinstance(ev, WorkflowFinished)
    wf = state.workflows.get(ev.workflow_id)
    if wf is None or wf.done:
        return
    wf.done = True
    state.active_count -= 1
    wf.last_ts = ev.ts
    state.counters.workflows_finished += 1
    resident = state.resident
    if all(wf.blocks.isdisjoint(resident[t]) for t in TIERS):
        # nothing of it is cached: forget it now, ownership included
        for block in wf.blocks:
            holders = state.owners.get(block)
            if holders is not None:
                holders.discard(ev.workflow_id)
                if not holders:
                    del state.owners[block]
        del state.workflows[ev.workflow_id]
