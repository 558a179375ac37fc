"""Cache effectiveness: hit ratio per tier over time, recomputed tokens saved against the LRU
counterfactual (where the daemon computes one), host-tier traffic and write-filter declines
(GET /api/timeseries, the history's ``cache_stats``; totals from GET /api/stats)."""

from __future__ import annotations

import pandas as pd  # type: ignore[import-untyped]
import streamlit as st

from ui import charts, connection, tables
from ui.client import ApiError

WINDOWS_MIN = (5, 15, 60, 240, 1440)

st.title("Cache effectiveness")
minutes = st.select_slider(
    "Window (minutes)", options=WINDOWS_MIN, value=60, key="cache_window_min"
)


@st.fragment(run_every=connection.live_interval())
def live() -> None:
    api = connection.client()
    try:
        stats = api.stats()
        rows = api.timeseries(minutes)
    except ApiError as err:
        connection.banner(err, what="cache statistics")
        return
    block_tokens = int(stats.get("block_tokens") or tables.DEFAULT_BLOCK_TOKENS)
    frame = tables.cache_frame(rows, block_tokens=block_tokens)
    hit = stats.get("hit_ratio") or {}
    top = st.columns(4)
    top[0].metric("GPU hit ratio (all time)", tables.percent(hit.get("gpu")))
    top[1].metric("host hit ratio (all time)", tables.percent(hit.get("host")))
    saved = tables.saved_tokens(frame)
    top[2].metric(
        f"tokens saved vs LRU ({minutes} min)",
        "—" if saved is None else f"{saved:,.0f}",
        help="(LRU counterfactual recomputed blocks - ours) x block size, summed over the window.",
    )
    top[3].metric(
        "write-filter declines (all time)", f"{int(stats.get('write_declined_blocks') or 0):,}"
    )
    if frame.empty:
        st.info(f"No cache statistics in the last {minutes} minutes yet.")
        return
    st.altair_chart(charts.hit_ratio_over_time(tables.hit_ratio_long(frame)), width="stretch")
    left, right = st.columns(2)
    with left:
        if "saved_tokens_cum" in frame and frame["saved_tokens_cum"].notna().any():
            st.altair_chart(
                charts.saved_tokens_over_time(frame.dropna(subset=["saved_tokens_cum"])),
                width="stretch",
            )
        else:
            st.info("The daemon computes no LRU counterfactual for this policy.")
    with right:
        st.altair_chart(charts.bytes_over_time(tables.bytes_long(frame)), width="stretch")
    declined_blocks = pd.to_numeric(frame.get("write_declined_blocks"), errors="coerce")
    if declined_blocks is not None and declined_blocks.fillna(0).sum() > 0:
        st.altair_chart(charts.declines_over_time(tables.active_intervals(frame)), width="stretch")
    else:
        st.info(f"The write filter declined no host-tier writes in the last {minutes} minutes.")
    with st.expander("Raw intervals"):
        st.dataframe(frame.drop(columns=["ts"]), hide_index=True, width="stretch")


live()
