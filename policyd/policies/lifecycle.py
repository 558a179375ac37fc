"""PBKV's lifecycle: the blocks of finished workflows go first.

A block is *retired* when every workflow that used it has finished (``EngineState.is_retired``).
Retired blocks are published at ``RETIRED_SCORE``, below every live score, so a tier evicts
them before anything a live workflow may read again - unless a live ranking scores them (an
agent's shared prefix, its system prompt, before the next workflow calls the agent).
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterator, Sequence
from itertools import filterfalse

from policyd.core.state import EngineState
from policyd.core.types import (
    BlocksRemoved,
    Event,
    RequestStarted,
    ScoredBlocks,
    WorkflowFinished,
)

RETIRED_SCORE = -1.0
DETACH_AFTER = 4096  # a mark's log may grow to the retired set's size, or to this, then detaches


class RetiredMark:
    """Which blocks were retired at one moment (``Lifecycle.mark``), answered for as long as it
    is held: ``retired(block)``.

    ``then`` is the lifecycle's set at the mark: changed in place since, the lifecycle logs in
    ``was`` (for every mark still held) the blocks whose retirement changed, with what it was
    at the mark; replaced whole since, the set the mark holds is changed no more. Either way a
    block logged answers from ``was``, any other from ``then``. A mark held long (a tier that
    keeps an old view) is detached once its log outgrows the set: ``then`` becomes a copy of
    what it stands for and the log stops, so its memory stays within about twice the set's."""

    __slots__ = ("__weakref__", "then", "was")

    def __init__(self, then: set[int]) -> None:
        self.then = then
        self.was: dict[int, bool] = {}  # block changed since -> retired at the mark

    def log(self, blocks: Collection[int]) -> None:
        """``blocks`` are about to change in the lifecycle's set: remember, for those not logged
        yet, whether they were retired at the mark."""
        was = self.was
        new = [*filterfalse(was.__contains__, blocks)]  # (in C, and in the blocks' number)
        was.update(zip(new, map(self.then.__contains__, new), strict=True))

    def detach(self) -> None:
        """Hold a copy of the set the mark stands for, and need no log from now on."""
        self.then, self.was = set(self.blocks()), {}

    def retired(self, block: int) -> bool:
        was = self.was.get(block)
        return block in self.then if was is None else was

    def any_retired(self) -> bool:
        """Whether any block was retired at the mark; stops at the first found (a walk only
        when none was, and then over the blocks logged since)."""
        was = self.was
        for block in self.then:
            if was.get(block, True):
                return True
        return any(was.values())

    def blocks(self) -> Iterator[int]:
        """Every block retired at the mark (a walk over the retired set)."""
        return (b for b in self.then | self.was.keys() if self.retired(b))


class Lifecycle:
    """The retired blocks still resident somewhere, kept from the event stream.

    ``retired`` may be replaced whole (the daemon rebuilds it from the engine state when it swaps
    policies); it is changed here only, never in place by a reader. A block leaves it when a new
    request references it, or once neither tier holds it.

    A snapshot's scores ask which blocks were retired when it was taken for as long as a tier
    holds it, without a copy of the set per snapshot (it can hold every block the tiers keep):
    ``mark`` returns a ``RetiredMark``, and while it is held the blocks whose retirement
    changes are logged in it with what it was."""

    def __init__(self) -> None:
        self._retired: set[int] = set()
        self._marks: weakref.WeakSet[RetiredMark] = weakref.WeakSet()

    @property
    def retired(self) -> set[int]:
        """The retired blocks now (read only: change it by replacing it whole)."""
        return self._retired

    @retired.setter
    def retired(self, blocks: set[int]) -> None:
        self._retired = blocks  # the marks keep the set they were taken on, changed no more

    def observe(self, event: Event, state: EngineState) -> None:
        kind = type(event)
        retired = self._retired
        if kind is RequestStarted:
            assert isinstance(event, RequestStarted)
            self._remove(retired.intersection(event.block_hashes))
        elif kind is WorkflowFinished:
            assert isinstance(event, WorkflowFinished)
            wf = state.workflows.get(event.workflow_id)
            if wf is not None:
                # in the workflow's order, as the set has always been filled
                added = [b for b in wf.blocks if b not in retired and state.is_retired(b)]
                self._log(added)
                retired.update(added)
        elif kind is BlocksRemoved:
            assert isinstance(event, BlocksRemoved)
            if not retired:
                return
            resident = state.resident
            gpu, host = resident["gpu"], resident["host"]
            self._remove(
                [b for b in event.block_hashes if b in retired and b not in gpu and b not in host]
            )

    def _remove(self, blocks: Collection[int]) -> None:
        self._log(blocks)
        self._retired.difference_update(blocks)

    def _log(self, blocks: Collection[int]) -> None:
        """``blocks`` are about to change: each mark held logs whether they were retired then."""
        if blocks:
            retired = self._retired
            for mark in self._marks:
                if mark.then is retired:  # (a mark of a set replaced since needs no log)
                    mark.log(blocks)
                    if len(mark.was) > max(DETACH_AFTER, len(retired)):
                        mark.detach()

    def mark(self) -> RetiredMark:
        """The retired blocks as they are now, answered for as long as the mark is held."""
        mark = RetiredMark(self._retired)
        self._marks.add(mark)
        return mark

    def group(self, live: Sequence[ScoredBlocks]) -> ScoredBlocks | None:
        """The retired blocks that no ``live`` group scores, at ``RETIRED_SCORE`` (None: none).
        A retired block a live group scores keeps that score: retiring it would evict first
        what the ranking says is reused next."""
        if not self._retired:
            return None
        dead = self._retired.difference(*[g.block_hashes for g in live])
        return ScoredBlocks(RETIRED_SCORE, tuple(dead)) if dead else None

    def with_retired(self, scores: dict[int, float]) -> dict[int, float]:
        """``scores`` (changed in place and returned) plus every retired block it does not
        name, at ``RETIRED_SCORE``."""
        scores.update(dict.fromkeys(self._retired.difference(scores), RETIRED_SCORE))
        return scores
