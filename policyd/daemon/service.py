"""The policy daemon's service: the Engine in a thin shell of threads.

* ingest (``Receiver``): PULL socket -> frames as received in a bounded queue (and, with the
  history in its own process, to that process);
* engine worker: decodes the frames it takes (shed under load), applies them to the Engine and
  feeds the predictions log, the SHARDS estimator and the history (what it did not get as
  frames);
* publisher: PUBs ``Engine.snapshot()`` every ``snapshot_interval_s``;
* housekeeping: ``engine.tick()`` (idle workflows), ``cache_stats`` rows, MRC + sizing rows,
  history snapshot publication, model checkpoints;
* optional: the vLLM KV-event subscriber, whose translated batches join the same queue.

Every access to the Engine, the policy, the predictor and the estimator happens under
``self.lock`` (one re-entrant ``YieldingLock``): the worker, the publisher, housekeeping and the
HTTP handlers all take it. The API calls the public methods below; none of them blocks on the
network or the history writer while holding the lock.
"""

from __future__ import annotations

import gc
import inspect
import json
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import msgspec
import zmq

from policyd.core.engine import Engine
from policyd.core.memory import release_free_heap
from policyd.core.profiles import get_profile
from policyd.core.types import (
    SNAPSHOT_CODEC,
    TIERS,
    BlocksLoaded,
    BlocksRemoved,
    BlocksStored,
    Event,
    PolicySnapshot,
    PrefixHit,
    RequestStarted,
    Tier,
    WorkflowFinished,
)
from policyd.core.wire import SNAPSHOT_TOPIC
from policyd.daemon import checkpoint
from policyd.daemon.ingest import IngestQueue, Received, Receiver
from policyd.daemon.kv_events import KvEventSubscriber
from policyd.daemon.metrics import Metrics
from policyd.daemon.predictions import PredictionLog, resize_predictor
from policyd.daemon.settings import DaemonSettings, default_tunables, validate_tunables
from policyd.daemon.sizing import (
    compute_sizing,
    empty_sizing,
    learn_prompt,
    lru_recomputed_blocks,
)
from policyd.daemon.stats import stats
from policyd.history import History, HistoryConfig
from policyd.history.files import remove_stale_temp_files
from policyd.history.process import HistoryProcess
from policyd.models.mrc import GiB
from policyd.models.predictor import BUILD as PREDICTOR_BUILD
from policyd.models.predictor import Predictor
from policyd.models.shards import Shards
from policyd.policies import POLICIES, Policy, make_policy

log = logging.getLogger(__name__)

TIER_NAMES: Final[dict[str, Tier]] = {"gpu": "gpu", "host": "host"}

# live settings -> the constructor parameter a policy takes for it (policies/*.py); a policy
# without the parameter ignores the setting (it is still stored and shown)
POLICY_PARAMS: Final[dict[str, str]] = {
    "lookahead_k": "k",
    "discount": "discount",
    "write_filter_mode": "mode",
    "write_filter_kappa_chunks": "kappa_chunks",
    "write_filter_theta": "theta",
    "host_tier_gib": "host_blocks",
}


GC_GEN0_THRESHOLD: Final = 50_000
SWITCH_INTERVAL_S: Final = 0.001
YIELD_S: Final = 0.0002  # how long the engine worker steps aside for a waiting lock holder


def _tune_gc() -> None:
    """Ingest allocates a struct and a tuple per event: with CPython's default gen-0 threshold
    (700 allocations) that is a collection every few frames, each walking the queued batches,
    and full collections walk everything start-up built (River models, modules). Freezing
    what exists now and a larger gen-0 threshold cut the CPU spent decoding and fanning out a
    frame of 4,096 block events by about half in bench-ingest (docs/DAEMON.md). Process-wide:
    the daemon owns its process."""
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(GC_GEN0_THRESHOLD, gc.get_threshold()[0]), gen1, gen2)
    # a thread waiting for the interpreter lock waits up to the switch interval (5 ms by
    # default) per hand-over, and an HTTP decision hands over several times (event loop,
    # worker thread) while the ingest threads are busy
    sys.setswitchinterval(min(SWITCH_INTERVAL_S, sys.getswitchinterval()))


class YieldingLock:
    """A re-entrant lock that knows whether a thread waits for it. Python's locks are not fair:
    the engine worker, releasing and re-taking the lock batch after batch, would starve an HTTP
    decision waiting for it while a backlog drains (seconds per answer); the worker checks
    ``contended`` after each batch and steps aside."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count = threading.Lock()
        self._waiting = 0

    def __enter__(self) -> YieldingLock:
        with self._count:
            self._waiting += 1
        self._lock.acquire()
        with self._count:
            self._waiting -= 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    @property
    def contended(self) -> bool:
        return self._waiting > 0


class Service:
    """One daemon: build with narrow settings, ``start()``, serve, ``stop()``."""

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
        self.tunables: dict[str, object] = default_tunables(settings.policy)
        profile = get_profile(settings.profile)
        self.kv_bytes_per_block = profile.kv_bytes_per_block
        self.gpu_blocks = (
            settings.gpu_blocks if settings.gpu_blocks is not None else profile.gpu_blocks()
        )
        self.started_s = clock()
        self.stop_problems: list[str] = []  # what went wrong in stop(), for the last word
        # forecasts are rolled out when the policy, the API or the prediction log asks
        self.predictor = Predictor(
            k=int(str(self.tunables["lookahead_k"])), roll_out_unserved=False
        )
        self.shards = Shards(
            rate=settings.shards_rate, max_tracked_blocks=settings.shards_max_tracked_blocks
        )
        self.checkpoint_info: dict[str, object] = {
            "path": str(settings.checkpoint_path),
            "last_ts": None,
            "saves": 0,
            "restored": False,
            "error": None,
            "moved_to": None,
            "rejected_settings": {},  # persisted settings ignored at start, and why
        }
        self.checkpoint_saves = 0
        self._restored_predictions: PredictionLog | None = None
        self._restore()
        self.engine = Engine(
            self._start_policy(),
            hook=self._observe,
            clock=clock,
            snapshot_ttl_s=settings.snapshot_ttl_s,
            idle_timeout_s=settings.idle_timeout_s,
            drop_stale=True,
            max_sources=settings.max_sources,
            request_timeout_s=settings.request_timeout_s,
            max_requests=settings.max_running_requests,
            max_workflows=settings.max_active_workflows,
        )
        self.predictions = self._restored_predictions or PredictionLog(wall_clock)
        self.predictions.wall_clock = wall_clock
        self._handlers: dict[type, Callable[[Event], None]] = {
            RequestStarted: self._on_request_started,
            PrefixHit: self._on_prefix_hit,
            BlocksStored: self._on_blocks_stored,
            BlocksRemoved: self._on_blocks_removed,
            BlocksLoaded: self._on_blocks_loaded,
            WorkflowFinished: self._on_workflow_finished,
        }
        self.counts: Counter[str] = Counter()
        self.decision_counts: Counter[str] = Counter()
        self._drift_alarms = 0
        self._drift_last_ts: float | None = None
        self._stats_mark: dict[str, int] = {}
        self._stats_mark_s = clock()
        self.sizing_view: dict[str, Any] = empty_sizing(
            self.shards, self.gpu_blocks, self._host_blocks(), self.kv_bytes_per_block
        )
        self.snapshot: PolicySnapshot | None = None
        self.snapshot_published_s: float | None = None
        self.snapshots_published = 0
        self.heap_trims = 0  # malloc_trim calls that released memory
        self._pin_stage: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        history_config = HistoryConfig(
            db_path=settings.db,
            block_sample_rate=self.float_setting("block_sample_rate"),
            retention_s=settings.history_retention_s,
            flush_interval_s=settings.history_flush_interval_s,
            cpu_budget=settings.history_cpu_budget or None,
        )
        # what a crash while publishing a snapshot or writing a checkpoint left behind
        for stale in remove_stale_temp_files(
            [history_config.resolved_snapshot_path, settings.checkpoint_path]
        ):
            log.warning("removed a stale temporary file left by a crash: %s", stale)
        self.history: History | HistoryProcess
        if settings.history_writer == "process":
            self.history = HistoryProcess(history_config)
        else:
            self.history = History(history_config, clock=wall_clock, defer=self._engine_behind)
        self.queue = IngestQueue(
            settings.ingest_queue_frames,
            settings.shed_above_frames,
            max_frame_bytes=settings.max_frame_bytes,
        )
        self.metrics = Metrics(lambda: stats(self))
        self.receiver: Receiver | None = None
        self.kv_events: KvEventSubscriber | None = None
        self.events_endpoint = settings.events
        self.snapshots_endpoint = settings.snapshots
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._publish_now = threading.Event()
        self._started = False

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
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 16)
        try:
            pub.bind(self.settings.snapshots)
        except zmq.ZMQError as exc:
            pub.close()
            self.receiver.close()
            self.history.close()
            raise ValueError(
                f"cannot bind the snapshot endpoint {self.settings.snapshots}: {exc}"
            ) from None
        self.snapshots_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.events_endpoint = self.receiver.endpoint
        self.receiver.start()
        threads: list[tuple[str, Callable[..., None], tuple[object, ...]]] = [
            ("policyd-engine", self._engine_loop, ()),
            ("policyd-publisher", self._publish_loop, (pub,)),  # the thread owns the socket
            ("policyd-housekeeping", self._housekeeping_loop, ()),
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
        self._publish_now.set()  # the publisher sends a final snapshot and returns
        for thread in self._threads:
            thread.join(timeout=30.0)
        self._drain_queue()
        try:
            self.save_checkpoint()
        except Exception as exc:
            log.exception("final checkpoint failed")
            self.stop_problems.append(f"final checkpoint failed: {exc}")
        self._record_history_rows(final=True)
        try:
            self.history.close()  # flushes and publishes the final history snapshot
        except Exception as exc:
            log.exception("closing the history failed")
            self.stop_problems.append(f"closing the history failed: {exc}")

    def ready(self) -> dict[str, bool]:
        hist = self.history.stats()
        parts = {
            "ingest": self.receiver is not None and self.receiver.running,
            "engine": any(t.name == "policyd-engine" and t.is_alive() for t in self._threads),
            "history": bool(hist.get("writer_alive")),
            "snapshots": any(t.name == "policyd-publisher" and t.is_alive() for t in self._threads),
        }
        return {"ready": all(parts.values()), **parts}

    # ---- policy and models ---------------------------------------------------------------------

    def _build_policy(self, name: str) -> Policy:
        """The named policy with the live settings it takes (by constructor parameter name)."""
        cls = POLICIES[name]
        accepted = set(inspect.signature(cls.__init__).parameters)
        params: dict[str, object] = {
            pname: self.tunables[key] for key, pname in POLICY_PARAMS.items() if pname in accepted
        }
        if "guard" in accepted:
            params["guard"] = self.tunables["recency_guard"] == "on"
        if "host_blocks" in params:
            params["host_blocks"] = self._host_blocks()
        if "gpu_blocks" in accepted:
            params["gpu_blocks"] = self.gpu_blocks
        if "kv_bytes_per_block" in accepted:
            params["kv_bytes_per_block"] = self.kv_bytes_per_block
        if "predictor" in accepted:
            resize_predictor(self.predictor, self.int_setting("lookahead_k"))
            params["predictor"] = self.predictor
        return make_policy(name, **params)

    def int_setting(self, key: str) -> int:
        value = self.tunables[key]
        assert isinstance(value, int)
        return value

    def float_setting(self, key: str) -> float:
        value = self.tunables[key]
        assert isinstance(value, int | float)
        return float(value)

    def _owns_predictor(self) -> bool:
        return getattr(self.engine.policy, "predictor", None) is self.predictor

    def _rebuild_policy(self) -> None:
        """Swap in a freshly built policy; the EngineState, the predictor and the estimator
        carry over, and the policy's own derived state is recomputed from them."""
        old = self.engine.policy
        new = self._build_policy(str(self.tunables["policy"]))
        state = self.engine.state
        if hasattr(new, "retired"):
            new.retired = {b for tier in TIERS for b in state.resident[tier] if state.is_retired(b)}
        if hasattr(new, "calls_seen"):
            new.calls_seen = getattr(old, "calls_seen", self.counts["requests"])
        if not self._owns_predictor() and getattr(new, "predictor", None) is not self.predictor:
            resize_predictor(self.predictor, self.int_setting("lookahead_k"))
        self.engine.policy = new

    def _restore(self) -> None:
        restored = checkpoint.load(self.settings.checkpoint_path)
        if restored.error is not None:
            self.checkpoint_info.update(
                error=restored.error, moved_to=str(restored.moved_to) if restored.moved_to else None
            )
        models = restored.models
        if not models:
            return
        predictor, shards = models.get("predictor"), models.get("shards")
        predictions = models.get("predictions")
        if isinstance(predictions, PredictionLog):
            self._restored_predictions = predictions
        if isinstance(predictor, Predictor):
            predictor.roll_out_unserved = False
            self.predictor = predictor
            self.tunables["lookahead_k"] = predictor.k
        if isinstance(shards, Shards):
            self.shards = shards
        saved = models.get("tunables")
        if isinstance(saved, dict):
            # a persisted setting that does not validate (out of range, from an older daemon,
            # a hand-edited file) is reported and its default kept: the daemon always starts
            good, errors = validate_tunables(saved)
            good.pop("policy", None)  # the policy named at start (flag, env, default) wins
            self.tunables.update(good)
            self._report_rejected(errors)
        self.checkpoint_info["restored"] = True

    def _report_rejected(self, errors: Mapping[str, str]) -> None:
        for key, why in errors.items():
            log.warning("persisted setting %s ignored, its default used: %s", key[:200], why)
        rejected = self.checkpoint_info.setdefault("rejected_settings", {})
        assert isinstance(rejected, dict)
        rejected.update(errors)

    def _start_policy(self) -> Policy:
        """The policy at start, from the restored settings; settings the policy refuses (a
        value a later daemon no longer accepts) are reported and their defaults used."""
        try:
            return self._build_policy(str(self.tunables["policy"]))
        except Exception as exc:
            defaults = default_tunables(self.settings.policy)
            changed = [k for k in POLICY_PARAMS if self.tunables.get(k) != defaults[k]]
            self._report_rejected({k: f"refused by the policy: {exc}" for k in changed})
            self.tunables.update({k: defaults[k] for k in changed})
            return self._build_policy(str(self.tunables["policy"]))

    def save_checkpoint(self) -> dict[str, object]:
        with self.lock:
            models = {
                "predictor": self.predictor,
                "predictions": self.predictions,
                "shards": self.shards,
                "tunables": dict(self.tunables),
            }
            path = self.settings.checkpoint_path
            nbytes = checkpoint.save(path, models, wall_clock=self.wall_clock())
        self.checkpoint_saves += 1
        self.checkpoint_info.update(
            last_ts=self.wall_clock(),
            saves=self.checkpoint_saves,
        )
        return {"path": str(path), "bytes": nbytes}

    # ---- the engine worker ---------------------------------------------------------------------

    def _engine_loop(self) -> None:
        while not self._stop.is_set():
            self._apply_items(self.queue.take(16, 0.05))

    def _drain_queue(self) -> None:
        while True:
            items = self.queue.take(256, 0.0)
            if not items:
                return
            self._apply_items(items)

    def _engine_behind(self) -> bool:
        """Whether the Engine's backlog is past half the depth at which block events are shed:
        the history writer then steps aside, so that the interpreter lock goes to applying
        events first - a history that falls behind samples its block rows, an Engine that
        falls behind sheds block events from the policy's view."""
        return self.queue.depth > self.queue.shed_above // 2

    def _apply_items(self, items: Sequence[Received]) -> None:
        validator = self.queue.validator
        for item in items:
            with self.lock:  # per batch: HTTP decisions wait at most one batch
                # the checks that need the Engine's state (ingest did the stateless ones)
                batch = validator.check_hits(item.batch, self.engine.state)
                applied = self.engine.apply(batch)  # False: a duplicate or regressed seq
                if applied:
                    dropped = len(item.batch.events) - len(batch.events)
                    self.counts["events"] += item.events - dropped
                    self.counts["block_events"] += item.block_events
            if self.lock.contended:  # a decision or a snapshot waits: let it in first
                time.sleep(YIELD_S)
            if applied and batch.events and not item.recorded:
                self.history.record_batch(batch, received_ts=item.received_ts)

    def _observe(self, event: Event) -> None:
        """Bookkeeping after the Engine and the policy saw ``event`` (under the lock)."""
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)

    def _on_request_started(self, event: Event) -> None:
        assert isinstance(event, RequestStarted)
        self.counts["requests"] += 1
        learn_prompt(self.shards, event.block_hashes, event.prompt_tokens)
        predictor = self.predictor
        if not self._owns_predictor():
            predictor.observe_call(
                event.workflow_id, event.workflow_type, event.agent, event.hints, event.ts
            )
        log_forecast = self.predictions.wants_forecast(event.workflow_id, self.clock())
        forecast = None
        if log_forecast:
            try:
                forecast = predictor.predict(event.workflow_id)
            except KeyError:
                forecast = None
        wf = self.engine.state.workflows.get(event.workflow_id)
        wtype = wf.workflow_type if wf is not None else event.workflow_type
        self.predictions.on_call(event.workflow_id, wtype, event.agent, forecast)
        alarms = sum(predictor.tracker.drifts.values())
        if alarms > self._drift_alarms:
            self._drift_alarms, self._drift_last_ts = alarms, self.wall_clock()

    def _on_prefix_hit(self, event: Event) -> None:
        assert isinstance(event, PrefixHit)
        c = self.counts
        c["prompt_blocks"] += event.gpu_blocks + event.host_blocks + event.recomputed_blocks
        c["gpu_hit_blocks"] += event.gpu_blocks
        c["host_hit_blocks"] += event.host_blocks
        c["recomputed_blocks"] += event.recomputed_blocks

    def _on_blocks_stored(self, event: Event) -> None:
        assert isinstance(event, BlocksStored)
        if event.tier == "host":
            self.counts["host_written_bytes"] += len(event.block_hashes) * self.kv_bytes_per_block

    def _on_blocks_removed(self, event: Event) -> None:
        assert isinstance(event, BlocksRemoved)
        if event.tier == "host":
            self.counts["host_evicted_blocks"] += len(event.block_hashes)

    def _on_blocks_loaded(self, event: Event) -> None:
        assert isinstance(event, BlocksLoaded)
        self.counts["host_loaded_bytes"] += len(event.block_hashes) * self.kv_bytes_per_block

    def _on_workflow_finished(self, event: Event) -> None:
        assert isinstance(event, WorkflowFinished)
        if not self._owns_predictor():
            self.predictor.observe_finished(event.workflow_id)
        self.predictions.on_finished(event.workflow_id)
        wf = self.engine.state.workflows.get(event.workflow_id)
        resident = self.engine.state.resident
        n = 0
        if wf is not None:
            n = len(wf.blocks) - len(wf.blocks.difference(resident["gpu"], resident["host"]))
        self._decision(
            "retire",
            tier=None,
            workflow_id=event.workflow_id,
            n_blocks=n,
            reason=f"workflow finished ({event.reason}): its {n} cached blocks are retired",
        )

    # ---- decisions -----------------------------------------------------------------------------

    def _decision(
        self,
        kind: str,
        *,
        tier: str | None,
        n_blocks: int,
        reason: str,
        request_id: str | None = None,
        workflow_id: str | None = None,
    ) -> None:
        self.decision_counts[kind] += 1
        self.history.record(
            "decisions",
            [
                {
                    "ts": self.wall_clock(),
                    "kind": kind,
                    "tier": tier,
                    "request_id": request_id,
                    "workflow_id": workflow_id,
                    "n_blocks": n_blocks,
                    "reason": reason,
                    "policy": self.engine.policy.name,
                    "snapshot_version": self.snapshot.version if self.snapshot else None,
                }
            ],
        )

    def decide_evict(self, tier: str, candidates: Sequence[int], n_blocks: int) -> dict[str, Any]:
        with self.lock:
            policy = self.engine.policy
            victims = self.engine.victims(TIER_NAMES[tier], candidates, n_blocks)
            retired: set[int] = getattr(policy, "retired", set())
            n_retired = len([b for b in victims if b in retired])
        if policy.ordering == "recency":
            reason = "least recently used first"
        else:
            reason = f"{policy.name}: lowest score first, ties by recency"
        if n_retired:
            reason = f"{n_retired} retired (workflow finished); " + reason
        self._decision("evict", tier=tier, n_blocks=len(victims), reason=reason)
        return {"evict": victims, "reason": reason}

    def decide_admit(self, request_id: str, block_hashes: Sequence[int]) -> dict[str, Any]:
        with self.lock:
            admit = self.engine.admit(request_id, block_hashes)
            req = self.engine.state.requests.get(request_id)
            workflow_id = req.workflow_id if req is not None else None
        self.counts["write_declined_blocks"] += len(admit.declined)
        if admit.block_hashes:
            self._decision(
                "admit",
                tier="host",
                n_blocks=len(admit.block_hashes),
                reason=admit.reason,
                request_id=request_id,
                workflow_id=workflow_id,
            )
        if admit.declined:
            self._decision(
                "decline",
                tier="host",
                n_blocks=len(admit.declined),
                reason=admit.reason,
                request_id=request_id,
                workflow_id=workflow_id,
            )
        return {
            "admit": list(admit.block_hashes),
            "declined": list(admit.declined),
            "reason": admit.reason,
        }

    def decide_prefetch(self, budget_blocks: int) -> dict[str, Any]:
        """Host blocks to load into free GPU space. Every answer is logged, an empty one too
        (as ``decide_evict`` logs a zero-victim answer), with why it is empty."""
        with self.lock:
            blocks = self.engine.prefetch(budget_blocks)
            policy = self.engine.policy
        if blocks:
            reason = f"{policy.name}: blocks of likely next agents"
        elif budget_blocks <= 0:
            reason = f"{policy.name}: nothing to prefetch (a budget of 0 blocks)"
        elif type(policy).prefetch is Policy.prefetch:
            reason = f"{policy.name}: nothing to prefetch (the policy does not prefetch)"
        else:
            reason = f"{policy.name}: nothing to prefetch (no host block of a likely next agent)"
        self._decision("prefetch", tier="gpu", n_blocks=len(blocks), reason=reason)
        return {"prefetch": blocks, "reason": reason}

    def _host_blocks(self) -> int:
        return int(self.float_setting("host_tier_gib") * GiB // self.kv_bytes_per_block)

    # ---- snapshots -----------------------------------------------------------------------------

    def build_snapshot(self) -> PolicySnapshot:
        """The policy's snapshot plus the shell's write filter and staging (under the lock)."""
        with self.lock:
            snap = self.engine.snapshot()
            changes: dict[str, object] = {}
            budget = self.int_setting("prefetch_budget_blocks")
            if budget > 0 and not snap.stage:
                changes["stage"] = tuple(self.engine.prefetch(budget))
            if changes:
                snap = msgspec.structs.replace(snap, **changes)
            self.snapshot = snap
        pin_stage = (snap.pin, snap.stage)
        if pin_stage != self._pin_stage:
            self._pin_stage = pin_stage
            if snap.pin:
                self._decision(
                    "pin",
                    tier="gpu",
                    n_blocks=len(snap.pin),
                    reason=f"snapshot {snap.version}: pinned on the GPU",
                )
            if snap.stage:
                self._decision(
                    "prefetch",
                    tier="host",
                    n_blocks=len(snap.stage),
                    reason=f"snapshot {snap.version}: staged for predicted agents",
                )
        return snap

    def _publish_loop(self, sock: zmq.Socket[bytes]) -> None:
        try:
            while True:
                try:
                    snap = self.build_snapshot()
                    sock.send_multipart([SNAPSHOT_TOPIC, SNAPSHOT_CODEC.encode(snap)], zmq.NOBLOCK)
                    self.snapshot_published_s = self.clock()
                    self.snapshots_published += 1
                except zmq.Again:
                    pass
                except Exception:
                    log.exception("building or publishing a snapshot failed")
                if self._stop.is_set():
                    return  # the final snapshot went out above
                interval = self.float_setting("snapshot_interval_s")
                self._publish_now.wait(interval)
                self._publish_now.clear()
        finally:
            sock.close()

    # ---- housekeeping --------------------------------------------------------------------------

    def _housekeeping_loop(self) -> None:
        s = self.settings
        now = self.clock()
        due = {
            "tick": now + s.tick_interval_s,
            "stats": now + s.stats_interval_s,
            "sizing": now + min(2.0, s.sizing_interval_s),
            "publish": now + self.float_setting("history_publish_interval_s"),
            "checkpoint": now + s.checkpoint_interval_s,
        }
        jobs: dict[str, Callable[[], None]] = {
            "tick": self._tick,
            "stats": self._cache_stats_row,
            "sizing": self._sizing_job,
            "publish": self._publish_job,
            "checkpoint": self._checkpoint_job,
        }
        if s.heap_trim_interval_s > 0:
            due["heap_trim"] = now + s.heap_trim_interval_s
            jobs["heap_trim"] = self._heap_trim_job
        while not self._stop.wait(0.1):
            now = self.clock()
            for name, when in list(due.items()):
                if now < when:
                    continue
                try:
                    jobs[name]()
                except Exception:
                    log.exception("housekeeping job %s failed", name)
                due[name] = self.clock() + self._interval(name)
            self._record_history_rows()

    def _interval(self, name: str) -> float:
        s = self.settings
        return {
            "tick": s.tick_interval_s,
            "stats": s.stats_interval_s,
            "sizing": s.sizing_interval_s,
            "publish": self.float_setting("history_publish_interval_s"),
            "checkpoint": s.checkpoint_interval_s,
            "heap_trim": s.heap_trim_interval_s,
        }[name]

    def _publish_job(self) -> None:
        self.publish_history()

    def _checkpoint_job(self) -> None:
        self.save_checkpoint()

    def _heap_trim_job(self) -> None:
        self.heap_trims += release_free_heap()

    def _sizing_job(self) -> None:
        self.refresh_sizing()

    def _tick(self) -> None:
        with self.lock:
            self.engine.tick()

    def _record_history_rows(self, final: bool = False) -> None:
        with self.lock:
            rows = self.predictions.take_rows(include_pending=final)
        if rows:
            self.history.record("predictions", rows)

    def _cache_stats_row(self) -> None:
        keys = (
            "requests",
            "prompt_blocks",
            "gpu_hit_blocks",
            "host_hit_blocks",
            "recomputed_blocks",
            "host_written_bytes",
            "host_loaded_bytes",
            "write_declined_blocks",
        )
        with self.lock:
            current = {k: self.counts[k] for k in keys}
            current["events"] = self.counts["events"]
        current["events_shed"] = self.queue.counters.events_shed
        now = self.clock()
        row: dict[str, object] = {"ts": self.wall_clock(), "interval_s": now - self._stats_mark_s}
        row.update({k: v - self._stats_mark.get(k, 0) for k, v in current.items()})
        row["lru_recomputed_blocks"] = lru_recomputed_blocks(
            self.sizing_view.get("lru_hit_ratio_current"), row["prompt_blocks"]
        )
        self._stats_mark, self._stats_mark_s = current, now
        self.history.record("cache_stats", [row])

    def refresh_sizing(self) -> dict[str, Any]:
        with self.lock:
            agents = len(self.engine.state.active_workflows())
            view, mrc_rows, sizing_row = compute_sizing(
                self.shards,
                kv_bytes_per_block=self.kv_bytes_per_block,
                gpu_blocks=self.gpu_blocks,
                host_blocks=self._host_blocks(),
                agents=agents,
                coverage=self.settings.sizing_coverage,
                ts=self.wall_clock(),
            )
            self.sizing_view = view
        if mrc_rows:
            self.history.record("mrc_points", mrc_rows)
            self.history.record("sizing", [sizing_row])
        return view

    def publish_snapshot_now(self, quiet_s: float = 0.2, timeout_s: float = 30.0) -> dict[str, Any]:
        """Publish a snapshot once ingestion is quiet: no running request, nothing queued, and
        no event applied for ``quiet_s``. For runs that step the daemon between batches of
        requests (the simulator-vs-engine differential); a live service publishes on its timer.
        Raises ``TimeoutError`` if ingestion never goes quiet."""
        deadline = time.monotonic() + timeout_s
        last_events, quiet_since = -1, time.monotonic()
        while True:
            with self.lock:
                events = self.engine.state.counters.events
                running = len(self.engine.state.requests)
            now = time.monotonic()
            if events != last_events or running or len(self.queue):
                last_events, quiet_since = events, now
            elif now - quiet_since >= quiet_s:
                break
            if now > deadline:
                raise TimeoutError(f"ingestion not quiet after {timeout_s:.0f} s")
            time.sleep(0.02)
        before = self.snapshots_published
        self._publish_now.set()
        while self.snapshots_published <= before:
            if time.monotonic() > deadline:
                raise TimeoutError("no snapshot published")
            time.sleep(0.01)
        snap = self.snapshot
        return {"version": snap.version if snap else None, "events": events}

    def publish_history(self) -> dict[str, str]:
        path = self.history.publish_snapshot()
        return {"snapshot_path": str(path)}

    # ---- settings ------------------------------------------------------------------------------

    def update_settings(self, changes: Mapping[str, object], actor: str = "api") -> dict[str, str]:
        """Validate everything, then apply live; returns errors per key (nothing applied if any)."""
        good, errors = validate_tunables(changes)
        if errors:
            return errors
        rows = []
        with self.lock:
            old = dict(self.tunables)
            changed = {k: v for k, v in good.items() if old[k] != v}
            self.tunables.update(changed)
            if changed.keys() & {"policy", "recency_guard", *POLICY_PARAMS}:
                try:
                    self._rebuild_policy()
                except Exception as exc:  # a policy that refuses its params: roll back
                    self.tunables = old
                    self._rebuild_policy()
                    return {
                        k: f"rejected by policy {good.get('policy', old['policy'])}: {exc}"
                        for k in changed
                    }
            if "block_sample_rate" in changed:
                self.history.set_block_sample_rate(self.float_setting("block_sample_rate"))
            for k, v in changed.items():
                rows.append(
                    {
                        "ts": self.wall_clock(),
                        "key": k,
                        "old_value": json.dumps(old[k]),
                        "new_value": json.dumps(v),
                        "actor": actor,
                    }
                )
        if rows:
            self.history.record("settings_changes", rows)
        if "snapshot_interval_s" in changed or "policy" in changed:
            self._publish_now.set()
        return {}
