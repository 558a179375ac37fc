"""The daemon's counters and sizes in one dict: what ``GET /api/stats`` returns and what the
Prometheus ``/metrics`` page is rendered from.

``StatsSource`` is the contract: the parts of a running service the figures are read from (the
service satisfies it; this module does not import it, so the service can build its metrics from
``stats`` without an import loop).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from policyd.core.engine import Engine
from policyd.core.types import PolicySnapshot
from policyd.daemon.ingest import IngestQueue
from policyd.daemon.kv_events import KvEventSubscriber
from policyd.daemon.predictions import PredictionLog
from policyd.fleet.link import FleetLink
from policyd.history.process import HistoryProcess
from policyd.history.store import History
from policyd.models.predictor import BUILD, Predictor


class StatsSource(Protocol):
    """What ``stats`` reads of a running service (``policyd.daemon.service.Service``)."""

    @property
    def lock(self) -> AbstractContextManager[Any]: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def started_s(self) -> float: ...
    @property
    def counts(self) -> Mapping[str, int]: ...
    @property
    def decision_counts(self) -> Mapping[str, int]: ...
    @property
    def engine(self) -> Engine: ...
    @property
    def predictor(self) -> Predictor: ...
    @property
    def predictions(self) -> PredictionLog: ...
    @property
    def heap_trims(self) -> int: ...
    @property
    def fleet(self) -> FleetLink | None: ...
    @property
    def snapshot(self) -> PolicySnapshot | None: ...
    @property
    def snapshot_published_s(self) -> float | None: ...
    @property
    def snapshots_published(self) -> int: ...
    @property
    def queue(self) -> IngestQueue: ...
    @property
    def sizing_view(self) -> Mapping[str, Any]: ...
    @property
    def kv_events(self) -> KvEventSubscriber | None: ...
    @property
    def history(self) -> History | HistoryProcess: ...
    @property
    def checkpoint_info(self) -> Mapping[str, object]: ...
    @property
    def events_endpoint(self) -> str: ...
    @property
    def snapshots_endpoint(self) -> str: ...


def stats(service: StatsSource) -> dict[str, Any]:
    """Every counter and size the daemon reports (``GET /api/stats``, ``/metrics``)."""
    with service.lock:
        c = dict(service.counts)
        ec = service.engine.state.counters
        workflows_active = len(service.engine.state.active_workflows())
        tracker = service.predictor.tracker
        accuracy = {
            str(s): (tracker.accuracy(s, rolling=True) if tracker.checked[s - 1] else None)
            for s in range(1, tracker.k + 1)
        }
        engine = {
            "events": c.get("events", 0),
            "engine_events": ec.events,
            "batches": ec.batches,
            "seq_gaps": ec.seq_gaps,
            "seq_duplicates": ec.seq_duplicates,
            "seq_regressions": ec.seq_regressions,
            "seq_restarts": ec.seq_restarts,
            "stale_batches_dropped": ec.stale_batches_dropped,
            "sources_tracked": len(service.engine.state.last_seq),
            "sources_forgotten": ec.sources_forgotten,
            "requests_expired": ec.requests_expired,
            "requests_evicted": ec.requests_evicted,
            "workflows_evicted": ec.workflows_evicted,
            "workflows_finished": ec.workflows_finished,
            "unknown_requests": ec.unknown_requests,
        }
        es = service.engine.state
        state_sizes = {  # what the daemon's memory holds, to tell growth from noise
            "workflows": len(es.workflows),
            "requests_running": len(es.requests),
            "blocks_tracked": len(es.recency),
            "blocks_owned": len(es.owners),
            "gpu_resident_blocks": len(es.resident["gpu"]),
            "host_resident_blocks": len(es.resident["host"]),
            "predictor_workflows": len(service.predictor.active()),
            "prediction_log_workflows": len(service.predictions),
            "heap_trims": service.heap_trims,
        }
        policy = service.engine.policy.name
        snap = service.snapshot
    ic = service.queue.counters
    prompt = c.get("prompt_blocks", 0)

    def ratio(n: int) -> float | None:
        return n / prompt if prompt else None

    gpu, host = c.get("gpu_hit_blocks", 0), c.get("host_hit_blocks", 0)
    received = ic.events_received
    blocks_received = ic.block_events_received
    out: dict[str, Any] = {
        "uptime_s": service.clock() - service.started_s,
        "policy": policy,
        "frames": ic.frames,
        **engine,
        "events_received": received,
        "malformed_frames": ic.malformed_frames,
        "oversize_frames": ic.oversize_frames,
        "connections_closed": ic.connections_closed,
        "last_malformed": ic.last_malformed or None,
        "events_invalid": service.queue.validator.total,
        "events_invalid_by_reason": service.queue.validator.by_reason(),
        "events_shed": ic.events_shed,
        "shed_rate": ic.events_shed / received if received else 0.0,
        "block_events_received": blocks_received,
        "block_events_applied": c.get("block_events", 0),
        "block_events_shed": ic.block_events_shed,
        "block_shed_rate": ic.block_events_shed / blocks_received if blocks_received else 0.0,
        "frames_dropped": ic.frames_dropped,
        "frames_dropped_undecoded": ic.frames_dropped_undecoded,
        "events_dropped": ic.events_dropped,
        "receiver_waits": ic.receiver_waits,
        "receiver_wait_s": ic.receiver_wait_s,
        "ingest_queue_frames": len(service.queue),
        "ingest_queue_depth": service.queue.depth,
        "workflows_active": workflows_active,
        "state_sizes": state_sizes,
        "requests": c.get("requests", 0),
        "prompt_blocks": prompt,
        "gpu_hit_blocks": gpu,
        "host_hit_blocks": host,
        "recomputed_blocks": c.get("recomputed_blocks", 0),
        "hit_ratio": {"gpu": ratio(gpu), "host": ratio(host), "total": ratio(gpu + host)},
        "host_written_bytes": c.get("host_written_bytes", 0),
        "host_loaded_bytes": c.get("host_loaded_bytes", 0),
        "write_declined_blocks": c.get("write_declined_blocks", 0),
        "decisions": sum(service.decision_counts.values()),
        "decisions_by_kind": dict(service.decision_counts),
        "prediction_accuracy": accuracy,
        "predictor_build": BUILD,  # "compiled" (AGENTKV_COMPILE=1 install) or "interpreted"
        # calls whose forecast the prediction log did not record: over its budget per second
        "predictions_not_logged": service.predictions.forecasts_skipped,
        "recommended_host_gib": service.sizing_view.get("recommended_host_gib"),
        # agentkv's recency guard (mode, shadow LRU sample rate, windows), when it has one
        "guard": _guard_state(service.engine.policy),
        "kv_events": dict(service.kv_events.counters) if service.kv_events else None,
        # the fleet link: deltas published, applied, duplicates and gaps (docs/FLEET.md)
        "fleet": service.fleet.stats() if service.fleet is not None else None,
        "snapshot": {
            "version": snap.version if snap else None,
            "age_s": service.clock() - service.snapshot_published_s
            if service.snapshot_published_s is not None
            else None,
            "published": service.snapshots_published,
            "blocks_scored": sum(len(g.block_hashes) for g in snap.scores) if snap else 0,
            # the host tier's own order, when the policy gives one (agentkv); else null
            "host_blocks_scored": sum(len(g.block_hashes) for g in snap.host_scores)
            if snap and snap.host_scores is not None
            else None,
        },
        "history": service.history.stats(),
        "checkpoint": dict(service.checkpoint_info),
        "endpoints": {"events": service.events_endpoint, "snapshots": service.snapshots_endpoint},
    }
    return out


def _guard_state(policy: object) -> dict[str, object] | None:
    guard = getattr(policy, "guard", None)
    state = getattr(guard, "state", None)
    return state() if callable(state) else None
