"""``agentkv``: ours - learned rankings judged online order the GPU tier, their sum orders the
host tier, and a host-tier admission generalises EfficientAgent's write filter.

``AgentKV`` wires parts that each do one job:

* rankings of the live prompts: ``Lookahead`` (PBKV's, from the predictor, ``lookahead``) and
  ``StepsRanking`` (KVFlow's ``1 / steps`` on a step graph learned online, ``steps``), whose
  ties are broken by the lookahead when there is no host tier; each call's output blocks score
  as its prompt (``CallOutputs``);
* ``GpuRanking``: a referee chooses which of steps, lookahead and their sum orders the GPU;
* ``HostOrder``: the host tier's own order (the sum, the pace in flat types, resident copies
  raised while the tier thrashes);
* ``HostAdmission``: the per-request admission and the snapshot's write filter;
* ``Lifecycle``: retired blocks lowest in both orders; ``PredictorTrust``: while the predictor
  is degraded only ``steps`` is published; ``NextCallPrefetch``: PBKV's prefetch;
* ``RecencyGuard`` (``guard``): vLLM's default while the learned decisions lose to it, or the
  write filter alone on vLLM's order (the ``filter`` arm, ``guard_filter``) while that wins.

Between snapshots, the blocks a call stores take its prompt's score on the GPU
(``PolicySnapshot.inherit_scores``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import msgspec

from policyd.core.policy import Ordering, ScoredPolicy
from policyd.core.state import EngineState
from policyd.core.types import (
    Admit,
    Event,
    PolicySnapshot,
    RequestStarted,
    ScoredBlocks,
    score_map,
)
from policyd.models.mrc import Sizing
from policyd.models.predictor import MIN_BRANCH, Predictor
from policyd.policies.admission import HostAdmission
from policyd.policies.efficientagent import WorkingSet
from policyd.policies.gpu_ranking import GpuRanking
from policyd.policies.guard import FILTER, LEARNED, MAX_SHADOW_BLOCKS, RECENCY, RecencyGuard
from policyd.policies.host_order import HostOrder
from policyd.policies.lifecycle import Lifecycle
from policyd.policies.lookahead import (
    Lookahead,
    NextCallPrefetch,
    PredictorSurface,
    PredictorTrust,
)
from policyd.policies.outputs import CallOutputs
from policyd.policies.pacing import WorkflowPacing
from policyd.policies.rankings import Ranked, Values, disjoint, summed, to_groups
from policyd.policies.referee import RankingReferee
from policyd.policies.steps import StepsRanking


class AgentKV(PredictorSurface, ScoredPolicy):
    """The parts, wired to the policy contract.

    Parameters: the lookahead's and prefetch's as ``pbkv`` takes them (``k``, ``discount``,
    ``min_accuracy``, ``min_observations``, ``prefetch_min_probability``, ``noise``, ``seed``,
    ``predictor``, ``min_branch``); the write filter's and working set's as ``efficientagent``
    takes them (``kappa_chunks``, ``chunk_tokens``, ``theta``, ``window_s``, ``coverage``,
    ``shards_rate``); the tiers' sizes; ``guard`` (False: the learned decisions always);
    ``guard_filter`` (False: the guard chooses between vLLM's default and the learned
    decisions only); ``guard_shadow_blocks``: the most blocks each guard shadow follows (its
    sample rate is this over the tiers' blocks); ``guard_arm``: publish this arm throughout
    (``recency``, ``filter`` or ``learned``; empty: the guard chooses).

    Public surface: ``predictor``, ``retired`` and ``calls_seen`` (assignable), ``degraded``,
    ``ranking`` (the GPU's, by name), ``referee``, ``decisions``, ``guard``, ``working_set``,
    ``configure_tiers`` and ``sizing``."""

    name: ClassVar[str] = "agentkv"
    ordering: ClassVar[Ordering] = "snapshot"
    description: ClassVar[str] = (
        "ours: referee-chosen ranking on GPU, summed rankings on host + reuse-before-eviction "
        "host write filter"
    )

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
        kappa_chunks: int = 8,
        chunk_tokens: int = 1024,
        theta: float = 0.95,
        window_s: float = 60.0,
        coverage: float = 0.9,
        shards_rate: float = 0.1,
        host_blocks: int = 0,
        gpu_blocks: int = 0,
        guard: bool = True,
        guard_filter: bool = True,
        guard_shadow_blocks: int = MAX_SHADOW_BLOCKS,
        guard_arm: str = "",
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
        self.prefetcher = NextCallPrefetch(self.lookahead, min_probability=prefetch_min_probability)
        self.lifecycle = Lifecycle()
        self.steps = StepsRanking()
        self.outputs = CallOutputs()
        self.gpu_ranking = GpuRanking()
        self.working_set = WorkingSet(
            window_s=window_s, coverage=coverage, shards_rate=shards_rate, seed=seed
        )
        self.pacing = WorkflowPacing(window_s=window_s)
        self.host_order = HostOrder(self.steps, self.lookahead, self.pacing)
        self.admission = HostAdmission(
            host_order=self.host_order,
            pacing=self.pacing,
            working_set=self.working_set,
            kappa_chunks=kappa_chunks,
            chunk_tokens=chunk_tokens,
            theta=theta,
        )
        arms = (FILTER, LEARNED) if guard_filter else (LEARNED,)
        self.guard = (
            RecencyGuard(arms=arms, max_shadow_blocks=guard_shadow_blocks, pinned=guard_arm or None)
            if guard
            else None
        )
        self.configure_tiers(gpu_blocks=gpu_blocks, host_blocks=host_blocks)

    # -- the public surface ----------------------------------------------------------------------

    @property
    def ranking(self) -> str:
        return self.gpu_ranking.ranking

    @property
    def referee(self) -> RankingReferee:
        return self.gpu_ranking.referee

    @property
    def decisions(self) -> dict[str, int]:
        return self.admission.decisions

    def configure_tiers(self, *, gpu_blocks: int, host_blocks: int) -> None:
        self.working_set.configure(gpu_blocks=gpu_blocks, host_blocks=host_blocks)
        if self.guard is not None:
            self.guard.configure(gpu_blocks=gpu_blocks, host_blocks=host_blocks)

    def sizing(self) -> Sizing:
        return self.working_set.sizing()

    @property
    def _published(self) -> str:
        """What is published: the learned decisions, the write filter alone, or vLLM's
        default (no ranking, retiring, declining or prefetching)."""
        return LEARNED if self.guard is None else self.guard.published

    # -- the policy contract ---------------------------------------------------------------------

    def observe(self, event: Event, state: EngineState) -> None:
        self.trust.observe(event)
        self.lifecycle.observe(event, state)
        self.lookahead.observe(event)
        self.working_set.observe(event)
        if self.guard is not None:
            self.guard.observe(event)
        self.pacing.observe(event)
        self.steps.observe(event)
        self.outputs.observe(event, state)
        if type(event) is RequestStarted:
            assert isinstance(event, RequestStarted)
            self.gpu_ranking.referenced((event.workflow_id, event.agent))

    def snapshot(
        self, state: EngineState, *, now: float, version: int, ttl_s: float
    ) -> PolicySnapshot:
        """The GPU ranking as ``scores``, the host order as ``host_scores``, retired blocks
        lowest in both, each block said once, and the write filter. Computed all the same
        while the guard publishes another arm (the referee and the forecasts keep learning
        from it, the guard's learned shadow applies it); then the write filter alone (the
        filter arm) or an empty snapshot (vLLM's default) is published.

        The guard's shadows read the two orders from their maps, so the snapshot they adopt
        carries the rest only: the orders' groups, whose retired part can name every block a
        tier keeps, are built when the learned decisions are published."""
        gpu_groups, host_groups = self._ranked(state, degraded=self.trust.judge())
        retired = self.lifecycle.mark()
        gpu = disjoint(gpu_groups, retired)
        pressure = self.admission.pressure(state, now)
        same = gpu if host_groups is gpu_groups else None  # (one ranking orders both tiers)
        host = self.host_order.publish(
            host_groups, state, retired=retired, pressure=pressure, ranked=same
        )
        decisions = PolicySnapshot(
            version=version,
            ts=now,
            ttl_s=ttl_s,
            policy=self.name,
            default_score=0.0,
            retired_workflows=tuple(w.workflow_id for w in state.workflows.values() if w.done),
            write_filter=self.admission.write_filter(pressure),
            inherit_scores=True,
        )
        if self.guard is None:
            return _with_orders(decisions, gpu, host, self.lifecycle)
        self.guard.adopt(decisions, gpu.scores, host.scores)  # followed, always
        filtered = PolicySnapshot(
            version=version,
            ts=now,
            ttl_s=ttl_s,
            policy=self.name,
            write_filter=decisions.write_filter,
        )
        if FILTER in self.guard.arms:
            self.guard.adopt(filtered, {}, None, arm=FILTER)
        published = self.guard.published
        if published == RECENCY:
            return PolicySnapshot(version=version, ts=now, ttl_s=ttl_s, policy=self.name)
        return (
            filtered if published == FILTER else _with_orders(decisions, gpu, host, self.lifecycle)
        )

    def block_scores(self, state: EngineState) -> dict[int, float]:
        """The synchronous path's order: the ranking the referee prefers now (not published
        to it: a query teaches the referee nothing), retired blocks lowest."""
        rankings, _ = self._rankings(state)
        values = rankings[self.gpu_ranking.referee.best()]
        return self.lifecycle.with_retired(score_map(self._groups(values, state)))

    def admit(self, request_id: str, block_hashes: Sequence[int], state: EngineState) -> Admit:
        """``HostAdmission.admit`` while the learned decisions are published; the write filter
        alone in the filter arm; everything while the guard holds vLLM's default."""
        published = self._published
        if published == LEARNED:
            return self.admission.admit(
                request_id, block_hashes, state, degraded=self.trust.degraded
            )
        if published == FILTER:
            return self.admission.admit_by_filter(request_id, block_hashes, state)
        blocks = tuple(block_hashes)
        return Admit(request_id=request_id, block_hashes=blocks, reason="guard: vLLM's default")

    def prefetch(self, budget_blocks: int, state: EngineState) -> list[int]:
        """PBKV's conservative prefetch, with the learned decisions only; none while the
        predictor is degraded."""
        if self._published != LEARNED or self.trust.degraded:
            return []
        return self.prefetcher.blocks(budget_blocks, state)

    # -- wiring the rankings ---------------------------------------------------------------------

    def _rankings(self, state: EngineState) -> tuple[dict[str, Values], Values]:
        """The GPU's candidate rankings by name, and the host tier's ranking (the candidate
        ``both`` itself when it is the plain sum)."""
        steps = self.steps.values(state)
        ahead = self.lookahead.values(state)
        both = summed(steps, ahead)
        host_tier = self.working_set.host_blocks > 0
        host = self.host_order.ranking(steps, ahead, both, state, host_tier=host_tier)
        if not host_tier:
            steps = self.steps.tie_broken(steps, ahead, state)
        return {"steps": steps, "lookahead": ahead, "both": both}, host

    def _ranked(
        self, state: EngineState, *, degraded: bool
    ) -> tuple[list[ScoredBlocks], list[ScoredBlocks]]:
        """The GPU's groups (the referee's choice; steps while ``degraded``) and the host's."""
        if degraded:
            steps = self.steps.values(state)
            self.gpu_ranking.choose_degraded(steps, state)
            groups = self._groups(steps, state)
            return groups, groups
        rankings, host = self._rankings(state)
        chosen = rankings[self.gpu_ranking.choose(rankings, state)]
        groups = self._groups(chosen, state)
        return groups, (groups if host is chosen else self._groups(host, state))

    def _groups(self, values: Values, state: EngineState) -> list[ScoredBlocks]:
        return self.outputs.scored(to_groups(values, state), state)


def _with_orders(
    decisions: PolicySnapshot, gpu: Ranked, host: Ranked, lifecycle: Lifecycle
) -> PolicySnapshot:
    """``decisions`` with the GPU's order as ``scores`` and the host's as ``host_scores``
    (one tuple for both when one ranking orders both tiers)."""
    scores = gpu.published(lifecycle)
    host_scores = scores if host is gpu else host.published(lifecycle)
    return msgspec.structs.replace(decisions, scores=scores, host_scores=host_scores)
