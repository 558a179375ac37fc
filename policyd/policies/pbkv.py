"""``pbkv``: prediction-based KV-cache management (PBKV, arXiv 2605.06472), by composition.

* Lifecycle (``lifecycle.Lifecycle``): blocks every owning workflow of which has finished are
  *retired* and evicted first - unless the lookahead scores them.
* Lookahead score (``lookahead.Lookahead``): each live prompt valued by the agent's expected
  discounted calls in the next K steps; lowest value is evicted (or demoted) first, ties by
  recency.
* Conservative prefetch (``lookahead.NextCallPrefetch``): host-resident blocks of the agents
  most likely to run next, into free GPU space only, within the caller's budget.
* Graceful degradation (``lookahead.PredictorTrust``): while the predictor's rolling step-1
  accuracy is below ``min_accuracy`` no scores are published, so eviction is plain recency
  plus lifecycle, and nothing is prefetched.

Scores travel as groups (``ScoredBlocks``): per agent, its shared prefix; per (workflow, agent),
the private rest of its prompt (``rankings.to_groups``).
"""

from __future__ import annotations

from typing import ClassVar

from policyd.core.policy import Ordering, ScoredPolicy
from policyd.core.state import EngineState
from policyd.core.types import Event, PolicySnapshot, ScoredBlocks, score_map
from policyd.models.predictor import MIN_BRANCH, Predictor
from policyd.policies.lifecycle import RETIRED_SCORE, Lifecycle
from policyd.policies.lookahead import (
    Lookahead,
    NextCallPrefetch,
    PredictorSurface,
    PredictorTrust,
)
from policyd.policies.rankings import to_groups

__all__ = ["PBKV", "RETIRED_SCORE"]


class PBKV(PredictorSurface, ScoredPolicy):
    """The lookahead ranking, the lifecycle, the trust gate and the prefetch, wired.

    Public surface the daemon relies on: ``predictor`` (shared when given), ``retired`` and
    ``calls_seen`` (both may be assigned, to carry state over a policy swap), ``degraded``."""

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
        self.lookahead = Lookahead(
            k=k,
            discount=discount,
            noise=noise,
            seed=seed,
            predictor=predictor,
            min_branch=min_branch,
        )
        self.trust = PredictorTrust(
            self.lookahead.predictor, min_accuracy=min_accuracy, min_observations=min_observations
        )
        self.lifecycle = Lifecycle()
        self.prefetcher = NextCallPrefetch(self.lookahead, min_probability=prefetch_min_probability)

    def observe(self, event: Event, state: EngineState) -> None:
        self.trust.observe(event)
        self.lifecycle.observe(event, state)
        self.lookahead.observe(event)

    def score_groups(self, state: EngineState) -> list[ScoredBlocks]:
        """The lookahead's groups (retired blocks left to the lifecycle)."""
        return to_groups(self.lookahead.values(state), state)

    def snapshot(
        self, state: EngineState, *, now: float, version: int, ttl_s: float
    ) -> PolicySnapshot:
        groups = [] if self.trust.judge() else self.score_groups(state)
        retired = self.lifecycle.group(groups)
        if retired is not None:
            groups.append(retired)
        return PolicySnapshot(
            version=version,
            ts=now,
            ttl_s=ttl_s,
            policy=self.name,
            scores=tuple(groups),
            default_score=0.0,
            retired_workflows=tuple(w.workflow_id for w in state.workflows.values() if w.done),
        )

    def block_scores(self, state: EngineState) -> dict[int, float]:
        return self.lifecycle.with_retired(score_map(self.score_groups(state)))

    def prefetch(self, budget_blocks: int, state: EngineState) -> list[int]:
        """The likely next calls' host blocks; none while the predictor is not trusted."""
        if self.trust.degraded:
            return []
        return self.prefetcher.blocks(budget_blocks, state)
