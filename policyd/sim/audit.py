"""Did a write filter decline a block that would have been reused before its eviction?

EfficientAgent's Proposition 1: declining the write of a block whose next reuse distance is at
least the host tier's capacity loses no hit - an LRU tier would evict it before the reuse. The
distance is that of the unfiltered stream, so ``DeclineAudit`` runs the counterfactual tier
alongside the replay: an LRU ``HostTier`` of the same capacity that writes everything offered
(vLLM's default, all or nothing per request) and is touched like the real one. When a later
request references a block a filter declined, the audit classes the reference:

* ``lost_hits`` - the counterfactual tier still holds it: a hit the write-all tier would have had
  (the declined block's next reuse distance was below the capacity: Proposition 1's condition
  did not hold for it);
* ``reused_late`` - the counterfactual tier had evicted it (distance >= capacity: declining it
  lost nothing, as Proposition 1 says).

Declined blocks never referenced again are ``never_reused``. A block counts once, at its first
reference after the decline; a block declined again after that counts again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from policyd.core.queues import LruQueue
from policyd.sim.cache import HostTier


@dataclass(slots=True)
class AuditCounts:
    declined_blocks: int = 0
    lost_hits: int = 0
    reused_late: int = 0
    lost_examples: list[int] = field(default_factory=list)

    @property
    def never_reused(self) -> int:
        return self.declined_blocks - self.lost_hits - self.reused_late


class DeclineAudit:
    """The write-all counterfactual host tier and the declined blocks awaiting a reference."""

    def __init__(
        self, capacity_blocks: int, *, max_examples: int = 20, keep_blocks: bool = False
    ) -> None:
        self.tier = HostTier(capacity_blocks, LruQueue())
        self.max_examples = max_examples
        self.counts = AuditCounts()
        self._requests: dict[str, tuple[Sequence[int], Sequence[int]]] = {}
        self._pending: dict[int, str] = {}  # declined block -> the request that declined it
        self.keep_blocks = keep_blocks  # remember which declines were lost / late (tests)
        self.lost_blocks: set[tuple[str, int]] = set()  # (declining request, block)
        self.late_blocks: set[tuple[str, int]] = set()

    def started(self, request_id: str, blocks: Sequence[int], gpu_hit: int) -> None:
        """A request was admitted with ``gpu_hit`` GPU prefix blocks: its prompt blocks are
        referenced, and the counterfactual tier serves its own host prefix (so what it is
        offered and touches follows the simulator's rule on the counterfactual's contents)."""
        self.referenced(blocks)
        host_hit = self.tier.prefix_hits(blocks, gpu_hit, len(blocks))
        offered = blocks[gpu_hit + host_hit :] if host_hit else blocks
        touched = blocks[gpu_hit:] if host_hit else offered
        self._requests[request_id] = (offered, touched)

    def prefilled(self, request_id: str) -> None:
        """The request's blocks are offered: the counterfactual writes them all."""
        offered, _ = self._requests[request_id]
        self.tier.store(offered, protected=offered)

    def finished(self, request_id: str) -> None:
        _, touched = self._requests.pop(request_id)
        self.tier.touch(reversed(touched))

    def declined(self, request_id: str, blocks: Iterable[int]) -> None:
        pending = self._pending
        for block in blocks:
            if block not in pending:
                pending[block] = request_id
                self.counts.declined_blocks += 1

    def referenced(self, blocks: Sequence[int]) -> None:
        """A request's prompt blocks: settle the declined ones among them."""
        pending = self._pending
        if not pending:
            return
        counts, resident = self.counts, self.tier.queue
        for block in pending.keys() & set(blocks):
            rid = pending.pop(block)
            if block in resident:
                counts.lost_hits += 1
                if len(counts.lost_examples) < self.max_examples:
                    counts.lost_examples.append(block)
                if self.keep_blocks:
                    self.lost_blocks.add((rid, block))
            else:
                counts.reused_late += 1
                if self.keep_blocks:
                    self.late_blocks.add((rid, block))

    @property
    def pending_blocks(self) -> set[tuple[str, int]]:
        """Declines whose block was not referenced since (never reused, so far)."""
        return {(rid, block) for block, rid in self._pending.items()}
