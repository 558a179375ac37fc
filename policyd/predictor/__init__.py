"""Online next-agent prediction (PBKV's predictor): ``Predictor`` answers a ``Forecast``.

* ``forecast`` - the answer: P(agent at step k | running) and P(running at step k), k = 1..K;
* ``backoff`` - workflow structure: back-off counts over the last agents (a River classifier);
* ``context`` - the request's own context: hints, position, retries (River logistic model);
* ``position`` - where a workflow is, and what that says about each candidate next agent;
* ``mixture`` - how much to trust each expert, learnt online;
* ``rollout`` - K-step forecasts from the one-step model (a beam);
* ``tracking`` - online accuracy per step, calibration, drift (River metrics and ADWIN);
* ``fusion`` - the ``Predictor``: the experts mixed, rolled forward over K steps, learning as
  calls are observed.
"""

from policyd.predictor.forecast import END, START, Forecast
from policyd.predictor.fusion import MIN_BRANCH, Predictor

__all__ = ["END", "MIN_BRANCH", "START", "Forecast", "Predictor"]
