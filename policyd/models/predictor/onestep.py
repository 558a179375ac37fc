"""The one-step model: three experts' distributions over the next label at a position, fused.

For one position of a workflow (the agents called so far, the last request's hints) three
experts give a distribution over the next label (an agent, or ``END``):

* ``markov`` - per workflow type, which label followed the last 1..``order`` agents, with
  back-off to shorter contexts, the type's unigram, and what all types share
  (``BackoffClassifier``);
* ``copy`` - which of the agents called recently comes back (the last one again, the one before
  it, ...), counted as ranks, so it transfers to agents seen for the first time in this workflow
  (group chats name their experts per task); the rest of its mass goes to ``markov``'s choice
  among the other labels;
* ``context`` - a River logistic model over the request's hints, position, retries and the two
  experts' opinions, scoring the few most likely candidates (``ContextModel``).

They are mixed with weights learnt online per workflow type and last agent (``Mixture``), over
the ``max_candidates`` labels the count experts find likeliest (``END`` always among them).

``OneStepModel.evaluate`` gives the fused distribution as a ``Node``. The count experts' view
of a position is cached per type (``Structure``, refreshed after at most ``refresh`` learns of
the type), the candidates' relative features and their dot products with the context model's
weights per path through it (``Path``, recomputed when the weights changed), the hint part of
the context model once per forecast (``Hints``): the same numbers, less work.
"""

from __future__ import annotations

import math
from itertools import repeat
from typing import Final

from policyd.models.predictor.backoff import BackoffClassifier, Keys
from policyd.models.predictor.context import ContextModel, Features
from policyd.models.predictor.forecast import END
from policyd.models.predictor.kinds import TypeModel, TypeModels
from policyd.models.predictor.nodes import Hints, Node, Path, Structure
from policyd.models.predictor.position import RANKS, PathFeatures, Position, counted_features

OTHER: Final = "other"  # the copy expert's label for "not one of the recent agents"
RANK_LABELS: Final = tuple(f"r{j}" for j in range(1, RANKS + 1))  # its labels for the recent


def rank_label(recent: tuple[str, ...], label: str) -> str:
    """The copy expert's label for ``label``: ``rj`` for the j-th most recent distinct agent,
    ``OTHER`` for any other label.

    >>> rank_label(("coder", "planner"), "planner"), rank_label(("coder",), "tester")
    ('r2', 'other')
    """
    if label in recent:
        i = recent.index(label)
        return RANK_LABELS[i] if i < len(RANK_LABELS) else f"r{i + 1}"
    return OTHER


class OneStepModel:
    """The fused one-step distribution at any position, from the shared count experts
    (``markov``, ``copy``) and each type's context model and mixture (``types``).

    ``evaluations`` counts the evaluations made and ``views`` the count experts' views of a
    position computed for them, new or refreshed (work, not time: a view costs the most)."""

    def __init__(
        self,
        markov: BackoffClassifier,
        copy: BackoffClassifier,
        types: TypeModels,
        path: PathFeatures,
        *,
        order: int = 3,
        max_candidates: int = 4,
        refresh: int = 16,
        max_cache: int = 20_000,
        max_paths: int = 256,
        evaluations: int = 0,
        views: int = 0,
    ) -> None:
        self.markov = markov
        self.copy = copy
        self.path = path  # the candidates' features along a workflow's path
        self._types = types
        self.order = order
        self.max_candidates = max_candidates
        self.refresh = refresh
        self.max_cache = max_cache
        self.max_paths = max_paths
        self.evaluations = evaluations
        self.views = views
        # per (type, last agents, run): the count models' inputs there (``_contexts``)
        self._known_contexts: dict[
            tuple[object, ...], tuple[dict[str, str], Keys, dict[str, str], Keys]
        ] = {}

    def __setstate__(self, state: dict[str, object]) -> None:
        """Restore a pickle, one made before the contexts were kept or the views counted
        included."""
        self.__dict__.update(state)
        self.__dict__.setdefault("_known_contexts", {})
        self.__dict__.setdefault("views", 0)

    def at(self, position: Position) -> tuple[Hints, Node]:
        """The hints of ``position``'s request and the one-step prediction there."""
        hints = self.hints(position, self._types.model(position.kind).context)
        return hints, self.evaluate(position, hints)

    def hints(self, position: Position, context: ContextModel) -> Hints:
        """The hint part of ``context`` for ``position``'s request, once per forecast."""
        features = context.hint_features(position.numeric, position.onehot)
        if all(features.values()):  # (the usual case: every hint has a value)
            keys = tuple(features)
            values = (1.0, *features.values())
        else:
            keys = tuple([feature for feature, value in features.items() if value])
            values = (1.0, *[value for value in features.values() if value])
        return Hints(position.numeric, features, {}, keys, values, {})

    def evaluate(self, position: Position, hints: Hints, learning: bool = True) -> Node:
        """The fused one-step distribution at ``position`` (whose hints are ``hints``).

        The context model's score of a candidate is a hint part (once per forecast, in
        ``hints``) plus a relative part that depends on the path only; the relative features
        and their dot products are cached per (structure, path) and the dot products are
        recomputed only when the weights have changed since: the same numbers, less work.
        Without ``learning`` (a roll-out step) the node's ``context`` is left empty."""
        self.evaluations += 1
        model = self._types.model(position.kind)
        run = position.run
        view = (position.history[-self.order :], run if run < 3 else 3, position.recent)
        structure = model.structures.get(view)
        learns = model.learns
        if structure is None or learns - structure.version > min(self.refresh, learns // 10):
            structure = self._structure(position, model, view, structure)
        labels = structure.labels
        # the path: position, run and the candidate agents' call counts (END is last)
        key = (position.pos, run, *map(position.calls.get, structure.agents, repeat(0)))
        path = structure.paths.get(key) or self._new_path(position, structure, key)
        context = model.context
        version = context.version
        if path.version != version:
            path.dots = list(map(context.dot(), path.relative))
            path.version = version
        margins = hints.margins
        exp = math.exp
        scores: list[float] = []
        append = scores.append
        for label, relative_margin in zip(labels, path.dots, strict=True):
            hint_margin = margins.get(label)
            if hint_margin is None:
                hint_margin = self.crossed(context, hints, label)[1]
            margin = hint_margin + relative_margin
            if margin >= 0.0:  # context.sigmoid, inlined: it runs for every candidate
                append(1.0 / (1.0 + exp(-margin)))
            else:
                e = exp(margin)
                append(e / (1.0 + e))
        total = sum(scores)
        mixture = model.mixture
        w_markov, w_copy, w_context = mixture._local.get(position.history[-1]) or mixture.typewide
        if learning:
            qs = [score / total for score in scores]
            probs = [
                w_markov * m + w_copy * c + w_context * q
                for m, c, q in zip(structure.markov_p, structure.copy_p, qs, strict=True)
            ]
        else:  # a roll-out step: the context expert's own distribution is not kept
            qs = []
            probs = [
                w_markov * m + w_copy * c + w_context * (score / total)
                for m, c, score in zip(structure.markov_p, structure.copy_p, scores, strict=True)
            ]
        norm = sum(probs)
        probs = [p / norm for p in probs]
        return Node(structure, labels, probs, qs, path.relative, scores)

    @staticmethod
    def crossed(context: ContextModel, hints: Hints, label: str) -> tuple[Features, float]:
        """The hint features crossed with ``label`` and their margin, once per forecast."""
        part = hints.crossed.get(label)
        if part is None:
            # context.crossed_names and context.hint_margin, their usual case inlined
            names = context._crossed.get((label, hints.keys))
            if names is None:
                names = context.crossed_names(label, hints.keys)
            features = dict(zip(names, hints.values, strict=True))
            model = context.model
            margin = model._weights.dot(features) + float(model.intercept)
            part = hints.crossed[label] = (features, margin)
            hints.margins[label] = margin
        return part

    def _structure(
        self,
        position: Position,
        model: TypeModel,
        view: tuple[object, ...],
        cached: Structure | None,
    ) -> Structure:
        """The count models' view of ``position`` (cached under ``view``), computed afresh:
        ``cached`` is the stale one it replaces, if any."""
        self.views += 1
        if cached is not None:  # a refresh: the contexts are the same, their counts changed
            markov_x, markov_keys, copy_x, copy_keys = (
                cached.markov_x,
                cached.markov_keys,
                cached.copy_x,
                cached.copy_keys,
            )
        else:
            markov_x, markov_keys, copy_x, copy_keys = self._contexts(position)
        markov = self.markov.distribution_keys(markov_keys)
        copy = self._copy_distribution(position, copy_keys, markov)
        labels = self._candidates(markov, copy, model.mixture.weights(position.history[-1]))
        relative = [counted_features(position, label, markov, copy) for label in labels]
        structure = Structure(
            model.learns,
            labels,
            markov,
            copy,
            relative,
            markov_x,
            copy_x,
            markov_keys,
            copy_keys,
            [markov.get(label, 0.0) for label in labels],
            [copy.get(label, 0.0) for label in labels],
            agents=tuple(labels[:-1]),
            resolved=None if cached is None else cached.resolved,
        )
        if len(model.structures) >= self.max_cache:
            model.structures.clear()
        model.structures[view] = structure
        return structure

    def _contexts(self, position: Position) -> tuple[dict[str, str], Keys, dict[str, str], Keys]:
        """The count models' inputs at ``position`` and their back-off levels: ``markov``'s
        over the last ``order`` agents, ``copy``'s over the last agent and its run. They
        depend on the type and the last agents only, so they are made once per such context
        (and shared, never modified)."""
        history = position.history[-self.order :]
        run = min(position.run, 3)
        key = (position.kind, history, run)
        known = self._known_contexts.get(key)
        if known is None:
            kind = position.kind
            markov_x = {"type": kind}
            for i in range(1, len(history) + 1):
                markov_x[f"h{i}"] = history[-i]
            copy_x = {"type": kind, "h1": f"run{run}", "h2": history[-1]}
            markov_keys = self.markov.context_keys(markov_x)
            known = (markov_x, markov_keys, copy_x, self.copy.context_keys(copy_x))
            if len(self._known_contexts) >= self.max_cache:
                self._known_contexts.clear()
            self._known_contexts[key] = known
        return known

    def _candidates(
        self, markov: dict[str, float], copy: dict[str, float], weights: list[float]
    ) -> list[str]:
        """The ``max_candidates - 1`` agents the count experts, mixed by ``weights``, find
        likeliest (the first seen among equals), then ``END``."""
        w_markov, w_copy, _ = weights
        prior = {label: w_markov * p for label, p in markov.items()}
        get = prior.get
        for label, p in copy.items():
            prior[label] = get(label, 0.0) + w_copy * p
        prior.pop(END, None)
        agents = sorted(prior, key=prior.__getitem__, reverse=True)
        return [*agents[: self.max_candidates - 1], END]

    def _new_path(self, position: Position, structure: Structure, key: tuple[int, ...]) -> Path:
        """The candidates' complete relative features at a path not cached yet."""
        relative = [
            self.path(position, label, counted)
            for label, counted in zip(structure.labels, structure.relative, strict=True)
        ]
        path = Path(relative, [], -1)
        if len(structure.paths) >= self.max_paths:
            structure.paths.clear()
        if self.max_paths:
            structure.paths[key] = path
        return path

    def _copy_distribution(
        self, position: Position, copy_keys: Keys, markov: dict[str, float]
    ) -> dict[str, float]:
        """The copy expert: P(rank j) on the j-th most recent distinct agent; the rest of the
        mass spread over the other labels as ``markov`` spreads it."""
        recent = position.recent
        if not recent:
            return markov
        ranks = self.copy.distribution_keys(copy_keys)
        if not ranks:
            return markov
        possible = [ranks.get(rank, 0.0) for rank in RANK_LABELS[: len(recent)]]
        other = ranks.get(OTHER, 0.0)
        total = sum(possible) + other
        if total <= 0.0:
            return markov
        dist = {agent: p / total for agent, p in zip(recent, possible, strict=True)}
        rest = 1.0 - sum([markov.get(agent, 0.0) for agent in recent])
        if rest > 1e-9:
            scale = other / total / rest
            dist.update({label: p * scale for label, p in markov.items() if label not in dist})
        return dist
