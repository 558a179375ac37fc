"""Decisions: a searchable log of the daemon's evict / admit / decline / prefetch / pin / retire
decisions with their reasons (GET /api/decisions?limit=&kind=&q=)."""

from __future__ import annotations

import streamlit as st

from ui import charts, connection, tables
from ui.client import ApiError

KINDS = ("", "evict", "admit", "decline", "prefetch", "pin", "retire")

st.title("Decisions")
st.caption("Newest first. The search matches reasons, workflow ids and request ids.")
search = st.columns([3, 1, 1])
query = search[0].text_input("Search", key="decisions_q", placeholder="e.g. retired or wf-3")
kind = search[1].selectbox(
    "Kind", KINDS, key="decisions_kind", format_func=lambda k: k or "all kinds"
)
limit = int(
    search[2].number_input(
        "Rows", min_value=10, max_value=1000, value=500, step=50, key="decisions_limit"
    )
)


@st.fragment(run_every=connection.live_interval())
def live() -> None:
    try:
        rows = connection.client().decisions(limit=limit, kind=kind, q=query.strip())
    except ApiError as err:
        connection.banner(err, what="decisions")
        return
    frame = tables.decisions_frame(rows)
    if frame.empty:
        st.info("No decisions match." if query or kind else "No decisions recorded yet.")
        return
    st.caption(f"{len(frame):,} decisions shown.")
    left, right = st.columns([1, 2])
    with left:
        by_kind = frame.groupby("kind").size().reset_index(name="n")
        st.altair_chart(charts.counts_bar(by_kind, "kind", "Decisions by kind"), width="stretch")
    with right:
        shapes = frame["reason"].map(tables.reason_shape).rename("reason")
        by_reason = shapes.groupby(shapes).size().reset_index(name="n").nlargest(12, "n")
        st.altair_chart(
            charts.counts_bar(by_reason, "reason", "Most frequent reasons"), width="stretch"
        )
    st.dataframe(frame, hide_index=True, width="stretch")


live()
