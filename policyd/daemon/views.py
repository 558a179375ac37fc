"""What the HTTP API reads from a running service: stats, predictions, settings, decisions,
the time series and user SQL. Functions of the service; each takes the service's lock only
for the in-memory part and queries the history outside it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec

from policyd.daemon.predictions import forecast_view
from policyd.daemon.settings import tunables
from policyd.history import run_readonly_query
from policyd.history.schema import TABLES
from policyd.predictor import BUILD

if TYPE_CHECKING:
    from policyd.daemon.service import Service

MAX_API_WORKFLOWS: Final = 100


def settings_view(service: Service) -> dict[str, Any]:
    with service.lock:
        values = dict(service.tunables)
    return {"settings": [t.describe(values[k]) for k, t in tunables().items()]}


def settings_history(service: Service, limit: int) -> list[dict[str, Any]]:
    rows = service.history.query_live(
        "select ts, key, old_value, new_value, actor from settings_changes "
        "order by ts desc limit ?",
        [limit],
    )
    return [
        dict(zip(("ts", "key", "old_value", "new_value", "actor"), r, strict=True)) for r in rows
    ]


def stats(service: Service) -> dict[str, Any]:
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


def predictions_view(service: Service, limit: int = 50) -> dict[str, Any]:
    with service.lock:
        predictor = service.predictor
        tracker = predictor.tracker
        k = predictor.k
        workflows = []
        for wid in reversed(predictor.active()):  # the predictor's active workflows survive
            described = service.predictions.describe(wid)  # a restart (checkpointed)
            try:
                forecast = predictor.predict(wid)
            except KeyError:
                continue
            workflows.append(
                {
                    "workflow_id": wid,
                    "workflow_type": described[0] if described else None,
                    "last_agent": described[1] if described else None,
                    "steps": forecast_view(forecast),
                }
            )
            if len(workflows) >= MAX_API_WORKFLOWS:
                break
        steps = range(1, k + 1)
        accuracy = {
            str(s): tracker.accuracy(s, rolling=True) if tracker.checked[s - 1] else None
            for s in steps
        }
        total = {str(s): tracker.accuracy(s) if tracker.checked[s - 1] else None for s in steps}
        checked = {str(s): tracker.checked[s - 1] for s in steps}
        ce = float(tracker.cross_entropy.get()) if tracker.checked[0] else None  # type: ignore[no-untyped-call]
        recent = list(service.predictions.recent)[-limit:][::-1]
    return {
        "k": k,
        "workflows": workflows,
        "accuracy": accuracy,
        "accuracy_total": total,
        "checked": checked,
        "calibration": {"cross_entropy": ce},
        "drift": {"alarms": service._drift_alarms, "last_ts": service._drift_last_ts},
        "recent": [
            {
                key: r[key]
                for key in (
                    "ts",
                    "workflow_id",
                    "step",
                    "predicted_agent",
                    "probability",
                    "actual_agent",
                    "correct",
                )
            }
            for r in recent
        ],
    }


def snapshot_view(service: Service) -> dict[str, Any]:
    snap = service.snapshot or service.build_snapshot()
    return msgspec.to_builtins(snap)  # type: ignore[no-any-return]


def decisions_view(
    service: Service, limit: int, kind: str | None, q: str | None
) -> list[dict[str, Any]]:
    where, params = [], []
    if kind:
        where.append("kind = ?")
        params.append(kind)
    if q:
        where.append(
            "(lower(coalesce(reason,'')) like ? or lower(coalesce(workflow_id,'')) like ? "
            "or lower(coalesce(request_id,'')) like ?)"
        )
        pattern = "%" + q.lower().replace("%", r"\%").replace("_", r"\_") + "%"
        params += [pattern] * 3
    cols = (
        "ts",
        "kind",
        "tier",
        "request_id",
        "workflow_id",
        "n_blocks",
        "reason",
        "policy",
        "snapshot_version",
    )
    sql = f"select {', '.join(cols)} from decisions"
    if where:
        sql += " where " + " and ".join(where)
    sql += " order by ts desc limit ?"
    rows = service.history.query_live(sql, [*params, limit])
    return [dict(zip(cols, r, strict=True)) for r in rows]


def timeseries(service: Service, minutes: float) -> list[dict[str, Any]]:
    cols = tuple(name for name, _ in TABLES["cache_stats"])  # the schema's order
    since = service.wall_clock() - minutes * 60.0
    rows = service.history.query_live(
        f"select {', '.join(cols)} from cache_stats where ts >= ? order by ts", [since]
    )
    out = []
    for r in rows:
        row: dict[str, Any] = dict(zip(cols, r, strict=True))
        pb = int(row["prompt_blocks"] or 0)
        g, h = int(row["gpu_hit_blocks"] or 0), int(row["host_hit_blocks"] or 0)
        row["gpu_hit_ratio"] = g / pb if pb else None
        row["host_hit_ratio"] = h / pb if pb else None
        row["hit_ratio"] = (g + h) / pb if pb else None
        out.append(row)
    return out


def sql(service: Service, sql: str, max_rows: int) -> dict[str, Any]:
    path = Path(str(service.history.stats()["snapshot_path"]))
    if not path.exists():
        service.publish_history()
    result = run_readonly_query(path, sql, max_rows=max_rows)
    return {
        "columns": result.columns,
        "rows": [list(r) for r in result.rows],
        "truncated": result.truncated,
        "elapsed_ms": result.elapsed_ms,
        "snapshot_ts": path.stat().st_mtime if path.exists() else None,
    }


def _guard_state(policy: object) -> dict[str, object] | None:
    guard = getattr(policy, "guard", None)
    state = getattr(guard, "state", None)
    return state() if callable(state) else None
