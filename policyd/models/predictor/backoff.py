"""Workflow structure as counts: a variable-order Markov model with Witten-Bell back-off.

``BackoffClassifier`` is a River classifier. Its input names a workflow type and a context, most
recent first (``{"type": t, "h1": last, "h2": one before, ...}``); it counts which label followed
each context at every level, from the most specific to the most general:

    (t, h1..hn) -> ... -> (t, h1) -> (t) -> (h1) over all types -> () over all types

and predicts by interpolating them (Witten-Bell): a level that saw N labels, T of them distinct,
keeps N / (N + T) of the mass and hands T / (N + T) down to the next level. A context never seen
costs nothing; a new workflow type starts from what every type shares, so new agents and types
are picked up without a restart.

Cost is bounded: each context keeps its ``top`` most frequent labels in order, and a prediction
reads only those, walking down the levels until the mass left to hand down is below ``tail``.
Counts of a context are halved when their total passes ``max_count`` (recent behaviour weighs
more), and ``decay`` scales a whole workflow type at once (the reaction to drift). Memory is
bounded too: past ``max_contexts`` contexts, every count is halved and the contexts left with
less than one observation are dropped (streams that name their agents per task, like group
chats, would otherwise add contexts forever).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from river import base

Keys = list[tuple[tuple[str, ...], str]]  # a context's levels: (table key, owning type)


class Counts:
    """The labels that followed one context: counts, their total, the ``top`` most frequent."""

    __slots__ = ("counts", "order", "top", "total")

    def __init__(self, top: int) -> None:
        self.counts: dict[str, float] = {}
        self.total = 0.0
        self.top = top
        self.order: list[str] = []  # the most frequent labels, most frequent first

    def add(self, label: str, weight: float = 1.0) -> None:
        counts = self.counts
        count = counts.get(label, 0.0) + weight
        counts[label] = count
        self.total += weight
        order = self.order
        if order and order[0] == label:  # the most frequent label again: the usual case
            return
        if label not in order:
            if len(order) < self.top:
                order.append(label)
            elif count > counts[order[-1]]:
                order[-1] = label
            else:
                return
        # restore the order by moving ``label`` up (counts only grow, so it never moves down)
        i = order.index(label)
        while i > 0 and counts[order[i - 1]] < count:
            order[i - 1], order[i] = order[i], order[i - 1]
            i -= 1

    def scale(self, factor: float) -> None:
        """Multiply every count by ``factor`` (order is preserved)."""
        counts = self.counts
        for label in counts:
            counts[label] *= factor
        self.total *= factor


class BackoffClassifier(base.Classifier):
    """Interpolated back-off counts over the last ``order`` context features, per workflow type.

    Parameters
    ----------
    order
        How many context features (``h1``..``h{order}``) the most specific level uses.
    top
        Labels read per context (the rest of its mass is spread over the lower levels' labels).
    tail
        Stop walking down the levels once the mass left to hand down is below this.
    max_count
        Halve a context's counts when their total passes this (0: never).
    max_contexts
        Age and prune the contexts when there are more than this.

    Examples
    --------
    >>> model = BackoffClassifier(order=2)
    >>> for _ in range(20):
    ...     model.learn_one({"type": "w", "h1": "planner"}, "coder")
    ...     model.learn_one({"type": "w", "h1": "coder", "h2": "planner"}, "tester")
    >>> model.predict_one({"type": "w", "h1": "coder", "h2": "someone new"})
    'tester'
    >>> round(model.predict_proba_one({"type": "w", "h1": "planner"})["coder"], 2)
    0.98
    """

    def __init__(
        self,
        order: int = 3,
        top: int = 8,
        tail: float = 0.01,
        max_count: float = 0.0,
        max_contexts: int = 200_000,
    ) -> None:
        self.order = order
        self.top = top
        self.tail = tail
        self.max_count = max_count
        self.max_contexts = max_contexts
        self._tables: dict[tuple[str, ...], Counts] = {}
        self._by_type: dict[str, list[Counts]] = {}
        # bumped whenever contexts are dropped (``_prune``): a list of a context's Counts taken
        # before (``learn_keys`` returns one) is stale then
        self.generation = 0

    @property
    def _multiclass(self) -> bool:
        return True

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {"order": 2}

    def context_keys(self, x: Mapping[str, object]) -> Keys:
        """The levels' context keys of ``x``, most specific first, each with the type it belongs
        to (``""`` for the levels shared by every type). A caller that learns from or asks about
        the same context repeatedly computes them once (``learn_keys``, ``distribution_keys``)."""
        kind = str(x.get("type", ""))
        history: list[str] = []
        for i in range(1, self.order + 1):
            value = x.get(f"h{i}")
            if value is None:
                break
            history.append(str(value))
        keys = [(("t", kind, *history[:n]), kind) for n in range(len(history), -1, -1)]
        if history:
            keys.append((("g", history[0]), ""))
        keys.append((("g",), ""))
        return keys

    def learn_one(self, x: dict[base.typing.FeatureName, Any], y: base.typing.ClfTarget) -> None:
        self.learn({str(k): v for k, v in x.items()}, str(y))

    def predict_proba_one(
        self, x: dict[base.typing.FeatureName, Any], **kwargs: Any
    ) -> dict[base.typing.ClfTarget, float]:
        """Witten-Bell interpolation, most specific level first; sums to 1 (empty when nothing
        was learnt yet)."""
        return {
            label: p for label, p in self.distribution({str(k): v for k, v in x.items()}).items()
        }

    def learn(self, x: Mapping[str, object], label: str) -> None:
        """``learn_one`` for string labels and features, typed."""
        self.learn_keys(self.context_keys(x), label)

    def learn_keys(self, keys: Keys, label: str) -> list[Counts]:
        """``learn`` for a context whose ``keys`` were computed already (the fast path). Returns
        the levels' Counts: ``learn_counts`` learns from the same context again without looking
        them up, while ``generation`` is unchanged."""
        tables = self._tables
        max_count = self.max_count
        resolved: list[Counts] = []
        for key, kind in keys:
            counts = tables.get(key)
            if counts is None:
                counts = tables[key] = Counts(self.top)
                self._by_type.setdefault(kind, []).append(counts)
            resolved.append(counts)
            table = counts.counts  # Counts.add inlined for its usual case (the leader again)
            order = counts.order
            if order and order[0] == label:
                table[label] += 1.0
                counts.total += 1.0
            else:
                counts.add(label)
            if max_count and counts.total > max_count:
                counts.scale(0.5)
        if len(tables) > self.max_contexts:
            self._prune()
        return resolved

    def learn_counts(self, resolved: list[Counts], label: str) -> None:
        """``learn_keys`` for a context whose levels' Counts it returned (same ``generation``):
        the same updates, without hashing the levels' keys (no context is created)."""
        max_count = self.max_count
        for counts in resolved:
            order = counts.order
            if order and order[0] == label:
                counts.counts[label] += 1.0
                counts.total += 1.0
            else:
                counts.add(label)
            if max_count and counts.total > max_count:
                counts.scale(0.5)

    def add_keys(self, keys: Iterable[tuple[str, ...]], label: str, weight: float) -> None:
        """Count ``label`` ``weight`` times after the context whose levels' table keys are
        ``keys`` (another replica's counts merged in: the same updates as ``weight`` calls of
        ``learn_keys``, up to when ``max_count`` halves them)."""
        tables = self._tables
        max_count = self.max_count
        for key in keys:
            counts = tables.get(key)
            if counts is None:
                counts = tables[key] = Counts(self.top)
                kind = key[1] if key[0] == "t" else ""
                self._by_type.setdefault(kind, []).append(counts)
            counts.add(label, weight)
            if max_count and counts.total > max_count:
                counts.scale(0.5)
        if len(tables) > self.max_contexts:
            self._prune()

    def _prune(self) -> None:
        """Halve every count; drop the contexts left with less than one observation."""
        kept: dict[tuple[str, ...], Counts] = {}
        by_type: dict[str, list[Counts]] = {}
        for key, counts in self._tables.items():
            counts.scale(0.5)
            if counts.total >= 1.0:
                kept[key] = counts
                by_type.setdefault(key[1] if key[0] == "t" else "", []).append(counts)
        self._tables, self._by_type = kept, by_type
        self.generation = getattr(self, "generation", 0) + 1  # (pickled before it existed: 0)

    def distribution(self, x: Mapping[str, object]) -> dict[str, float]:
        """``predict_proba_one`` for string labels and features, typed."""
        return self.distribution_keys(self.context_keys(x))

    def distribution_keys(self, keys: Keys) -> dict[str, float]:
        """``distribution`` for a context whose ``keys`` were computed already."""
        dist: dict[str, float] = {}
        left = 1.0  # mass not yet given out
        tables = self._tables
        for key, _ in keys:
            counts = tables.get(key)
            if counts is None or counts.total <= 0.0:
                continue
            table = counts.counts
            denominator = counts.total + len(table)
            share = left / denominator
            for label in counts.order:
                dist[label] = dist.get(label, 0.0) + share * table[label]
            left *= len(table) / denominator
            if left < self.tail:
                break
        total = sum(dist.values())
        if total <= 0.0:
            return {}
        return {label: p / total for label, p in dist.items()}

    def decay(self, kind: str, factor: float) -> None:
        """Scale every count of workflow type ``kind`` by ``factor`` (forget its past faster)."""
        for counts in self._by_type.get(kind, ()):
            counts.scale(factor)

    @property
    def n_contexts(self) -> int:
        return len(self._tables)
