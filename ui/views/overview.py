"""Overview: the daemon's counters from /api/stats, refreshed live."""

from __future__ import annotations

from typing import Any

import streamlit as st

from ui import connection
from ui.client import ApiError

st.title("AgentKV overview")
st.caption("Live counters from the policy daemon (`GET /api/stats`).")


def _ratio(value: Any) -> str:
    return "—" if value is None else f"{float(value):.1%}"


def _gib(value: Any) -> str:
    return "—" if value is None else f"{float(value) / 1024**3:,.3f} GiB"


_GUARD_MODES = {
    "learned": "learned decisions",
    "filter": "write filter alone",
    "recency": "vLLM's default",
}


def _guard_row(guard: dict[str, Any]) -> None:
    """agentkv's recency guard: what it publishes, and the sampled shadows it decides on."""
    learned = int(guard.get("learned_shadow_hits") or 0)
    default = int(guard.get("default_shadow_hits") or 0)
    row = st.columns(4)
    row[0].metric(
        "guard publishes",
        _GUARD_MODES.get(str(guard.get("mode")), str(guard.get("mode"))),
        help="agentkv publishes its learned decisions, or its write filter alone on vLLM's "
        "order, only while a sampled shadow of them hits more than a shadow of vLLM's default "
        "on the same traffic (the recency_guard setting).",
    )
    row[1].metric(
        "shadow hits, learned / default",
        f"{learned / default:.3f}x" if default else "—",
        help=f"{learned:,} / {default:,} sampled blocks hit; the write filter alone "
        f"{int(guard.get('filter_shadow_hits') or 0):,}",
    )
    to_filter = int(guard.get("switches_to_filter") or 0)
    row[2].metric(
        "switches to learned",
        f"{int(guard.get('switches_to_learned') or 0):,}",
        help=f"and {to_filter:,} to the write filter alone",
    )
    row[3].metric("switches to default", f"{int(guard.get('switches_to_recency') or 0):,}")


@st.fragment(run_every=connection.live_interval())
def live() -> None:
    try:
        stats = connection.client().stats()
    except ApiError as err:
        connection.banner(err, what="the daemon's stats")
        return
    hit = stats.get("hit_ratio") or {}
    row1 = st.columns(4)
    row1[0].metric("policy", str(stats.get("policy", "?")))
    row1[1].metric("active workflows", f"{int(stats.get('workflows_active') or 0):,}")
    row1[2].metric("requests", f"{int(stats.get('requests') or 0):,}")
    row1[3].metric("events", f"{int(stats.get('events') or 0):,}")
    row2 = st.columns(4)
    row2[0].metric("GPU hit ratio", _ratio(hit.get("gpu")))
    row2[1].metric("host hit ratio", _ratio(hit.get("host")))
    row2[2].metric("written to host", _gib(stats.get("host_written_bytes")))
    row2[3].metric("loaded from host", _gib(stats.get("host_loaded_bytes")))
    row3 = st.columns(4)
    row3[0].metric("write-filter declines", f"{int(stats.get('write_declined_blocks') or 0):,}")
    row3[1].metric("events shed", _ratio(stats.get("shed_rate")))
    row3[2].metric("sequence gaps", f"{int(stats.get('seq_gaps') or 0):,}")
    row3[3].metric("uptime", f"{float(stats.get('uptime_s') or 0):,.0f} s")
    history = stats.get("history") or {}
    written = sum(int(n) for n in (history.get("rows_written") or {}).values())
    row4 = st.columns(4)
    row4[0].metric("history rows written", f"{written:,}")
    row4[1].metric("history rows dropped", f"{int(history.get('rows_dropped') or 0):,}")
    row4[2].metric(
        "block rows kept",
        _ratio(history.get("block_sample_rate")),
        help="Share of block-level rows the history keeps now: the block_sample_rate setting, "
        "halved while the history writer is behind.",
    )
    row4[3].metric("history queue", f"{int(history.get('queue_rows') or 0):,} rows")
    guard = stats.get("guard")
    if guard:
        _guard_row(guard)
    with st.expander("All counters (raw JSON)"):
        st.json(stats)


live()
