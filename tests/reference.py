"""Adapters from our calls to independent reference simulators, for the differential tests.

* ``kvcache-simulator`` (``kvcache_sim``, the KVCache.AI lab's hit-rate simulator): a prefix
  trie with LRU or optimal (Belady with bypass) eviction of leaves. A request's blocks are looked
  up as a prefix and then inserted; capacity counts cached blocks. It measures hits over a fixed
  window only: requests from ``warmup_requests`` on, and only if the cache filled during the
  warm-up (else "underfilled"). A window starting at request 0 is always underfilled, so
  ``KvcacheReference`` starts the window right after the request that fills the cache - before
  it nothing is evicted under either policy - and tests sum our per-request records over the
  same window.
* ``libcachesim`` (the libCacheSim bindings): plain LRU over a flat stream of block ids, each
  request's blocks tail first (the order vLLM frees them). It knows nothing of prefixes, so it is
  an exact reference only where every request's blocks are all cached or all absent.

Both see what our simulator caches for a call: its prompt blocks, then the output blocks it
completes. That is exact only for block-aligned calls (``check_aligned``): a partial tail block
is scratch space in our model (vLLM allocates it while the request runs), which a reference
without running space has no notion of. ``cache_view`` makes any call aligned.
"""

from __future__ import annotations

import dataclasses
import json
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import libcachesim
from kvcache_sim.plan import build_execution_plan
from kvcache_sim.policies import simulate_trie_policy
from kvcache_sim.trace import parse_trace_lines

from policyd.core.types import BLOCK_SIZE_TOKENS
from policyd.workloads.calls import Call, Workload


def flatten(workload: Workload) -> list[Call]:
    """Every call of every stream, stream after stream: the order a replay at concurrency 1
    issues them."""
    return [call for stream in workload for call in stream]


def cache_view(calls: Iterable[Call]) -> list[Call]:
    """The calls as a reference sees them: prompt of whole blocks (``prompt_tokens`` =
    16 x blocks), no output, issued alone; calls without a full block are dropped (they touch
    no cached block, and ``kvcache_sim`` skips them, which would shift the window)."""
    return [
        dataclasses.replace(
            c,
            prompt_tokens=BLOCK_SIZE_TOKENS * len(c.block_hashes),
            output_tokens=0,
            output_block_hashes=(),
            parallel=False,
        )
        for c in calls
        if c.block_hashes
    ]


def output_blocks(call: Call) -> int:
    """Full output blocks vLLM caches: the last generated token's KV is never computed."""
    return max(0, call.output_tokens - 1) // BLOCK_SIZE_TOKENS


def cached_blocks(call: Call) -> tuple[int, ...]:
    """What our simulator caches for an aligned call: prompt blocks, then output blocks."""
    return call.block_hashes + call.output_block_hashes[: output_blocks(call)]


def check_aligned(calls: Sequence[Call]) -> None:
    """Raise ``ValueError`` unless the references model these calls exactly: whole-block
    prompt, whole-block output computed (one token more, whose KV vLLM never computes), every
    output block given, and output blocks fresh (never referenced before their call, so a
    reference that looks them up with the prompt finds no hit there)."""
    seen: set[int] = set()
    for i, c in enumerate(calls):
        n_out = output_blocks(c)
        if (
            not c.block_hashes
            or c.prompt_tokens != BLOCK_SIZE_TOKENS * len(c.block_hashes)
            or (c.output_tokens and (c.output_tokens - 1) % BLOCK_SIZE_TOKENS)
            or len(c.output_block_hashes) < n_out
        ):
            raise ValueError(f"call {i} ({c.workflow_id}) is not block-aligned: use cache_view")
        output = c.output_block_hashes[:n_out]
        if seen.intersection(output):
            raise ValueError(f"call {i} ({c.workflow_id}) outputs blocks referenced before")
        seen.update(c.block_hashes, output)


def max_cached_blocks(calls: Sequence[Call]) -> int:
    """Blocks of the largest call: the least capacity our shared running space accepts."""
    return max(len(cached_blocks(c)) for c in calls)


@dataclass(frozen=True, slots=True)
class WindowHits:
    """A reference's hits over requests ``[warmup_requests, end)``, in blocks."""

    policy: str
    capacity_blocks: int
    warmup_requests: int
    mode: str  # kvcache_sim's measurementMode: "fixed_window" or "underfilled_at_window"
    hit_blocks: int
    total_blocks: int


def kvcache_trace_lines(calls: Sequence[Call]) -> list[str]:
    """Our calls in kvcache_sim's JSONL: block hashes as ids, 16 tokens per block."""
    lines: list[str] = []
    for c in calls:
        blocks = cached_blocks(c)
        record = {
            "hash_ids": list(blocks),
            "input_length": BLOCK_SIZE_TOKENS * len(blocks),
            "block_size": BLOCK_SIZE_TOKENS,
        }
        lines.append(json.dumps(record))
    return lines


class KvcacheReference:
    """kvcache_sim over aligned ``calls`` (parsed once, simulated per capacity and policy)."""

    POLICIES = ("lru", "optimal")

    def __init__(self, calls: Sequence[Call]) -> None:
        check_aligned(calls)
        self.calls = calls
        self.trace = parse_trace_lines(kvcache_trace_lines(calls))
        if (
            self.trace.request_count != len(calls)
            or self.trace.parse_errors
            or self.trace.skipped_records
        ):
            raise AssertionError(f"kvcache_sim read {self.trace.request_count}/{len(calls)} calls")
        self._distinct: list[int] = []  # distinct blocks referenced by calls[: i + 1]
        seen: set[int] = set()
        for call in calls:
            seen.update(cached_blocks(call))
            self._distinct.append(len(seen))

    @property
    def distinct_blocks(self) -> int:
        return self._distinct[-1] if self._distinct else 0

    def fill_request(self, capacity_blocks: int) -> int | None:
        """Index of the call whose blocks first fill a cache of ``capacity_blocks`` (its
        ``capacity_blocks``-th distinct block); None if the calls never fill it."""
        i = bisect_left(self._distinct, capacity_blocks)
        return i if i < len(self._distinct) else None

    def warmup_requests(self, capacity_blocks: int) -> int:
        """The first call of the window: the one after the call that fills the cache."""
        fill = self.fill_request(capacity_blocks)
        if fill is None or fill + 1 >= len(self.calls):
            raise ValueError(
                f"{len(self.calls)} calls ({self.distinct_blocks} distinct blocks) leave no "
                f"window after filling {capacity_blocks} blocks"
            )
        return fill + 1

    def hits(self, capacity_blocks: int, policy: str) -> WindowHits:
        """kvcache_sim's hits under ``policy`` (``lru`` or ``optimal``) over the window."""
        if policy not in self.POLICIES:
            raise ValueError(f"unknown kvcache_sim policy {policy!r}; valid: lru, optimal")
        warmup = self.warmup_requests(capacity_blocks)
        # floor(n * (w + 0.5) / n) == w, with room for rounding either way
        plan = build_execution_plan(self.trace, warmup_fraction=(warmup + 0.5) / len(self.calls))
        if plan.warmup_requests != warmup:
            raise AssertionError(f"window starts at {plan.warmup_requests}, wanted {warmup}")
        result = simulate_trie_policy(plan, capacity_blocks, optimal=policy == "optimal")
        if result.hitTokens % BLOCK_SIZE_TOKENS or result.totalTokens % BLOCK_SIZE_TOKENS:
            raise AssertionError(f"kvcache_sim counted partial blocks: {result}")
        return WindowHits(
            policy=policy,
            capacity_blocks=capacity_blocks,
            warmup_requests=warmup,
            mode=result.measurementMode,
            hit_blocks=result.hitTokens // BLOCK_SIZE_TOKENS,
            total_blocks=result.totalTokens // BLOCK_SIZE_TOKENS,
        )


def libcachesim_lru_hits(calls: Sequence[Call], capacity_blocks: int) -> list[int]:
    """Per call, the blocks a plain LRU cache of ``capacity_blocks`` hits when each call's
    blocks are referenced tail first. Equal to our prefix hits only on all-or-nothing traces."""
    check_aligned(calls)
    cache = libcachesim.LRU(cache_size=capacity_blocks)
    req = libcachesim.Request()
    req.obj_size = 1
    get = cache.get
    hits: list[int] = []
    for call in calls:
        n = 0
        for block in reversed(cached_blocks(call)):
            req.obj_id = block
            n += get(req)
        hits.append(n)
    return hits
