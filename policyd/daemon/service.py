"""The policy daemon's service: the Engine in a thin shell of threads.

* ingest (``Receiver``): PULL socket -> frames as received in a bounded queue (and, with the
  history in its own process, to that process);
* engine worker (``EngineWorker``): decodes the frames it takes (shed under load), applies them
  to the Engine, whose hook (``EventBookkeeping``) feeds the counters, the predictions log, the
  SHARDS estimator and the predictor; the worker feeds the history what it did not get as
  frames;
* publisher (``SnapshotPublisher``): PUBs ``Engine.snapshot()`` every ``snapshot_interval_s``;
* housekeeping (``Housekeeping``): ``engine.tick()`` (idle workflows), ``cache_stats`` rows, MRC +
  sizing rows, history snapshot publication, model checkpoints, heap trims, prediction rows;
* optional: the vLLM KV-event subscriber, whose translated batches join the same queue.

``Service`` builds these parts, starts and stops their threads, and exposes what the API, the
stats and the demo read: the synchronous decisions (``DecisionDesk``), settings changes
(``SettingsUpdater``), checkpoints (``ModelCheckpoints``), the live tunables and models
(``PolicyHolder``).

Every access to the Engine, the policy, the predictor and the estimator happens under
``self.lock`` (one re-entrant ``YieldingLock``): the worker, the publisher, housekeeping and the
HTTP handlers all take it. The API calls the public methods below; none of them blocks on the
network or the history writer while holding the lock.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import zmq

from policyd.core.engine import Engine
from policyd.core.types import Event, PolicySnapshot
from policyd.daemon.bookkeeping import EventBookkeeping
from policyd.daemon.cache_rows import CacheStatsRows, SizingTracker
from policyd.daemon.decisions import DecisionDesk, DecisionLog
from policyd.daemon.housekeeping import HeapTrimmer, Housekeeping, Job
from policyd.daemon.ingest import IngestQueue, Receiver
from policyd.daemon.kv_events import KvEventSubscriber
from policyd.daemon.live_settings import SettingsUpdater
from policyd.daemon.locking import YieldingLock
from policyd.daemon.metrics import Metrics
from policyd.daemon.model_checkpoints import ModelCheckpoints
from policyd.daemon.policy_holder import PolicyHolder
from policyd.daemon.predictions import PredictionLog
from policyd.daemon.settings import DaemonSettings
from policyd.daemon.snapshots import SnapshotPublisher, bind_snapshot_socket
from policyd.daemon.stats import stats
from policyd.daemon.worker import EngineWorker, engine_behind
from policyd.fleet.deltas import FleetLearning, FleetState
from policyd.fleet.link import FleetLink, parse_servers
from policyd.fleet.residency import ResidencyFeed, ResidencyPublisher
from policyd.history import History, HistoryConfig
from policyd.history.files import remove_stale_temp_files
from policyd.history.process import HistoryProcess
from policyd.history.segments import SegmentExporter
from policyd.models.predictor import BUILD as PREDICTOR_BUILD

log = logging.getLogger(__name__)

GC_GEN0_THRESHOLD: Final = 50_000
SWITCH_INTERVAL_S: Final = 0.001


def _tune_gc() -> None:
    """Ingest allocates a struct and a tuple per event: with CPython's default gen-0 threshold
    (700 allocations) that is a collection every few frames, each walking the queued batches,
    and full collections walk everything start-up built (River models, modules). Freezing
    what exists now and a larger gen-0 threshold spare ingest those walks (``policyd
    bench-ingest --stages`` shows the cost per stage). Process-wide: the daemon owns its
    process."""
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(GC_GEN0_THRESHOLD, gc.get_threshold()[0]), gen1, gen2)
    # a thread waiting for the interpreter lock waits up to the switch interval (5 ms by
    # default) per hand-over, and an HTTP decision hands over several times (event loop,
    # worker thread) while the ingest threads are busy
    sys.setswitchinterval(min(SWITCH_INTERVAL_S, sys.getswitchinterval()))


def new_history(
    settings: DaemonSettings,
    block_sample_rate: float,
    queue: IngestQueue,
    wall_clock: Callable[[], float],
) -> History | HistoryProcess:
    """The daemon's history (not started: ``start()`` opens it), once the temporary files a
    crash left are removed; a history in the daemon's process steps aside while the Engine's
    backlog is long (``engine_behind``)."""
    history_config = HistoryConfig(
        db_path=settings.db,
        block_sample_rate=block_sample_rate,
        retention_s=settings.history_retention_s,
        flush_interval_s=settings.history_flush_interval_s,
        cpu_budget=settings.history_cpu_budget or None,
    )
    # what a crash while publishing a snapshot or writing a checkpoint left behind
    for stale in remove_stale_temp_files(
        [history_config.resolved_snapshot_path, settings.checkpoint_path]
    ):
        log.warning("removed a stale temporary file left by a crash: %s", stale)
    if settings.history_writer == "process":
        return HistoryProcess(history_config)
    return History(history_config, clock=wall_clock, defer=lambda: engine_behind(queue))


class Service:
    """One daemon: build with narrow settings, ``start()``, serve, ``stop()``.

    Construction restores the models from the checkpoint, builds the policy and the Engine,
    removes temporary files a crash left, and creates the history and the ingest queue (opened
    and bound by ``start``). ``start`` and ``stop`` run on one thread (the caller's); the
    other public methods may be called from any thread (the API's threadpool) once
    constructed. ``counts`` is the service's one set of counters: the engine hook and the
    worker add to it under ``lock``, ``decide_admit`` adds ``write_declined_blocks``."""

    def __init__(
        self,
        settings: DaemonSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.wall_clock = wall_clock
        self.lock = YieldingLock()
        self.started_s = clock()
        self.stop_problems: list[str] = []  # what went wrong in stop(), for the last word
        self.checkpoints = ModelCheckpoints(
            settings.checkpoint_path, lock=self.lock, wall_clock=wall_clock
        )
        self.holder = PolicyHolder(settings, self.checkpoints)  # restores the checkpoint
        # (the parts' own objects, fixed once built: read by the stats and the API)
        self.checkpoint_info = self.checkpoints.info
        self.predictor = self.holder.predictor
        self.engine = Engine(
            self.holder.start_policy(),
            clock=clock,
            snapshot_ttl_s=settings.snapshot_ttl_s,
            idle_timeout_s=settings.idle_timeout_s,
            drop_stale=True,
            max_sources=settings.max_sources,
            request_timeout_s=settings.request_timeout_s,
            max_requests=settings.max_running_requests,
            max_workflows=settings.max_active_workflows,
        )
        self.predictions = self.holder.restored_predictions or PredictionLog(wall_clock)
        self.predictions.wall_clock = wall_clock
        self.counts: Counter[str] = Counter()
        self.queue = IngestQueue(
            settings.ingest_queue_frames,
            settings.shed_above_frames,
            max_frame_bytes=settings.max_frame_bytes,
        )
        self.history = new_history(
            settings, self.float_setting("block_sample_rate"), self.queue, wall_clock
        )
        self.decisions = DecisionLog(
            self.history, self.engine, wall_clock=wall_clock, latest_snapshot=lambda: self.snapshot
        )
        self.decision_counts = self.decisions.counts
        self.bookkeeping = EventBookkeeping(
            lock=self.lock,
            engine=self.engine,
            holder=self.holder,
            predictions=self.predictions,
            counts=self.counts,
            decisions=self.decisions,
            history=self.history,
            clock=clock,
            wall_clock=wall_clock,
        )
        self.residency = (
            ResidencyFeed(settings.replica, endpoint=settings.fleet_endpoint)
            if settings.fleet
            else None
        )
        self.engine.hook = self._engine_hook()  # before any event reaches the Engine
        self.worker = EngineWorker(self.lock, self.engine, self.queue, self.history, self.counts)
        self.desk = DecisionDesk(self.lock, self.engine, self.decisions, self.counts)
        self.publisher = SnapshotPublisher(
            self.lock, self.engine, self.holder, self.decisions, self.queue, clock=clock
        )
        self.settings_updater = SettingsUpdater(
            self.lock,
            self.holder,
            self.engine,
            self.history,
            self.counts,
            wall_clock=wall_clock,
            wake_publisher=self.publisher.wake,
        )
        self.sizing = SizingTracker(
            self.lock,
            self.engine,
            self.holder,
            self.history,
            coverage=settings.sizing_coverage,
            wall_clock=wall_clock,
        )
        self.cache_stats = CacheStatsRows(
            self.lock,
            self.counts,
            self.queue,
            self.sizing,
            self.history,
            clock=clock,
            wall_clock=wall_clock,
        )
        # fleet SQL (the API reads these): the segments' source, and the exporter of this
        # replica's own history into it
        self.fleet_history = settings.fleet_history
        self.segments = (
            SegmentExporter.from_history(
                self.history, replica=settings.replica, destination=settings.fleet_history
            )
            if settings.fleet_history
            else None
        )
        self.heap_trimmer = HeapTrimmer()
        self.housekeeping = Housekeeping(
            self._housekeeping_jobs(),
            clock=clock,
            after_pass=self.bookkeeping.record_prediction_rows,
        )
        self.metrics = Metrics(lambda: stats(self))
        self.fleet = self._fleet_link()
        self.receiver: Receiver | None = None
        self.kv_events: KvEventSubscriber | None = None
        self.events_endpoint = settings.events
        self.snapshots_endpoint = settings.snapshots
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False

    def _engine_hook(self) -> Callable[[Event], None]:
        """What runs after the Engine applied each event: the bookkeeping, and in a fleet the
        residency feed the router reads."""
        observe, residency = self.bookkeeping.observe, self.residency
        if residency is None:
            return observe

        def both(event: Event) -> None:
            observe(event)
            residency.observe(event)

        return both

    def _fleet_link(self) -> FleetLink | None:
        """The JetStream link of a replica in a fleet (``--fleet``), from the checkpoint's
        state of it when there is one; None outside a fleet."""
        s = self.settings
        if not s.fleet:
            return None
        restored = self.holder.restored_fleet
        state = restored if isinstance(restored, FleetState) else None
        holder = self.holder
        learning = FleetLearning(
            holder.predictor, lambda: holder.shards, state.baseline if state else None
        )
        return FleetLink(
            parse_servers(s.fleet),
            s.replica,
            learning,
            self.lock,
            state=state,
            interval_s=s.fleet_interval_s,
            stream_replicas=s.fleet_stream_replicas,
            extra_publish=ResidencyPublisher(self.residency) if self.residency else None,
        )

    def _housekeeping_jobs(self) -> list[Job]:
        s = self.settings
        jobs = [
            Job("tick", self.worker.tick, lambda: s.tick_interval_s),
            Job("stats", self.cache_stats.record, lambda: s.stats_interval_s),
            Job(
                "sizing",
                self.sizing.refresh,
                lambda: s.sizing_interval_s,
                first_delay_s=min(2.0, s.sizing_interval_s),
            ),
            Job(
                "publish",
                self.publish_history,
                lambda: self.float_setting("history_publish_interval_s"),
            ),
            Job("checkpoint", self.save_checkpoint, lambda: s.checkpoint_interval_s),
        ]
        if self.segments is not None:
            jobs.append(
                Job("fleet-export", self.segments.export, lambda: s.fleet_history_interval_s)
            )
        if s.heap_trim_interval_s > 0:
            jobs.append(Job("heap_trim", self.heap_trimmer.trim, lambda: s.heap_trim_interval_s))
        return jobs

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Open the history, bind the sockets, start the threads (returns once they listen).
        An endpoint that cannot be bound is a ``ValueError`` naming it (nothing left open)."""
        _tune_gc()
        self.history.start()
        try:
            history = self.history
            self.receiver = Receiver(
                self.settings.events,
                self.queue,
                wall_clock=self.wall_clock,
                # a history in its own process takes the frames as received
                forward=history.record_frame if isinstance(history, HistoryProcess) else None,
            )
        except zmq.ZMQError as exc:
            self.history.close()
            raise ValueError(
                f"cannot bind the events endpoint {self.settings.events}: {exc}"
            ) from None
        try:
            pub = bind_snapshot_socket(self.settings.snapshots)
        except ValueError:
            self.receiver.close()
            self.history.close()
            raise
        self.snapshots_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.events_endpoint = self.receiver.endpoint
        self.receiver.start()
        threads: list[tuple[str, Callable[..., None], tuple[object, ...]]] = [
            ("policyd-engine", self.worker.run, (self._stop,)),
            # the thread owns the socket
            ("policyd-publisher", self.publisher.run, (pub, self._stop)),
            ("policyd-housekeeping", self.housekeeping.run, (self._stop,)),
        ]
        for name, target, args in threads:
            thread = threading.Thread(target=target, args=args, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.settings.vllm_events:
            self.kv_events = KvEventSubscriber(
                self.settings.vllm_events,
                lambda batch: self.queue.offer(batch, self.wall_clock()),
                replay_endpoint=self.settings.vllm_replay,
                topic=self.settings.vllm_topic,
                clock=self.clock,
            )
            self.kv_events.start()
        if self.fleet is not None:
            self.fleet.start()
        self._started = True
        log.info(
            "policyd serving: events %s, snapshots %s, history %s, policy %s, predictor %s",
            self.events_endpoint,
            self.snapshots_endpoint,
            self.settings.db,
            self.tunables["policy"],
            PREDICTOR_BUILD,
        )

    def stop(self) -> None:
        """Drain what was received, flush the history, checkpoint, publish a final snapshot."""
        if not self._started:
            return
        self._started = False
        if self.kv_events is not None:
            self.kv_events.stop()
        if self.receiver is not None:
            self.receiver.stop()
        deadline = time.monotonic() + 10.0
        while len(self.queue) and time.monotonic() < deadline:  # the worker drains it
            time.sleep(0.01)
        self._stop.set()
        self.publisher.wake()  # the publisher sends a final snapshot and returns
        for thread in self._threads:
            thread.join(timeout=30.0)
        self.worker.drain()
        if self.fleet is not None:
            self.fleet.stop()  # one last publish, bounded
        try:
            self.save_checkpoint()
        except Exception as exc:
            log.exception("final checkpoint failed")
            self.stop_problems.append(f"final checkpoint failed: {exc}")
        self.bookkeeping.record_prediction_rows(final=True)
        try:
            self.history.close()  # flushes and publishes the final history snapshot
        except Exception as exc:
            log.exception("closing the history failed")
            self.stop_problems.append(f"closing the history failed: {exc}")
        if self.segments is not None:
            try:
                self.segments.export()  # the final snapshot's rows, for fleet SQL
            except Exception as exc:
                log.exception("exporting the last history segments failed")
                self.stop_problems.append(f"exporting history segments failed: {exc}")

    def ready(self) -> dict[str, bool]:
        hist = self.history.stats()
        parts = {
            "ingest": self.receiver is not None and self.receiver.running,
            "engine": any(t.name == "policyd-engine" and t.is_alive() for t in self._threads),
            "history": bool(hist.get("writer_alive")),
            "snapshots": any(t.name == "policyd-publisher" and t.is_alive() for t in self._threads),
        }
        return {"ready": all(parts.values()), **parts}

    # ---- what the API, the stats and the demo read (the parts own it) -------------------------

    @property
    def tunables(self) -> dict[str, object]:
        return self.holder.tunables

    @property
    def snapshot(self) -> PolicySnapshot | None:
        return self.publisher.snapshot

    @property
    def snapshot_published_s(self) -> float | None:
        return self.publisher.snapshot_published_s

    @property
    def snapshots_published(self) -> int:
        return self.publisher.snapshots_published

    @property
    def sizing_view(self) -> dict[str, Any]:
        return self.sizing.view

    @property
    def heap_trims(self) -> int:
        return self.heap_trimmer.trims

    def int_setting(self, key: str) -> int:
        return self.holder.int_setting(key)

    def float_setting(self, key: str) -> float:
        return self.holder.float_setting(key)

    def update_settings(self, changes: Mapping[str, object], actor: str = "api") -> dict[str, str]:
        """Validate everything, then apply live; returns errors per key (nothing applied if any)."""
        return self.settings_updater.update(changes, actor)

    # ---- what the API asks for ------------------------------------------------------------------

    def decide_evict(self, tier: str, candidates: Sequence[int], n_blocks: int) -> dict[str, Any]:
        return self.desk.evict(tier, candidates, n_blocks)

    def decide_admit(self, request_id: str, block_hashes: Sequence[int]) -> dict[str, Any]:
        return self.desk.admit(request_id, block_hashes)

    def decide_prefetch(self, budget_blocks: int) -> dict[str, Any]:
        """Host blocks to load into free GPU space (``DecisionDesk.prefetch``)."""
        return self.desk.prefetch(budget_blocks)

    def build_snapshot(self) -> PolicySnapshot:
        """The policy's snapshot plus the shell's staging (``SnapshotPublisher``)."""
        return self.publisher.build_snapshot()

    def publish_snapshot_now(self, quiet_s: float = 0.2, timeout_s: float = 30.0) -> dict[str, Any]:
        """Publish a snapshot once ingestion is quiet (``SnapshotPublisher``); raises
        ``TimeoutError`` if ingestion never goes quiet."""
        return self.publisher.publish_snapshot_now(quiet_s, timeout_s)

    def refresh_sizing(self) -> dict[str, Any]:
        return self.sizing.refresh()

    def save_checkpoint(self) -> dict[str, object]:
        return self.checkpoints.save(self._checkpoint_models)

    def _checkpoint_models(self) -> dict[str, object]:
        models = self.holder.checkpoint_models(self.predictions)
        if self.fleet is not None:  # with the models it describes: the same instant
            models["fleet"] = self.fleet.state()
        return models

    def publish_history(self) -> dict[str, str]:
        path = self.history.publish_snapshot()
        return {"snapshot_path": str(path)}
