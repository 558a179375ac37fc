"""K-step forecasts from a one-step model: a beam over likely continuations.

Step 1 is the one-step distribution at the workflow's position. For step k + 1 the ``beam``
most likely continuations of step k (``END`` excluded, each at least ``min_branch`` likely) are
expanded: the position advances by the hypothetical agent (position, last agents, per-agent
call counts, run length) and the one-step model is asked again. Continuations not expanded are
assumed to behave like the expanded ones on average (their mass is spread in proportion).
``END`` absorbs: P(alive) at step k is one minus the mass that reached ``END`` by then, so it
never increases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from policyd.predictor.forecast import END, Forecast
from policyd.predictor.position import Position


class OneStep(Protocol):
    """A one-step prediction: candidate labels (``END`` among them) and their probabilities."""

    @property
    def labels(self) -> list[str]: ...

    @property
    def probs(self) -> list[float]: ...


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
        mass = sum(p for p, _, _ in paths)
        scale = (1.0 - ended) / mass if mass > 0.0 else 0.0
        joint: dict[str, float] = {}
        children: list[tuple[float, str, Position]] = []
        last = index + 1 == k
        for p, one, here in paths:
            weight = p * scale
            for label, q in zip(one.labels, one.probs, strict=True):
                pq = weight * q
                joint[label] = joint.get(label, 0.0) + pq
                if not last and label != END and pq >= min_branch:
                    children.append((pq, label, here))
        ended = min(1.0, ended + joint.pop(END, 0.0))
        alive.append(1.0 - ended)
        total = sum(joint.values())
        agents.append({a: p / total for a, p in joint.items()} if total > 0.0 else {})
        if last or not children:
            break
        children.sort(key=lambda c: c[0], reverse=True)
        paths = []
        for p, label, here in children[:beam]:
            child = here.then(label, order)
            paths.append((p, step(child), child))
    while len(alive) < k:  # nothing left to expand: the last step's view carries over
        agents.append(dict(agents[-1]))
        alive.append(alive[-1])
    return Forecast(agents, alive)
