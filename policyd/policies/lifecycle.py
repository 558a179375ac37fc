"""PBKV's lifecycle: the blocks of finished workflows go first.

A block is *retired* when every workflow that used it has finished (``EngineState.is_retired``).
Retired blocks are published at ``RETIRED_SCORE``, below every live score, so a tier evicts
them before anything a live workflow may read again - unless a live ranking scores them (an
agent's shared prefix, its system prompt, before the next workflow calls the agent).
"""

from __future__ import annotations

from collections.abc import Sequence

from policyd.core.state import EngineState
from policyd.core.types import (
    BlocksRemoved,
    Event,
    RequestStarted,
    ScoredBlocks,
    WorkflowFinished,
)

RETIRED_SCORE = -1.0


class Lifecycle:
    """The retired blocks still resident somewhere, kept from the event stream.

    ``retired`` may be replaced whole (the daemon rebuilds it from the engine state when it swaps
    policies). A block leaves it when a new request references it, or once neither tier holds
    it."""

    def __init__(self) -> None:
        self.retired: set[int] = set()

    def observe(self, event: Event, state: EngineState) -> None:
        kind = type(event)
        if kind is RequestStarted:
            assert isinstance(event, RequestStarted)
            self.retired.difference_update(event.block_hashes)
        elif kind is WorkflowFinished:
            assert isinstance(event, WorkflowFinished)
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

    def group(self, live: Sequence[ScoredBlocks]) -> ScoredBlocks | None:
        """The retired blocks that no ``live`` group scores, at ``RETIRED_SCORE`` (None: none).
        A retired block a live group scores keeps that score: retiring it would evict first
        what the ranking says is reused next."""
        if not self.retired:
            return None
        dead = self.retired.difference(*[g.block_hashes for g in live])
        return ScoredBlocks(RETIRED_SCORE, tuple(dead)) if dead else None

    def with_retired(self, scores: dict[int, float]) -> dict[int, float]:
        """``scores`` (changed in place and returned) plus every retired block it does not
        name, at ``RETIRED_SCORE``."""
        scores.update(dict.fromkeys(self.retired.difference(scores), RETIRED_SCORE))
        return scores
