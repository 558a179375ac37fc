"""A request's own context, learnt by a River model: which candidate agent comes next.

The structural models (``backoff.py``) see only which agents were called. This model also sees
what the request says about itself (``kv_transfer_params`` hints: numbers after a
``preprocessing.StandardScaler``, strings one-hot, and the differences between integer hints,
so that "this is the last hop" - ``hop - hops == -1`` - is one weight away), how often each
agent ran so far (retries), the run of the last agent, the position (for ``END``) and the
structural models' own opinion of each candidate.

It scores candidates, not a fixed set of classes: for a candidate agent ``c`` the features of
the pair (state, c) are

* the state's hint features crossed with ``c``'s name (``"c|hops"``), and a bias per agent, so
  that a hint can favour one agent over another;
* features of ``c`` relative to the workflow, with weights shared across agents (its rank among
  the agents called recently, how often it ran, whether it repeats the last call, what the count
  models give it, ``END``'s dependence on position), so that what is learnt about "the agent
  before last comes back" carries over to agents never seen before.

A ``linear_model.LogisticRegression`` turns them into P(c is next) (one-vs-rest; the caller
normalises over its candidates). The score is linear, so a roll-out that keeps the hints fixed
computes the crossed part once per candidate agent (``hint_margin``) and adds the relative part
per hypothetical step (``dot``): one small dot product per candidate and step. (River exposes
only sigma(w.x + b); ``dot`` reads the model's weight vector, the one private attribute used.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Final

from river import linear_model, optim, preprocessing

from policyd.types import HintValue

Features = dict[str, float]

MAX_LOG: Final = 8.0  # log-probabilities of the count models are floored at -MAX_LOG
MAX_INT_HINTS: Final = 4  # integer hints whose pairwise differences become features


def split_hints(hints: Mapping[str, HintValue]) -> tuple[Features, Features]:
    """Hints as (numeric, one-hot) features: numbers and booleans as they are, strings as
    ``key=value`` indicators, ``None`` and non-finite numbers dropped; for the first few integer
    hints (in key order), their pairwise differences ``"a-b"``.

    >>> split_hints({"hops": 3, "hop": 2, "repo": "django", "urgent": True, "note": None})
    ({'hops': 3.0, 'hop': 2.0, 'urgent': 1.0, 'hop-hops': -1.0}, {'repo=django': 1.0})
    """
    numeric: Features = {}
    onehot: Features = {}
    integers: list[tuple[str, int]] = []
    for key, value in hints.items():
        if isinstance(value, bool):
            numeric[key] = float(value)
        elif isinstance(value, int):
            numeric[key] = float(value)
            integers.append((key, value))
        elif isinstance(value, float):
            if math.isfinite(value):
                numeric[key] = value
        elif isinstance(value, str):
            onehot[f"{key}={value}"] = 1.0
    integers = sorted(integers)[:MAX_INT_HINTS]
    for i, (a, x) in enumerate(integers):
        for b, y in integers[i + 1 :]:
            numeric[f"{a}-{b}"] = float(x - y)
    return numeric, onehot


def sigmoid(margin: float) -> float:
    if margin >= 0.0:
        return 1.0 / (1.0 + math.exp(-margin))
    e = math.exp(margin)
    return e / (1.0 + e)


class ContextModel:
    """A ``StandardScaler`` for the hints' numbers and a logistic candidate scorer.

    >>> model = ContextModel(learning_rate=0.5)
    >>> for x in [0.0, 1.0] * 30:
    ...     hints = model.hint_features({"x": x}, {})
    ...     model.learn({**model.crossed("B", hints)}, x == 1.0)
    ...     model.learn({**model.crossed("C", hints)}, x == 0.0)
    ...     model.learn_hints({"x": x})
    >>> on = model.hint_features({"x": 1.0}, {})
    >>> b, c = (sigmoid(model.hint_margin(model.crossed(a, on))) for a in "BC")
    >>> b > 0.9 > 0.1 > c
    True
    """

    def __init__(self, *, learning_rate: float = 0.1, l2: float = 0.0) -> None:
        self.learning_rate = learning_rate
        self.l2 = l2
        self.scaler = preprocessing.StandardScaler()
        self.model = self._new_model()
        self.version = 0  # changes whenever the weights do (callers cache dot products by it)
        self._names: dict[tuple[str, str], str] = {}

    def _new_model(self) -> linear_model.LogisticRegression:
        return linear_model.LogisticRegression(
            optimizer=optim.SGD(self.learning_rate),
            l2=self.l2,
            intercept_lr=self.learning_rate,
        )

    def reset(self) -> None:
        """Forget what was learnt about candidates (after drift); keep the scaler's moments."""
        self.model = self._new_model()
        self.version += 1

    def hint_features(self, numeric: Features, onehot: Features) -> Features:
        """The hints' features: scaled numbers and one-hot strings."""
        scaled: Features = self.scaler.transform_one(numeric)  # type: ignore[no-untyped-call]
        if onehot:
            scaled.update(onehot)
        return scaled

    def learn_hints(self, numeric: Features) -> None:
        self.scaler.learn_one(numeric)  # type: ignore[no-untyped-call]

    def crossed(self, candidate: str, hints: Features) -> Features:
        """The hint features crossed with ``candidate``'s name, and its bias."""
        names = self._names
        features: Features = {}
        key = (candidate, "bias")
        name = names.get(key)
        if name is None:
            name = names[key] = f"{candidate}|bias"
        features[name] = 1.0
        for feature, value in hints.items():
            if value:
                key = (candidate, feature)
                name = names.get(key)
                if name is None:
                    if len(names) > 100_000:  # many distinct hint values: keep memory bounded
                        names.clear()
                    name = names[key] = f"{candidate}|{feature}"
                features[name] = value
        return features

    def hint_margin(self, crossed: Features) -> float:
        """Logit of the crossed part, intercept included."""
        return self.dot()(crossed) + float(self.model.intercept)

    def dot(self) -> Callable[[Features], float]:
        """w.x for the current weights (valid until the next ``learn``: ``version`` says)."""
        # River's LogisticRegression is sigma(w.x + b); the roll-out splits w.x into a part
        # computed once per forecast and a part per step, so it needs the dot product itself.
        dot: Callable[[Features], float] = self.model._weights.dot
        return dot

    def learn(self, features: Features, is_next: bool) -> None:
        self.model.learn_one(features, is_next)
        self.version += 1
