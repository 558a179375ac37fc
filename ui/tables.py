"""API payloads -> tidy pandas frames for the dashboard's tables and charts (pure functions).

Kept apart from Streamlit so the shaping is testable on its own and the pages stay thin.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import pandas as pd  # type: ignore[import-untyped]

DEFAULT_BLOCK_TOKENS: Final = 16  # vLLM's default block size
GIB: Final = 1024**3

Json = Mapping[str, Any]


def with_time(frame: pd.DataFrame, column: str = "ts") -> pd.DataFrame:
    """Add a ``time`` column (UTC datetimes) from unix seconds in ``column``."""
    out = frame.copy()
    if column in out:
        out["time"] = pd.to_datetime(
            pd.to_numeric(out[column], errors="coerce"), unit="s", utc=True
        )
    return out


# ---- predictions -------------------------------------------------------------------------------


def workflow_table(payload: Json) -> pd.DataFrame:
    """One row per active workflow: its last agent, then each step's most likely agent."""
    rows = []
    for wf in payload.get("workflows") or ():
        row: dict[str, Any] = {
            "workflow_id": wf.get("workflow_id"),
            "workflow_type": wf.get("workflow_type"),
            "last_agent": wf.get("last_agent"),
        }
        for step in wf.get("steps") or ():
            agents: Mapping[str, float] = step.get("agents") or {}
            n = step.get("step")
            if agents:
                best = max(agents, key=lambda a: agents[a])
                row[f"step {n}"] = f"{best} ({agents[best]:.0%})"
            else:
                row[f"step {n}"] = "—"
            p_alive = step.get("p_alive")
            row[f"alive {n}"] = None if p_alive is None else float(p_alive)
        rows.append(row)
    return pd.DataFrame(rows)


def step_probabilities(payload: Json) -> pd.DataFrame:
    """Long form: workflow_id, step, agent, probability - one row per predicted agent."""
    rows = [
        {
            "workflow_id": str(wf.get("workflow_id")),
            "step": int(step.get("step", 0)),
            "agent": str(agent),
            "probability": float(p),
        }
        for wf in payload.get("workflows") or ()
        for step in wf.get("steps") or ()
        for agent, p in (step.get("agents") or {}).items()
    ]
    return pd.DataFrame(rows, columns=["workflow_id", "step", "agent", "probability"])


def accuracy_by_step(payload: Json) -> pd.DataFrame:
    """Rolling top-1 accuracy per lookahead step from ``accuracy: {"1": acc, ...}``."""
    acc: Mapping[str, float | None] = payload.get("accuracy") or {}
    rows = [
        {"step": int(step), "accuracy": float(value)}
        for step, value in acc.items()
        if value is not None
    ]
    return pd.DataFrame(rows, columns=["step", "accuracy"]).sort_values("step")


def recent_predictions(payload: Json) -> pd.DataFrame:
    """The newest predictions with what actually happened."""
    frame = pd.DataFrame(list(payload.get("recent") or ()))
    if frame.empty:
        return frame
    frame = with_time(frame)
    first = [c for c in ("time", "workflow_id", "step", "predicted_agent") if c in frame]
    rest = [c for c in frame.columns if c not in first and c != "ts"]
    return frame[first + rest]


# ---- cache effectiveness -----------------------------------------------------------------------

HIT_COLUMNS: Final = {
    "gpu": "gpu_hit_blocks",
    "host": "host_hit_blocks",
    "recomputed": "recomputed_blocks",
}


def cache_frame(rows: Sequence[Json], block_tokens: int = DEFAULT_BLOCK_TOKENS) -> pd.DataFrame:
    """cache_stats rows with hit ratios per tier and the tokens saved against LRU per interval."""
    frame = with_time(pd.DataFrame(list(rows)))
    if frame.empty:
        return frame
    frame = frame.sort_values("ts").reset_index(drop=True)
    prompt = pd.to_numeric(frame.get("prompt_blocks", 0), errors="coerce").astype(float)
    denom = prompt.where(prompt > 0)
    for tier, column in HIT_COLUMNS.items():
        if column in frame:
            values = pd.to_numeric(frame[column], errors="coerce").astype(float)
            frame[f"{tier}_ratio"] = values / denom
    if "lru_recomputed_blocks" in frame and "recomputed_blocks" in frame:
        lru = pd.to_numeric(frame["lru_recomputed_blocks"], errors="coerce").astype(float)
        ours = pd.to_numeric(frame["recomputed_blocks"], errors="coerce").astype(float)
        frame["saved_tokens"] = (lru - ours) * block_tokens
        frame["saved_tokens_cum"] = frame["saved_tokens"].fillna(0.0).cumsum()
        frame.loc[lru.isna(), "saved_tokens_cum"] = np.nan
    return frame


def saved_tokens(frame: pd.DataFrame) -> float | None:
    """Tokens saved against LRU over the frame; None when the daemon computed no counterfactual."""
    if frame.empty or "saved_tokens" not in frame or frame["saved_tokens"].isna().all():
        return None
    return float(frame["saved_tokens"].sum())


def active_intervals(frame: pd.DataFrame) -> pd.DataFrame:
    """Intervals in which requests ran or host-tier bytes moved (idle ones are left out, as the
    hit-ratio chart leaves them out: a ratio of nothing is undefined)."""
    activity = pd.Series(0.0, index=frame.index)
    for column in ("requests", "prompt_blocks", "host_written_bytes", "host_loaded_bytes"):
        if column in frame:
            activity += pd.to_numeric(frame[column], errors="coerce").fillna(0.0)
    return frame[activity > 0]


def hit_ratio_long(frame: pd.DataFrame) -> pd.DataFrame:
    """time, tier, ratio: hit ratio per tier (and the recomputed share) per interval."""
    columns = [f"{t}_ratio" for t in HIT_COLUMNS if f"{t}_ratio" in frame]
    if frame.empty or not columns:
        return pd.DataFrame(columns=["time", "tier", "ratio"])
    long = frame.melt(id_vars=["time"], value_vars=columns, var_name="tier", value_name="ratio")
    long["tier"] = long["tier"].str.removesuffix("_ratio")
    return long.dropna(subset=["ratio"])


def bytes_long(frame: pd.DataFrame) -> pd.DataFrame:
    """time, direction, MiB: bytes written to and loaded from the host tier per interval."""
    names = {"host_written_bytes": "written to host", "host_loaded_bytes": "loaded from host"}
    present = [c for c in names if c in frame]
    if frame.empty or not present:
        return pd.DataFrame(columns=["time", "direction", "mib"])
    frame = active_intervals(frame)
    long = frame.melt(id_vars=["time"], value_vars=present, var_name="direction", value_name="b")
    long["direction"] = long["direction"].map(names)
    long["mib"] = pd.to_numeric(long["b"], errors="coerce") / 2**20
    return long.drop(columns=["b"]).dropna(subset=["mib"])


# ---- sizing ------------------------------------------------------------------------------------


def mrc_frame(payload: Json) -> pd.DataFrame:
    """The MRC points, long form: capacity_gib, curve ('hit ratio' / 'host hit ratio'), value."""
    points = pd.DataFrame(list(payload.get("mrc") or ()))
    if points.empty or "capacity_gib" not in points:
        return pd.DataFrame(columns=["capacity_gib", "curve", "value"])
    curves = {"hit_ratio": "hit ratio (all tiers)", "host_hit_ratio": "host-tier hit ratio"}
    present = [c for c in curves if c in points]
    long = points.melt(
        id_vars=["capacity_gib"], value_vars=present, var_name="curve", value_name="value"
    )
    long["curve"] = long["curve"].map(curves)
    return long.dropna(subset=["value"]).sort_values(["curve", "capacity_gib"])


def hit_ratio_at(payload: Json, capacity_gib: float, column: str = "hit_ratio") -> float | None:
    """The MRC's hit ratio at ``capacity_gib`` by linear interpolation (clamped at the ends)."""
    points = [
        (float(p["capacity_gib"]), float(p[column]))
        for p in payload.get("mrc") or ()
        if p.get("capacity_gib") is not None and p.get(column) is not None
    ]
    if not points:
        return None
    points.sort()
    xs, ys = zip(*points, strict=True)
    return float(np.interp(capacity_gib, xs, ys))


# ---- decisions / settings / sql ----------------------------------------------------------------


def log_frame(rows: Sequence[Json], first: Sequence[str]) -> pd.DataFrame:
    """Log rows (decisions, settings changes) with a readable time and the ``first`` columns
    leading, in the daemon's order (newest first)."""
    frame = with_time(pd.DataFrame(list(rows)))
    if frame.empty:
        return frame
    lead = [c for c in first if c in frame]
    rest = [c for c in frame.columns if c not in lead and c != "ts"]
    return frame[lead + rest]


def reason_shape(reason: object) -> str:
    """A reason with its numbers replaced by N, so that reasons group by what they say."""
    return re.sub(r"\d+(\.\d+)?", "N", str(reason))


def decisions_frame(rows: Sequence[Json]) -> pd.DataFrame:
    """Decision rows with time, kind, reason and workflow first."""
    return log_frame(rows, first=("time", "kind", "reason", "workflow_id", "n_blocks"))


def sql_frame(result: Json) -> pd.DataFrame:
    """An /api/sql result as a frame with the daemon's column names."""
    columns = [str(c) for c in result.get("columns") or ()]
    rows = result.get("rows") or ()
    if not columns:
        return pd.DataFrame()
    return pd.DataFrame([list(r) for r in rows], columns=columns)


def percent(value: object) -> str:
    """A ratio as a percentage, or an em dash when unknown."""
    if value is None:
        return "—"
    try:
        return f"{float(value):.1%}"  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "—"
