"""Serving forecasts: the K-step forecast at a workflow's position, made once per position.

What is served for an active workflow is rolled out from the one-step prediction at its
position (``BeamRollout``), translated to agent names where its type is modelled over aliases,
kept until its next call (asked again, the same forecast is answered) and queued to be scored
as the calls it forecasts arrive (``Workflow.pending``). With ``noise``, that fraction of the
forecasts served is replaced by random ones (``random_forecast``, drawn from the labels the
type has learnt): an experiment knob for measuring degradation, its draws seeded by ``rng``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from policyd.core.types import HintValue
from policyd.models.predictor.forecast import END, Forecast, random_forecast
from policyd.models.predictor.kinds import TypeModels
from policyd.models.predictor.onestep import OneStepModel
from policyd.models.predictor.rollout import BeamRollout
from policyd.models.predictor.workflows import Workflow, first_position, named


class Server:
    """The forecasts served: for an active workflow, and for one that has made no call."""

    def __init__(
        self,
        one_step: OneStepModel,
        rollout: BeamRollout,
        types: TypeModels,
        rng: random.Random,
        *,
        noise: float = 0.0,
    ) -> None:
        self._one_step = one_step
        self._rollout = rollout
        self._types = types
        self._rng = rng
        self.noise = noise

    def served(self, workflow: Workflow) -> Forecast:
        """The forecast at ``workflow``'s position: rolled out the first time it is asked
        (and queued to be scored), the same one after that."""
        if workflow.forecast is None:
            position = workflow.position
            if workflow.node is None or workflow.hints is None:
                workflow.hints, workflow.node = self._one_step.at(position)
            rolled = self._rollout.forecast(position, workflow.node, workflow.hints)
            forecast = workflow.in_names(self._noisy(position.kind, rolled))
            workflow.forecast = forecast
            workflow.pending.append((position.pos, forecast))
        return workflow.forecast

    def for_new(self, kind: str, hints: Mapping[str, HintValue]) -> Forecast:
        """The forecast for a workflow of type ``kind`` that has made no call yet, whose first
        request carries ``hints``: step 1 is its first agent."""
        model = self._types.model(kind)
        position = first_position(kind, hints)
        state = self._one_step.hints(position, model.context)
        node = self._one_step.evaluate(position, state)
        forecast = self._noisy(kind, self._rollout.forecast(position, node, state))
        # an aliased type's new workflow has called nobody: no alias has a name yet
        return named(forecast, {}) if model.aliased else forecast

    def _noisy(self, kind: str, forecast: Forecast) -> Forecast:
        if self.noise and self._rng.random() < self.noise:
            labels = [*self._types.model(kind).agents, END]
            return random_forecast(labels, self._rollout.k, self._rng)
        return forecast
