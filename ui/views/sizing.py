"""Host-tier sizing: the MRC (hit ratio vs host capacity in GiB) with the current size and the
recommendation marked, the working set over time and the expected effect of resizing
(GET /api/sizing; the history's ``sizing`` table through POST /api/sql)."""

from __future__ import annotations

from typing import Any

import streamlit as st

from ui import charts, connection, tables
from ui.client import ApiError

SIZING_SQL = """
SELECT ts, working_set_blocks, current_host_gib, recommended_host_gib, achievable_hit_ratio
FROM sizing ORDER BY ts DESC LIMIT 2000
"""

st.title("Host-tier sizing")
st.caption(
    "The miss-ratio curve the daemon estimates online (SHARDS), as hit ratio against the "
    "host tier's capacity; the dashed rules mark the current size and the recommendation."
)


def _gib(value: Any) -> str:
    return "—" if value is None else f"{float(value):,.2f} GiB"


def _tokens(value: Any) -> str:
    return "—" if value is None else f"{float(value):,.0f}"


@st.fragment(run_every=connection.live_interval())
def live() -> None:
    api = connection.client()
    try:
        sizing = api.sizing()
    except ApiError as err:
        connection.banner(err, what="the sizing estimate")
        return
    current = sizing.get("current_host_gib")
    recommended = sizing.get("recommended_host_gib")
    top = st.columns(4)
    top[0].metric("current host tier", _gib(current))
    top[1].metric("recommended", _gib(recommended))
    top[2].metric("working set", _gib(sizing.get("working_set_gib")))
    top[3].metric("closed-form estimate", _gib(sizing.get("closed_form_gib")))
    if sizing.get("reason"):
        st.info(f"**Recommendation:** {sizing['reason']}")

    long = tables.mrc_frame(sizing)
    if long.empty:
        st.info("No MRC yet: the estimator needs block accesses first.")
    else:
        st.altair_chart(
            charts.mrc_chart(
                long,
                None if current is None else float(current),
                None if recommended is None else float(recommended),
            ),
            width="stretch",
        )

    st.subheader("Expected effect of resizing")
    effect = st.columns(3)
    at_current = None if current is None else tables.hit_ratio_at(sizing, float(current))
    at_recommended = (
        None if recommended is None else tables.hit_ratio_at(sizing, float(recommended))
    )
    effect[0].metric(
        "hit ratio: current → recommended",
        tables.percent(at_recommended),
        delta=None
        if at_current is None or at_recommended is None
        else f"{(at_recommended - at_current) * 100:+.1f} pp",
        help=f"At the current size: {tables.percent(at_current)} (read off the MRC).",
    )
    rec_now = sizing.get("recomputed_tokens_current")
    rec_new = sizing.get("recomputed_tokens_recommended")
    effect[1].metric(
        "recomputed tokens: current → recommended",
        _tokens(rec_new),
        delta=None
        if rec_now is None or rec_new is None
        else f"{float(rec_new) - float(rec_now):+,.0f}",
        delta_color="inverse",
        help=f"At the current size: {_tokens(rec_now)}.",
    )
    coverage = sizing.get("coverage_gib") or {}
    effect[2].metric(
        "size for 90 % of achievable hits",
        _gib(coverage.get("0.9")),
        help="; ".join(f"{float(k):.0%}: {_gib(v)}" for k, v in coverage.items()) or None,
    )
    if not long.empty:
        top_gib = float(long["capacity_gib"].max())
        what_if = st.slider(
            "What if the host tier were (GiB)",
            min_value=0.0,
            max_value=max(top_gib, 0.01),
            value=min(float(recommended or 0.0), top_gib),
            key="what_if_gib",
        )
        st.write(
            f"Expected hit ratio at **{what_if:,.2f} GiB**: "
            f"**{tables.percent(tables.hit_ratio_at(sizing, what_if))}** "
            f"(host-tier share "
            f"{tables.percent(tables.hit_ratio_at(sizing, what_if, 'host_hit_ratio'))})."
        )

    try:
        history = tables.with_time(tables.sql_frame(api.sql(SIZING_SQL)))
    except ApiError as err:
        connection.banner(err, what="the working set over time")
    else:
        if history.empty:
            st.info("No sizing history recorded yet.")
        else:
            st.altair_chart(
                charts.series_over_time(
                    history, "working_set_blocks", "Working set over time", "blocks"
                ),
                width="stretch",
            )
    with st.expander("Estimator"):
        st.json(sizing.get("estimator") or {})


live()
