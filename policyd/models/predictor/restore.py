"""Reading checkpoints that earlier versions of the predictor pickled.

A ``Predictor`` pickles its parts, and they pickle their state by attribute name. Two kinds
of older checkpoints are read back:

* one pickled before the predictor was split into parts is a single flat dict: the settings
  under their parameter names, the count models (``markov``, ``copy``), the ``tracker``, the
  per-type and per-workflow state (``_types``, ``_workflows``), the noise's generator
  (``_rng``), the path-features cache (``_path``) and the counters (``_calls``,
  ``_finished``, ``_nodes``, ``_forecasts``). ``is_flat`` tells it; ``from_flat`` reads it as
  the ``Settings`` and ``Learnt`` the parts are built from; a setting added since reads as
  its default. (Its per-type and per-workflow classes were pickled under the names
  ``fusion`` still gives them.)
* any checkpoint may hold objects pickled before some of their caches or fields existed:
  ``repair`` drops those caches (they are rebuilt on demand from the learnt state) and gives
  the missing fields the values that keep the predictor behaving as it did.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from policyd.models.predictor.backoff import BackoffClassifier
from policyd.models.predictor.kinds import TypeModel
from policyd.models.predictor.parts import Learnt, Settings
from policyd.models.predictor.workflows import Workflow

_SETTINGS = frozenset(f.name for f in fields(Settings))


def is_flat(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` is a predictor pickled before it was split into parts."""
    return "markov" in state


def from_flat(state: Mapping[str, Any]) -> tuple[Settings, Learnt]:
    """The settings and learnt state of a predictor pickled as a flat dict."""
    settings = Settings(**{name: value for name, value in state.items() if name in _SETTINGS})
    learnt = Learnt(
        state["markov"],
        state["copy"],
        state["tracker"],
        state["_rng"],
        state["_types"],
        state["_workflows"],
        state["_path"],
        calls=state["_calls"],
        finished=state["_finished"],
        evaluations=state["_nodes"],
        forecasts=state["_forecasts"],
    )
    return settings, learnt


def repair(
    classifiers: Iterable[BackoffClassifier],
    types: Iterable[TypeModel],
    workflows: Iterable[Workflow],
    alias_window: int,
) -> None:
    """Bring objects pickled by older versions up to date, in place.

    * a count model from before it counted its prunings (``generation``) starts at 0;
    * a context model from before it counted its weight versions: its type's views, and every
      workflow's hints and prediction, are dropped (their cached dot products cannot be
      trusted);
    * views from before they kept their back-off Counts are dropped;
    * a type from before types could be modelled over aliases is modelled by name, the names
      it has learnt being those it has met (``alias_window`` sizes its novelty window);
    * a workflow from before workflows could be aliased is modelled by name;
    * hints from before they kept their margins are dropped with their prediction.
    """
    for classifier in classifiers:
        classifier.__dict__.setdefault("generation", 0)
    legacy = False
    for model in types:
        if not hasattr(model.context, "version"):
            model.context.version = 0
            model.structures.clear()
            legacy = True
        if not all(hasattr(s, "resolved") for s in model.structures.values()):
            model.structures.clear()
        if not hasattr(model, "aliased"):
            model.names = set(model.known)
            model.novel = deque(maxlen=alias_window)
            model.aliased = False
    for workflow in workflows:
        if not hasattr(workflow, "novel"):
            workflow.aliases = workflow.named = None
            workflow.novel = False
        hints = workflow.hints
        if legacy or (hints is not None and not hasattr(hints, "margins")):
            workflow.node = workflow.hints = None
