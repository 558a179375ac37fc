"""Per-workflow state: where each active workflow is, what was forecast for it, its aliases.

An active workflow (one whose calls are being observed) keeps its position, the one-step
prediction there and its request's hints (computed once per position, for serving and for
learning), the forecast served there, and the forecasts still to be scored (``pending``: one
made at position ``p`` is scored as the calls at ``p + 1 .. p + K`` arrive). A workflow of a
type modelled over aliases calls its agents ``#1`` (its first speaker), ``#2`` (the next new
one), and so on; what is forecast for it is translated back to names (``named``).
``ActiveWorkflows`` remembers at most ``max_workflows`` of them, forgetting the least recently
seen first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from policyd.core.types import HintValue
from policyd.models.predictor.context import split_hints
from policyd.models.predictor.forecast import START, Forecast
from policyd.models.predictor.nodes import Hints, Node
from policyd.models.predictor.position import Position


def first_position(kind: str, hints: Mapping[str, HintValue]) -> Position:
    """The position of a workflow of type ``kind`` before its first call."""
    numeric, onehot = split_hints(hints)
    return Position(kind, (START,), (), 0, {}, 0, numeric, onehot)


def named(forecast: Forecast, names: Mapping[str, str]) -> Forecast:
    """An aliased workflow's forecast in agent names (``names``: alias -> name). An alias with
    no name yet (an agent the workflow has not called) is left out: its step's distribution
    then sums to less than 1, the rest being "an agent not called so far".

    >>> named(Forecast([{"#1": 0.6, "#2": 0.4}], [1.0]), {"#1": "coder"}).agents
    [{'coder': 0.6}]
    """
    agents = [{names[a]: p for a, p in step.items() if a in names} for step in forecast.agents]
    return Forecast(agents, forecast.alive)


@dataclass(slots=True)
class Workflow:
    """One active workflow (checkpoints pickle its fields by name: one may be added, never
    renamed)."""

    position: Position
    ts: float
    node: Node | None = None  # the one-step prediction at the current position
    hints: Hints | None = None
    forecast: Forecast | None = None  # what was served for the current position
    pending: deque[tuple[int, Forecast]] = field(default_factory=deque)
    # an aliased workflow's aliases: name -> alias and alias -> name (None: modelled by name)
    aliases: dict[str, str] | None = None
    named: dict[str, str] | None = None
    novel: bool = False  # one of its calls named an agent new to its type

    def label(self, agent: str) -> str:
        """What ``agent`` is called in this workflow's models: its alias, given on its first
        call (``#n`` for the workflow's n-th distinct agent), or, by name, itself."""
        aliases = self.aliases
        if aliases is None:
            return agent
        alias = aliases.get(agent)
        if alias is None:
            assert self.named is not None
            alias = aliases[agent] = f"#{len(aliases) + 1}"
            self.named[alias] = agent
        return alias

    def in_names(self, forecast: Forecast) -> Forecast:
        """``forecast`` (over this workflow's labels) as served: in agent names."""
        return forecast if self.named is None else named(forecast, self.named)

    def advance(self, label: str, hints: Mapping[str, HintValue], ts: float, order: int) -> None:
        """Move on past a call of ``label`` whose request carried ``hints``: what was computed
        for the position left (prediction, hints, forecast) is dropped."""
        numeric, onehot = split_hints(hints)
        position = self.position.then(label, order)
        position.numeric, position.onehot = numeric, onehot
        self.position = position
        self.ts = ts
        self.node = self.hints = self.forecast = None


class ActiveWorkflows:
    """The active workflows by id, least recently seen first, at most ``max_workflows``.

    >>> active = ActiveWorkflows(OrderedDict(), max_workflows=2)
    >>> for wid in ("a", "b", "c"):
    ...     _ = active.start(wid, "code", {}, 0.0, aliased=False)
    >>> list(active)
    ['b', 'c']
    """

    def __init__(self, by_id: OrderedDict[str, Workflow], max_workflows: int = 100_000) -> None:
        self._by_id = by_id
        self.max_workflows = max_workflows

    def seen(self, workflow_id: str) -> Workflow | None:
        """The active workflow ``workflow_id``, now the most recently seen (None: not active)."""
        workflow = self._by_id.get(workflow_id)
        if workflow is not None:
            self._by_id.move_to_end(workflow_id)
        return workflow

    def start(
        self,
        workflow_id: str,
        kind: str,
        hints: Mapping[str, HintValue],
        ts: float,
        *,
        aliased: bool,
    ) -> Workflow:
        """A new active workflow of type ``kind`` (modelled over aliases if ``aliased``); the
        least recently seen are forgotten past ``max_workflows``."""
        workflow = Workflow(first_position(kind, hints), ts)
        if aliased:
            workflow.aliases, workflow.named = {}, {}
        by_id = self._by_id
        by_id[workflow_id] = workflow
        while len(by_id) > self.max_workflows:
            by_id.popitem(last=False)
        return workflow

    def pop(self, workflow_id: str) -> Workflow | None:
        return self._by_id.pop(workflow_id, None)

    def __getitem__(self, workflow_id: str) -> Workflow:
        return self._by_id[workflow_id]

    def get(self, workflow_id: str) -> Workflow | None:
        return self._by_id.get(workflow_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def values(self) -> Iterator[Workflow]:
        return iter(self._by_id.values())
