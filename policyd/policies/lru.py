"""``lru``: exactly what vLLM does by default.

GPU tier: the free-block queue is LRU; a request's blocks are freed tail first, so the deepest
block of a prefix is evicted before its parents. Host tier (vLLM's CPU offloading, LRU manager):
store every new block, evict the least recently used. No prefetch. All of it is the base policy.
"""

from __future__ import annotations

from typing import ClassVar

from policyd.core.policy import Ordering, Policy


class LRU(Policy):
    name: ClassVar[str] = "lru"
    ordering: ClassVar[Ordering] = "recency"
    description: ClassVar[str] = "vLLM default: LRU on both tiers, store everything"
