"""What a ``Predictor`` is built from: its settings, and what it has learnt and counted.

``Settings`` are the predictor's parameters, checked when made (``Predictor`` documents each).
``Learnt`` is its learnt state, fresh for a new predictor or read back from an older
checkpoint (``restore``): the count models, the tracker, the per-type and per-workflow state,
the noise's random generator, the path-features cache and the counters ``stats`` reports.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

from policyd.models.predictor.backoff import BackoffClassifier
from policyd.models.predictor.kinds import TypeModel
from policyd.models.predictor.position import PathFeatures
from policyd.models.predictor.rollout import MIN_BRANCH
from policyd.models.predictor.tracking import Tracker
from policyd.models.predictor.workflows import Workflow


@dataclass(frozen=True, slots=True)
class Settings:
    """A predictor's parameters; a value out of range is refused.

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
        ADWIN's confidence parameter: the larger, the fewer checks a drift needs to be seen
        (River's default is 0.002).
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
        most of a call's cost: the daemon, which asks for forecasts at its own pace. Served
        forecasts are computed the same way either way.

    Examples
    --------
    >>> Settings(k=0)
    Traceback (most recent call last):
    ...
    ValueError: k must be at least 1, got 0
    """

    k: int = 3
    order: int = 3
    max_candidates: int = 4
    beam: int = 2
    min_branch: float = MIN_BRANCH
    refresh: int = 16
    max_cache: int = 20_000
    max_paths: int = 256
    learning_rate: float = 0.1
    sure: float = 0.02
    expert_rate: float = 0.5
    expert_floor: float = 0.02
    max_count: float = 1000.0
    window: int = 500
    drift_delta: float = 0.05
    drift_decay: float = 0.1
    noise: float = 0.0
    max_workflows: int = 100_000
    seed: int = 0
    alias_share: float | None = 0.5
    alias_window: int = 64
    alias_after: int = 16
    roll_out_unserved: bool = True

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be at least 1, got {self.k}")
        if not 0.0 <= self.noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {self.noise}")
        if not 0.0 <= self.min_branch <= 1.0:
            raise ValueError(f"min_branch must be in [0, 1], got {self.min_branch}")
        if self.max_candidates < 2:
            raise ValueError(f"max_candidates must be at least 2, got {self.max_candidates}")
        share = self.alias_share
        if share is not None and not 0.0 < share <= 1.0:
            raise ValueError(f"alias_share must be in (0, 1] or None, got {share}")
        if not 1 <= self.alias_after <= self.alias_window:
            raise ValueError(
                f"need 1 <= alias_after <= alias_window, got {self.alias_after} and "
                f"{self.alias_window}"
            )


@dataclass(slots=True)
class Learnt:
    """A predictor's learnt state and counters."""

    markov: BackoffClassifier
    copy: BackoffClassifier
    tracker: Tracker
    rng: random.Random
    types: dict[str, TypeModel] = field(default_factory=dict)
    workflows: OrderedDict[str, Workflow] = field(default_factory=OrderedDict)
    path: PathFeatures = field(default_factory=PathFeatures)
    calls: int = 0  # calls observed
    finished: int = 0  # workflows finished
    evaluations: int = 0  # one-step evaluations
    forecasts: int = 0  # forecasts rolled out

    @classmethod
    def fresh(cls, settings: Settings) -> Learnt:
        """Nothing learnt yet, for a predictor of ``settings``."""
        return cls(
            BackoffClassifier(order=settings.order, max_count=settings.max_count),
            BackoffClassifier(order=2, max_count=settings.max_count),
            Tracker(settings.k, window=settings.window, drift_delta=settings.drift_delta),
            random.Random(settings.seed),
        )
