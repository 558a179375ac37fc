"""Which replica a call goes to: the fleet's residency index and the routers (pure, no I/O).

``PrefixIndex`` holds what every replica's ``ResidencyFeed`` published (policyd/fleet/
residency.py): the blocks resident on each replica's GPU and host tiers, and each active
workflow's last prompt and the replica that served it. A router answers ``choose(query,
loads) -> Decision`` where ``loads`` maps each replica that may take the call to its outstanding
work (any non-negative measure: running requests, queued tokens); only those replicas are
candidates, so the caller decides which replicas are alive.

Routers:

* ``RoundRobin`` - the candidates in turn (vLLM's production-stack default);
* ``SessionSticky`` - one replica per workflow by rendezvous hashing (stable while the fleet
  does not change, moving only the workflows of a replica that leaves or joins);
* ``PrefixAware`` - llm-d's idea: the replica with the longest cached prefix of the call's own
  block hashes (``RouteQuery.block_hashes``), the least loaded when none holds any;
* ``WorkflowAware`` - AgentKV's: the replica holding the longest prefix of the workflow's
  previous prompt (an agent's transcript grows, so it prefixes the next call), whichever agent
  makes the call; a new workflow goes to the least-loaded replica and stays there until the
  index sees it. ``stage_for(workflow_id, predicted_agent, loads)`` names the replica where the
  workflow's next call will go: where to stage the predicted agent's blocks.

``PrefixAware`` and ``WorkflowAware`` skip an **overloaded** replica (load above ``slack`` x
the candidates' mean and at least ``min_excess`` above it) for the next-best holder.

A prefix is counted as vLLM serves it: the GPU prefix, then host blocks past it up to the first
miss (``Prefix``). Routers are not thread-safe (they keep a cursor or recent placements); the
index is not either: one owner (the route service's event loop) applies updates and routes.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple, Protocol

from policyd.fleet.residency import (
    Residency,
    ResidencyState,
    ResidencyUpdate,
    WorkflowCall,
    join_parts,
)

DEFAULT_SLACK: Final = 1.5
DEFAULT_MIN_EXCESS: Final = 2.0
MAX_WORKFLOWS: Final = 262_144  # workflows the index remembers (the oldest call forgotten first)
MAX_PLACEMENTS: Final = 65_536  # a WorkflowAware router's recent placements
MAX_AGENTS: Final = 65_536  # agent names whose shared prompt prefix the index keeps
MAX_AGENTS_PER_WORKFLOW: Final = 16  # agents whose last prompt a workflow record keeps


class NoReplicaError(LookupError):
    """No replica may take the call (``loads`` is empty)."""


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """A call to route: its workflow, optionally its agent, its prompt's block hashes (for
    ``PrefixAware``; a proxy without a tokenizer leaves them empty) and its prompt's size."""

    workflow_id: str
    agent: str | None = None
    block_hashes: tuple[int, ...] = ()
    prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a call goes: ``replica``, the cached prefix (blocks) it holds of the call (of the
    workflow's previous prompt for ``WorkflowAware``), and why (``reason``, one word-ish tag:
    ``prefix``, ``workflow-prefix``, ``placed``, ``last-replica``, ``least-loaded``, ``spill``,
    ``sticky``, ``round-robin``, ``fallback``). Routers leave ``endpoint`` (the replica's
    vLLM base URL) and ``stage`` (the replica to stage the workflow's predicted next agent on)
    empty; the route service fills them."""

    replica: str
    prefix_blocks: int = 0
    reason: str = ""
    endpoint: str = ""
    stage: str | None = None


class Prefix(NamedTuple):
    """A replica's cached prefix of a sequence of blocks: GPU blocks, then host blocks."""

    gpu: int
    host: int

    @property
    def total(self) -> int:
        return self.gpu + self.host


def _run(resident: set[int] | frozenset[int], hashes: Sequence[int]) -> int:
    """How many of ``hashes`` from the first are in ``resident`` (C-level iteration)."""
    return len(list(itertools.takewhile(resident.__contains__, hashes)))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(slots=True)
class ReplicaView:
    """What the index knows of one replica. ``seq``/``epoch``: the last update applied;
    ``stale``: a gap was seen since the last full state (what is held may be wrong until the
    next full state); ``seen_s``: the index's clock at the last message."""

    name: str
    epoch: int = 0
    seq: int = 0
    endpoint: str = ""
    running: int = 0
    gpu: set[int] = field(default_factory=set)
    host: set[int] = field(default_factory=set)
    stale: bool = True
    full_seen: bool = False
    seen_s: float = 0.0
    gaps: int = 0

    def prefix(self, hashes: Sequence[int]) -> Prefix:
        gpu = _run(self.gpu, hashes)
        host = _run(self.host, hashes[gpu:]) if self.host else 0
        return Prefix(gpu, host)


@dataclass(frozen=True, slots=True)
class WorkflowRecord:
    """A workflow's last call the index saw: on which replica, by which agent, its prompt;
    and each agent's last prompt in the workflow (``by_agent``: an agent's next call starts
    with its own system prompt, so its previous prompt is the prefix it will re-send)."""

    replica: str
    agent: str
    block_hashes: tuple[int, ...]
    seen_s: float
    by_agent: dict[str, tuple[int, ...]] = field(default_factory=dict)


class PrefixIndex:
    """The fleet's residency: per replica, the resident blocks of each tier; per workflow, its
    last call. Fed by ``apply(replica, update)`` (``ResidencyUpdate`` / ``ResidencyState``,
    decoded) or directly by ``stored`` / ``removed``; not thread-safe.

    Updates of one replica apply in ``seq`` order within an ``epoch``: an old or repeated one
    is ignored; one past a gap (or from a new epoch) is applied anyway but marks the replica
    ``stale`` (counted in ``gaps``) until a full state replaces what it holds. A workflow's
    record belongs to the replica that reported its newest call (newest by the index's own
    clock: replicas' clocks are not compared); a finish from another replica leaves it.
    """

    def __init__(
        self, *, clock: Callable[[], float] = time.monotonic, max_workflows: int = MAX_WORKFLOWS
    ) -> None:
        self._clock = clock
        self._max_workflows = max_workflows
        self.replicas: dict[str, ReplicaView] = {}
        self.workflows: dict[str, WorkflowRecord] = {}
        # per replica, the parts of a split full state received so far
        self._parts: dict[str, tuple[tuple[int, int, int], dict[int, ResidencyState]]] = {}
        # per agent name, the prefix its prompts share across workflows (its system prompt),
        # and the workflow of its last call
        self.agent_prefixes: dict[str, tuple[int, ...]] = {}
        self._agent_last: dict[str, tuple[str, tuple[int, ...]]] = {}

    # ---- feeding ----

    def replica(self, name: str) -> ReplicaView:
        """The view of ``name``, created empty (and stale) when unknown."""
        view = self.replicas.get(name)
        if view is None:
            view = self.replicas[name] = ReplicaView(name)
        return view

    def apply(self, replica: str, update: Residency) -> bool:
        """Apply one decoded message from ``replica``; False when it was ignored (old,
        repeated, or naming another replica)."""
        if update.replica != replica:
            return False
        view = self.replica(replica)
        if isinstance(update, ResidencyState):
            if update.parts > 1:
                whole = self._assemble(replica, update)
                if whole is None:
                    return True  # a part kept until the others arrive
                update = whole
            self._apply_state(view, update)
            return True
        return self._apply_update(view, update)

    def _assemble(self, replica: str, part: ResidencyState) -> ResidencyState | None:
        """The whole state once every part of ``part``'s split arrived, else None; parts of an
        older split (another epoch or seq) are dropped when a newer one starts."""
        key = (part.epoch, part.seq, part.parts)
        held = self._parts.get(replica)
        if held is None or held[0] != key:
            held = self._parts[replica] = (key, {})
        held[1][part.part] = part
        if len(held[1]) < part.parts:
            return None
        del self._parts[replica]
        return join_parts(list(held[1].values()))

    def _apply_state(self, view: ReplicaView, state: ResidencyState) -> None:
        view.epoch, view.seq = state.epoch, state.seq
        view.endpoint = state.endpoint or view.endpoint
        view.running = state.running
        view.gpu = set(state.gpu)
        view.host = set(state.host)
        view.stale = False
        view.full_seen = True
        view.seen_s = self._clock()
        listed = {call.workflow_id for call in state.workflows}
        for wf_id, record in list(self.workflows.items()):
            if record.replica == view.name and wf_id not in listed:
                del self.workflows[wf_id]
        for call in state.workflows:
            current = self.workflows.get(call.workflow_id)
            # a full state repeats old calls: it must not take a workflow another replica
            # reported since (that record is newer than anything this state says)
            if current is None or current.replica == view.name:
                self._record(view.name, call, keep_order=current is not None)

    def _apply_update(self, view: ReplicaView, update: ResidencyUpdate) -> bool:
        if update.epoch == view.epoch and update.seq <= view.seq:
            return False
        if update.epoch != view.epoch and update.seq == 1:
            self._restart(view, update.epoch)  # a new feed's first update: nothing missed
        elif update.epoch != view.epoch or update.seq != view.seq + 1:
            view.gaps += 1
            view.stale = True
            view.epoch = update.epoch
        view.seq = update.seq
        view.running = update.running
        view.seen_s = self._clock()
        for change in update.tiers:
            resident = view.gpu if change.tier == "gpu" else view.host
            if change.cleared:
                resident.clear()
            resident.difference_update(change.removed)
            resident.update(change.stored)
        for wf_id in update.finished:
            record = self.workflows.get(wf_id)
            if record is not None and record.replica == view.name:
                del self.workflows[wf_id]
        for call in update.calls:
            self._record(view.name, call)
        return True

    def _restart(self, view: ReplicaView, epoch: int) -> None:
        """``view``'s replica started a new feed, empty: forget what the old one said."""
        view.epoch, view.seq = epoch, 0
        view.gpu, view.host = set(), set()
        view.stale = False
        for wf_id in [w for w, r in self.workflows.items() if r.replica == view.name]:
            del self.workflows[wf_id]

    def _record(self, replica: str, call: WorkflowCall, *, keep_order: bool = False) -> None:
        workflows = self.workflows
        earlier = workflows.get(call.workflow_id)
        by_agent = earlier.by_agent if earlier is not None else {}
        by_agent[call.agent] = call.block_hashes
        if len(by_agent) > MAX_AGENTS_PER_WORKFLOW:
            del by_agent[next(iter(by_agent))]
        record = WorkflowRecord(replica, call.agent, call.block_hashes, self._clock(), by_agent)
        self._learn_agent_prefix(call)
        if not keep_order:
            workflows.pop(call.workflow_id, None)
        workflows[call.workflow_id] = record
        if len(workflows) > self._max_workflows:
            del workflows[next(iter(workflows))]

    def _learn_agent_prefix(self, call: WorkflowCall) -> None:
        """What the agent's prompts share across workflows: known once it called in two."""
        agent, last = call.agent, self._agent_last
        earlier = last.get(agent)
        if earlier is not None and earlier[0] != call.workflow_id:
            known = self.agent_prefixes.get(agent, earlier[1])
            self.agent_prefixes[agent] = known[: _common_prefix(known, call.block_hashes)]
        last.pop(agent, None)
        last[agent] = (call.workflow_id, call.block_hashes)
        if len(last) > MAX_AGENTS:
            oldest = next(iter(last))
            del last[oldest]
            self.agent_prefixes.pop(oldest, None)

    def stored(self, replica: str, block_hashes: Iterable[int], tier: str = "gpu") -> None:
        """Blocks became resident on ``replica``'s ``tier``."""
        view = self.replica(replica)
        (view.gpu if tier == "gpu" else view.host).update(block_hashes)

    def removed(self, replica: str, block_hashes: Iterable[int], tier: str | None = None) -> None:
        """Blocks left ``replica``'s ``tier`` (both tiers when None)."""
        view = self.replica(replica)
        hashes = tuple(block_hashes)
        if tier in (None, "gpu"):
            view.gpu.difference_update(hashes)
        if tier in (None, "host"):
            view.host.difference_update(hashes)

    def call(self, replica: str, workflow_id: str, agent: str, block_hashes: Sequence[int]) -> None:
        """A workflow's call was served by ``replica`` (what an update's ``calls`` say)."""
        self.replica(replica)
        self._record(replica, WorkflowCall(workflow_id, agent, tuple(block_hashes)))

    def drop_replica(self, replica: str) -> None:
        """Forget ``replica`` (it left the fleet) and the workflows recorded on it."""
        self.replicas.pop(replica, None)
        self._parts.pop(replica, None)
        for wf_id in [w for w, r in self.workflows.items() if r.replica == replica]:
            del self.workflows[wf_id]

    # ---- queries ----

    def prefixes(
        self, block_hashes: Sequence[int], replicas: Iterable[str] | None = None
    ) -> dict[str, Prefix]:
        """Each replica's (or each of ``replicas``') cached prefix of ``block_hashes``; a
        replica the index does not know holds nothing."""
        names = self.replicas.keys() if replicas is None else replicas
        empty = Prefix(0, 0)
        out: dict[str, Prefix] = {}
        for name in names:
            view = self.replicas.get(name)
            out[name] = view.prefix(block_hashes) if view is not None else empty
        return out

    def longest_prefix(
        self, block_hashes: Sequence[int], replicas: Iterable[str] | None = None
    ) -> dict[str, int]:
        """Each replica's cached prefix of ``block_hashes``, in blocks (GPU then host)."""
        return {n: p.total for n, p in self.prefixes(block_hashes, replicas).items()}

    def workflow(self, workflow_id: str) -> WorkflowRecord | None:
        """The workflow's last call the index saw (its replica, agent and prompt), if any."""
        return self.workflows.get(workflow_id)


# ---- routers -----------------------------------------------------------------------------------


class Router(Protocol):
    """Chooses a replica for one call among ``loads``' keys (replica -> outstanding work)."""

    name: str

    def choose(self, query: RouteQuery, loads: Mapping[str, float]) -> Decision: ...


def _candidates(loads: Mapping[str, float]) -> list[str]:
    if not loads:
        raise NoReplicaError("no replica may take the call")
    return sorted(loads)


def least_loaded(loads: Mapping[str, float], exclude: Iterable[str] = ()) -> str:
    """The replica with the least outstanding work (ties: the first by name)."""
    skip = set(exclude)
    names = [n for n in _candidates(loads) if n not in skip] or _candidates(loads)
    return min(names, key=lambda n: (loads[n], n))


def overloaded(
    loads: Mapping[str, float],
    *,
    slack: float = DEFAULT_SLACK,
    min_excess: float = DEFAULT_MIN_EXCESS,
) -> frozenset[str]:
    """The replicas whose load exceeds ``slack`` x the mean and the mean by ``min_excess``."""
    if len(loads) < 2:
        return frozenset()
    mean = sum(loads.values()) / len(loads)
    limit = max(mean * slack, mean + min_excess)
    return frozenset(n for n, load in loads.items() if load > limit)


def _best_holder(
    prefixes: Mapping[str, Prefix], loads: Mapping[str, float], skip: frozenset[str]
) -> tuple[str, Prefix] | None:
    """The replica not in ``skip`` with the longest prefix (more of it on GPU, then less load,
    then the name, break ties); None when none holds any block."""
    best: tuple[str, Prefix] | None = None
    best_key: tuple[int, int, float, str] | None = None
    for name in sorted(prefixes):
        prefix = prefixes[name]
        if name in skip or prefix.total == 0:
            continue
        key = (-prefix.total, -prefix.gpu, loads.get(name, 0.0), name)
        if best_key is None or key < best_key:
            best, best_key = (name, prefix), key
    return best


def _prefix_holder(
    index: PrefixIndex,
    prompt: Sequence[int],
    loads: Mapping[str, float],
    skip: frozenset[str],
    reason: str,
) -> Decision | None:
    """The candidate (a key of ``loads``, not in ``skip``) holding the longest cached prefix
    of ``prompt``, said with ``reason`` ("spill" when a skipped one holds more); None when no
    candidate holds any of it."""
    if not prompt:
        return None
    prefixes = index.prefixes(prompt, _candidates(loads))
    best = _best_holder(prefixes, loads, skip)
    if best is None:
        return None
    any_holder = _best_holder(prefixes, loads, frozenset())
    spilled = any_holder is not None and any_holder[0] != best[0]
    return Decision(best[0], best[1].total, "spill" if spilled else reason)


class RoundRobin:
    """The candidates in turn, by name order."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, query: RouteQuery, loads: Mapping[str, float]) -> Decision:
        names = _candidates(loads)
        replica = names[self._turn % len(names)]
        self._turn += 1
        return Decision(replica, 0, "round-robin")


class SessionSticky:
    """One replica per workflow, by rendezvous (highest random weight) hashing of the
    workflow id and the replica's name: deterministic across processes and restarts."""

    name = "sticky"

    @staticmethod
    def _weight(workflow_id: str, replica: str) -> bytes:
        return hashlib.blake2b(f"{workflow_id}\x00{replica}".encode(), digest_size=8).digest()

    def choose(self, query: RouteQuery, loads: Mapping[str, float]) -> Decision:
        names = _candidates(loads)
        replica = max(names, key=lambda n: self._weight(query.workflow_id, n))
        return Decision(replica, 0, "sticky")


class _OverIndex:
    """A router reading the prefix index, skipping a replica whose load exceeds the mean by
    ``slack`` (and by ``min_excess`` at least: ``overloaded``)."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        slack: float = DEFAULT_SLACK,
        min_excess: float = DEFAULT_MIN_EXCESS,
    ) -> None:
        self.index = index
        self.slack = slack
        self.min_excess = min_excess


class PrefixAware(_OverIndex):
    """llm-d's prefix-cache-aware routing: the replica with the longest cached prefix of the
    call's own ``block_hashes`` (an overloaded holder skipped for the next-best), else the
    least-loaded replica."""

    name = "prefix"

    def choose(self, query: RouteQuery, loads: Mapping[str, float]) -> Decision:
        _candidates(loads)  # (raises NoReplicaError when there is none)
        skip = overloaded(loads, slack=self.slack, min_excess=self.min_excess)
        decision = _prefix_holder(self.index, query.block_hashes, loads, skip, "prefix")
        return decision or Decision(least_loaded(loads, skip), 0, "least-loaded")


class WorkflowAware(_OverIndex):
    """AgentKV's workflow-aware routing.

    For ``query.workflow_id`` the replica holding the longest cached prefix of the prompt the
    call will extend: the named agent's previous prompt in the workflow when the index has one
    (its system prompt, then the transcript), else the workflow's previous prompt (the index's
    record, when it starts with what the agent's prompts share; else that shared part; the
    query's own ``block_hashes`` when the index knows neither); an overloaded holder is skipped
    for the next-best one ("spill"); when no candidate holds any of it, the replica this router
    placed the workflow on recently ("placed": the index learns of a call a few hundred ms after
    it starts), else the least-loaded replica. The choice is remembered as the workflow's
    placement, so calls that arrive before the index has seen the previous one stay together.
    Not thread-safe.
    """

    name = "workflow"

    def __init__(
        self,
        index: PrefixIndex,
        *,
        slack: float = DEFAULT_SLACK,
        min_excess: float = DEFAULT_MIN_EXCESS,
        max_placements: int = MAX_PLACEMENTS,
    ) -> None:
        super().__init__(index, slack=slack, min_excess=min_excess)
        self._max_placements = max_placements
        self._placed: dict[str, str] = {}

    def choose(self, query: RouteQuery, loads: Mapping[str, float]) -> Decision:
        decision = self._decide(query.workflow_id, query.block_hashes, loads, query.agent)
        self._place(query.workflow_id, decision.replica)
        return decision

    def stage_for(
        self,
        workflow_id: str,
        predicted_agent: str | None = None,
        loads: Mapping[str, float] | None = None,
    ) -> str | None:
        """The replica the workflow's next call will go to (where to stage
        ``predicted_agent``'s blocks), or None when the workflow is unknown. Whichever agent
        calls next, the call carries the workflow's transcript, so the same choice serves every
        predicted agent; ``loads`` (default: every replica the index knows, equally loaded)
        applies the overload rule."""
        if loads is None:
            loads = dict.fromkeys(self.index.replicas, 0.0)
        if not loads:
            return None
        record = self.index.workflow(workflow_id)
        if record is None and workflow_id not in self._placed:
            return None
        return self._decide(workflow_id, (), loads, predicted_agent).replica

    def forget(self, workflow_id: str) -> None:
        """Drop the workflow's placement (it finished)."""
        self._placed.pop(workflow_id, None)

    def _decide(
        self,
        workflow_id: str,
        block_hashes: tuple[int, ...],
        loads: Mapping[str, float],
        agent: str | None = None,
    ) -> Decision:
        _candidates(loads)  # (raises NoReplicaError when there is none)
        skip = overloaded(loads, slack=self.slack, min_excess=self.min_excess)
        record = self.index.workflow(workflow_id)
        prompt = self._prompt_extended(record, agent) or block_hashes

        decision = _prefix_holder(self.index, prompt, loads, skip, "workflow-prefix")
        if decision is not None:
            return decision
        placed = self._placed.get(workflow_id)
        if placed is not None and placed in loads and placed not in skip:
            return Decision(placed, 0, "placed")
        if record is not None and record.replica in loads and record.replica not in skip:
            return Decision(record.replica, 0, "last-replica")
        return Decision(least_loaded(loads, skip), 0, "least-loaded")

    def _prompt_extended(self, record: WorkflowRecord | None, agent: str | None) -> tuple[int, ...]:
        """The recorded prompt the call of ``agent`` will extend: the agent's previous prompt
        in the workflow; else the workflow's previous prompt when it starts with what the
        agent's prompts share (its system prompt), else that shared part (the agent's first
        call in this workflow re-sends only it); empty when the index knows neither."""
        if record is not None and agent is not None and agent in record.by_agent:
            return record.by_agent[agent]
        shared = self.index.agent_prefixes.get(agent, ()) if agent is not None else ()
        if record is not None and record.block_hashes[: len(shared)] == shared:
            return record.block_hashes
        return shared

    def _place(self, workflow_id: str, replica: str) -> None:
        placed = self._placed
        placed.pop(workflow_id, None)
        placed[workflow_id] = replica
        if len(placed) > self._max_placements:
            del placed[next(iter(placed))]


ROUTERS: Final = ("workflow", "prefix", "sticky", "round-robin")


def make_router(
    name: str,
    index: PrefixIndex,
    *,
    slack: float = DEFAULT_SLACK,
    min_excess: float = DEFAULT_MIN_EXCESS,
) -> Router:
    """The router named ``name`` (``ROUTERS``) over ``index``; ``slack`` / ``min_excess``
    apply to ``prefix`` and ``workflow``."""
    if name == "workflow":
        return WorkflowAware(index, slack=slack, min_excess=min_excess)
    if name == "prefix":
        return PrefixAware(index, slack=slack, min_excess=min_excess)
    if name == "sticky":
        return SessionSticky()
    if name in ("round-robin", "rr"):
        return RoundRobin()
    raise ValueError(f"unknown router {name!r}; one of {', '.join(ROUTERS)}")
