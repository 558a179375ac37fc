"""The policy contract: one object, three decision families (eviction, admission, prefetch).

A policy reads ``EngineState`` and returns decisions as data; it never applies them. It learns
what actually happened from the events that follow (``observe``).

``ordering`` tells a cache model how to order its eviction queue without a call per eviction:

* ``recency`` - plain LRU in vLLM's order (free-queue order; no snapshot needed),
* ``snapshot`` - by the scores of the newest applied ``PolicySnapshot``, ties by recency,
* ``oracle`` - by ``oracle_key``: an offline policy that sees the future (simulator only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Literal

from policyd.core.state import EngineState
from policyd.core.types import Admit, Event, PolicySnapshot, Tier

Ordering = Literal["recency", "snapshot", "oracle"]


class Policy:
    """Base policy: vLLM's behaviour (evict least recently used, store everything, no prefetch)."""

    name: ClassVar[str] = "base"
    ordering: ClassVar[Ordering] = "recency"
    description: ClassVar[str] = ""

    def observe(self, event: Event, state: EngineState) -> None:
        """Learn from a fact. The default learns nothing."""

    def snapshot(
        self, state: EngineState, *, now: float, version: int, ttl_s: float
    ) -> PolicySnapshot:
        """The decisions connectors apply asynchronously. Empty: plain LRU, store everything."""
        return PolicySnapshot(version=version, ts=now, ttl_s=ttl_s, policy=self.name)

    def victims(
        self, tier: Tier, candidates: Sequence[int], n_blocks: int, state: EngineState
    ) -> list[int]:
        """The ``n_blocks`` candidates to evict first: least recently referenced, deepest first
        among blocks referenced together. Never-seen blocks go before seen ones."""
        recency = state.recency
        return sorted(candidates, key=lambda b: recency.get(b, -1))[:n_blocks]

    def admit(self, request_id: str, block_hashes: Sequence[int], state: EngineState) -> Admit:
        """Host-tier admission for a request's new blocks. Default: store everything."""
        return Admit(request_id=request_id, block_hashes=tuple(block_hashes), reason="store all")

    def prefetch(self, budget_blocks: int, state: EngineState) -> list[int]:
        """Host blocks worth loading into free GPU space. Default: none."""
        return []

    def oracle_keys(self, tier: Tier, blocks: Sequence[int]) -> list[tuple[int, int]]:
        """For ``ordering == "oracle"``: the block with the *smallest* key is evicted first."""
        raise NotImplementedError(f"{self.name} is not an oracle policy")

    def oracle_admits(self, tier: Tier, block: int, victim: int) -> bool:
        """For ``ordering == "oracle"``: cache ``block`` by evicting ``victim``?"""
        raise NotImplementedError(f"{self.name} is not an oracle policy")


class ScoredPolicy(Policy):
    """A policy that ranks blocks by a score (lower = evict first) published in its snapshots;
    the synchronous path ranks the same way, ties by recency."""

    ordering: ClassVar[Ordering] = "snapshot"

    def block_scores(self, state: EngineState) -> dict[int, float]:
        """Every scored block's score; unscored blocks count as 0."""
        raise NotImplementedError

    def victims(
        self, tier: Tier, candidates: Sequence[int], n_blocks: int, state: EngineState
    ) -> list[int]:
        scores = self.block_scores(state)
        recency = state.recency
        return sorted(candidates, key=lambda b: (scores.get(b, 0.0), recency.get(b, -1)))[:n_blocks]
