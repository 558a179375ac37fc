"""Closed-loop, trace-driven replay of a workload through the two-tier cache model.

``concurrency`` streams run at once; call k+1 of a stream arrives ``gap_s`` after call k
finished; when a stream ends the next one starts. Requests are admitted first-come first-served
when the GPU pool can hold all their blocks (vLLM's scheduler, head-of-line blocking included).

Per request, as vLLM with an offloading connector does it: the GPU prefix hit is taken (never the
whole prompt: the last token is always computed), then the run of host-resident blocks after it is
loaded over the host link, the rest is recomputed. Computed blocks are cached when the prefill
ends, output blocks when decoding ends; new blocks are offered to the host tier (write-through),
and the request's GPU blocks are freed once its host writes are done.

Cost model (per profile): prefills run one at a time at ``prefill_tokens_per_s`` after their
loads arrive; loads and stores queue on their own direction of the host link; decoding runs
concurrently at ``decode_s_per_token``.

The simulator drives the same ``Engine`` as the daemon, with events in sequenced batches
(optionally through the wire codec) and the policy's snapshot applied every
``snapshot_interval_s`` of simulated time, so decisions are as stale as they would be in service.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Protocol

import msgspec

from policyd.core.engine import Engine
from policyd.core.profiles import HardwareProfile, get_profile
from policyd.core.queues import KeyedQueue, LruQueue
from policyd.core.types import (
    BATCH_CODEC,
    BLOCK_SIZE_TOKENS,
    BlocksLoaded,
    BlocksRemoved,
    BlocksStored,
    Event,
    EventBatch,
    PolicySnapshot,
    PrefixHit,
    RequestFinished,
    RequestStarted,
    Tier,
    WorkflowFinished,
)
from policyd.policies import FutureIndex, Policy, make_policy
from policyd.sim.audit import DeclineAudit
from policyd.sim.cache import GpuTier, HostOrderQueue, HostTier, RunningSpace
from policyd.sim.report import Report, RequestRecord
from policyd.tiers.budget import StepBudget
from policyd.tiers.gpu import DEFAULT_STEP_OPS, GpuApplier, gpu_caps
from policyd.tiers.view import Ownership, SnapshotView, write_allowed
from policyd.workloads.calls import Call, Stream, Workload

Progress = Callable[[int], None]  # called with the number of calls completed since last call
# (request id, candidate blocks) -> the blocks written: a per-block host admission decided
# offline, for analyses such as Proposition 1's audit (sim/audit.py). No connector applies it,
# so no policy figure may come from it.
OfflineAdmission = Callable[[str, list[int]], list[int]]

_ARRIVE, _PREFILLED, _FINISH, _SNAPSHOT = range(4)

_SYNTHETIC_BIT = 1 << 63  # hashes for output blocks whose content the workload does not give


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One replay's settings. ``gpu_blocks``/``host_blocks`` default to the profile's sizes."""

    concurrency: int = 8
    gpu_blocks: int | None = None
    host_blocks: int | None = None
    profile: str = "h200-llama3.1-8b"
    running_space: RunningSpace = "shared"
    recompute_last_token: bool = True
    snapshot_interval_s: float = 1.0
    codec_roundtrip: bool = False
    prefetch_budget_blocks: int = 0
    # the connector's GPU-tier caps (agentkv_max_pinned_blocks / agentkv_max_ranked_blocks);
    # None: the connector's defaults, fractions of the GPU pool
    max_pinned_blocks: int | None = None
    max_ranked_blocks: int | None = None
    step_ops: int | None = DEFAULT_STEP_OPS  # plan operations a scheduling round (None: all)
    offload_prompt_only: bool = True  # vLLM 0.32's default: decode blocks are not offloaded
    record_requests: bool = False
    audit_declines: bool = False  # check declined host writes against Proposition 1 (audit.py)
    block_tokens: int = BLOCK_SIZE_TOKENS  # vLLM's block size (the workload's hashes use it)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.snapshot_interval_s <= 0:
            raise ValueError("snapshot_interval_s must be > 0")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")


@dataclass(slots=True)
class _Req:
    rid: str
    call: Call
    stream: int
    index: int
    arrival_s: float
    physical_blocks: int
    output_blocks: tuple[int, ...]
    held: list[int] = field(default_factory=list)
    scratch: int = 0
    gpu_hit: int = 0
    host_hit: int = 0
    prefill_end_s: float = 0.0
    may_store: bool = True  # the write filter's decision, taken at the prefix lookup


class EventCounts(Protocol):
    events: int


class EngineCounters(Protocol):
    @property
    def counters(self) -> EventCounts: ...


class SimEngine(Protocol):
    """What the simulator asks of its engine: ``policyd.core.engine.Engine`` in-process by default,
    or a stand-in given as ``engine=`` (the demo's, which forwards the events to a daemon)."""

    @property
    def state(self) -> EngineCounters: ...

    def apply(self, batch: EventBatch) -> object: ...

    def snapshot(self) -> PolicySnapshot: ...

    def prefetch(self, budget_blocks: int) -> list[int]: ...


class Simulator:
    """Replays ``workload`` under ``policy``; ``run()`` returns a ``Report``.

    ``engine``: builds the engine from the simulator's clock (default: an in-process
    ``Engine`` running ``policy``)."""

    def __init__(
        self,
        workload: Workload,
        policy: Policy,
        config: SimConfig,
        *,
        offline_admission: OfflineAdmission | None = None,
        script: Mapping[int, PolicySnapshot] | None = None,
        engine: Callable[[Callable[[], float]], SimEngine] | None = None,
    ) -> None:
        self.workload = workload
        self.offline_admission = offline_admission
        # scripted snapshots: the k-th request admitted (from 0) adopts ``script[k]`` after its
        # GPU prefix lookup, before its blocks are allocated - where the connector adopts a
        # snapshot that arrived while vLLM was idle; the policy's own snapshots are not used
        self.script = dict(script) if script is not None else None
        # when a list: both tiers' blocks right after each request's allocation (engine_check)
        self.tier_log: list[dict[str, list[int]]] | None = None
        self._admitted_count = 0
        self.block_tokens = config.block_tokens
        self.policy = policy
        self.config = config
        self.profile: HardwareProfile = get_profile(config.profile)
        gpu_blocks = (
            config.gpu_blocks if config.gpu_blocks is not None else self.profile.gpu_blocks()
        )
        host_blocks = (
            config.host_blocks if config.host_blocks is not None else self.profile.host_blocks()
        )
        self.now = 0.0
        clock: Callable[[], float] = lambda: self.now  # noqa: E731
        self.engine: SimEngine = Engine(policy, clock=clock) if engine is None else engine(clock)
        self._snapshot: PolicySnapshot | None = None
        self._view: SnapshotView | None = None
        self._events_at_snapshot = -1
        # what the connector knows and decides: who used which blocks, the GPU moves
        self.ownership = Ownership()
        # snapshots are applied for score-ordered policies and for any policy publishing more
        # than the empty default (a write filter); plain LRU runs without them, exactly
        self._uses_snapshots = self.script is None and (
            policy.ordering == "snapshot"
            or (policy.ordering == "recency" and type(policy).snapshot is not Policy.snapshot)
        )
        self.gpu = GpuTier(
            gpu_blocks,
            self._queue("gpu"),
            running_space=config.running_space,
            admits=self._oracle_admits("gpu"),
        )
        self.host = HostTier(host_blocks, self._queue("host"), admits=self._oracle_admits("host"))
        pinned, ranked = gpu_caps(gpu_blocks, config.max_pinned_blocks, config.max_ranked_blocks)
        self.gpu_applier = GpuApplier(self.gpu, max_pinned_blocks=pinned, max_ranked_blocks=ranked)
        host_order = self.host.queue.order if isinstance(self.host.queue, HostOrderQueue) else None
        # the connector's work per scheduling round: the GPU plan and the host order's re-keying
        self.step_budget = StepBudget(self.gpu_applier, host_order, config.step_ops)
        self._round_s = -1.0
        # policies that size decisions by the tiers (write filters) are told their capacities,
        # as the daemon tells them from its settings
        configure = getattr(policy, "configure_tiers", None)
        if callable(configure):
            configure(gpu_blocks=gpu_blocks, host_blocks=host_blocks)
        self.audit = DeclineAudit(host_blocks) if config.audit_declines else None
        self._events: list[Event] = []
        self._batch_seq = count(1)
        self._timers: list[tuple[float, int, int, object]] = []
        self._timer_seq = count()
        self._waiting: deque[_Req] = deque()
        self._outstanding: dict[int, int] = {}  # stream -> calls of its current step running
        self._next_step: dict[int, int] = {}  # stream -> index of its next step's first call
        self._running = 0
        self._compute_free_s = 0.0
        self._h2d_free_s = 0.0
        self._d2h_free_s = 0.0
        self._synthetic = count()
        self.report = Report(
            policy=policy.name,
            workload=workload.name,
            profile=self.profile.name,
            concurrency=config.concurrency,
            gpu_blocks=gpu_blocks,
            host_blocks=host_blocks,
        )
        self._latencies: list[float] = []
        self._last_finish_s = 0.0

    # -- wiring the policy in ----------------------------------------------------------------

    def _queue(self, tier: Tier) -> LruQueue | KeyedQueue | HostOrderQueue:
        """vLLM's orders for every policy the connector serves (the GPU's free queue, the host
        tier's order); a key order for the offline oracle only."""
        ordering = self.policy.ordering
        if ordering == "oracle":
            policy = self.policy
            return KeyedQueue(lambda blocks: policy.oracle_keys(tier, blocks))
        if tier == "host" and (self._uses_snapshots or self.script is not None):
            return HostOrderQueue()
        return LruQueue()

    def _oracle_admits(self, tier: Tier) -> Callable[[int, int], bool] | None:
        if self.policy.ordering != "oracle":
            return None
        policy = self.policy
        return lambda block, victim: policy.oracle_admits(tier, block, victim)

    def _apply_snapshot(self) -> None:
        """A new snapshot, applied as the connector applies it: the GPU moves of
        ``GpuApplier``, the host tier's order, and the write filter of later lookups."""
        events = self.engine.state.counters.events
        if self._snapshot is not None and events == self._events_at_snapshot:
            # nothing happened since: the decisions would be the same, only fresher
            self._snapshot = msgspec.structs.replace(self._snapshot, ts=self.now)
            return
        self._events_at_snapshot = events
        self._adopt(self.engine.snapshot())

    def _adopt(self, snap: PolicySnapshot) -> None:
        """Apply a snapshot as the connector does: the GPU moves, the host order, and the
        write filter for the lookups that follow."""
        self._snapshot = snap
        limit = max(self.gpu_applier.max_pinned_blocks, self.gpu_applier.max_ranked_blocks)
        view = self._view = SnapshotView.of(snap, top_blocks=limit)
        # stepped at the lookups that follow; the host order takes the view once recounted
        self.step_budget.adopt(view, self.ownership.retire(view.retired_workflows))

    def _step_plan(self, hit: frozenset[int]) -> None:
        """The connector's work at a prefix lookup: what is left of this scheduling round's
        ``step_ops`` operations (a round, like a vLLM scheduler step, may admit several
        requests; the budget is the round's)."""
        if not self.step_budget.busy:
            return
        evicted = self.step_budget.run(hit)
        if evicted:
            self._events.append(BlocksRemoved(ts=self.now, tier="gpu", block_hashes=tuple(evicted)))
            self.report.gpu_evicted_blocks += len(evicted)

    def _view_fresh(self) -> SnapshotView | None:
        """The applied view while its snapshot is fresh; None (LRU, store all) once stale."""
        snap = self._snapshot
        if snap is None or self.now - snap.ts > snap.ttl_s:
            return None
        return self._view

    # -- the event loop ----------------------------------------------------------------------

    def _at(self, when: float, kind: int, payload: object) -> None:
        heapq.heappush(self._timers, (when, next(self._timer_seq), kind, payload))

    def run(self, progress: Progress | None = None) -> Report:
        started = time.perf_counter()
        streams: Iterator[tuple[int, Stream]] = enumerate(self.workload)
        active = 0
        for stream_index, stream in streams:
            if stream:
                self._arrive(stream_index, stream, 0)
                active += 1
                if active >= self.config.concurrency:
                    break
        if self._uses_snapshots:
            self._apply_snapshot()
            self._at(self.config.snapshot_interval_s, _SNAPSHOT, None)
        done = 0
        while self._timers:
            when, _, kind, payload = heapq.heappop(self._timers)
            self.now = when
            if kind == _SNAPSHOT:
                self._apply_snapshot()
                if len(self._timers) > 0:
                    self._at(when + self.config.snapshot_interval_s, _SNAPSHOT, None)
            elif kind == _ARRIVE:
                assert isinstance(payload, _Req)
                # the connector learns who uses which blocks when vLLM adds the request
                self.ownership.record(payload.call.workflow_id, payload.call.block_hashes)
                self._waiting.append(payload)
                self._admit_waiting()
            elif kind == _PREFILLED:
                assert isinstance(payload, _Req)
                self._prefilled(payload)
            elif kind == _FINISH:
                assert isinstance(payload, _Req)
                req = payload
                self._finish(req)
                self._prefetch()
                self._admit_waiting()
                done += 1
                if progress is not None and done % 256 == 0:
                    progress(256)
                self._outstanding[req.stream] -= 1
                if self._outstanding[req.stream] > 0:
                    pass  # other calls of this fan-out step still run
                elif (nxt := self._next_step[req.stream]) < len(
                    stream := self.workload.streams[req.stream]
                ):
                    self._arrive(req.stream, stream, nxt)
                else:
                    del self._outstanding[req.stream], self._next_step[req.stream]
                    self._events.append(
                        WorkflowFinished(ts=self.now, workflow_id=req.call.workflow_id)
                    )
                    for stream_index, stream in streams:
                        if stream:
                            self._arrive(stream_index, stream, 0)
                            break
            self._flush()
        if self._waiting:
            raise RuntimeError(f"{len(self._waiting)} requests never admitted")
        if progress is not None:
            progress(done % 256)
        if self.audit is not None:
            self.report.declined_lost_hits = self.audit.counts.lost_hits
            self.report.declined_reused_late = self.audit.counts.reused_late
        # the makespan ends with the last request, not with a snapshot tick scheduled after it
        self.report.finish(self._last_finish_s, self._latencies, time.perf_counter() - started)
        return self.report

    def _flush(self) -> None:
        if not self._events:
            return
        batch = EventBatch(source="sim", seq=next(self._batch_seq), events=tuple(self._events))
        self._events.clear()
        if self.config.codec_roundtrip:
            batch = BATCH_CODEC.decode(BATCH_CODEC.encode(batch))
        self.engine.apply(batch)

    # -- requests ----------------------------------------------------------------------------

    def _arrive(self, stream_index: int, stream: Stream, index: int) -> None:
        """Issue the step starting at call ``index``: that call and the calls after it marked
        ``parallel`` (a fan-out); the stream's next step waits for all of them."""
        end = index + 1
        while end < len(stream) and stream[end].parallel:
            end += 1
        self._outstanding[stream_index] = end - index
        self._next_step[stream_index] = end
        for i in range(index, end):
            self._issue(stream_index, stream[i], i)

    def _issue(self, stream_index: int, call: Call, index: int) -> None:
        total_tokens = computed_tokens(call)
        physical = -(-total_tokens // self.block_tokens)
        n_out = total_tokens // self.block_tokens - len(call.block_hashes)
        output = call.output_block_hashes[:n_out]
        if len(output) < n_out:  # content unknown: unique blocks nobody will reuse
            output += tuple(
                _SYNTHETIC_BIT | next(self._synthetic) for _ in range(n_out - len(output))
            )
        when = self.now + (call.gap_s if index > 0 else 0.0)
        req = _Req(f"{stream_index}.{index}", call, stream_index, index, when, physical, output)
        self._at(when, _ARRIVE, req)

    def _hit_limit(self, call: Call) -> int:
        n = len(call.block_hashes)
        if self.config.recompute_last_token:
            # vLLM computes at least the last prompt token, so a fully cached prompt loses a block
            return min(n, (call.prompt_tokens - 1) // self.block_tokens)
        return n

    def _admit_waiting(self) -> None:
        gpu = self.gpu
        if self.now != self._round_s:  # a new scheduling round; events at one instant share it
            self._round_s = self.now
            self.step_budget.new_step()
        while self._waiting:
            req = self._waiting[0]
            blocks = req.call.block_hashes
            limit = self._hit_limit(req.call)
            gpu_hit = gpu.prefix_hits(blocks, limit)
            if self.script is not None and self._admitted_count in self.script:
                snap = self.script.pop(self._admitted_count)
                self._adopt(msgspec.structs.replace(snap, ts=self.now))  # dated on arrival
            self._step_plan(frozenset(blocks[:gpu_hit]))
            refs = gpu.refs
            queued_hits = len([b for b in blocks[:gpu_hit] if not refs[b]])
            new_blocks = req.physical_blocks - gpu_hit
            need = new_blocks + queued_hits
            if not gpu.can_allocate(need) and self.gpu_applier.make_room(
                need, gpu.free_blocks + len(gpu.queue)
            ):
                continue  # the pins were released (as the connector does): look again
            if not gpu.can_allocate(need):
                if self._running == 0:
                    raise ValueError(
                        f"request {req.rid} needs {req.physical_blocks} GPU blocks but the GPU "
                        f"tier has {gpu.capacity_blocks}: raise the GPU capacity"
                    )
                return
            self._waiting.popleft()
            self._admitted_count += 1
            self._running += 1
            self._start(req, gpu_hit, limit, new_blocks)

    def _start(self, req: _Req, gpu_hit: int, limit: int, new_blocks: int) -> None:
        call, gpu, host, profile, now = req.call, self.gpu, self.host, self.profile, self.now
        blocks = call.block_hashes
        # vLLM's offloading lookup is not capped at N-1 tokens: it may load the whole prompt
        # and then recompute one token (offloading/scheduler.py, sched/scheduler.py in 0.32)
        host_hit = host.prefix_hits(blocks, gpu_hit, len(blocks)) if len(host) else 0
        req.gpu_hit, req.host_hit = gpu_hit, host_hit
        if self.audit is not None:
            self.audit.started(req.rid, blocks, gpu_hit)
        events = self._events
        events.append(
            RequestStarted(
                ts=now,
                request_id=req.rid,
                workflow_id=call.workflow_id,
                agent=call.agent,
                workflow_type=call.workflow_type,
                block_hashes=blocks,
                prompt_tokens=call.prompt_tokens,
                hints=call.hints,
            )
        )
        events.append(
            PrefixHit(
                ts=now,
                request_id=req.rid,
                gpu_blocks=gpu_hit,
                host_blocks=host_hit,
                recomputed_blocks=len(blocks) - gpu_hit - host_hit,
            )
        )
        # the connector's lookup takes the write filter's decision for the request from the
        # snapshot it holds (connector/runtime.py)
        view = self._view_fresh()
        staged = view is not None and any(b in view.stage for b in blocks)
        req.may_store = write_allowed(view, len(blocks) - gpu_hit - host_hit, staged)
        # the policy sees the request before any decision about its blocks (the connector
        # sends the start first, too)
        self._flush()
        gpu.acquire(blocks[:gpu_hit])
        req.held.extend(blocks[:gpu_hit])
        evicted = gpu.allocate(new_blocks)
        if self.config.running_space == "shared":
            req.scratch = new_blocks
        if evicted:
            events.append(BlocksRemoved(ts=now, tier="gpu", block_hashes=tuple(evicted)))
        load_bytes = host_hit * profile.kv_bytes_per_block
        load_end = now
        if load_bytes:
            load_start = max(now, self._h2d_free_s)
            load_end = self._h2d_free_s = load_start + load_bytes / profile.h2d_bytes_per_s
        # vLLM caches a request's blocks when it is scheduled: later admissions hit them
        self._cache_gpu(req, blocks[gpu_hit:], blocks[:gpu_hit])
        if host_hit:  # what the GPU now holds of the loaded run (all of it in shared space)
            refs = gpu.refs
            loaded = tuple(b for b in blocks[gpu_hit : gpu_hit + host_hit] if b in refs)
            if loaded:
                events.append(BlocksLoaded(ts=now, block_hashes=loaded, request_id=req.rid))
        if self.tier_log is not None:
            self.tier_log.append(self._tier_contents())
        computed_tokens = max(1, call.prompt_tokens - (gpu_hit + host_hit) * self.block_tokens)
        prefill_start = max(now, self._compute_free_s, load_end)
        req.prefill_end_s = self._compute_free_s = (
            prefill_start + computed_tokens / profile.prefill_tokens_per_s
        )
        r = self.report
        r.requests += 1
        r.prompt_blocks += len(blocks)
        r.prompt_tokens += call.prompt_tokens
        r.gpu_hit_blocks += gpu_hit
        r.host_hit_blocks += host_hit
        r.recomputed_tokens += computed_tokens
        r.host_read_bytes += load_bytes
        r.gpu_evicted_blocks += len(evicted)
        if self.config.record_requests:
            r.records.append(
                RequestRecord(req.rid, call.workflow_id, call.agent, len(blocks), gpu_hit, host_hit)
            )
        self._at(req.prefill_end_s, _PREFILLED, req)

    def _tier_contents(self) -> dict[str, list[int]]:
        """As the connector traces them: the GPU's free queue (next victim first), its held
        blocks sorted, the host tier's blocks sorted."""
        free = list(self.gpu.queue) if isinstance(self.gpu.queue, LruQueue) else []
        held = sorted(b for b, n in self.gpu.refs.items() if n)
        host = self.host.queue
        return {
            "gpu_free_order": free,
            "gpu_held": held,
            "host": sorted(host) if isinstance(host, LruQueue | HostOrderQueue) else [],
        }

    def _cache_gpu(self, req: _Req, blocks: Sequence[int], before: Sequence[int]) -> None:
        """Cache ``blocks`` on the GPU for ``req`` (``before``: its blocks that precede them)."""
        cached, evicted = self.gpu.commit(blocks, req.held)
        if self.config.running_space == "shared":
            req.scratch -= len(cached)
        if evicted:
            self._events.append(BlocksRemoved(ts=self.now, tier="gpu", block_hashes=tuple(evicted)))
            self.report.gpu_evicted_blocks += len(evicted)
        if cached:
            self._events.append(
                BlocksStored(
                    ts=self.now, tier="gpu", block_hashes=tuple(cached), request_id=req.rid
                )
            )

    def _offered(self, req: _Req) -> Sequence[int]:
        """What vLLM's offloading scheduler offers to the host tier for this request: every
        prompt block, or, after a host load, the blocks past the loaded ones; output blocks
        only when ``offload_prompt_only`` is off."""
        blocks = req.call.block_hashes
        offered = blocks[req.gpu_hit + req.host_hit :] if req.host_hit else blocks
        if not self.config.offload_prompt_only:
            offered = offered + req.output_blocks
        return offered

    def _store(self, req: _Req, offered: Sequence[int]) -> None:
        host = self.host
        resident = host.queue
        candidates = [b for b in offered if b not in resident]
        if not candidates:
            return
        admitted = self._admitted(req, candidates)
        stored, evicted = host.store(admitted, protected=offered)
        r = self.report
        r.host_declined_blocks += len(candidates) - len(stored)
        if self.audit is not None:
            kept = set(stored)
            self.audit.declined(req.rid, (b for b in candidates if b not in kept))
        r.host_evicted_blocks += len(evicted)
        if evicted:
            self._events.append(
                BlocksRemoved(ts=self.now, tier="host", block_hashes=tuple(evicted))
            )
        if stored:
            self._events.append(
                BlocksStored(
                    ts=self.now, tier="host", block_hashes=tuple(stored), request_id=req.rid
                )
            )
            nbytes = len(stored) * self.profile.kv_bytes_per_block
            r.host_write_bytes += nbytes
            start = max(self.now, self._d2h_free_s)
            self._d2h_free_s = start + nbytes / self.profile.d2h_bytes_per_s

    def _admitted(self, req: _Req, candidates: list[int]) -> list[int]:
        """The write filter's per-request decision, taken at the lookup (as the connector's
        ``prepare_store`` applies it): all of the request's new blocks, or none."""
        if self.offline_admission is not None:
            return self.offline_admission(req.rid, candidates)
        return candidates if req.may_store else []

    def _prefilled(self, req: _Req) -> None:
        """The prompt's KV exists: write it to the host tier, then decode."""
        if self.audit is not None:
            self.audit.prefilled(req.rid)
        if self.host.capacity_blocks:
            self._store(req, self._offered(req))
        finish = self.now + req.call.output_tokens * self.profile.decode_s_per_token
        self._at(finish, _FINISH, req)

    def _finish(self, req: _Req) -> None:
        if self.audit is not None:
            self.audit.finished(req.rid)
        if req.output_blocks:
            self._cache_gpu(req, req.output_blocks, req.call.block_hashes)
        if self.host.capacity_blocks:
            # the offloading manager re-ranks the request's keys at finish, tail first
            # (the loaded keys and the offered ones), tail first
            touched = req.call.block_hashes[req.gpu_hit :] if req.host_hit else self._offered(req)
            self.host.touch(reversed(touched))
        self._events.append(
            RequestFinished(ts=self.now, request_id=req.rid, output_tokens=req.call.output_tokens)
        )
        self._latencies.append(self.now - req.arrival_s)
        self._last_finish_s = self.now
        self.gpu.release(req.held, req.scratch)
        self._running -= 1

    def _prefetch(self) -> None:
        budget = min(self.config.prefetch_budget_blocks, self.gpu.free_blocks)
        if budget <= 0 or not len(self.host):
            return
        wanted = [b for b in self.engine.prefetch(budget) if b in self.host and b not in self.gpu]
        if not wanted:
            return
        loaded = self.gpu.insert_unreferenced(wanted)
        if loaded:
            nbytes = len(loaded) * self.profile.kv_bytes_per_block
            self.report.host_read_bytes += nbytes
            self.report.prefetched_blocks += len(loaded)
            start = max(self.now, self._h2d_free_s)
            self._h2d_free_s = start + nbytes / self.profile.h2d_bytes_per_s
            self._events.append(BlocksLoaded(ts=self.now, block_hashes=tuple(loaded)))


# ---- running policies ----------------------------------------------------------------------------


def computed_tokens(call: Call) -> int:
    """The tokens vLLM computes KV for: the prompt and every generated token but the last
    (sampled, never fed back). Those are the slots it allocates while the call runs (their
    blocks, rounded up) and the full blocks it caches."""
    return call.prompt_tokens + max(0, call.output_tokens - 1)


def _order_of(report: Report, workload: Workload) -> list[tuple[str, Sequence[int]]]:
    """The order in which calls reached the cache in a replay, with each call's blocks."""
    order: list[tuple[str, Sequence[int]]] = []
    for rec in report.records:
        stream, index = (int(x) for x in rec.request_id.split("."))
        call = workload.streams[stream][index]
        order.append((rec.request_id, call.block_hashes + call.output_block_hashes))
    return order


def simulate(
    workload: Workload,
    policy_name: str,
    config: SimConfig,
    *,
    progress: Progress | None = None,
    belady_passes: int = 2,
    lru_report: Report | None = None,
    policy_params: dict[str, object] | None = None,
) -> Report:
    """Replay ``workload`` under the named policy.

    ``belady`` needs the order calls reach the cache, which in a closed loop depends on the
    policy: pass 1 takes the order of an LRU replay (``lru_report``, recorded with
    ``record_requests``, when the caller has one), each further pass the order of the previous
    Belady replay (with concurrency 1 the order is fixed and one pass is exact).
    """
    if policy_name != "belady":
        policy = make_policy(policy_name, **(policy_params or {}))
        return Simulator(workload, policy, config).run(progress)
    recording = dataclasses.replace(config, record_requests=True)
    if lru_report is not None and len(lru_report.records) == lru_report.requests:
        report = lru_report
    else:
        report = Simulator(workload, make_policy("lru"), recording).run()
    passes = 1 if config.concurrency == 1 else max(1, belady_passes)
    for i in range(passes):
        future = FutureIndex(_order_of(report, workload))
        last = i == passes - 1
        report = Simulator(workload, make_policy("belady", future=future), recording).run(
            progress if last else None
        )
    if not config.record_requests:
        report.records.clear()
    return report
