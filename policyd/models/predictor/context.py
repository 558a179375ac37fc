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

from policyd.core.types import HintValue

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
    isfinite = math.isfinite
    for key, value in hints.items():
        kind = type(value)
        if kind is int:  # the exact types first (one test each), subclasses below
            numeric[key] = float(value)  # type: ignore[arg-type]
            integers.append((key, value))  # type: ignore[arg-type]
        elif kind is float:
            if isfinite(value):  # type: ignore[arg-type]
                numeric[key] = value  # type: ignore[assignment]
        elif kind is str:
            onehot[_onehot_name(key, value)] = 1.0  # type: ignore[arg-type]
        elif value is None:
            continue
        elif isinstance(value, bool):
            numeric[key] = float(value)
        elif isinstance(value, int):
            numeric[key] = float(value)
            integers.append((key, value))
        elif isinstance(value, float):
            if isfinite(value):
                numeric[key] = value
        elif isinstance(value, str):
            onehot[_onehot_name(key, value)] = 1.0
    if len(integers) > 1:
        integers.sort()
        del integers[MAX_INT_HINTS:]
        names = _PAIR_NAMES.get(tuple([key for key, _ in integers]))
        if names is None:
            names = _pair_names(tuple([key for key, _ in integers]))
        values = [value for _, value in integers]
        for i, j, name in names:
            numeric[name] = float(values[i] - values[j])
    return numeric, onehot


_PAIR_NAMES: dict[tuple[str, ...], tuple[tuple[int, int, str], ...]] = {}
_ONEHOT_NAMES: dict[tuple[str, str], str] = {}
_MAX_NAMES: Final = 10_000  # names cached (bounded: hint names and values come from requests)


def _pair_names(keys: tuple[str, ...]) -> tuple[tuple[int, int, str], ...]:
    """The difference features of integer hints ``keys`` (sorted): (i, j, "keys[i]-keys[j]")
    for i < j, in the order the pairs are added; built once per set of keys."""
    if len(_PAIR_NAMES) >= _MAX_NAMES:
        _PAIR_NAMES.clear()
    names = _PAIR_NAMES[keys] = tuple(
        (i, j, f"{a}-{b}") for i, a in enumerate(keys) for j, b in enumerate(keys) if j > i
    )
    return names


def _onehot_name(key: str, value: str) -> str:
    name = _ONEHOT_NAMES.get((key, value))
    if name is None:
        if len(_ONEHOT_NAMES) >= _MAX_NAMES:
            _ONEHOT_NAMES.clear()
        name = _ONEHOT_NAMES[key, value] = f"{key}={value}"
    return name


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
        # River keeps the scaler's moments in a Counter and defaultdicts; in plain dicts the
        # interpreter reads and writes them faster (its exact-dict fast paths), for the same
        # River arithmetic. A feature's entries are added before River first reads them
        # (``_seed``), with the values the defaults would give.
        self.scaler.counts, self.scaler.means, self.scaler.vars = {}, {}, {}  # type: ignore[assignment]
        self.model = self._new_model()
        self.version = 0  # changes whenever the weights do (callers cache dot products by it)
        self._names: dict[tuple[str, str], str] = {}
        self._crossed: dict[tuple[str, tuple[str, ...]], tuple[str, ...]] = {}

    def __setstate__(self, state: dict[str, object]) -> None:
        """Restore a pickle, one made before the crossed names were cached included."""
        self.__dict__.update(state)
        self.__dict__.setdefault("_crossed", {})

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
        scaler = self.scaler
        if not numeric.keys() <= scaler.vars.keys():
            for key in numeric:  # (River reads a feature's mean only once its variance is > 0)
                scaler.vars.setdefault(key, 0.0)
        scaled: Features = scaler.transform_one(numeric)  # type: ignore[no-untyped-call]
        if onehot:
            scaled.update(onehot)
        return scaled

    def learn_hints(self, numeric: Features) -> None:
        scaler = self.scaler
        if not numeric.keys() <= scaler.counts.keys():
            self._seed(numeric)
        scaler.learn_one(numeric)  # type: ignore[no-untyped-call]

    def _seed(self, numeric: Features) -> None:
        """Entries for the features of ``numeric`` the scaler has none for yet: a count of 0
        and moments of 0.0, what River's Counter and defaultdicts read for a missing key."""
        scaler = self.scaler
        for key in numeric:
            scaler.counts.setdefault(key, 0)
            scaler.means.setdefault(key, 0.0)
            scaler.vars.setdefault(key, 0.0)

    def crossed(self, candidate: str, hints: Features) -> Features:
        """The hint features crossed with ``candidate``'s name, and its bias."""
        keys = tuple([feature for feature, value in hints.items() if value])
        values = (1.0, *[value for value in hints.values() if value])
        return dict(zip(self.crossed_names(candidate, keys), values, strict=True))

    def crossed_names(self, candidate: str, keys: tuple[str, ...]) -> tuple[str, ...]:
        """The names of ``candidate``'s bias and of the hint features ``keys`` crossed with it:
        built once per (candidate, set of hint names), since both recur from call to call."""
        cached = self._crossed.get((candidate, keys))
        if cached is not None:
            return cached
        if len(self._crossed) > 10_000:  # many distinct hint sets: keep memory bounded
            self._crossed.clear()
        names = self._names
        if len(names) > 100_000:
            names.clear()
        crossed = []
        for feature in ("bias", *keys):
            name = names.get((candidate, feature))
            if name is None:
                name = names[candidate, feature] = f"{candidate}|{feature}"
            crossed.append(name)
        out = self._crossed[candidate, keys] = tuple(crossed)
        return out

    def hint_margin(self, crossed: Features) -> float:
        """Logit of the crossed part, intercept included."""
        model = self.model
        return model._weights.dot(crossed) + float(model.intercept)  # (as ``dot`` says)

    def dot(self) -> Callable[[Features], float]:
        """w.x for the current weights (valid until the next ``learn``: ``version`` says)."""
        # River's LogisticRegression is sigma(w.x + b); the roll-out splits w.x into a part
        # computed once per forecast and a part per step, so it needs the dot product itself.
        dot: Callable[[Features], float] = self.model._weights.dot
        return dot

    def learn(self, features: Features, is_next: bool) -> None:
        self.model.learn_one(features, is_next)
        self.version += 1
