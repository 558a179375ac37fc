"""``agentkv``: ours - PBKV's lifecycle and lookahead scores on both tiers, plus a host-tier write
filter that generalises EfficientAgent's.

* GPU tier and demotion: PBKV (``policyd.policies.pbkv``, inherited): retired blocks first,
  then the lowest lookahead value, ties by recency; conservative prefetch. One addition: the
  blocks a call's output completes score as its prompt does (the agent's next prompt in the
  workflow repeats them; PBKV leaves them unscored, below every live prompt).
* Host tier eviction: the same scores (the simulator and the connector order the host queue by
  the snapshot too), so retired blocks leave the host first and a shared system prompt outlives
  a private tail nobody is predicted to read.
* Host tier admission, per request on the synchronous path (``admit``). A write is worth its
  space only if the block is reused before the tier would evict it. Three tests, in order:

  1. *lifecycle / prediction*: a block of a finished workflow, or of an agent the predictor gives
     less than ``min_reuse`` expected calls in the next K steps (outside the agent's shared
     prefix), is never reused: declined (skipped while the predictor is degraded);
  2. *no pressure* (EfficientAgent's pressure signal from ``WorkingSet``: the online SHARDS
     working set > host capacity, occupancy >= theta, a capacity eviction in the window): the
     rest is written;
  3. *under pressure*: EfficientAgent's rule keeps small extensions (at most ``kappa_chunks``
     new chunks); a larger write is admitted only if its *expected stack distance* - the prompt
     blocks referenced per second over the window times the workflow's expected time to its
     next call - is below
     the host capacity (it survives until reused). That is Proposition 1's condition estimated
     online; EfficientAgent's fixed threshold is the special case "refills never survive".

* In service the connector asks ``admit`` once per request (the daemon's synchronous path); a
  connector applying snapshots only gets EfficientAgent's rule as the snapshot's write filter.
* Graceful degradation: while the predictor's rolling accuracy is below ``min_accuracy`` PBKV
  publishes no scores (recency + lifecycle) and admission skips test 1 - EfficientAgent's filter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import ClassVar

import msgspec

from policyd.engine import EngineState
from policyd.mrc import Sizing
from policyd.policies.efficientagent import WorkingSet
from policyd.policies.pbkv import PBKV
from policyd.predictor import Predictor
from policyd.types import (
    BLOCK_SIZE_TOKENS,
    Admit,
    BlocksStored,
    Event,
    PolicySnapshot,
    RequestStarted,
    ScoredBlocks,
    WorkflowFinished,
    WriteFilter,
)


class AgentKV(PBKV):
    name: ClassVar[str] = "agentkv"
    description: ClassVar[str] = (
        "ours: PBKV scores on both tiers + reuse-before-eviction host write filter"
    )
    sync_admission: ClassVar[bool] = True

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
        kappa_chunks: int = 8,
        chunk_tokens: int = 1024,
        theta: float = 0.95,
        window_s: float = 60.0,
        coverage: float = 0.9,
        shards_rate: float = 0.1,
        min_reuse: float = 0.05,
        survival: bool = True,
        interval_smoothing: float = 0.5,
        host_blocks: int = 0,
        gpu_blocks: int = 0,
    ) -> None:
        super().__init__(
            k=k,
            discount=discount,
            min_accuracy=min_accuracy,
            min_observations=min_observations,
            prefetch_min_probability=prefetch_min_probability,
            noise=noise,
            seed=seed,
            predictor=predictor,
        )
        if kappa_chunks < 0:
            raise ValueError(f"kappa_chunks must be >= 0, got {kappa_chunks}")
        if not 0.0 <= theta <= 1.0:
            raise ValueError(f"theta must be in [0, 1], got {theta}")
        if not 0.0 < interval_smoothing <= 1.0:
            raise ValueError(f"interval_smoothing must be in (0, 1], got {interval_smoothing}")
        self.max_new_blocks = kappa_chunks * (chunk_tokens // BLOCK_SIZE_TOKENS)
        self.theta = theta
        self.min_reuse = min_reuse
        self.survival = survival
        self.interval_smoothing = interval_smoothing
        self.working_set = WorkingSet(
            window_s=window_s, coverage=coverage, shards_rate=shards_rate, seed=seed
        )
        self.working_set.configure(gpu_blocks=gpu_blocks, host_blocks=host_blocks)
        self.now_ts = 0.0
        self._refs: deque[tuple[float, int]] = deque()  # (ts, prompt blocks) in the window
        self._refs_in_window = 0
        self._last_call_ts: dict[str, float] = {}
        self._interval_s: dict[str, float] = {}  # workflow -> smoothed time between its calls
        self._mean_interval_s = 0.0
        # (workflow, agent) -> (its latest prompt, the blocks that call's output completed):
        # the agent's next prompt in the workflow starts with both
        self._output: dict[tuple[str, str], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.decisions = {"all": 0, "dead": 0, "extension": 0, "survives": 0, "declined": 0}

    def snapshot(
        self, state: EngineState, *, now: float, version: int, ttl_s: float
    ) -> PolicySnapshot:
        """PBKV's scores, plus EfficientAgent's rule as the write filter: what a connector that
        applies snapshots only (no per-request ``admit`` call) can enforce on its own."""
        snap = super().snapshot(state, now=now, version=version, ttl_s=ttl_s)
        pressure = self.working_set.pressure(state, now, theta=self.theta, source="shards")
        write_filter = WriteFilter(
            mode="conditioned", max_new_blocks=self.max_new_blocks, pressure=pressure
        )
        return msgspec.structs.replace(snap, write_filter=write_filter)

    def configure_tiers(self, *, gpu_blocks: int, host_blocks: int) -> None:
        self.working_set.configure(gpu_blocks=gpu_blocks, host_blocks=host_blocks)

    def sizing(self) -> Sizing:
        return self.working_set.sizing()

    # -- learning ------------------------------------------------------------------------------

    def observe(self, event: Event, state: EngineState) -> None:
        super().observe(event, state)
        self.working_set.observe(event)
        self.now_ts = max(self.now_ts, event.ts)
        kind = type(event)
        if kind is RequestStarted:
            assert isinstance(event, RequestStarted)
            wid = event.workflow_id
            last = self._last_call_ts.get(wid)
            self._last_call_ts[wid] = event.ts
            if last is not None:
                gap = event.ts - last
                a = self.interval_smoothing
                old = self._interval_s.get(wid)
                self._interval_s[wid] = gap if old is None else a * gap + (1 - a) * old
                self._mean_interval_s = 0.02 * gap + 0.98 * self._mean_interval_s
            self._refs.append((event.ts, len(event.block_hashes)))
            self._refs_in_window += len(event.block_hashes)
        elif kind is BlocksStored:
            assert isinstance(event, BlocksStored)
            req = state.requests.get(event.request_id or "")
            if event.tier == "gpu" and req is not None:
                prompt = set(req.block_hashes)
                out = tuple(b for b in event.block_hashes if b not in prompt)
                if out:
                    self._output[req.workflow_id, req.agent] = (req.block_hashes, out)
        elif kind is WorkflowFinished:
            assert isinstance(event, WorkflowFinished)
            self._last_call_ts.pop(event.workflow_id, None)
            self._interval_s.pop(event.workflow_id, None)
            for key in [k for k in self._output if k[0] == event.workflow_id]:
                del self._output[key]

    def score_groups(self, state: EngineState) -> list[ScoredBlocks]:
        """PBKV's groups, plus each call's output blocks at the score of its prompt's tail:
        an append-only conversation's next prompt starts with them (PBKV scores prompts
        only, so their outputs would rank with unscored blocks, below every live prompt)."""
        groups = super().score_groups(state)
        if not self._output:
            return groups
        by_last = {g.block_hashes[-1]: g.score for g in groups}
        extra: list[ScoredBlocks] = []
        for (wid, agent), (prompt, out) in self._output.items():
            wf = state.workflows.get(wid)
            if wf is None or wf.agent_blocks.get(agent) != prompt or not prompt:
                continue
            score = by_last.get(prompt[-1])
            if score is not None:
                extra.append(ScoredBlocks(score, out))
        return groups + extra

    def reference_rate_blocks_per_s(self) -> float:
        """Prompt blocks referenced per second over the window: in an LRU-like tier a block's
        stack distance grows by the distinct blocks written or touched, which under pressure
        is about every prompt block referenced (the other workflows' prompts)."""
        horizon = self.now_ts - self.working_set.window_s
        refs = self._refs
        while refs and refs[0][0] < horizon:
            self._refs_in_window -= refs.popleft()[1]
        return self._refs_in_window / self.working_set.window_s

    def expected_reuse_s(self, workflow_id: str) -> float:
        return self._interval_s.get(workflow_id, self._mean_interval_s)

    # -- admission -----------------------------------------------------------------------------

    def _reuse_mass(self, workflow_id: str, agent: str) -> float | None:
        """Expected discounted calls of ``agent`` in the workflow's next K steps (None: no
        forecast to go by)."""
        if self.degraded:
            return None
        forecast = self._forecast(workflow_id)
        if forecast is None:
            return None
        return self.agent_mass(forecast).get(agent, 0.0)

    def admit(self, request_id: str, block_hashes: Sequence[int], state: EngineState) -> Admit:
        blocks = tuple(block_hashes)
        req = state.requests.get(request_id)
        if req is None:  # unknown request: store everything (vLLM's behaviour)
            return Admit(request_id=request_id, block_hashes=blocks, reason="unknown request")
        wf = state.workflows.get(req.workflow_id)
        shared = set(state.agent_prefix.get(req.agent, ()))
        mass = self._reuse_mass(req.workflow_id, req.agent)
        if (wf is not None and wf.done) or (mass is not None and mass < self.min_reuse):
            keep = tuple(b for b in blocks if b in shared)
            self.decisions["dead"] += 1
            return Admit(
                request_id=request_id,
                block_hashes=keep,
                declined=tuple(b for b in blocks if b not in shared),
                reason="no reuse expected (lifecycle / prediction)",
            )
        ws = self.working_set
        if not ws.pressure(state, self.now_ts, theta=self.theta, source="shards"):
            self.decisions["all"] += 1
            return Admit(request_id=request_id, block_hashes=blocks, reason="no pressure")
        if len(blocks) <= self.max_new_blocks:
            self.decisions["extension"] += 1
            return Admit(request_id=request_id, block_hashes=blocks, reason="small extension")
        if self.survival:
            distance = self.reference_rate_blocks_per_s() * self.expected_reuse_s(req.workflow_id)
            if distance < ws.host_blocks:
                self.decisions["survives"] += 1
                return Admit(
                    request_id=request_id,
                    block_hashes=blocks,
                    reason=f"expected distance {distance:.0f} < host {ws.host_blocks}",
                )
        self.decisions["declined"] += 1
        return Admit(
            request_id=request_id,
            block_hashes=(),
            declined=blocks,
            reason="refill under pressure, evicted before reuse",
        )
