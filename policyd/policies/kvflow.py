"""``kvflow``: the KVFlow baseline (Pan et al., 2025) - a static Agent Step Graph.

* Agent Step Graph: per workflow type, a fixed graph agent -> agents that may run next, given to
  the constructor (``DEFAULT_GRAPHS`` reads them off ``policyd.workloads.pbkv``). Nothing is
  learned: this is the static-workflow method PBKV compares against.
* Steps-to-execution: for each active workflow, the BFS distance in its graph from where it
  stands (its last called agent, plus the agents of its running requests: a fan-out stands at
  several places at once) to every agent; 1 for a direct successor, infinite when unreachable.
* Eviction priority: a (workflow, agent) private prompt (the agent's latest prompt in the
  workflow minus its shared prefix) scores ``1 / steps``; an agent's shared prefix scores
  ``1 / min steps`` over every active workflow (KVFlow: shared prefixes take the minimum).
  Farther agents are evicted first, ties by recency.
* No lifecycle of its own: blocks in no active workflow's future - finished workflows, agents
  unreachable from where their workflow stands, workflows of a type without a graph - are at
  infinite steps and go unscored (``default_score`` 0, below every ``1 / steps``), so they are
  evicted before all graph-reachable blocks, least recently used first.
* Prefetch: host-resident blocks of the next-step agents (steps == 1) of idle active workflows,
  only blocks not on the GPU, within the caller's budget.

Groups are published disjoint: they are built highest score first and each block keeps the
first (highest) score it gets, so a block reachable along two paths takes the nearer one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar

from policyd.core.policy import Ordering, ScoredPolicy
from policyd.core.state import EngineState, WorkflowState
from policyd.core.types import PolicySnapshot, ScoredBlocks, score_map
from policyd.models.stepgraph import steps_from

AgentGraph = Mapping[str, Sequence[str]]

_ANALYSTS = ["income_analyst", "balance_analyst", "cashflow_analyst"]

DEFAULT_GRAPHS: dict[str, dict[str, list[str]]] = {
    "fact-checking": {
        "planner": ["retriever"],
        "retriever": ["verifier"],
        "verifier": ["retriever", "summarizer"],
        "summarizer": [],
    },
    "code-writing": {
        "planner": ["coder"],
        "coder": ["tester"],
        "tester": ["debugger", "reviewer"],
        "debugger": ["coder"],
        "reviewer": [],
    },
    # the three statement analysts are a fan-out iterating in lockstep (income, balance,
    # cashflow, income, ...): after any of them, any of them may run next, or the ratio analyst
    "financial": {
        "planner": list(_ANALYSTS),
        **{analyst: [*_ANALYSTS, "ratio_analyst"] for analyst in _ANALYSTS},
        "ratio_analyst": ["ratio_analyst", "risk_analyst"],
        "risk_analyst": ["writer"],
        "writer": [],
    },
}


class KVFlow(ScoredPolicy):
    name: ClassVar[str] = "kvflow"
    ordering: ClassVar[Ordering] = "snapshot"
    description: ClassVar[str] = (
        "KVFlow baseline: static agent step graph, evict by steps-to-execution, prefetch next"
    )

    def __init__(self, *, graphs: Mapping[str, AgentGraph] | None = None) -> None:
        source = DEFAULT_GRAPHS if graphs is None else graphs
        self.graphs: dict[str, dict[str, tuple[str, ...]]] = {
            wtype: {agent: tuple(nexts) for agent, nexts in graph.items()}
            for wtype, graph in source.items()
        }
        # all-pairs BFS once: the graphs are static and small
        self._steps: dict[str, dict[str, dict[str, int]]] = {}
        for wtype, graph in self.graphs.items():
            agents = set(graph).union(*graph.values())
            self._steps[wtype] = {agent: steps_from(graph, agent) for agent in agents}

    # -- steps-to-execution --------------------------------------------------------------------

    def positions(self, wf: WorkflowState, state: EngineState) -> set[str]:
        """Where a workflow stands: its last called agent and the agents it is running."""
        here = {r.agent for r in state.requests.values() if r.workflow_id == wf.workflow_id}
        if wf.agents:
            here.add(wf.agents[-1])
        return here

    def workflow_steps(self, wf: WorkflowState, state: EngineState) -> dict[str, int]:
        """Steps-to-execution of every agent reachable from where ``wf`` stands (the minimum
        over its positions). Empty for a workflow whose type has no graph."""
        table = self._steps.get(wf.workflow_type)
        if table is None:
            return {}
        steps: dict[str, int] = {}
        for position in self.positions(wf, state):
            for agent, k in table.get(position, {}).items():
                if k < steps.get(agent, math.inf):
                    steps[agent] = k
        return steps

    def all_steps(self, state: EngineState) -> list[tuple[WorkflowState, dict[str, int]]]:
        return [(wf, self.workflow_steps(wf, state)) for wf in state.active_workflows()]

    # -- scoring -------------------------------------------------------------------------------

    def score_groups(self, state: EngineState) -> list[ScoredBlocks]:
        """Disjoint groups scored ``1 / steps``, highest first; unreachable blocks are left out."""
        prefixes = state.agent_prefix
        shared: dict[str, int] = {}  # agent -> min steps over active workflows
        private: list[tuple[int, tuple[int, ...]]] = []
        for wf, steps in self.all_steps(state):
            for agent, k in steps.items():
                if k < shared.get(agent, math.inf):
                    shared[agent] = k
                blocks = wf.agent_blocks.get(agent)
                if blocks is not None:
                    tail = blocks[len(prefixes.get(agent, ())) :]
                    if tail:
                        private.append((k, tail))
        candidates = [(k, prefixes[a]) for a, k in shared.items() if prefixes.get(a)]
        candidates.extend(private)
        candidates.sort(key=lambda item: item[0])  # stable: prefixes before tails at equal k
        return _disjoint(candidates)

    def block_scores(self, state: EngineState) -> dict[int, float]:
        return score_map(self.score_groups(state))

    def snapshot(
        self, state: EngineState, *, now: float, version: int, ttl_s: float
    ) -> PolicySnapshot:
        return PolicySnapshot(
            version=version,
            ts=now,
            ttl_s=ttl_s,
            policy=self.name,
            scores=tuple(self.score_groups(state)),
            default_score=0.0,
        )

    # -- synchronous decisions -----------------------------------------------------------------

    def prefetch(self, budget_blocks: int, state: EngineState) -> list[int]:
        """Host blocks of the next-step agents of idle workflows (their latest prompt in the
        workflow, or the agent's shared prefix if the workflow has not called it yet)."""
        if budget_blocks <= 0:
            return []
        host, gpu = state.resident["host"], state.resident["gpu"]
        out: list[int] = []
        taken: set[int] = set()
        for wf, steps in self.all_steps(state):
            if wf.running:
                continue
            for agent, k in steps.items():
                if k != 1:
                    continue
                blocks = wf.agent_blocks.get(agent) or state.agent_prefix.get(agent, ())
                for b in blocks:
                    if b in host and b not in gpu and b not in taken:
                        taken.add(b)
                        out.append(b)
                        if len(out) >= budget_blocks:
                            return out
        return out


def _disjoint(candidates: Iterable[tuple[int, tuple[int, ...]]]) -> list[ScoredBlocks]:
    """One group per candidate, nearest first; a block keeps the first score it gets."""
    claimed: set[int] = set()
    groups: list[ScoredBlocks] = []
    for k, offered in candidates:
        blocks = offered
        if not claimed.isdisjoint(blocks):
            blocks = tuple(dict.fromkeys(b for b in blocks if b not in claimed))
        elif len(set(blocks)) != len(blocks):
            blocks = tuple(dict.fromkeys(blocks))
        if blocks:
            claimed.update(blocks)
            groups.append(ScoredBlocks(1.0 / k, blocks))
    return groups
