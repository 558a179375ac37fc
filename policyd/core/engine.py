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
from collections.abc import Callable, Sequence
from itertools import islice
from typing import TYPE_CHECKING

from policyd.core.state import Counters, EngineState, RequestState, WorkflowState
from policyd.core.types import (
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
    from policyd.core.policy import Policy

__all__ = ["Clock", "Counters", "Engine", "EngineState", "RequestState", "WorkflowState"]

Clock = Callable[[], float]
MAX_SOURCES = 4096  # sources whose last sequence number the Engine keeps


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
    state.hold(blocks)
    new = set(blocks).difference(wf.blocks)
    if new:
        wf.blocks.update(new)
        state.own(ev.workflow_id, new)
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
    state.release(req.block_hashes)
    # blocks the request used that no tier kept (bypassed, or never stored) are forgotten now
    state.forget_blocks(req.block_hashes)


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
        state.disown(ev.workflow_id, wf.blocks)
        del state.workflows[ev.workflow_id]
