"""``pbkv``: prediction-based KV-cache management (PBKV, arXiv 2605.06472).

* Lifecycle: blocks every owning workflow of which has finished are *retired* and evicted first
  - unless an active workflow's lookahead scores them (an agent's shared prefix before the next
  workflow calls the agent keeps its value).
* Lookahead score: value(block) = sum over active workflows w and steps k = 1..K of
  discount^(k-1) * P_w(step k calls an agent whose prompt contains the block) (the predictor's
  joint probability already includes that w is still running at step k). An agent's next prompt
  in w starts with its latest prompt in w; a shared prefix (the agent's system prompt) collects
  value from every workflow that may call the agent, including workflows that have not called
  it yet. Lowest value is evicted (or demoted) first; ties fall back to recency.
* Conservative prefetch: host-resident blocks of the agents most likely to run next, into free
  GPU space only (the cache model never evicts for a prefetch), within the caller's budget.
* Graceful degradation: while the predictor's rolling step-1 accuracy is below
  ``min_accuracy`` no scores are published, so eviction is plain recency plus lifecycle - never
  worse than LRU by more than what retiring finished workflows costs (nothing, unless a workflow
  id is reused).

Scores travel as groups (``ScoredBlocks``): per agent, its shared prefix; per (workflow, agent),
the private rest of its prompt - the structure of agent prompts makes these disjoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from policyd.core.policy import Ordering, ScoredPolicy
from policyd.core.state import EngineState
from policyd.core.types import (
    BlocksRemoved,
    Event,
    PolicySnapshot,
    RequestStarted,
    ScoredBlocks,
    WorkflowFinished,
    score_map,
)
from policyd.models.predictor import END, MIN_BRANCH, Forecast, Predictor

RETIRED_SCORE = -1.0


class PBKV(ScoredPolicy):
    name: ClassVar[str] = "pbkv"
    ordering: ClassVar[Ordering] = "snapshot"
    description: ClassVar[str] = "PBKV: lifecycle + lookahead reuse score, conservative prefetch"

    def __init__(
        self,
        *,
        k: int = 3,
        discount: float = 0.8,
        min_accuracy: float = 0.3,
        min_observations: int = 20,
        prefetch_min_probability: float = 0.5,
        noise: float = 0.0,
        seed: int = 0,
        predictor: Predictor | None = None,
        min_branch: float = MIN_BRANCH,
    ) -> None:
        if not 0.0 < discount <= 1.0:
            raise ValueError(f"discount must be in (0, 1], got {discount}")
        self.k = k
        self.discount = discount
        self.min_accuracy = min_accuracy
        self.min_observations = min_observations
        self.prefetch_min_probability = prefetch_min_probability
        self.predictor = predictor or Predictor(k=k, noise=noise, seed=seed, min_branch=min_branch)
        self.retired: set[int] = set()
        self.calls_seen = 0
        self.degraded = False

    # -- learning ------------------------------------------------------------------------------

    def observe(self, event: Event, state: EngineState) -> None:
        kind = type(event)
        if kind is RequestStarted:
            assert isinstance(event, RequestStarted)
            self.calls_seen += 1
            self.retired.difference_update(event.block_hashes)
            self.predictor.observe_call(
                event.workflow_id, event.workflow_type, event.agent, event.hints, event.ts
            )
        elif kind is WorkflowFinished:
            assert isinstance(event, WorkflowFinished)
            self.predictor.observe_finished(event.workflow_id)
            wf = state.workflows.get(event.workflow_id)
            if wf is not None:
                self.retired.update(b for b in wf.blocks if state.is_retired(b))
        elif kind is BlocksRemoved:
            assert isinstance(event, BlocksRemoved)
            if not self.retired:
                return
            resident = state.resident
            self.retired.difference_update(
                b
                for b in event.block_hashes
                if b not in resident["gpu"] and b not in resident["host"]
            )

    # -- scoring -------------------------------------------------------------------------------

    def _forecast(self, workflow_id: str) -> Forecast | None:
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

    def score_groups(self, state: EngineState) -> list[ScoredBlocks]:
        """Disjoint block groups with their lookahead value (retired blocks excluded)."""
        shared: dict[str, float] = {}
        groups: list[ScoredBlocks] = []
        prefixes = state.agent_prefix
        for wf in state.active_workflows():
            forecast = self._forecast(wf.workflow_id)
            if forecast is None:
                continue
            for agent, mass in self.agent_mass(forecast).items():
                shared[agent] = shared.get(agent, 0.0) + mass
                blocks = wf.agent_blocks.get(agent)
                if blocks is not None:
                    tail = blocks[len(prefixes.get(agent, ())) :]
                    if tail:
                        groups.append(ScoredBlocks(mass, tail))
        for agent, mass in shared.items():
            prefix = prefixes.get(agent)
            if prefix:
                groups.append(ScoredBlocks(mass, prefix))
        return groups

    def accuracy(self) -> float:
        """The predictor's rolling top-1 accuracy at step 1."""
        return self.predictor.tracker.accuracy(1, rolling=True)

    def snapshot(
        self, state: EngineState, *, now: float, version: int, ttl_s: float
    ) -> PolicySnapshot:
        self.degraded = (
            self.calls_seen < self.min_observations or self.accuracy() < self.min_accuracy
        )
        groups = self.degraded_groups(state) if self.degraded else self.score_groups(state)
        retired = self.retired_group(groups)
        if retired is not None:  # a new list: a subclass may keep the one it returned
            groups = [*groups, retired]
        retired_workflows = tuple(w.workflow_id for w in state.workflows.values() if w.done)
        return PolicySnapshot(
            version=version,
            ts=now,
            ttl_s=ttl_s,
            policy=self.name,
            scores=tuple(groups),
            default_score=0.0,
            retired_workflows=retired_workflows,
        )

    def degraded_groups(self, state: EngineState) -> list[ScoredBlocks]:
        """What the snapshot ranks by while the predictor is degraded: nothing here, so
        only the lifecycle is published (the connector falls back to recency)."""
        del state
        return []

    def retired_group(self, live: Sequence[ScoredBlocks]) -> ScoredBlocks | None:
        """The retired blocks that no ``live`` group scores, at ``RETIRED_SCORE`` (None: none).
        A block every owner of which finished but that an active workflow is expected to use
        - an agent's shared prefix (its system prompt) before the next workflow calls the
        agent - keeps its live score: retiring it would evict first what the lookahead says is
        reused next."""
        if not self.retired:
            return None
        dead = self.retired.difference(*[g.block_hashes for g in live])
        return ScoredBlocks(RETIRED_SCORE, tuple(dead)) if dead else None

    def block_scores(self, state: EngineState) -> dict[int, float]:
        scores = score_map(self.score_groups(state))
        scores.update(dict.fromkeys(self.retired.difference(scores), RETIRED_SCORE))
        return scores

    # -- synchronous decisions -----------------------------------------------------------------

    def prefetch(self, budget_blocks: int, state: EngineState) -> list[int]:
        """Host blocks of the agents likely to be called next by idle workflows, most likely
        first; only blocks not on the GPU."""
        if budget_blocks <= 0 or self.degraded:
            return []
        host, gpu = state.resident["host"], state.resident["gpu"]
        wanted: list[tuple[float, tuple[int, ...]]] = []
        for wf in state.active_workflows():
            if wf.running:
                continue
            forecast = self._forecast(wf.workflow_id)
            if forecast is None:
                continue
            for agent, given_alive in forecast.agents[0].items():
                p = given_alive * forecast.alive[0]
                blocks = wf.agent_blocks.get(agent)
                if p >= self.prefetch_min_probability and blocks:
                    wanted.append((p, blocks))
        out: list[int] = []
        for _, blocks in sorted(wanted, key=lambda item: -item[0]):
            for b in blocks:
                if b in host and b not in gpu:
                    out.append(b)
                    if len(out) >= budget_blocks:
                        return out
        return out
