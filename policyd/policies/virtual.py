"""Which of several block rankings keeps what is reused: one virtual GPU tier per ranking.

Every ranking runs a virtual copy of the GPU tier, with the real tier's capacity. The same
requests reference the same blocks in every copy; each copy evicts by its own ranking (lowest
score first, least recently used first among equal scores, the real tier's order) and takes
that ranking's scores at every snapshot, as the real tier takes the published ones. A request's
prompt hits the leading run of its blocks that a copy holds (prefix caching); a running
request's blocks, its prompt and the blocks it computes, are pinned until it finishes. The
referee prefers the ranking whose copy hit the most prompt blocks over the last ``window``
requests.

Why not where a reused prompt ranked (``referee.RankingReferee``): that mark is a proxy. Whether
a prompt survives depends on the tier's size, on what else is pinned, on the blocks that share
it, and on the order among equal scores, which decides most evictions under a step ranking
(many prompts one step away). A virtual tier counts the hits themselves, with all of these as
the tier has them. The idea is ACME's: virtual caches, one per candidate policy, and the real
cache follows the best of them (Ari et al., "ACME: adaptive caching using multiple experts",
WDAS 2002).

>>> referee = VirtualReferee(("steps", "lookahead"), capacity_blocks=5, min_samples=1)
>>> for request, prompt in (("r0", (1, 2, 3)), ("r1", (7, 8))):
...     referee.started(request, prompt)
...     referee.finished(request)
>>> referee.rescore("steps", {7: 1.0, 8: 1.0})  # steps values r1's prompt, lookahead r0's
>>> referee.rescore("lookahead", {1: 1.0, 2: 1.0, 3: 1.0})
>>> referee.started("r2", (5, 6))  # two blocks must go: each tier drops its lowest
>>> referee.finished("r2")
>>> referee.started("r3", (1, 2, 3, 4))  # r0's prompt, extended
>>> {name: round(rate, 3) for name, rate in referee.hit_rates().items()}, referee.best()
({'steps': 0.091, 'lookahead': 0.273}, 'lookahead')

(``steps`` still hits block 1: r0's blocks were freed tail first, so 3 and 2 went before it.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from policyd.core.queues import KeyedQueue
from policyd.core.types import BLOCK_SIZE_TOKENS
from policyd.policies.referee import preferred


class VirtualTier:
    """One ranking's copy of the GPU tier: pinned blocks (referenced by running requests) and
    an eviction queue of the rest, by score and then recency."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.scores: Mapping[int, float] = {}
        self.queue = KeyedQueue(self._keys)
        self.pinned: dict[int, int] = {}  # block -> running requests referencing it
        self.reserved_blocks = 0  # running requests' space for the outputs they decode

    def _keys(self, blocks: Sequence[int]) -> list[float]:
        get = self.scores.get
        return [get(b, 0.0) for b in blocks]

    def __len__(self) -> int:
        return len(self.queue) + len(self.pinned) + self.reserved_blocks

    def __contains__(self, block: object) -> bool:
        return block in self.queue or block in self.pinned

    def reference(self, blocks: Sequence[int], reserve_blocks: int = 0) -> int:
        """A request starts: the leading run of ``blocks`` held (its hits); all are pinned,
        and ``reserve_blocks`` more are set aside for its output."""
        hits = 0
        for b in blocks:
            if b not in self:
                break
            hits += 1
        self.reserved_blocks += reserve_blocks
        self.pin(blocks)
        return hits

    def pin(self, blocks: Iterable[int]) -> None:
        queue, pinned = self.queue, self.pinned
        for b in blocks:
            if b in queue:
                queue.discard(b)
            pinned[b] = pinned.get(b, 0) + 1
        self._fit()

    def release(self, blocks: Sequence[int], reserved_blocks: int = 0) -> None:
        """A request finished: its blocks no other running request references are cached,
        most recently used, freed tail first as vLLM frees them (among equal scores a
        prompt's deepest block goes before its parents)."""
        pinned = self.pinned
        self.reserved_blocks -= reserved_blocks
        freed: list[int] = []
        for b in reversed(blocks):
            count = pinned.get(b)
            if count is None:
                continue
            if count > 1:
                pinned[b] = count - 1
            else:
                del pinned[b]
                freed.append(b)
        self.queue.push_many(freed)
        self._fit()

    def rescore(self, scores: Mapping[int, float]) -> None:
        """The ranking's scores at a new snapshot; the queue is reordered (ties keep their
        recency order)."""
        self.scores = scores
        self.queue.rekey()

    def resize(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._fit()

    def _fit(self) -> None:
        over = len(self) - self.capacity_blocks
        if over > 0:  # pinned blocks cannot go: the tier may overflow while they run
            self.queue.pop_many(over)


class VirtualReferee:
    """Hits of one virtual tier per ranking over the last ``window`` requests."""

    def __init__(
        self,
        names: Sequence[str],
        *,
        capacity_blocks: int,
        window: int = 256,
        min_samples: int = 32,
        max_running: int = 65_536,
    ) -> None:
        if not names:
            raise ValueError("at least one ranking is needed")
        if capacity_blocks < 1 or window < 1 or min_samples < 0 or max_running < 1:
            raise ValueError(
                "capacity_blocks, window and max_running must be >= 1 and min_samples >= 0, got "
                f"{capacity_blocks}, {window}, {max_running}, {min_samples}"
            )
        self.names = tuple(names)
        self.min_samples = min_samples
        self.max_running = max_running
        self.tiers = {name: VirtualTier(capacity_blocks) for name in self.names}
        # running request -> its blocks (prompt, then what it computed), pinned in every tier,
        # and the space set aside for its output
        self._running: dict[str, tuple[list[int], int]] = {}
        self.output_blocks = 0.0  # a request's output, in blocks: a moving average
        self._samples: deque[tuple[int, tuple[int, ...]]] = deque(maxlen=window)

    def resize(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        for tier in self.tiers.values():
            tier.resize(capacity_blocks)

    def started(self, request_id: str, blocks: Sequence[int]) -> None:
        """A request was admitted with prompt ``blocks``: each tier's hits are recorded."""
        if request_id in self._running:  # said twice: the first one's blocks stay pinned once
            return
        if len(self._running) >= self.max_running:  # a finish never said: the oldest goes
            self._release(next(iter(self._running)))
        reserve = round(self.output_blocks)
        self._running[request_id] = (list(blocks), reserve)
        hits = tuple(tier.reference(blocks, reserve) for tier in self.tiers.values())
        if blocks:
            self._samples.append((len(blocks), hits))

    def stored(self, request_id: str, blocks: Sequence[int]) -> None:
        """A running request computed ``blocks`` beyond its prompt (its output)."""
        running = self._running.get(request_id)
        if running is None:
            return
        held = running[0]
        have = set(held)
        new = [b for b in dict.fromkeys(blocks) if b not in have]
        if new:
            held.extend(new)
            for tier in self.tiers.values():
                tier.pin(new)

    def finished(self, request_id: str, output_tokens: int = 0) -> None:
        """A request ended, having decoded ``output_tokens``: its blocks are unpinned."""
        self.output_blocks += 0.05 * (output_tokens / BLOCK_SIZE_TOKENS - self.output_blocks)
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        running = self._running.pop(request_id, None)
        if running is not None:
            for tier in self.tiers.values():
                tier.release(*running)

    def rescore(self, name: str, scores: Mapping[int, float]) -> None:
        self.tiers[name].rescore(scores)

    def hit_rates(self) -> dict[str, float]:
        """Per ranking, the share of the window's prompt blocks its tier hit."""
        total = sum(n for n, _ in self._samples)
        if total <= 0:
            return {}
        return {
            name: sum(hits[i] for _, hits in self._samples) / total
            for i, name in enumerate(self.names)
        }

    def best(self) -> str:
        """The ranking with the most hits; the first one until ``min_samples`` requests (and
        on a tie)."""
        return preferred(self.names, self.hit_rates(), len(self._samples) >= self.min_samples)
