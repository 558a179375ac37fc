"""A learned agent step graph: KVFlow's steps-to-execution, with the graph learned online.

KVFlow (``policyd.policies.kvflow``) is given each workflow type's Agent Step Graph; here the
graph is the set of agent -> agent transitions observed so far (a workflow's consecutive calls,
the calls of a fan-out included). Steps from where a workflow stands (its last called agent and
the agents it is running) are BFS distances. A fan-out's calls chain here (income -> balance ->
cashflow) where KVFlow's graph for the financial crew has each one step from the others; while
they run, all of them are positions, so their distances are the same. A fan-out is not learned
as one step (docs/RESULTS.md, *Tried and not adopted*).

Why: the structure is learned from a handful of workflows - far sooner than the predictor's
probabilities are trustworthy - so it is what agentkv ranks by while the predictor is degraded
(cold start, drift), and the tie-break among blocks the lookahead gives equal value.

>>> graph = StepGraph()
>>> for agent in ("planner", "coder", "tester", "debugger", "coder", "tester"):
...     graph.observe_call("w0", "code", agent)
>>> graph.observe_finished("w0")
>>> graph.steps("code", {"tester"})
{'debugger': 1, 'coder': 2, 'tester': 3}
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence


def steps_from(graph: Mapping[str, Iterable[str]], start: str) -> dict[str, int]:
    """BFS distances from ``start`` to every agent reachable in at least one step (``start``
    itself only if a cycle leads back to it). Unreachable agents are absent (infinite)."""
    steps: dict[str, int] = {}
    frontier: deque[tuple[str, int]] = deque((nxt, 1) for nxt in graph.get(start, ()))
    while frontier:
        agent, k = frontier.popleft()
        if agent in steps:
            continue
        steps[agent] = k
        frontier.extend((nxt, k + 1) for nxt in graph.get(agent, ()) if nxt not in steps)
    return steps


class StepGraph:
    """Observed transitions per workflow type, and BFS steps-to-execution over them."""

    def __init__(self) -> None:
        self._next: dict[str, dict[str, set[str]]] = {}  # type -> agent -> successors
        self._known: dict[str, set[str]] = {}  # type -> agents seen followed by a call or the end
        self._last: dict[str, tuple[str, str]] = {}  # workflow -> (type, last agent)
        self._steps: dict[tuple[str, str], dict[str, int]] = {}  # BFS cache (type, start)

    def observe_call(self, workflow_id: str, workflow_type: str, agent: str) -> None:
        last = self._last.get(workflow_id)
        self._last[workflow_id] = (workflow_type, agent)
        if last is None:
            return
        graph = self._next.setdefault(last[0], {})
        successors = graph.setdefault(last[1], set())
        self._known.setdefault(last[0], set()).add(last[1])
        if agent not in successors:
            successors.add(agent)
            # a new edge changes distances of this type only
            for key in [key for key in self._steps if key[0] == last[0]]:
                del self._steps[key]

    def observe_finished(self, workflow_id: str) -> None:
        last = self._last.pop(workflow_id, None)
        if last is not None:
            self._known.setdefault(last[0], set()).add(last[1])

    def flat(self, workflow_type: str) -> bool:
        """Whether no transition between two different agents of the type was seen (single-agent
        workflows, or none yet): its steps rank every live prompt alike, i.e. by recency.

        >>> graph = StepGraph()
        >>> for agent in ("solver", "solver"):
        ...     graph.observe_call("w0", "pool", agent)
        >>> graph.flat("pool"), graph.flat("unknown")
        (True, True)
        >>> graph.observe_call("w0", "pool", "reviewer")
        >>> graph.flat("pool")
        False
        """
        return all(
            not successors or successors == {agent}
            for agent, successors in self._next.get(workflow_type, {}).items()
        )

    def edges(self, workflow_type: str) -> int:
        return sum(len(s) for s in self._next.get(workflow_type, {}).values())

    def steps_from(self, workflow_type: str, start: str) -> dict[str, int]:
        """BFS distances from ``start`` (``start`` itself only if a cycle leads back to it)."""
        key = (workflow_type, start)
        cached = self._steps.get(key)
        if cached is not None:
            return cached
        steps = self._steps[key] = steps_from(self._next.get(workflow_type, {}), start)
        return steps

    def steps(
        self, workflow_type: str, positions: Iterable[str], history: Sequence[str] = ()
    ) -> dict[str, int]:
        """Steps-to-execution of every agent reachable from any of ``positions`` (minimum).

        A position never yet seen followed by anything (cold start) has no edges to go by;
        the prior then is the workflow's own ``history`` (its agents in call order): each agent
        it called is reachable, the most recently called nearest - recency at agent grain."""
        out: dict[str, int] = {}
        known = self._known.get(workflow_type, set())
        for position in positions:
            if position in known:
                reach = self.steps_from(workflow_type, position)
            else:
                recent = list(dict.fromkeys(reversed(history)))
                reach = {agent: i + 1 for i, agent in enumerate(recent)}
            for agent, k in reach.items():
                if k < out.get(agent, 1 << 30):
                    out[agent] = k
        return out
