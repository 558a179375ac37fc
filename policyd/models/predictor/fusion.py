"""The online next-agent predictor: count models and a context model, fused, rolled forward.

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

They are mixed with weights learnt online per workflow type and last agent (``Mixture``).

Some workflow types name their agents per workflow (group chats name their experts per task:
in the Who&When chats 165 of 190 names speak in one chat only), so counts over names never
recur. Once most of a type's recent workflows (``alias_share`` of the last ``alias_window``,
after ``alias_after``) brought a name the type had not seen, its new workflows are modelled
over aliases: ``#1`` for the workflow's first speaker, ``#2`` for the next new one, and so on.
Every model then learns the shape of the conversation, which does recur, and the forecasts are
translated back to names; the mass on an alias that has not spoken yet (an agent the workflow
has not called, whose name is unknown) is left out, as no name can be given to it.

Steps 2..K roll the one-step model forward over a beam of likely continuations (``rollout``);
hints stay those of the last real request.

Learning happens as calls are observed (``observe_call``, ``observe_finished``): first the
forecasts made earlier for this workflow are scored (``Tracker``), then every model learns the
transition just seen. A drift towards more errors (ADWIN) decays the type's counts and resets
its context model. Nothing reads a clock; randomness (``noise``) comes from ``seed``.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from policyd.core.types import HintValue
from policyd.models.predictor.backoff import BackoffClassifier, Counts, Keys
from policyd.models.predictor.context import ContextModel, Features, split_hints
from policyd.models.predictor.forecast import END, START, Forecast, random_forecast
from policyd.models.predictor.mixture import Mixture
from policyd.models.predictor.position import RANKS, PathFeatures, Position, counted_features
from policyd.models.predictor.tracking import Tracker

EXPERTS = ("markov", "copy", "context")
MIN_BRANCH = 0.05  # the roll-out's default branching floor (``Predictor``'s ``min_branch``)
OTHER = "other"  # the copy expert's label for "not one of the recent agents"
_RANKS = tuple(f"r{j}" for j in range(1, RANKS + 1))  # its labels for the recent agents


def _step_one(labels: Sequence[str], probs: Sequence[float]) -> tuple[dict[str, float], float]:
    """Step 1 of a forecast from the one-step distribution: P(agent | still running) and
    P(ended) (what ``_rollout`` starts from, and what an unserved position is scored on)."""
    joint = dict(zip(labels, probs, strict=True))
    ended = min(1.0, joint.pop(END, 0.0))
    total = sum(joint.values())
    return ({label: q / total for label, q in joint.items()} if total > 0.0 else {}), ended


def _first(child: tuple[float, str, Position]) -> float:
    return child[0]


def _named(forecast: Forecast, named: Mapping[str, str]) -> Forecast:
    """An aliased workflow's forecast in agent names (``named``: alias -> name). An alias with
    no name yet (an agent the workflow has not called) is left out: its step's distribution
    then sums to less than 1, the rest being "an agent not called so far".

    >>> _named(Forecast([{"#1": 0.6, "#2": 0.4}], [1.0]), {"#1": "coder"}).agents
    [{'coder': 0.6}]
    """
    agents = [{named[a]: p for a, p in step.items() if a in named} for step in forecast.agents]
    return Forecast(agents, forecast.alive)


@dataclass(slots=True)
class _Path:
    """The candidates' complete relative features at one path through a structure (position,
    run, their call counts), and their dot products with the context model's weights as of
    ``version`` (recomputed when the weights changed)."""

    relative: list[Features]
    dots: list[float]
    version: int


@dataclass(slots=True)
class _Structure:
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
    paths: dict[tuple[int, ...], _Path] = field(default_factory=dict)
    agents: tuple[str, ...] = ()  # the candidates but END (their call counts name a path)
    # the back-off levels' Counts of markov_keys / copy_keys with the classifiers' generations
    # when taken (learning from this position again skips looking them up)
    resolved: tuple[int, int, list[Counts], list[Counts]] | None = None


@dataclass(slots=True)
class _Node:
    """One-step prediction at a position, with what learning needs."""

    structure: _Structure
    labels: list[str]  # the structure's candidates
    probs: list[float]  # fused, per candidate, sums to 1
    context: list[float]  # the context expert's distribution over the candidates (roll-out: [])
    relative: list[Features]  # per candidate, complete
    scores: list[float]  # the context model's own P(candidate is next), before normalising


@dataclass(slots=True)
class _Hints:
    """The hint part of the context model for one set of hints, computed once per forecast:
    the features, and per label they were crossed with, the crossed features and their margin."""

    numeric: Features
    features: Features
    crossed: dict[str, tuple[Features, float]] = field(default_factory=dict)  # label -> margin
    keys: tuple[str, ...] = ()  # the features with a value (zeros add nothing to a margin)
    values: tuple[float, ...] = (1.0,)  # the bias' 1.0, then those features' values
    margins: dict[str, float] = field(default_factory=dict)  # label -> the margin alone


@dataclass(slots=True)
class _Workflow:
    position: Position
    ts: float
    node: _Node | None = None  # the one-step prediction at the current position
    hints: _Hints | None = None
    forecast: Forecast | None = None  # what was served for the current position
    pending: deque[tuple[int, Forecast]] = field(default_factory=deque)
    # an aliased workflow's aliases: name -> alias and alias -> name (None: modelled by name)
    aliases: dict[str, str] | None = None
    named: dict[str, str] | None = None
    novel: bool = False  # one of its calls named an agent new to its type


class _TypeModel:
    """What is learnt per workflow type besides the counts."""

    __slots__ = (
        "agents",
        "aliased",
        "context",
        "known",
        "learns",
        "mixture",
        "names",
        "novel",
        "structures",
    )

    def __init__(self, context: ContextModel, mixture: Mixture, window: int = 64) -> None:
        self.context = context
        self.mixture = mixture
        self.agents: list[str] = []  # labels in order of first appearance (noise draws them)
        self.known: set[str] = set()
        self.learns = 0
        self.structures: dict[tuple[object, ...], _Structure] = {}
        self.names: set[str] = set()  # agent names called by this type's workflows
        self.novel: deque[bool] = deque(maxlen=window)  # per finished workflow: a new name?
        self.aliased = False  # new workflows are modelled over aliases


class Predictor:
    """P(agent at step k) and P(still running at step k), k = 1..K, for every active workflow.

    Parameters
    ----------
    k
        Steps forecast.
    order
        Longest context (last agents) of the count model.
    max_candidates
        Labels the fused distribution keeps per step (``END`` included).
    beam
        Hypothetical continuations expanded per step of the roll-out (top-1 accuracy is the same
        with 1; a wider beam gives the later steps' runner-up agents their probability).
    min_branch
        A continuation less likely than this is not expanded.
    refresh
        A position's count-model view is recomputed after at most this many learns of its type
        (and after every tenth of them while the type is young).
    max_cache
        Positions cached per type.
    max_paths
        Paths (position, run, call counts) cached per cached position, with the context
        model's relative features and dot products (0: no cache; the forecasts are the same).
    learning_rate
        SGD step of the context model.
    sure
        The context model skips learning a candidate it already scores within this of the
        truth (0 or 1): the gradient would be as small, and most steps of a structured
        workflow are such.
    expert_rate
        Learning rate of the experts' mixture weights (exponentiated gradient).
    expert_floor
        Share of each expert's weight that is kept uniform, so an expert can come back.
    max_count
        A context's counts are halved when their total passes this.
    window
        Checks in the rolling accuracy.
    drift_delta
        ADWIN's confidence parameter (River's default, 0.002, needs ~360 checks to see the error
        go from 0 to 25%; 0.05 needs ~70 and raised no false alarm on our workloads).
    drift_decay
        Factor applied to a type's counts when a drift towards more errors is detected.
    noise
        Fraction of served forecasts replaced by random ones (one uniformly drawn label per
        step, with probability 1): an experiment knob for measuring degradation.
    max_workflows
        Active workflows remembered; the least recently seen is forgotten past this.
    seed
        Seeds the noise.
    alias_share
        A workflow type whose last ``alias_window`` finished workflows (at least ``alias_after``
        of them) brought a name it had not seen at least this often is modelled over aliases
        (its new workflows; below half this share it goes back to names). None: never.
    alias_window, alias_after
        See ``alias_share``.
    roll_out_unserved
        Roll out a K-step forecast at every call, to score it, even when none was asked for
        (True: every position's steps 1..K are scored; what the replays do). False scores step
        1 from the one-step distribution where no forecast was served and skips the roll-out,
        about two thirds of a call's cost: the daemon, which asks for forecasts at its own
        pace. Served forecasts are computed the same way either way.

    Examples
    --------
    >>> predictor = Predictor(k=2)
    >>> for w in range(30):
    ...     for ts, agent in enumerate(["planner", "coder", "tester"]):
    ...         predictor.observe_call(f"w{w}", "code", agent, {}, float(ts))
    ...     predictor.observe_finished(f"w{w}")
    >>> predictor.observe_call("new", "code", "planner", {}, 0.0)
    >>> forecast = predictor.predict("new")
    >>> forecast.top(1), forecast.top(2)
    ('coder', 'tester')
    >>> predictor.predict_next_for_new("code", {}).top(1)
    'planner'
    """

    def __init__(
        self,
        k: int = 3,
        *,
        order: int = 3,
        max_candidates: int = 4,
        beam: int = 2,
        min_branch: float = MIN_BRANCH,
        refresh: int = 16,
        max_cache: int = 20_000,
        max_paths: int = 256,
        learning_rate: float = 0.1,
        sure: float = 0.02,
        expert_rate: float = 0.5,
        expert_floor: float = 0.02,
        max_count: float = 1000.0,
        window: int = 500,
        drift_delta: float = 0.05,
        drift_decay: float = 0.1,
        noise: float = 0.0,
        max_workflows: int = 100_000,
        seed: int = 0,
        alias_share: float | None = 0.5,
        alias_window: int = 64,
        alias_after: int = 16,
        roll_out_unserved: bool = True,
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {noise}")
        if not 0.0 <= min_branch <= 1.0:
            raise ValueError(f"min_branch must be in [0, 1], got {min_branch}")
        if max_candidates < 2:
            raise ValueError(f"max_candidates must be at least 2, got {max_candidates}")
        if alias_share is not None and not 0.0 < alias_share <= 1.0:
            raise ValueError(f"alias_share must be in (0, 1] or None, got {alias_share}")
        if not 1 <= alias_after <= alias_window:
            raise ValueError(
                f"need 1 <= alias_after <= alias_window, got {alias_after} and {alias_window}"
            )
        self.k = k
        self.order = order
        self.max_candidates = max_candidates
        self.beam = beam
        self.min_branch = min_branch
        self.refresh = refresh
        self.max_cache = max_cache
        self.max_paths = max_paths
        self.learning_rate = learning_rate
        self.sure = sure
        self.expert_rate = expert_rate
        self.expert_floor = expert_floor
        self.drift_decay = drift_decay
        self.noise = noise
        self.max_workflows = max_workflows
        self.seed = seed
        self.alias_share = alias_share
        self.alias_window = alias_window
        self.alias_after = alias_after
        self.roll_out_unserved = roll_out_unserved
        self.markov = BackoffClassifier(order=order, max_count=max_count)
        self.copy = BackoffClassifier(order=2, max_count=max_count)
        self.tracker = Tracker(k, window=window, drift_delta=drift_delta)
        self._rng = random.Random(seed)
        self._types: dict[str, _TypeModel] = {}
        self._workflows: OrderedDict[str, _Workflow] = OrderedDict()
        self._calls = 0
        self._finished = 0
        self._nodes = 0
        self._forecasts = 0
        self._path = PathFeatures()

    # -- the API -----------------------------------------------------------------------------

    def observe_call(
        self,
        workflow_id: str,
        workflow_type: str,
        agent: str,
        hints: Mapping[str, HintValue],
        ts: float,
    ) -> None:
        """Workflow ``workflow_id`` called ``agent`` (its request carried ``hints``; ``ts`` is the
        source's monotonic clock, kept as the workflow's last activity): score the earlier
        forecasts, learn this transition, advance the workflow. A workflow's type is the one
        named with its first call."""
        if agent in (END, START):
            raise ValueError(f"{agent!r} is reserved for the predictor's pseudo-agents")
        workflow = self._workflows.get(workflow_id)
        if workflow is None:
            workflow = self._start(workflow_id, workflow_type, hints, ts)
        else:
            self._workflows.move_to_end(workflow_id)
        model = self._types.get(workflow.position.kind) or self._type(workflow.position.kind)
        names = model.names
        if agent not in names:
            if len(names) >= self.max_workflows:
                names.clear()
            names.add(agent)
            workflow.novel = True
        label = agent
        aliases = workflow.aliases
        if aliases is not None:
            label = aliases.get(agent) or self._alias(workflow, agent)
        self._learn(workflow, label, agent)
        numeric, onehot = split_hints(hints)
        position = workflow.position.then(label, self.order)
        position.numeric, position.onehot = numeric, onehot
        workflow.position = position
        workflow.ts = ts
        workflow.node = workflow.hints = workflow.forecast = None
        self._calls += 1

    def observe_finished(self, workflow_id: str) -> None:
        """Workflow ``workflow_id`` ended: learn that ``END`` followed its last call."""
        workflow = self._workflows.pop(workflow_id, None)
        if workflow is None:
            return
        self._learn(workflow, END, END)
        self._type(workflow.position.kind).novel.append(workflow.novel)
        self._finished += 1

    def forget(self, workflow_id: str) -> None:
        """Drop a workflow without learning from it (e.g. it was cancelled)."""
        self._workflows.pop(workflow_id, None)

    def predict(self, workflow_id: str) -> Forecast:
        """The forecast for an active workflow (cached until its next call is observed)."""
        workflow = self._workflows.get(workflow_id)
        if workflow is None:
            raise KeyError(f"workflow {workflow_id!r} is not active (no call observed)")
        return self._served(workflow)

    def predict_next_for_new(
        self, workflow_type: str, hints: Mapping[str, HintValue] | None = None
    ) -> Forecast:
        """The forecast for a workflow of type ``workflow_type`` that has made no call yet,
        whose first request carries ``hints``: step 1 is its first agent."""
        model = self._type(workflow_type)
        position = self._fresh(workflow_type, hints or {})
        state = self._hints(position, model.context)
        forecast = self._noisy(
            workflow_type, self._rollout(position, self._evaluate(position, state), state)
        )
        # an aliased type's new workflow has called nobody: no alias has a name yet
        return _named(forecast, {}) if model.aliased else forecast

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled predictor (a daemon checkpoint). One pickled before the context
        model counted its weight versions, or before the hints kept their names, has caches
        whose fields this version reads: they are dropped and rebuilt on demand."""
        self.__dict__.update(state)
        self.__dict__.setdefault("max_paths", 256)
        self.__dict__.setdefault("roll_out_unserved", True)
        for classifier in (self.markov, self.copy):
            classifier.__dict__.setdefault("generation", 0)
        legacy = False
        for model in self._types.values():
            if not hasattr(model.context, "version"):
                model.context.version = 0
                model.structures.clear()
                legacy = True
            if not all(hasattr(s, "resolved") for s in model.structures.values()):
                model.structures.clear()  # (pickled before structures kept their Counts)
            if not hasattr(model, "aliased"):  # (pickled before types could be aliased)
                model.names = set(model.known)
                model.novel = deque(maxlen=self.__dict__.get("alias_window", 64))
                model.aliased = False
        self.__dict__.setdefault("alias_share", 0.5)
        self.__dict__.setdefault("alias_window", 64)
        self.__dict__.setdefault("alias_after", 16)
        for workflow in self._workflows.values():
            if not hasattr(workflow, "novel"):  # (pickled before workflows could be aliased)
                workflow.aliases = workflow.named = None
                workflow.novel = False
            hints = workflow.hints
            if legacy or (hints is not None and not hasattr(hints, "margins")):
                workflow.node = workflow.hints = None  # (hints pickled before margins existed)

    def active(self) -> list[str]:
        return list(self._workflows)

    def stats(self) -> dict[str, Any]:
        """Accuracy per step (rolling and since the start), step-1 cross-entropy, drifts,
        sizes, and the work done per forecast (model evaluations, a count, not a time)."""
        stats = self.tracker.stats()
        stats.update(
            calls=self._calls,
            finished=self._finished,
            active=len(self._workflows),
            types=len(self._types),
            aliased_types=sorted(kind for kind, t in self._types.items() if t.aliased),
            agents=sum(len(t.agents) for t in self._types.values()),
            contexts=self.markov.n_contexts + self.copy.n_contexts,
            forecasts=self._forecasts,
            evaluations=self._nodes,
            nodes_per_forecast=self._nodes / self._forecasts if self._forecasts else 0.0,
            expert_weights={
                kind: dict(zip(EXPERTS, t.mixture.typewide, strict=True))
                for kind, t in self._types.items()
            },
        )
        return stats

    # -- positions -----------------------------------------------------------------------------

    def _type(self, kind: str) -> _TypeModel:
        model = self._types.get(kind)
        if model is None:
            mixture = Mixture(len(EXPERTS), rate=self.expert_rate, floor=self.expert_floor)
            context = ContextModel(learning_rate=self.learning_rate)
            model = self._types[kind] = _TypeModel(context, mixture, self.alias_window)
        return model

    def _fresh(self, kind: str, hints: Mapping[str, HintValue]) -> Position:
        numeric, onehot = split_hints(hints)
        return Position(kind, (START,), (), 0, {}, 0, numeric, onehot)

    def _start(
        self, workflow_id: str, kind: str, hints: Mapping[str, HintValue], ts: float
    ) -> _Workflow:
        workflow = _Workflow(self._fresh(kind, hints), ts)
        if self._aliasing(kind):
            workflow.aliases, workflow.named = {}, {}
        self._workflows[workflow_id] = workflow
        while len(self._workflows) > self.max_workflows:
            self._workflows.popitem(last=False)
        return workflow

    def _aliasing(self, kind: str) -> bool:
        """Whether a new workflow of type ``kind`` is modelled over aliases; a type that changes
        mode forgets most of what it learnt (as after a drift: the labels are not the same)."""
        model = self._types.get(kind) or self._type(kind)
        share, novel = self.alias_share, model.novel
        if share is None or len(novel) < self.alias_after:
            return model.aliased
        seen = sum(novel) / len(novel)
        aliased = seen >= share if not model.aliased else seen >= share / 2
        if aliased != model.aliased:
            model.aliased = aliased
            self._forget_type(kind, model)
            model.agents, model.known = [], set()  # the labels are the new mode's from now
        return aliased

    def _forget_type(self, kind: str, model: _TypeModel) -> None:
        """Decay the type's counts, reset its context model and mixture, drop its views."""
        self.markov.decay(kind, self.drift_decay)
        self.copy.decay(kind, self.drift_decay)
        model.context.reset()
        model.mixture.reset()
        model.structures.clear()

    @staticmethod
    def _alias(workflow: _Workflow, agent: str) -> str:
        """The alias of ``agent``, new to ``workflow``: ``#n`` for its n-th distinct agent."""
        assert workflow.aliases is not None and workflow.named is not None
        alias = workflow.aliases[agent] = f"#{len(workflow.aliases) + 1}"
        workflow.named[alias] = agent
        return alias

    # -- one step ------------------------------------------------------------------------------

    def _structure(self, position: Position, model: _TypeModel) -> _Structure:
        """The count models' view of ``position``, from the cache while fresh enough."""
        history = position.history
        key = (history[-self.order :], min(position.run, 3), position.recent)
        cached = model.structures.get(key)
        stale = min(self.refresh, model.learns // 10)
        if cached is not None and model.learns - cached.version <= stale:
            return cached
        kind = position.kind
        if cached is not None:  # a refresh: the contexts are the same, their counts changed
            markov_x, copy_x = cached.markov_x, cached.copy_x
            markov_keys, copy_keys = cached.markov_keys, cached.copy_keys
        else:
            markov_x = {"type": kind}
            for i in range(1, min(self.order, len(history)) + 1):
                markov_x[f"h{i}"] = history[-i]
            markov_keys = self.markov.context_keys(markov_x)
            copy_x = {"type": kind, "h1": f"run{min(position.run, 3)}", "h2": history[-1]}
            copy_keys = self.copy.context_keys(copy_x)
        markov = self.markov.distribution_keys(markov_keys)
        copy = self._copy_distribution(position, copy_keys, markov)
        w_markov, w_copy, _ = model.mixture.weights(history[-1])
        prior: dict[str, float] = {}
        for label, p in markov.items():
            prior[label] = w_markov * p
        for label, p in copy.items():
            prior[label] = prior.get(label, 0.0) + w_copy * p
        agents = sorted((a for a in prior if a != END), key=prior.__getitem__, reverse=True)
        labels = [*agents[: self.max_candidates - 1], END]
        relative = [counted_features(position, label, markov, copy) for label in labels]
        structure = _Structure(
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
        model.structures[key] = structure
        return structure

    def _hints(self, position: Position, context: ContextModel) -> _Hints:
        features = context.hint_features(position.numeric, position.onehot)
        if all(features.values()):  # (the usual case: every hint has a value)
            keys = tuple(features)
            values = (1.0, *features.values())
        else:
            keys = tuple([feature for feature, value in features.items() if value])
            values = (1.0, *[value for value in features.values() if value])
        return _Hints(position.numeric, features, {}, keys, values, {})

    def _evaluate(self, position: Position, hints: _Hints, learning: bool = True) -> _Node:
        """The fused one-step distribution at ``position`` (whose hints are ``hints``).

        The context model's score of a candidate is a hint part (once per forecast, in
        ``hints``) plus a relative part that depends on the path only; the relative features
        and their dot products are cached per (structure, path) and the dot products are
        recomputed only when the weights have changed since: the same numbers, less work.
        Without ``learning`` (a roll-out step) the node's ``context`` is left empty."""
        self._nodes += 1
        model = self._types.get(position.kind) or self._type(position.kind)
        run = position.run
        structure = model.structures.get(
            (position.history[-self.order :], run if run < 3 else 3, position.recent)
        )
        learns = model.learns
        if structure is None or learns - structure.version > min(self.refresh, learns // 10):
            structure = self._structure(position, model)
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
                hint_margin = self._crossed(context, hints, label)[1]
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
        return _Node(structure, labels, probs, qs, path.relative, scores)

    def _new_path(self, position: Position, structure: _Structure, key: tuple[int, ...]) -> _Path:
        """The candidates' complete relative features at a path not cached yet."""
        relative = [
            self._path(position, label, counted)
            for label, counted in zip(structure.labels, structure.relative, strict=True)
        ]
        path = _Path(relative, [], -1)
        if len(structure.paths) >= self.max_paths:
            structure.paths.clear()
        if self.max_paths:
            structure.paths[key] = path
        return path

    @staticmethod
    def _crossed(context: ContextModel, hints: _Hints, label: str) -> tuple[Features, float]:
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
        possible = [ranks.get(f"r{j}", 0.0) for j in range(1, len(recent) + 1)]
        other = ranks.get(OTHER, 0.0)
        total = sum(possible) + other
        if total <= 0.0:
            return markov
        dist = {agent: p / total for agent, p in zip(recent, possible, strict=False)}
        rest = 1.0 - sum(markov.get(a, 0.0) for a in recent)
        if rest > 1e-9:
            scale = other / total / rest
            for label, p in markov.items():
                if label not in dist:
                    dist[label] = p * scale
        return dist

    # -- K steps -------------------------------------------------------------------------------

    def _rollout(self, position: Position, node: _Node, hints: _Hints) -> Forecast:
        """``rollout.rollout`` with ``_evaluate`` as its step, inlined: the same arithmetic in
        the same order (the same forecasts), without a call per step through a closure. Step
        1 is the node itself (one path of mass 1, scaled by 1: its probabilities as they are).
        """
        self._forecasts += 1
        k, min_branch = self.k, self.min_branch
        labels, probs = node.labels, node.probs
        first, ended = _step_one(labels, probs)
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
        hints: _Hints,
        agents: list[dict[str, float]],
        alive: list[float],
        ended: float,
    ) -> None:
        """Steps 2..K of ``_rollout``: expand the ``beam`` likeliest ``children`` of the step
        before, mix their one-step distributions, and so on."""
        k, beam, min_branch, order = self.k, self.beam, self.min_branch, self.order
        evaluate = self._evaluate
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

    def _noisy(self, kind: str, forecast: Forecast) -> Forecast:
        if self.noise and self._rng.random() < self.noise:
            labels = [*self._type(kind).agents, END]
            return random_forecast(labels, self.k, self._rng)
        return forecast

    def _served(self, workflow: _Workflow) -> Forecast:
        if workflow.forecast is None:
            position = workflow.position
            if workflow.node is None or workflow.hints is None:
                workflow.hints = self._hints(position, self._type(position.kind).context)
                workflow.node = self._evaluate(position, workflow.hints)
            forecast = self._noisy(
                position.kind, self._rollout(position, workflow.node, workflow.hints)
            )
            if workflow.named is not None:
                forecast = _named(forecast, workflow.named)
            workflow.forecast = forecast
            workflow.pending.append((position.pos, forecast))
        return workflow.forecast

    # -- learning ------------------------------------------------------------------------------

    def _learn(self, workflow: _Workflow, label: str, name: str) -> None:
        """Learn that ``label`` (``name``'s alias in an aliased workflow, else ``name``) followed
        the workflow's position; its forecasts, served in names, are scored on ``name``."""
        position = workflow.position
        kind = position.kind
        # An active workflow's position is scored: all K steps of its forecast, rolled out
        # here if nobody asked for it - or, without ``roll_out_unserved`` (the daemon, which
        # asks at its own pace, not per call), step 1 only where none was served: the one-step
        # node that learning needs anyway, without the roll-out. Step-1 accuracy,
        # cross-entropy and drift (what PBKV's fallback reads) then still see every position;
        # steps 2..K are scored where a forecast was served. With injected noise every
        # position is served, as the noise draws are per forecast.
        unserved = (
            not self.roll_out_unserved
            and bool(position.pos)
            and workflow.forecast is None
            and not self.noise
        )
        if position.pos and not unserved:
            self._served(workflow)
        if workflow.node is None or workflow.hints is None:  # (or dropped by a restore)
            workflow.hints = self._hints(position, self._type(kind).context)
            workflow.node = self._evaluate(position, workflow.hints)
        node, hints = workflow.node, workflow.hints
        assert node is not None and hints is not None
        structure = node.structure

        drifted = False
        pending = workflow.pending
        if pending:
            pos, check = position.pos, self.tracker.check
            for made, forecast in pending:
                if check(kind, forecast, pos - made + 1, name):
                    drifted = True
            while pending and (label == END or pos - pending[0][0] + 2 > self.k):
                pending.popleft()
        if unserved:  # (the newest forecast: after the older ones, as it would be in pending)
            first, ended = _step_one(node.labels, node.probs)
            step_one = Forecast([first], [1.0 - ended])
            if workflow.named is not None:
                step_one = _named(step_one, workflow.named)
            if self.tracker.check(kind, step_one, 1, name):
                drifted = True

        model = self._types.get(kind) or self._type(kind)
        model.learns += 1
        if label != END and label not in model.known:
            model.known.add(label)
            model.agents.append(label)
        recent = position.recent
        if label in recent:
            i = recent.index(label)
            rank = _RANKS[i] if i < len(_RANKS) else f"r{i + 1}"
        else:
            rank = OTHER
        markov, copy = self.markov, self.copy
        resolved = structure.resolved
        if (
            resolved is not None
            and resolved[0] == markov.generation
            and resolved[1] == copy.generation
        ):
            markov.learn_counts(resolved[2], label)
            copy.learn_counts(resolved[3], rank)
        else:
            generations = markov.generation, copy.generation
            markov_counts = markov.learn_keys(structure.markov_keys, label)
            copy_counts = copy.learn_keys(structure.copy_keys, rank)
            if generations == (markov.generation, copy.generation):  # (none dropped meanwhile)
                structure.resolved = (*generations, markov_counts, copy_counts)

        # the context model: the true label as a positive, the most likely wrong one as a
        # negative; a step is skipped where the model is already sure (its gradient is ~0)
        context = model.context
        labels = structure.labels
        truth = labels.index(label) if label in labels else -1
        if truth < 0 or node.scores[truth] < 1.0 - self.sure:
            if truth >= 0:
                relative = node.relative[truth]
            else:
                counted = counted_features(position, label, structure.markov, structure.copy)
                relative = self._path(position, label, counted)
            context.learn({**self._crossed(context, hints, label)[0], **relative}, True)
        wrong, best = -1, -1.0  # the most likely wrong candidate (the first among equals)
        for i, p in enumerate(node.probs):
            if i != truth and p > best:
                wrong, best = i, p
        if wrong >= 0 and node.scores[wrong] > self.sure:
            features = self._crossed(context, hints, labels[wrong])[0]
            context.learn({**features, **node.relative[wrong]}, False)
        context.learn_hints(hints.numeric)

        said = [structure.markov.get(label, 0.0), structure.copy.get(label, 0.0)]
        said.append(node.context[truth] if truth >= 0 else 0.0)
        model.mixture.learn(position.history[-1], said)

        if drifted:
            self._forget_type(kind, model)
