"""Closed-loop, trace-driven replay of a workload through the two-tier cache model.

``Simulator`` wires the parts together and runs the event loop on simulated time:

* ``streams.StreamScheduler`` - the closed loop: ``concurrency`` streams at once, call k+1 of a
  stream arriving ``gap_s`` after call k finished, the next stream when one ends;
* ``scheduler.RequestScheduler`` - vLLM's scheduler: first-come first-served admission when the
  GPU pool can hold a request's blocks, the prefix lookup (GPU prefix, then the host-resident run
  after it, loaded; the rest recomputed) and its accounting, the GPU blocks cached and freed;
* ``host_writes.HostWrites`` - the offloading connector: new blocks offered to the host tier when
  the prefill ends (write-through, through the write filter), keys re-ranked at finish, prefetch;
* ``snapshots.SnapshotApplier`` - the policy's snapshot applied as the connector applies it,
  every ``snapshot_interval_s`` of simulated time, so decisions are as stale as in service;
* ``costs.CostModel`` - the profile's time model (one prefill at a time after its loads, a queue
  per direction of the host link, concurrent decoding);
* ``link.EventOutbox`` - the events, sent to the same ``Engine`` as the daemon's in sequenced
  batches after each timer (optionally through the wire codec).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from policyd.core.engine import Engine
from policyd.core.profiles import HardwareProfile, get_profile
from policyd.core.queues import KeyedQueue, LruQueue
from policyd.core.types import PolicySnapshot, RequestFinished, Tier, WorkflowFinished
from policyd.policies import FutureIndex, Policy, make_policy
from policyd.sim import compiled
from policyd.sim.audit import DeclineAudit
from policyd.sim.cache import GpuTier, HostOrderQueue, HostTier
from policyd.sim.config import SimConfig
from policyd.sim.costs import CostModel
from policyd.sim.host_writes import HostWrites, OfflineAdmission
from policyd.sim.link import EventOutbox, SimEngine
from policyd.sim.report import Report
from policyd.sim.requests import SimRequest, call_of, computed_tokens
from policyd.sim.scheduler import RequestScheduler
from policyd.sim.snapshots import SnapshotApplier, uses_snapshots
from policyd.sim.streams import StreamScheduler
from policyd.sim.timeline import ARRIVE, FINISH, PREFILLED, SNAPSHOT, Timeline
from policyd.workloads.calls import Workload

__all__ = [
    "OfflineAdmission",
    "Progress",
    "SimConfig",
    "SimEngine",
    "Simulator",
    "computed_tokens",
    "simulate",
]

CacheModel = Literal["auto", "compiled", "python"]
Progress = Callable[[int], None]  # called with the number of calls completed since last call


def _tier_queue(
    policy: Policy, tier: Tier, *, host_ordered: bool
) -> LruQueue | KeyedQueue | HostOrderQueue:
    """vLLM's orders for every policy the connector serves (the GPU's free queue, the host
    tier's order: the connector's own when ``host_ordered``); a key order for the offline
    oracle only."""
    if policy.ordering == "oracle":
        return KeyedQueue(lambda blocks: policy.oracle_keys(tier, blocks))
    if tier == "host" and host_ordered:
        return HostOrderQueue()
    return LruQueue()


def _oracle_admits(policy: Policy, tier: Tier) -> Callable[[int, int], bool] | None:
    if policy.ordering != "oracle":
        return None
    return lambda block, victim: policy.oracle_admits(tier, block, victim)


class Simulator:
    """Replays ``workload`` under ``policy``; ``run()`` (once) returns a ``Report``.

    ``engine``: builds the engine from the simulator's clock (default: an in-process
    ``Engine`` running ``policy``). ``script``: snapshots adopted by admission count instead of
    the policy's own (``RequestScheduler``). ``tier_log`` and ``audit`` may be set before
    ``run``: a list collecting both tiers' blocks after each allocation, and a
    ``DeclineAudit`` (made from ``audit_declines`` by default). A workflow ends with its
    stream; with ``workflow_ends_at_last_call`` set, also when a call marked ``last`` finishes
    (a stream holding several workflows' calls, as ``engine_check`` replays an engine's
    rounds), as the connector reports a request sent with ``workflow_done``."""

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
        self.script = dict(script) if script is not None else None
        self.block_tokens = config.block_tokens
        self.policy = policy
        self.config = config
        self.profile: HardwareProfile = get_profile(config.profile)
        gpu_blocks, host_blocks = config.tier_blocks(self.profile)
        self.timeline = timeline = Timeline()
        clock: Callable[[], float] = lambda: timeline.now  # noqa: E731
        self.engine: SimEngine = Engine(policy, clock=clock) if engine is None else engine(clock)
        self.report = Report(
            policy=policy.name,
            workload=workload.name,
            profile=self.profile.name,
            concurrency=config.concurrency,
            gpu_blocks=gpu_blocks,
            host_blocks=host_blocks,
        )
        self.outbox = EventOutbox(self.engine, codec_roundtrip=config.codec_roundtrip)
        # snapshots are applied for score-ordered policies and for any policy publishing more
        # than the empty default (a write filter); plain LRU runs without them, exactly
        self._uses_snapshots = self.script is None and uses_snapshots(policy)
        host_ordered = self._uses_snapshots or self.script is not None
        self.gpu = GpuTier(
            gpu_blocks,
            _tier_queue(policy, "gpu", host_ordered=host_ordered),
            running_space=config.running_space,
            admits=_oracle_admits(policy, "gpu"),
        )
        self.host = HostTier(
            host_blocks,
            _tier_queue(policy, "host", host_ordered=host_ordered),
            admits=_oracle_admits(policy, "host"),
        )
        self.connector = SnapshotApplier(
            self.engine,
            self.gpu,
            self.host,
            config,
            timeline=timeline,
            outbox=self.outbox,
            report=self.report,
        )
        self.ownership = self.connector.ownership
        self.gpu_applier = self.connector.gpu_applier
        self.step_budget = self.connector.step_budget
        # policies that size decisions by the tiers (write filters) are told their capacities,
        # as the daemon tells them from its settings
        configure = getattr(policy, "configure_tiers", None)
        if callable(configure):
            configure(gpu_blocks=gpu_blocks, host_blocks=host_blocks)
        self.costs = CostModel(self.profile)
        self.streams = StreamScheduler(
            workload,
            concurrency=config.concurrency,
            block_tokens=config.block_tokens,
            timeline=timeline,
        )
        self.scheduler = RequestScheduler(
            config,
            self.gpu,
            self.host,
            connector=self.connector,
            costs=self.costs,
            timeline=timeline,
            outbox=self.outbox,
            report=self.report,
            script=self.script,
        )
        self.host_writes = HostWrites(
            config,
            self.gpu,
            self.host,
            engine=self.engine,
            costs=self.costs,
            timeline=timeline,
            outbox=self.outbox,
            report=self.report,
            offline_admission=offline_admission,
        )
        self.audit = DeclineAudit(host_blocks) if config.audit_declines else None
        self.workflow_ends_at_last_call = False
        self._latencies: list[float] = []
        self._last_finish_s = 0.0

    @property
    def now(self) -> float:
        """Simulated time, seconds."""
        return self.timeline.now

    @property
    def audit(self) -> DeclineAudit | None:
        """The Proposition 1 audit the replay feeds (None: no audit)."""
        return self.scheduler.audit

    @audit.setter
    def audit(self, audit: DeclineAudit | None) -> None:
        self.scheduler.audit = self.host_writes.audit = audit

    @property
    def tier_log(self) -> list[dict[str, list[int]]] | None:
        """When a list: both tiers' blocks right after each request's allocation."""
        return self.scheduler.tier_log

    @tier_log.setter
    def tier_log(self, log: list[dict[str, list[int]]] | None) -> None:
        self.scheduler.tier_log = log

    def _apply_snapshot(self) -> None:
        """A snapshot tick, by hand (tests): ``SnapshotApplier.refresh``."""
        self.connector.refresh()

    def _step_plan(self, hit: frozenset[int]) -> None:
        """The connector's work at a lookup, by hand (tests): ``SnapshotApplier.step_plan``."""
        self.connector.step_plan(hit)

    # -- the event loop ----------------------------------------------------------------------

    def run(self, progress: Progress | None = None) -> Report:
        started = time.perf_counter()
        timeline, interval = self.timeline, self.config.snapshot_interval_s
        self.streams.start()
        if self._uses_snapshots:
            self.connector.refresh()
            timeline.at(interval, SNAPSHOT, None)
        done = 0
        while timeline:
            kind, req = timeline.pop()
            if kind == SNAPSHOT:
                self.connector.refresh()
                if len(timeline) > 0:
                    timeline.at(timeline.now + interval, SNAPSHOT, None)
            elif kind == ARRIVE:
                assert req is not None
                # the connector learns who uses which blocks when vLLM adds the request
                self.ownership.record(req.call.workflow_id, req.call.block_hashes)
                self.scheduler.arrive(req)
            elif kind == PREFILLED:
                assert req is not None
                self._prefilled(req)
            elif kind == FINISH:
                assert req is not None
                self._finish(req)
                self.host_writes.prefetch()
                self.scheduler.admit_waiting()
                done += 1
                if progress is not None and done % 256 == 0:
                    progress(256)
                stream_ended = self.streams.call_finished(req)
                if stream_ended or (self.workflow_ends_at_last_call and req.call.last):
                    self.outbox.add(
                        WorkflowFinished(ts=timeline.now, workflow_id=req.call.workflow_id)
                    )
            self.outbox.flush()
        if self.scheduler.waiting:
            raise RuntimeError(f"{len(self.scheduler.waiting)} requests never admitted")
        if progress is not None:
            progress(done % 256)
        if self.audit is not None:
            self.report.declined_lost_hits = self.audit.counts.lost_hits
            self.report.declined_reused_late = self.audit.counts.reused_late
        # the makespan ends with the last request, not with a snapshot tick scheduled after it
        self.report.finish(self._last_finish_s, self._latencies, time.perf_counter() - started)
        return self.report

    def _prefilled(self, req: SimRequest) -> None:
        """The prompt's KV exists: write it to the host tier, then decode."""
        if self.audit is not None:
            self.audit.prefilled(req.rid)
        self.host_writes.prefilled(req)
        finish = self.costs.decode_end(self.timeline.now, req.call.output_tokens)
        self.timeline.at(finish, FINISH, req)

    def _finish(self, req: SimRequest) -> None:
        """The last token is out: cache the output blocks, re-rank the host keys, free the
        request's GPU blocks."""
        if self.audit is not None:
            self.audit.finished(req.rid)
        if req.output_blocks:
            self.scheduler.cache(req, req.output_blocks)
        self.host_writes.finished(req)
        now = self.timeline.now
        self.outbox.add(
            RequestFinished(ts=now, request_id=req.rid, output_tokens=req.call.output_tokens)
        )
        self._latencies.append(now - req.arrival_s)
        self._last_finish_s = now
        self.scheduler.release(req)


# ---- running policies ----------------------------------------------------------------------------


def _order_of(report: Report, workload: Workload) -> list[tuple[str, Sequence[int]]]:
    """The order in which calls reached the cache in a replay, with each call's blocks."""
    order: list[tuple[str, Sequence[int]]] = []
    for rec in report.records:
        stream, index = call_of(rec.request_id)
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
    model: CacheModel = "auto",
) -> Report:
    """Replay ``workload`` under the named policy.

    ``model``: ``"compiled"`` replays on the compiled cache model (``policyd.sim.compiled``:
    lru and belady, the same reports as this module's ``Simulator``, 10-100x faster),
    ``"python"`` on ``Simulator``; ``"auto"`` takes the compiled model wherever it applies.

    ``belady`` needs the order calls reach the cache, which in a closed loop depends on the
    policy: pass 1 takes the order of an LRU replay (``lru_report``, recorded with
    ``record_requests``, when the caller has one), each further pass the order of the previous
    Belady replay, until a pass admits the calls in the order it was told (a fixed point: with
    concurrency 1, or arrivals fixed by the trace's timestamps, the first pass).
    """
    if model != "python":
        reason = compiled.unsupported(workload, policy_name, config, policy_params)
        if reason is None:
            return compiled.compiled_simulate(
                workload,
                policy_name,
                config,
                belady_passes=belady_passes,
                lru_report=lru_report,
                progress=progress,
            )
        if model == "compiled":
            raise ValueError(f"the compiled cache model does not replay {reason}")
    if policy_name != "belady":
        policy = make_policy(policy_name, **(policy_params or {}))
        return Simulator(workload, policy, config).run(progress)
    recording = dataclasses.replace(config, record_requests=True)
    if lru_report is not None and len(lru_report.records) == lru_report.requests:
        report = lru_report
    else:
        report = Simulator(workload, make_policy("lru"), recording).run()
    passes = 1 if config.concurrency == 1 else max(1, belady_passes)
    order = _order_of(report, workload)
    for i in range(passes):
        last = i == passes - 1
        report = Simulator(
            workload, make_policy("belady", future=FutureIndex(order)), recording
        ).run(progress if last else None)
        admitted = _order_of(report, workload)
        if admitted == order:  # a fixed point: another pass replays this one
            break
        order = admitted
    if not config.record_requests:
        report.records.clear()
    return report
