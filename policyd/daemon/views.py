"""What the HTTP API reads from a running service: stats, predictions, settings, decisions,
the time series and user SQL. Functions of the service; each takes the service's lock only
for the in-memory part and queries the history outside it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec

from policyd.daemon.predictions import forecast_view
from policyd.daemon.settings import tunables
from policyd.daemon.stats import stats
from policyd.history import run_readonly_query
from policyd.history.schema import TABLES

if TYPE_CHECKING:
    from policyd.daemon.service import Service

MAX_API_WORKFLOWS: Final = 100

__all__ = [
    "decisions_view",
    "predictions_view",
    "settings_history",
    "settings_view",
    "snapshot_view",
    "sql",
    "stats",  # policyd.daemon.stats: the service's metrics read it too
    "timeseries",
]


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
        "drift": {
            "alarms": service.bookkeeping.drift_alarms,
            "last_ts": service.bookkeeping.drift_last_ts,
        },
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
