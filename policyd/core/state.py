"""What the Engine knows about the cache and its workflows, as policies read it.

``EngineState`` is written only by the Engine (policyd/core/engine.py) and read by every policy
(policyd/policies/): the policy contract depends on this module, not on the Engine, so the two
import in one direction only.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, count, repeat
from operator import not_, sub
from typing import Final

from policyd.core.types import TIERS, PrefixHit, Tier

_NO_OWNERS: Final[frozenset[str]] = frozenset()


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


class EngineState:
    """What the Engine knows. Policies read it; only the Engine writes it."""

    def __init__(self) -> None:
        self.workflows: dict[str, WorkflowState] = {}
        self.requests: dict[str, RequestState] = {}
        self.resident: dict[Tier, set[int]] = {tier: set() for tier in TIERS}
        # block -> workflows that referenced it. The sets are immutable and shared by blocks with
        # the same owners (a request's new blocks share one), so that the bookkeeping per block
        # is a dict operation in C: only the Engine replaces them (``own``, ``disown``)
        self.owners: dict[int, frozenset[str]] = {}
        # block -> sequence of its last reference; every block in ``owners`` has one (both are
        # set by a request's start and dropped together, ``forget_blocks``)
        self.recency: dict[int, int] = {}
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
        for w in owners:  # a loop, not all(<generator>): it runs per block
            wf = workflows.get(w)
            if wf is not None and not wf.done:
                return False
        return True

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

    def hold(self, blocks: Sequence[int]) -> None:
        """A running request references ``blocks`` (each counted once)."""
        self.running_refs.update(dict.fromkeys(blocks).keys())

    def release(self, blocks: Sequence[int]) -> None:
        """A running request that held ``blocks`` ended; counts reaching zero are dropped."""
        running = self.running_refs
        held = list(dict.fromkeys(blocks))
        left = list(map(sub, map(running.__getitem__, held), repeat(1)))
        # set the counts (Counter.update would add them)
        dict.update(running, zip(held, left, strict=True))
        deque(map(running.pop, compress(held, map(not_, left))), maxlen=0)

    def own(self, workflow_id: str, blocks: set[int]) -> None:
        """Add ``workflow_id`` to the owners of ``blocks``. Python work is per distinct owner
        set, not per block: the blocks nobody owned share one new set."""
        owners = self.owners
        shared = owners.keys() & blocks  # C speed, whichever of the two is smaller
        if shared:
            _rewrite_owners(owners, shared, lambda holders: holders | {workflow_id})
        owners.update(dict.fromkeys(blocks.difference(shared), frozenset((workflow_id,))))

    def disown(self, workflow_id: str, blocks: set[int]) -> None:
        """Remove ``workflow_id`` from the owners of ``blocks``; blocks left with no owner are
        dropped from ``owners``."""
        owned = self.owners.keys() & blocks
        if owned:
            _rewrite_owners(self.owners, owned, lambda holders: holders - {workflow_id})

    def forget_blocks(self, blocks: Iterable[int]) -> None:
        """Drop bookkeeping of blocks that no tier holds any more (set operations and ``map``
        keep this off the per-block interpreter path: it runs for every eviction)."""
        tracked = self.recency.keys() & blocks  # nothing else to drop for the others
        if not tracked:
            return
        gone = tracked.difference(self.resident["gpu"], self.resident["host"])
        gone.difference_update(self.running_refs.keys() & gone)  # still in use: kept
        if not gone:
            return
        deque(map(self.recency.pop, gone, repeat(None)), maxlen=0)
        holders = set(map(self.owners.pop, gone, repeat(_NO_OWNERS)))  # each distinct set once
        holders.discard(_NO_OWNERS)
        if not holders:
            return
        workflows = self.workflows
        for wf in set().union(*holders):
            state = workflows.get(wf)
            if state is not None:
                state.blocks.difference_update(gone)
                if state.done and not state.blocks:
                    del workflows[wf]


def _rewrite_owners(
    owners: dict[int, frozenset[str]],
    blocks: Iterable[int],
    change: Callable[[frozenset[str]], frozenset[str]],
) -> None:
    """Replace the owner set of each of ``blocks`` (all in ``owners``) by ``change`` of it,
    computed once per distinct set; blocks left with no owner are removed. Blocks keep their
    place in ``owners``."""
    blocks = list(blocks)
    held = list(map(owners.__getitem__, blocks))
    changed = {holders: change(holders) for holders in set(held)}
    new = list(map(changed.__getitem__, held))
    owners.update(compress(zip(blocks, new, strict=True), new))
    deque(map(owners.pop, compress(blocks, map(not_, new))), maxlen=0)
