"""``efficientagent``: EfficientAgent's host-tier write admission.

After the paper's code (KunmingSHAO/efficientagent_release, ``kvtier/policies.py`` and README).

LRU on both tiers, as vLLM; what changes is which requests write to the host tier. The decision is
taken once per request (its README: ``save(r) = not (p_t and u > kappa)``):

* ``u`` - the request's new chunks: blocks the host tier does not hold, in chunks of
  ``chunk_tokens`` (1024 tokens = 64 blocks of 16). Small extensions of still-cached prefixes add
  few chunks and are kept; a large refill of evicted context is declined under pressure.
* ``p_t`` - pressure: the reuse working set exceeds the host capacity AND the tier's occupancy is
  at least ``theta`` AND it evicted for capacity within the last ``window_s`` seconds.
* modes: ``none`` (write everything), ``fixed`` (``p_t`` always true), ``conditioned`` (``p_t`` as
  above; the paper's method).

The working set is the online estimate the daemon keeps (``WorkingSet``: a fixed-size SHARDS
estimator of the miss-ratio curve fed by every ``RequestStarted``), read as the capacity reaching
``coverage`` of the achievable reuse - the size ``policyd.models.mrc.recommend`` would recommend.
The paper's connector uses the closed form ``(A - 1) x mean prompt``; ``working_set="closed-form"``
selects that instead (A = workflows active in the last window).

Difference, stated: LMCache counts ``u = floor(n/b) - floor(h/b)`` whole chunks; the simulator and
the vLLM 0.32 offloading path store 16-token blocks, so ``u`` here is the request's
not-yet-resident blocks divided by the blocks per chunk, compared as ``blocks > kappa x 64``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import ClassVar, Literal

from policyd.core.policy import Ordering, Policy
from policyd.core.state import EngineState
from policyd.core.types import (
    BLOCK_SIZE_TOKENS,
    Admit,
    BlocksRemoved,
    Event,
    PolicySnapshot,
    RequestStarted,
    WriteFilter,
    WriteFilterMode,
)
from policyd.models.mrc import Sizing, recommend
from policyd.models.shards import Shards

WorkingSetSource = Literal["shards", "closed-form"]
KV_BYTES_PER_BLOCK_DEFAULT = 131_072 * BLOCK_SIZE_TOKENS  # Llama-3.1-8B bf16 (profiles.py)
MAX_SEEN_WORKFLOWS = 1 << 16  # workflows in the window past which the least recently seen go


def declined_refill(
    request_id: str, blocks: tuple[int, ...], new_blocks: int, max_new_blocks: int
) -> Admit:
    """The write filter's decline: a request adding ``new_blocks`` (more than ``max_new_blocks``)
    under pressure writes nothing to the host tier."""
    return Admit(
        request_id=request_id,
        block_hashes=(),
        declined=blocks,
        reason=f"pressure: {new_blocks} new blocks > kappa {max_new_blocks}",
    )


class WorkingSet:
    """The host-tier pressure signal's inputs, kept online from the event stream.

    * a SHARDS MRC estimate (``shards``) fed by every request's prompt blocks;
    * the host tier's capacity (``configure``) and the time of its last capacity eviction;
    * the workflows active within ``window_s`` and the mean prompt of the last 256 requests
      (the paper's closed form). At most ``max_workflows`` are kept, the least recently seen
      going first past it: a sender whose clock never leaves the window (every event at one
      time) cannot grow the set without bound.
    """

    def __init__(
        self,
        *,
        window_s: float = 60.0,
        coverage: float = 0.9,
        shards_max_tracked_blocks: int = 8192,
        shards_rate: float = 0.1,
        seed: int = 0,
        kv_bytes_per_block: int = KV_BYTES_PER_BLOCK_DEFAULT,
        max_workflows: int = MAX_SEEN_WORKFLOWS,
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if max_workflows < 1:
            raise ValueError(f"max_workflows must be >= 1, got {max_workflows}")
        if not 0.0 < coverage <= 1.0:
            raise ValueError(f"coverage must be in (0, 1], got {coverage}")
        self.max_workflows = max_workflows
        self.window_s = window_s
        self.coverage = coverage
        self.kv_bytes_per_block = kv_bytes_per_block
        self.shards = Shards(
            rate=shards_rate, max_tracked_blocks=shards_max_tracked_blocks, seed=seed
        )
        self.gpu_blocks = 0
        self.host_blocks = 0
        self.last_eviction_ts = -float("inf")
        self.host_evicted_blocks = 0
        self._recent_prompts: deque[int] = deque(maxlen=256)
        self._workflow_seen_ts: dict[str, float] = {}
        self._sizing: Sizing | None = None
        self._sizing_prompts = -1

    def configure(self, *, gpu_blocks: int, host_blocks: int) -> None:
        self.gpu_blocks = gpu_blocks
        self.host_blocks = host_blocks
        self._sizing_prompts = -1

    def observe(self, event: Event) -> None:
        kind = type(event)
        if kind is RequestStarted:
            assert isinstance(event, RequestStarted)
            self.shards.learn_prompt(event.block_hashes, event.prompt_tokens)
            self._recent_prompts.append(event.prompt_tokens)
            seen = self._workflow_seen_ts
            seen.pop(event.workflow_id, None)  # (kept in the order they were last seen)
            seen[event.workflow_id] = event.ts
            if len(seen) > self.max_workflows:  # a clock that never leaves the window
                del seen[next(iter(seen))]
        elif kind is BlocksRemoved:
            assert isinstance(event, BlocksRemoved)
            if event.tier == "host" and event.block_hashes:
                self.last_eviction_ts = event.ts
                self.host_evicted_blocks += len(event.block_hashes)

    def active_workflows(self, now: float) -> int:
        """Workflows that started a request within the window (the paper's ``A_t``)."""
        horizon = now - self.window_s
        seen = self._workflow_seen_ts
        stale = [w for w, ts in seen.items() if ts < horizon]
        for w in stale:
            del seen[w]
        return len(seen)

    def sizing(self) -> Sizing:
        """``recommend()`` on the current online estimate (cached until the next request)."""
        prompts = self.shards.prompts
        if self._sizing is None or prompts != self._sizing_prompts:
            curve = self.shards.curve(self.kv_bytes_per_block, label="online")
            self._sizing = recommend(
                curve,
                agents=max(1, len(self._workflow_seen_ts)),
                gpu_blocks=self.gpu_blocks,
                host_blocks=self.host_blocks,
                coverage=self.coverage,
            )
            self._sizing_prompts = prompts
        return self._sizing

    def working_set_blocks(self, now: float, source: WorkingSetSource) -> float:
        if source == "closed-form":
            prompts = self._recent_prompts
            mean = sum(prompts) / len(prompts) if prompts else 0.0
            return (self.active_workflows(now) - 1) * mean / BLOCK_SIZE_TOKENS
        return float(self.sizing().target_blocks)

    def occupancy(self, state: EngineState) -> float:
        if self.host_blocks <= 0:
            return 0.0
        return len(state.resident["host"]) / self.host_blocks

    def pressure(
        self, state: EngineState, now: float, *, theta: float, source: WorkingSetSource
    ) -> bool:
        """Working set > host capacity, occupancy >= theta, a capacity eviction in the window
        (cheapest tests first: the MRC is read only when the tier is full and evicting)."""
        if self.host_blocks <= 0:
            return False
        if now - self.last_eviction_ts > self.window_s:
            return False
        if self.occupancy(state) < theta:
            return False
        return self.working_set_blocks(now, source) > self.host_blocks


class EfficientAgent(Policy):
    name: ClassVar[str] = "efficientagent"
    ordering: ClassVar[Ordering] = "recency"
    description: ClassVar[str] = (
        "EfficientAgent: LRU tiers, host writes declined for large refills under pressure"
    )

    def __init__(
        self,
        *,
        mode: WriteFilterMode = "conditioned",
        kappa_chunks: int = 8,
        chunk_tokens: int = 1024,
        theta: float = 0.95,
        window_s: float = 60.0,
        working_set: WorkingSetSource = "shards",
        coverage: float = 0.9,
        shards_rate: float = 0.1,
        host_blocks: int = 0,
        gpu_blocks: int = 0,
        seed: int = 0,
    ) -> None:
        if mode not in ("none", "fixed", "conditioned"):
            raise ValueError(f"unknown mode {mode!r}; valid modes: conditioned, fixed, none")
        if kappa_chunks < 0:
            raise ValueError(f"kappa_chunks must be >= 0, got {kappa_chunks}")
        if chunk_tokens < BLOCK_SIZE_TOKENS or chunk_tokens % BLOCK_SIZE_TOKENS:
            raise ValueError(f"chunk_tokens must be a multiple of {BLOCK_SIZE_TOKENS}")
        if not 0.0 <= theta <= 1.0:
            raise ValueError(f"theta must be in [0, 1], got {theta}")
        if working_set not in ("shards", "closed-form"):
            raise ValueError(f"unknown working_set {working_set!r}; valid: closed-form, shards")
        self.mode: WriteFilterMode = mode
        self.kappa_chunks = kappa_chunks
        self.chunk_tokens = chunk_tokens
        self.theta = theta
        self.working_set_source: WorkingSetSource = working_set
        self.working_set = WorkingSet(
            window_s=window_s, coverage=coverage, shards_rate=shards_rate, seed=seed
        )
        self.working_set.configure(gpu_blocks=gpu_blocks, host_blocks=host_blocks)
        self.pressure = False
        self.decisions = {"saved": 0, "skipped": 0}

    @property
    def max_new_blocks(self) -> int:
        """kappa in blocks: a request adding more new blocks than this is a large refill."""
        return self.kappa_chunks * (self.chunk_tokens // BLOCK_SIZE_TOKENS)

    def configure_tiers(self, *, gpu_blocks: int, host_blocks: int) -> None:
        """The tier sizes (the simulator's, or the daemon's settings)."""
        self.working_set.configure(gpu_blocks=gpu_blocks, host_blocks=host_blocks)

    def observe(self, event: Event, state: EngineState) -> None:
        self.working_set.observe(event)

    def under_pressure(self, state: EngineState, now: float) -> bool:
        if self.mode == "none":
            return False
        if self.mode == "fixed":
            return True
        return self.working_set.pressure(
            state, now, theta=self.theta, source=self.working_set_source
        )

    def snapshot(
        self, state: EngineState, *, now: float, version: int, ttl_s: float
    ) -> PolicySnapshot:
        self.pressure = self.under_pressure(state, now)
        return PolicySnapshot(
            version=version,
            ts=now,
            ttl_s=ttl_s,
            policy=self.name,
            write_filter=WriteFilter(
                mode=self.mode, max_new_blocks=self.max_new_blocks, pressure=self.pressure
            ),
        )

    def admit(self, request_id: str, block_hashes: Sequence[int], state: EngineState) -> Admit:
        """The synchronous form of the snapshot's write filter (pressure as last published):
        ``block_hashes`` are the request's blocks the host tier does not hold."""
        blocks = tuple(block_hashes)
        if self.pressure_applies() and len(blocks) > self.max_new_blocks:
            self.decisions["skipped"] += 1
            return declined_refill(request_id, blocks, len(blocks), self.max_new_blocks)
        self.decisions["saved"] += 1
        return Admit(request_id=request_id, block_hashes=blocks, reason="save")

    def pressure_applies(self) -> bool:
        return self.mode == "fixed" or (self.mode == "conditioned" and self.pressure)

    def sizing(self) -> Sizing:
        """The host-tier size recommendation from the online estimate (``policyd.models.mrc``)."""
        return self.working_set.sizing()
