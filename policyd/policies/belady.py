"""``belady``: the offline oracle (Belady's MIN with bypass), the physical limit for hit rate.

It is given the order in which calls reach the cache and every call's blocks, so it knows each
block's next use. Eviction takes the block used farthest in the future (never-reused first); ties
take the deeper block, so a prefix's parents outlive its tail. A block is cached only if its next
use comes before that of the block it would displace - never-reused blocks are not stored.

In a closed loop the order of calls depends on the policy itself; the simulator gives the oracle
the order observed in a previous replay (see ``policyd.sim.replay.simulate``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from policyd.core.policy import Ordering, Policy
from policyd.core.state import EngineState
from policyd.core.types import Event, RequestStarted, Tier


class FutureIndex:
    """Next use of every block reference in a fixed order of calls.

    ``order`` lists ``(request_id, blocks)`` as the cache will see them; a call's blocks are its
    prompt blocks followed by the blocks its output completes.
    """

    def __init__(self, order: Sequence[tuple[str, Sequence[int]]]) -> None:
        self.never = len(order) + 1
        self.position: dict[str, int] = {}
        self.blocks: list[Sequence[int]] = []
        for pos, (request_id, blocks) in enumerate(order):
            self.position[request_id] = pos
            self.blocks.append(blocks)
        self.next_use: list[list[int]] = [[] for _ in order]
        last: dict[int, int] = {}
        never = self.never
        for pos in range(len(order) - 1, -1, -1):
            blocks = self.blocks[pos]
            self.next_use[pos] = [last.get(b, never) for b in blocks]
            last.update(dict.fromkeys(blocks, pos))
        self.depth: dict[int, int] = {}
        for blocks in self.blocks:
            self.depth.update(zip(blocks, range(len(blocks)), strict=True))


class Belady(Policy):
    name: ClassVar[str] = "belady"
    ordering: ClassVar[Ordering] = "oracle"
    description: ClassVar[str] = "offline oracle: farthest next use, no store of unused blocks"

    def __init__(self, future: FutureIndex) -> None:
        self.future = future
        self.next_use: dict[int, int] = {}

    def observe(self, event: Event, state: EngineState) -> None:
        if type(event) is RequestStarted:
            pos = self.future.position.get(event.request_id)
            if pos is not None:
                self.next_use.update(
                    zip(self.future.blocks[pos], self.future.next_use[pos], strict=True)
                )

    def _next(self, block: int) -> int:
        return self.next_use.get(block, self.future.never)

    def oracle_keys(self, tier: Tier, blocks: Sequence[int]) -> list[tuple[int, int]]:
        next_use, never, depth = self.next_use.get, self.future.never, self.future.depth.get
        return [(-next_use(b, never), -depth(b, 0)) for b in blocks]

    def oracle_admits(self, tier: Tier, block: int, victim: int) -> bool:
        return self._next(victim) > self._next(block)

    def victims(
        self, tier: Tier, candidates: Sequence[int], n_blocks: int, state: EngineState
    ) -> list[int]:
        keys = self.oracle_keys(tier, candidates)
        ranked = sorted(range(len(candidates)), key=keys.__getitem__)
        return [candidates[i] for i in ranked[:n_blocks]]
