"""The steps ranking: KVFlow's ``1 / steps-to-execution`` on an agent step graph learned online.

A live prompt is valued ``1 / k`` where k is the fewest steps from where its workflow stands
(its last called agent and the agents it is running) to the agent (``StepGraph.steps``; before
a position has been seen followed by anything, the workflow's own agents by recency). A shared
prefix takes the nearest workflow's value; agents no step reaches score 0.

Ties: ``tie_broken`` breaks the ties of a ``1 / k`` class by the lookahead, in the workflow
types whose learned graph has structure; in a *flat* type (one agent per workflow) the steps
ranking stays recency (``StepGraph.flat``).
"""

from __future__ import annotations

from collections.abc import Mapping

from policyd.core.state import EngineState
from policyd.core.types import Event, RequestStarted, WorkflowFinished
from policyd.models.stepgraph import StepGraph
from policyd.policies.rankings import Key, Values, added

TIE_SHARE = 1e-6  # the lookahead's share of a steps score: below any gap between 1/k and 1/(k+1)


class StepsRanking:
    """The learned step graph (``graph``) and the rankings read from it."""

    def __init__(self) -> None:
        self.graph = StepGraph()

    def observe(self, event: Event) -> None:
        kind = type(event)
        if kind is RequestStarted:
            assert isinstance(event, RequestStarted)
            self.graph.observe_call(event.workflow_id, event.workflow_type, event.agent)
        elif kind is WorkflowFinished:
            assert isinstance(event, WorkflowFinished)
            self.graph.observe_finished(event.workflow_id)

    def values(self, state: EngineState) -> Values:
        """Every live prompt's ``1 / steps`` from where its workflow stands."""
        private: dict[Key, float] = {}
        shared: dict[str, float] = {}
        running: dict[str, set[str]] = {}
        for req in state.requests.values():
            running.setdefault(req.workflow_id, set()).add(req.agent)
        for wf in state.active_workflows():
            wid = wf.workflow_id
            here = running.get(wid, set())
            if wf.agents:
                here = here | {wf.agents[-1]}
            for agent, k in self.graph.steps(wf.workflow_type, here, wf.agents).items():
                private[wid, agent] = 1.0 / k
                shared[agent] = max(shared.get(agent, 0.0), 1.0 / k)
        return Values(private, shared)

    def value(self, workflow_id: str, agent: str, state: EngineState) -> float:
        """``1 / steps`` to ``agent``'s next call in the workflow, counted from the agents the
        workflow is running and ``agent`` itself (0: unreachable or an unknown workflow)."""
        wf = state.workflows.get(workflow_id)
        if wf is None:
            return 0.0
        here = {r.agent for r in state.requests.values() if r.workflow_id == workflow_id}
        k = self.graph.steps(wf.workflow_type, here | {agent}, wf.agents).get(agent)
        return 0.0 if k is None else 1.0 / k

    def flat(self, workflow_type: str) -> bool:
        """Whether the type's learned graph is flat (``StepGraph.flat``)."""
        return self.graph.flat(workflow_type)

    def flat_types(self, private: Mapping[Key, float], state: EngineState) -> set[str]:
        """The types of the workflows keyed in ``private`` (active ones) whose learned graph
        is flat."""
        workflows = state.workflows
        kinds = {workflows[wid].workflow_type for wid, _ in private}
        return {kind for kind in kinds if self.graph.flat(kind)}

    def structured(self, ranking: Values, state: EngineState) -> Values:
        """``ranking`` restricted to the workflows whose type's learned graph has structure,
        its shared prefixes re-summed over them (``ranking`` itself when no type is flat)."""
        workflows = state.workflows
        flat = self.flat_types(ranking.private, state)
        if not flat:
            return ranking
        private = {
            key: mass
            for key, mass in ranking.private.items()
            if workflows[key[0]].workflow_type not in flat
        }
        shared: dict[str, float] = {}
        for (_, agent), mass in private.items():
            shared[agent] = shared.get(agent, 0.0) + mass
        return Values(private, shared)

    def tie_broken(self, steps: Values, ahead: Values, state: EngineState) -> Values:
        """``steps`` with the lookahead ``ahead`` of the structured types as its tie-break."""
        return tie_broken(steps, self.structured(ahead, state))


def tie_broken(steps: Values, ahead: Values) -> Values:
    """``steps`` with ``ahead`` as its tie-break: each value raised by ``ahead``'s, scaled to
    under ``TIE_SHARE``, so the steps classes keep their order and within a class (and among
    the blocks no step reaches, which the lookahead may still expect) the block the forecast
    expects more goes last; recency decides only what both leave equal.

    >>> steps = Values({("w", "a"): 0.5, ("w", "b"): 0.5, ("w", "d"): 1.0}, {})
    >>> ahead = Values({("w", "b"): 2.0, ("w", "d"): 0.1}, {"c": 1.0})
    >>> private, shared = tie_broken(steps, ahead)
    >>> sorted(private, key=private.__getitem__), 0.0 < shared["c"] < 1e-6
    ([('w', 'a'), ('w', 'b'), ('w', 'd')], True)
    """
    top = max(max(ahead.private.values(), default=0.0), max(ahead.shared.values(), default=0.0))
    if top <= 0.0:
        return steps
    scale = TIE_SHARE / (1.0 + top)
    private = added(steps.private, {key: scale * v for key, v in ahead.private.items()})
    shared = added(steps.shared, {agent: scale * v for agent, v in ahead.shared.items()})
    return Values(private, shared)
