"""The online next-agent predictor: ``Predictor``, a facade over the parts that do the work.

For every active workflow it answers P(agent at step k) and P(still running at step k), k =
1..K, and it learns as calls are observed. The parts, each with one job:

* ``OneStepModel`` (``onestep``) - three experts (back-off counts over the last agents, a
  copy expert over the recent ones, a context model over the request's hints) fused into the
  distribution of the next label at a position;
* ``BeamRollout`` (``rollout``) - steps 2..K, by rolling that model forward over a beam of
  likely continuations;
* ``Server`` (``serving``) - the forecast served at a workflow's position, once per position,
  in agent names, with injected noise if asked;
* ``Scorer`` (``scoring``) - the forecasts scored as their truth arrives (``Tracker``:
  accuracy per step, calibration, drift);
* ``TransitionLearner`` (``learning``) - every expert and the mixture taught the transition
  just seen;
* ``TypeModels`` (``kinds``) - per workflow type, its context model, mixture and cached views,
  whether it is modelled over aliases, and forgetting it after a drift;
* ``ActiveWorkflows`` (``workflows``) - per workflow, its position and what was computed and
  forecast there;
* ``restore`` - checkpoints pickled by earlier versions, read back.

Learning happens as calls are observed (``observe_call``, ``observe_finished``): first the
forecasts made earlier for the workflow are scored, then every model learns the transition just
seen; a drift towards more errors (ADWIN) makes the predictor forget the workflow's type.
Nothing reads a clock; randomness (``noise``) comes from ``seed``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from policyd.core.types import HintValue
from policyd.models.predictor.backoff import BackoffClassifier
from policyd.models.predictor.forecast import END, START, Forecast
from policyd.models.predictor.kinds import TypeModel, TypeModels
from policyd.models.predictor.learning import Transition, TransitionLearner
from policyd.models.predictor.nodes import Hints, Node, Path, Structure
from policyd.models.predictor.onestep import OneStepModel
from policyd.models.predictor.parts import Learnt, Settings
from policyd.models.predictor.restore import from_flat, is_flat, repair
from policyd.models.predictor.rollout import MIN_BRANCH, BeamRollout
from policyd.models.predictor.scoring import Scorer
from policyd.models.predictor.serving import Server
from policyd.models.predictor.tracking import Tracker
from policyd.models.predictor.workflows import ActiveWorkflows, Workflow

# the names checkpoints pickled by earlier versions give these classes
_Hints, _Node, _Path, _Structure = Hints, Node, Path, Structure
_TypeModel, _Workflow = TypeModel, Workflow

__all__ = ["MIN_BRANCH", "Predictor"]


class Predictor:
    """P(agent at step k) and P(still running at step k), k = 1..K, for every active workflow.

    Parameters
    ----------
    k, order, max_candidates, beam, min_branch, ...
        The fields of ``Settings`` (``parts``), documented there: ``k`` positional or by
        keyword, the others by keyword. A value out of range raises ``ValueError``.

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
        settings = Settings(
            k=k,
            order=order,
            max_candidates=max_candidates,
            beam=beam,
            min_branch=min_branch,
            refresh=refresh,
            max_cache=max_cache,
            max_paths=max_paths,
            learning_rate=learning_rate,
            sure=sure,
            expert_rate=expert_rate,
            expert_floor=expert_floor,
            max_count=max_count,
            window=window,
            drift_delta=drift_delta,
            drift_decay=drift_decay,
            noise=noise,
            max_workflows=max_workflows,
            seed=seed,
            alias_share=alias_share,
            alias_window=alias_window,
            alias_after=alias_after,
            roll_out_unserved=roll_out_unserved,
        )
        self._assemble(settings, Learnt.fresh(settings))

    def _assemble(self, settings: Settings, learnt: Learnt) -> None:
        """Build the parts over ``learnt`` (fresh, or read from an older checkpoint)."""
        s = settings
        self.roll_out_unserved = s.roll_out_unserved
        self._calls, self._finished = learnt.calls, learnt.finished
        self._types = TypeModels(
            learnt.types,
            learnt.markov,
            learnt.copy,
            learning_rate=s.learning_rate,
            expert_rate=s.expert_rate,
            expert_floor=s.expert_floor,
            drift_decay=s.drift_decay,
            alias_share=s.alias_share,
            alias_window=s.alias_window,
            alias_after=s.alias_after,
        )
        self._workflows = ActiveWorkflows(learnt.workflows, s.max_workflows)
        self._one_step = OneStepModel(
            learnt.markov,
            learnt.copy,
            self._types,
            learnt.path,
            order=s.order,
            max_candidates=s.max_candidates,
            refresh=s.refresh,
            max_cache=s.max_cache,
            max_paths=s.max_paths,
            evaluations=learnt.evaluations,
        )
        self._learner = TransitionLearner(self._one_step, sure=s.sure)
        self._rollout = BeamRollout(
            self._one_step,
            k=s.k,
            beam=s.beam,
            min_branch=s.min_branch,
            order=s.order,
            forecasts=learnt.forecasts,
        )
        self._server = Server(self._one_step, self._rollout, self._types, learnt.rng, noise=s.noise)
        self._scorer = Scorer(learnt.tracker)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled predictor (a daemon checkpoint), one an earlier version pickled
        included (``restore.from_flat``, ``restore.repair``)."""
        if is_flat(state):
            self._assemble(*from_flat(state))
        else:
            self.__dict__.update(state)
        one_step, types = self._one_step, self._types
        repair(
            (one_step.markov, one_step.copy),
            types.values(),
            self._workflows.values(),
            types.alias_window,
        )

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
        workflows = self._workflows
        workflow = workflows.seen(workflow_id)
        if workflow is None:
            aliased = self._types.aliasing(workflow_type)
            workflow = workflows.start(workflow_id, workflow_type, hints, ts, aliased=aliased)
        if self._types.model(workflow.position.kind).met(agent, workflows.max_workflows):
            workflow.novel = True
        label = workflow.label(agent)
        self._learn(workflow, label, agent)
        workflow.advance(label, hints, ts, self._one_step.order)
        self._calls += 1

    def observe_finished(self, workflow_id: str) -> None:
        """Workflow ``workflow_id`` ended: learn that ``END`` followed its last call."""
        workflow = self._workflows.pop(workflow_id)
        if workflow is None:
            return
        self._learn(workflow, END, END)
        self._types.model(workflow.position.kind).novel.append(workflow.novel)
        self._finished += 1

    def forget(self, workflow_id: str) -> None:
        """Drop a workflow without learning from it (e.g. it was cancelled)."""
        self._workflows.pop(workflow_id)

    def predict(self, workflow_id: str) -> Forecast:
        """The forecast for an active workflow (cached until its next call is observed)."""
        workflow = self._workflows.get(workflow_id)
        if workflow is None:
            raise KeyError(f"workflow {workflow_id!r} is not active (no call observed)")
        return self._server.served(workflow)

    def predict_next_for_new(
        self, workflow_type: str, hints: Mapping[str, HintValue] | None = None
    ) -> Forecast:
        """The forecast for a workflow of type ``workflow_type`` that has made no call yet,
        whose first request carries ``hints``: step 1 is its first agent."""
        return self._server.for_new(workflow_type, hints or {})

    def active(self) -> list[str]:
        return list(self._workflows)

    def stats(self) -> dict[str, Any]:
        """Accuracy per step (rolling and since the start), step-1 cross-entropy, drifts,
        sizes, and the work done (counts, not times): one-step evaluations per forecast, and
        the share of evaluations that computed the count experts' view anew."""
        stats = self.tracker.stats()
        types = self._types
        forecasts, evaluations = self._rollout.forecasts, self._one_step.evaluations
        views = self._one_step.views
        stats.update(
            calls=self._calls,
            finished=self._finished,
            active=len(self._workflows),
            types=len(types),
            aliased_types=types.aliased(),
            agents=types.labels(),
            contexts=self.markov.n_contexts + self.copy.n_contexts,
            forecasts=forecasts,
            evaluations=evaluations,
            nodes_per_forecast=evaluations / forecasts if forecasts else 0.0,
            views=views,
            views_per_evaluation=views / evaluations if evaluations else 0.0,
            expert_weights=types.expert_weights(),
        )
        return stats

    # -- what callers read (and the daemon's resize sets) ------------------------------------

    @property
    def k(self) -> int:
        """Steps forecast; the daemon's resize sets it (with a tracker of as many steps)."""
        return self._rollout.k

    @k.setter
    def k(self, k: int) -> None:
        self._rollout.k = k

    @property
    def tracker(self) -> Tracker:
        """Accuracy per step, calibration and drift, online (``Tracker``)."""
        return self._scorer.tracker

    @tracker.setter
    def tracker(self, tracker: Tracker) -> None:
        self._scorer.tracker = tracker

    @property
    def beam(self) -> int:
        return self._rollout.beam

    @property
    def min_branch(self) -> float:
        return self._rollout.min_branch

    @property
    def order(self) -> int:
        return self._one_step.order

    @property
    def markov(self) -> BackoffClassifier:
        """The back-off count model over the last agents (shared by all types)."""
        return self._one_step.markov

    @property
    def copy(self) -> BackoffClassifier:
        """The copy expert's counts over ranks of the recent agents (shared by all types)."""
        return self._one_step.copy

    # -- a fleet's shared learning (policyd.fleet.deltas) ------------------------------------

    def start_journal(self) -> None:
        """From now on, count every transition the count experts learn (``take_journal``)."""
        if self._learner.journal is None:
            self._learner.journal = {}

    def take_journal(self) -> dict[Transition, int]:
        """The transitions learnt since the last take (empty without ``start_journal``)."""
        journal = self._learner.journal
        if journal is None:
            return {}
        self._learner.journal = {}
        return journal

    def merge_transitions(self, transitions: Iterable[tuple[Transition, float]]) -> int:
        """Add another replica's transition counts to the count experts (``markov``, ``copy``);
        the context models and mixtures stay this replica's own. Returns the transitions."""
        markov, copy = self.markov, self.copy
        kinds: set[str] = set()
        n = 0
        for (markov_keys, label, copy_keys, rank), weight in transitions:
            markov.add_keys(markov_keys, label, weight)
            copy.add_keys(copy_keys, rank, weight)
            if markov_keys and markov_keys[0][0] == "t":
                kinds.add(markov_keys[0][1])
            n += 1
        for kind in kinds:
            self._types.counts_changed(kind)
        return n

    # -- learning ------------------------------------------------------------------------------

    def _learn(self, workflow: Workflow, label: str, name: str) -> None:
        """Learn that ``label`` (``name``'s alias in an aliased workflow, else ``name``) followed
        the workflow's position; its forecasts, served in names, are scored on ``name``."""
        position = workflow.position
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
            and not self._server.noise
        )
        if position.pos and not unserved:
            self._server.served(workflow)
        if workflow.node is None or workflow.hints is None:  # (or dropped by a restore)
            workflow.hints, workflow.node = self._one_step.at(position)
        node, hints = workflow.node, workflow.hints
        assert node is not None and hints is not None
        drifted = self._scorer.score(workflow, node, name, unserved=unserved)
        model = self._types.model(position.kind)
        self._learner.learn(model, position, node, hints, label)
        if drifted:
            self._types.forget(position.kind, model)
