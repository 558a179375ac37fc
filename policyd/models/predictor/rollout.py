"""K-step forecasts from a one-step model: a beam over likely continuations.

Step 1 is the one-step distribution at the workflow's position. For step k + 1 the ``beam``
most likely continuations of step k (``END`` excluded, each at least ``min_branch`` likely) are
expanded: the position advances by the hypothetical agent (position, last agents, per-agent
call counts, run length) and the one-step model is asked again; hints stay those of the last
real request. Continuations not expanded are assumed to behave like the expanded ones on
average (their mass is spread in proportion). ``END`` absorbs: P(alive) at step k is one minus
the mass that reached ``END`` by then, so it never increases.

``BeamRollout`` is what the predictor runs: this computation with ``OneStepModel.evaluate`` as
its step, inlined (no closure call per step). ``rollout`` is the same computation over any
one-step function: the reference its tests compare ``BeamRollout`` with, forecast by forecast.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from operator import mul, truediv
from typing import Final, Protocol

from policyd.models.predictor.forecast import END, Forecast
from policyd.models.predictor.nodes import Hints, Node, step_one
from policyd.models.predictor.onestep import OneStepModel
from policyd.models.predictor.position import Position

MIN_BRANCH: Final = 0.05  # the default branching floor (``Predictor``'s ``min_branch``)


class OneStep(Protocol):
    """A one-step prediction: candidate labels (``END`` among them) and their probabilities."""

    @property
    def labels(self) -> list[str]: ...

    @property
    def probs(self) -> list[float]: ...


def _first(child: tuple[float, str, Position]) -> float:
    return child[0]


class _Fixed:
    def __init__(self, labels: list[str], probs: list[float]) -> None:
        self.labels, self.probs = labels, probs


def rollout(
    position: Position,
    first: OneStep,
    step: Callable[[Position], OneStep],
    *,
    k: int,
    beam: int,
    min_branch: float,
    order: int,
) -> Forecast:
    """Roll ``step`` forward from ``position``, whose one-step prediction is ``first``.

    >>> table = {"a": _Fixed(["b", END], [0.5, 0.5]), "b": _Fixed([END], [1.0])}
    >>> start = Position("t", ("a",), ("a",), 1, {"a": 1}, 1, {}, {})
    >>> f = rollout(start, table["a"], lambda p: table[p.history[-1]], k=3, beam=2,
    ...             min_branch=0.0, order=2)
    >>> f.alive, f.agents[0]
    ([0.5, 0.0, 0.0], {'b': 1.0})
    """
    agents: list[dict[str, float]] = []
    alive: list[float] = []
    ended = 0.0  # P(END by now)
    paths: list[tuple[float, OneStep, Position]] = [(1.0, first, position)]
    for index in range(k):
        mass = sum([path[0] for path in paths])
        scale = (1.0 - ended) / mass if mass > 0.0 else 0.0
        joint: dict[str, float] = {}
        children: list[tuple[float, str, Position]] = []
        last = index + 1 == k
        for p, one, here in paths:
            labels = one.labels
            pqs = list(map(mul, repeat(p * scale), one.probs))  # P(path) x P(label | path)
            if not joint:  # (a OneStep's labels are distinct)
                joint = dict(zip(labels, pqs, strict=True))
            else:
                get = joint.get
                for label, pq in zip(labels, pqs, strict=True):
                    joint[label] = get(label, 0.0) + pq
            if not last:
                for label, pq in zip(labels, pqs, strict=True):
                    if pq >= min_branch and label != END:
                        children.append((pq, label, here))
        ended = min(1.0, ended + joint.pop(END, 0.0))
        alive.append(1.0 - ended)
        total = sum(joint.values())
        shares = map(truediv, joint.values(), repeat(total))
        agents.append(dict(zip(joint, shares, strict=True)) if total > 0.0 else {})
        if last or not children:
            break
        if len(children) > 1:
            children.sort(key=_first, reverse=True)
        paths = []
        for p, label, here in children[:beam]:
            child = here.then(label, order)
            paths.append((p, step(child), child))
    while len(alive) < k:  # nothing left to expand: the last step's view carries over
        agents.append(dict(agents[-1]))
        alive.append(alive[-1])
    return Forecast(agents, alive)


class BeamRollout:
    """``rollout`` with ``one_step.evaluate`` as its step, inlined: the same arithmetic in the
    same order (the same forecasts), without a call per step through a closure.

    ``k`` (steps forecast) may be changed between forecasts; ``forecasts`` counts the
    forecasts rolled out."""

    def __init__(
        self,
        one_step: OneStepModel,
        *,
        k: int = 3,
        beam: int = 2,
        min_branch: float = MIN_BRANCH,
        order: int = 3,
        forecasts: int = 0,
    ) -> None:
        self._one_step = one_step
        self.k = k
        self.beam = beam
        self.min_branch = min_branch
        self.order = order
        self.forecasts = forecasts

    def forecast(self, position: Position, node: Node, hints: Hints) -> Forecast:
        """The K-step forecast from ``position``, whose one-step prediction is ``node`` and
        whose request's hints are ``hints``. Step 1 is the node itself (one path of mass 1,
        scaled by 1: its probabilities as they are)."""
        self.forecasts += 1
        k, min_branch = self.k, self.min_branch
        labels, probs = node.labels, node.probs
        first, ended = step_one(labels, probs)
        alive = [1.0 - ended]
        agents = [first]
        if k > 1:
            children = [
                (q, label, position)
                for label, q in zip(labels, probs, strict=True)
                if q >= min_branch and label != END
            ]
            if children:
                self._roll_on(children, hints, agents, alive, ended)
        while len(alive) < k:  # nothing left to expand: the last step's view carries over
            agents.append(dict(agents[-1]))
            alive.append(alive[-1])
        return Forecast(agents, alive)

    def _roll_on(
        self,
        children: list[tuple[float, str, Position]],
        hints: Hints,
        agents: list[dict[str, float]],
        alive: list[float],
        ended: float,
    ) -> None:
        """Steps 2..K of ``forecast``: expand the ``beam`` likeliest ``children`` of the step
        before, mix their one-step distributions, and so on."""
        k, beam, min_branch, order = self.k, self.beam, self.min_branch, self.order
        evaluate = self._one_step.evaluate
        for index in range(1, k):
            if len(children) > 1:
                children.sort(key=_first, reverse=True)
            paths = []
            for p, label, here in children[:beam]:
                child = here.then(label, order)
                step = evaluate(child, hints, False)
                paths.append((p, step.labels, step.probs, child))
            # one path's mass is its probability (what sum gives: 0 + p is p)
            mass = paths[0][0] if len(paths) == 1 else sum([path[0] for path in paths])
            scale = (1.0 - ended) / mass if mass > 0.0 else 0.0
            joint: dict[str, float] = {}
            children = []
            last = index + 1 == k
            for p, labels, probs, here in paths:
                ps = p * scale
                pqs = [ps * q for q in probs]  # P(path) x P(label | path)
                if not joint:  # (a node's labels are distinct)
                    joint = dict(zip(labels, pqs, strict=True))
                else:
                    get = joint.get
                    for label, pq in zip(labels, pqs, strict=True):
                        joint[label] = get(label, 0.0) + pq
                if not last:
                    for label, pq in zip(labels, pqs, strict=True):
                        if pq >= min_branch and label != END:
                            children.append((pq, label, here))
            ended = min(1.0, ended + joint.pop(END, 0.0))
            alive.append(1.0 - ended)
            total = sum(joint.values())
            agents.append({label: pq / total for label, pq in joint.items()} if total > 0.0 else {})
            if not children:
                return
