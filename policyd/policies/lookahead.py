"""PBKV's lookahead (arXiv 2605.06472): what the online predictor expects each workflow to call.

* ``Lookahead`` - the ranking: value(prompt) = sum over active workflows w and steps
  k = 1..K of discount^(k-1) * P_w(step k calls the agent whose prompt it is) (the predictor's
  joint probability already includes that w is still running at step k). An agent's next
  prompt in w starts with its latest prompt in w; its shared prefix collects value from every
  workflow that may call it, including workflows that have not called it yet.
* ``PredictorTrust`` - graceful degradation: the forecasts are trusted only after
  ``min_observations`` calls and while the predictor's rolling step-1 accuracy is at least
  ``min_accuracy``; a policy publishes no lookahead otherwise.
* ``NextCallPrefetch`` - conservative prefetch: host-resident blocks of the agents most likely
  to run next in idle workflows, most likely first, within the caller's budget.
"""

from __future__ import annotations

from policyd.core.state import EngineState
from policyd.core.types import Event, RequestStarted, WorkflowFinished
from policyd.models.predictor import END, MIN_BRANCH, Forecast, Predictor
from policyd.policies.lifecycle import Lifecycle
from policyd.policies.rankings import Key, Values


class Lookahead:
    """The predictor's expected discounted calls per agent in each workflow's next K steps.

    ``predictor`` is the one given (the daemon shares its own) or one of its own; it learns
    from the calls and ends this object observes."""

    def __init__(
        self,
        *,
        k: int = 3,
        discount: float = 0.8,
        noise: float = 0.0,
        seed: int = 0,
        predictor: Predictor | None = None,
        min_branch: float = MIN_BRANCH,
    ) -> None:
        if not 0.0 < discount <= 1.0:
            raise ValueError(f"discount must be in (0, 1], got {discount}")
        self.discount = discount
        self.predictor = predictor or Predictor(k=k, noise=noise, seed=seed, min_branch=min_branch)

    def observe(self, event: Event) -> None:
        kind = type(event)
        if kind is RequestStarted:
            assert isinstance(event, RequestStarted)
            self.predictor.observe_call(
                event.workflow_id, event.workflow_type, event.agent, event.hints, event.ts
            )
        elif kind is WorkflowFinished:
            assert isinstance(event, WorkflowFinished)
            self.predictor.observe_finished(event.workflow_id)

    def forecast(self, workflow_id: str) -> Forecast | None:
        """The workflow's forecast; None for a workflow the predictor does not know."""
        try:
            return self.predictor.predict(workflow_id)
        except KeyError:
            return None

    def agent_mass(self, forecast: Forecast) -> dict[str, float]:
        """Expected discounted number of calls of each agent in the next K steps."""
        mass: dict[str, float] = {}
        weight = 1.0
        for step in range(1, forecast.k + 1):
            alive = forecast.alive[step - 1]
            for agent, p in forecast.agents[step - 1].items():
                if agent != END and p > 0.0:
                    mass[agent] = mass.get(agent, 0.0) + weight * alive * p
            weight *= self.discount
        return mass

    def mass(self, workflow_id: str, agent: str) -> float:
        """``agent``'s expected discounted calls in the workflow (0 without a forecast)."""
        forecast = self.forecast(workflow_id)
        return 0.0 if forecast is None else self.agent_mass(forecast).get(agent, 0.0)

    def values(self, state: EngineState) -> Values:
        """Every active workflow's agents valued by their mass; a shared prefix by the sum of
        its agent's mass over the workflows. Workflows without a forecast are left out."""
        private: dict[Key, float] = {}
        shared: dict[str, float] = {}
        for wf in state.active_workflows():
            wid = wf.workflow_id
            forecast = self.forecast(wid)
            if forecast is None:
                continue
            for agent, mass in self.agent_mass(forecast).items():
                shared[agent] = shared.get(agent, 0.0) + mass
                private[wid, agent] = mass
        return Values(private, shared)


class PredictorTrust:
    """Whether the predictor's forecasts may rank blocks, judged at each snapshot (``judge``).

    ``calls_seen`` counts the calls observed (the daemon carries it over when it swaps
    policies); ``degraded`` is the last verdict: True before ``min_observations`` calls and
    while the rolling step-1 top-1 accuracy is below ``min_accuracy``."""

    def __init__(
        self, predictor: Predictor, *, min_accuracy: float = 0.3, min_observations: int = 20
    ) -> None:
        self.predictor = predictor
        self.min_accuracy = min_accuracy
        self.min_observations = min_observations
        self.calls_seen = 0
        self.degraded = False

    def observe(self, event: Event) -> None:
        if type(event) is RequestStarted:
            self.calls_seen += 1

    def accuracy(self) -> float:
        """The predictor's rolling top-1 accuracy at step 1."""
        return self.predictor.tracker.accuracy(1, rolling=True)

    def judge(self) -> bool:
        """The verdict now (kept as ``degraded``): True while the forecasts are not trusted."""
        self.degraded = (
            self.calls_seen < self.min_observations or self.accuracy() < self.min_accuracy
        )
        return self.degraded


class NextCallPrefetch:
    """Host blocks worth loading into free GPU space: the prompts of the agents that idle
    workflows call next with probability at least ``min_probability``, most likely first;
    only blocks the host holds and the GPU does not."""

    def __init__(self, lookahead: Lookahead, *, min_probability: float = 0.5) -> None:
        self.lookahead = lookahead
        self.min_probability = min_probability

    def blocks(self, budget_blocks: int, state: EngineState) -> list[int]:
        """At most ``budget_blocks`` distinct blocks, the likeliest prompts' first (a block two
        likely prompts share is named once, for the likelier)."""
        if budget_blocks <= 0:
            return []
        host, gpu = state.resident["host"], state.resident["gpu"]
        wanted: list[tuple[float, tuple[int, ...]]] = []
        for wf in state.active_workflows():
            if wf.running:
                continue
            forecast = self.lookahead.forecast(wf.workflow_id)
            if forecast is None:
                continue
            for agent, given_alive in forecast.agents[0].items():
                p = given_alive * forecast.alive[0]
                blocks = wf.agent_blocks.get(agent)
                if p >= self.min_probability and blocks:
                    wanted.append((p, blocks))
        out: dict[int, None] = {}
        for _, blocks in sorted(wanted, key=lambda item: -item[0]):
            for b in blocks:
                if b in host and b not in gpu and b not in out:
                    out[b] = None
                    if len(out) >= budget_blocks:
                        return list(out)
        return list(out)


class PredictorSurface:
    """What the daemon reads and sets on a policy built around the predictor (``pbkv``,
    ``agentkv``), delegated to the parts that own it: the shared ``predictor``, the ``retired``
    blocks, the ``calls_seen`` the trust gate counts and whether it is ``degraded``. A policy
    using it has ``lookahead``, ``lifecycle`` and ``trust`` attributes."""

    lookahead: Lookahead
    lifecycle: Lifecycle
    trust: PredictorTrust

    @property
    def predictor(self) -> Predictor:
        return self.lookahead.predictor

    @property
    def retired(self) -> set[int]:
        return self.lifecycle.retired

    @retired.setter
    def retired(self, blocks: set[int]) -> None:
        self.lifecycle.retired = blocks

    @property
    def calls_seen(self) -> int:
        return self.trust.calls_seen

    @calls_seen.setter
    def calls_seen(self, calls: int) -> None:
        self.trust.calls_seen = calls

    @property
    def degraded(self) -> bool:
        return self.trust.degraded
