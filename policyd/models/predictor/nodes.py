"""What the one-step model computes at a position, and the caches that make it cheap.

A ``Node`` is the fused one-step distribution at a position, with what learning needs (each
candidate's features and the context model's own scores). A ``Structure`` is the count models'
view of a position, a ``Path`` the candidates' relative features along one path through it,
``Hints`` the hint part of the context model for one request's hints: caches only, each
recomputed when what it was computed from has changed, so they change no forecast.

Daemon checkpoints pickle these objects by attribute name: a field may be added (a restore of
an older pickle then drops the cache that lacks it, ``restore.repair``), never renamed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from policyd.models.predictor.backoff import Counts, Keys
from policyd.models.predictor.context import Features
from policyd.models.predictor.forecast import END


@dataclass(slots=True)
class Path:
    """The candidates' complete relative features at one path through a structure (position,
    run, their call counts), and their dot products with the context model's weights as of
    ``version`` (recomputed when the weights changed)."""

    relative: list[Features]
    dots: list[float]
    version: int


@dataclass(slots=True)
class Structure:
    """What the count models say at a position: cached, since positions recur across workflows
    (refreshed after a few learns of the type)."""

    version: int  # the type's learn count when computed
    labels: list[str]  # candidates, END last
    markov: dict[str, float]
    copy: dict[str, float]
    relative: list[Features]  # per candidate: its relative features that depend on counts only
    markov_x: dict[str, str]
    copy_x: dict[str, str]
    markov_keys: Keys  # the back-off levels of markov_x / copy_x, computed once
    copy_keys: Keys
    markov_p: list[float]  # per candidate, markov's / copy's probability
    copy_p: list[float]
    paths: dict[tuple[int, ...], Path] = field(default_factory=dict)
    agents: tuple[str, ...] = ()  # the candidates but END (their call counts name a path)
    # the back-off levels' Counts of markov_keys / copy_keys with the classifiers' generations
    # when taken (learning from this position again skips looking them up)
    resolved: tuple[int, int, list[Counts], list[Counts]] | None = None


@dataclass(slots=True)
class Node:
    """One-step prediction at a position, with what learning needs."""

    structure: Structure
    labels: list[str]  # the structure's candidates
    probs: list[float]  # fused, per candidate, sums to 1
    context: list[float]  # the context expert's distribution over the candidates (roll-out: [])
    relative: list[Features]  # per candidate, complete
    scores: list[float]  # the context model's own P(candidate is next), before normalising


@dataclass(slots=True)
class Hints:
    """The hint part of the context model for one set of hints, computed once per forecast:
    the features, and per label they were crossed with, the crossed features and their margin."""

    numeric: Features
    features: Features
    crossed: dict[str, tuple[Features, float]] = field(default_factory=dict)  # label -> margin
    keys: tuple[str, ...] = ()  # the features with a value (zeros add nothing to a margin)
    values: tuple[float, ...] = (1.0,)  # the bias' 1.0, then those features' values
    margins: dict[str, float] = field(default_factory=dict)  # label -> the margin alone


def step_one(labels: Sequence[str], probs: Sequence[float]) -> tuple[dict[str, float], float]:
    """Step 1 of a forecast from a one-step distribution: P(agent | still running) and
    P(ended) (what a roll-out starts from, and what an unserved position is scored on).

    >>> step_one(["a", "b", END], [0.3, 0.3, 0.4])
    ({'a': 0.5, 'b': 0.5}, 0.4)
    """
    joint = dict(zip(labels, probs, strict=True))
    ended = min(1.0, joint.pop(END, 0.0))
    total = sum(joint.values())
    return ({label: q / total for label, q in joint.items()} if total > 0.0 else {}), ended
