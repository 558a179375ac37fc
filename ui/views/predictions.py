"""Predictions: active workflows with their next-K agent probabilities, what actually happened,
rolling accuracy per step, calibration and drift alarms (GET /api/predictions; the history's
``predictions`` table through POST /api/sql for accuracy over time and the reliability diagram)."""

from __future__ import annotations

import pandas as pd  # type: ignore[import-untyped]
import streamlit as st

from ui import charts, connection, tables
from ui.client import ApiError

ACCURACY_SQL = """
WITH r AS (SELECT ts, step, correct FROM predictions WHERE correct IS NOT NULL),
     b AS (SELECT min(ts) AS t0, greatest((max(ts) - min(ts)) / 20, 1) AS w FROM r)
SELECT t0 + floor((ts - t0) / w) * w AS ts, step,
       avg(CASE WHEN correct THEN 1.0 ELSE 0.0 END) AS accuracy, count(*) AS n
FROM r, b GROUP BY ALL ORDER BY ts, step
"""  # about 20 time buckets over whatever span the history holds
CALIBRATION_SQL = """
SELECT least(floor(probability * 10), 9) / 10 AS bin, avg(probability) AS predicted,
       avg(CASE WHEN correct THEN 1.0 ELSE 0.0 END) AS observed, count(*) AS n
FROM predictions WHERE correct IS NOT NULL GROUP BY ALL ORDER BY bin
"""

st.title("Next-agent predictions")
st.caption(
    "What the daemon expects each active workflow to run next, K steps ahead, and how often "
    "it was right."
)


@st.fragment(run_every=connection.live_interval())
def live() -> None:
    api = connection.client()
    try:
        payload = api.predictions()
    except ApiError as err:
        connection.banner(err, what="predictions")
        return
    drift = payload.get("drift") or {}
    calibration = payload.get("calibration") or {}
    workflows = tables.workflow_table(payload)
    top = st.columns(4)
    top[0].metric("active workflows", f"{len(workflows):,}")
    top[1].metric("lookahead K", str(payload.get("k", "?")))
    cross_entropy = calibration.get("cross_entropy")
    top[2].metric(
        "cross-entropy (nats)", "—" if cross_entropy is None else f"{float(cross_entropy):.3f}"
    )
    alarms = int(drift.get("alarms") or 0)
    last = drift.get("last_ts")
    top[3].metric("drift alarms", f"{alarms:,}")
    if alarms and last is not None:
        when = pd.to_datetime(float(last), unit="s", utc=True)
        st.warning(
            f"Concept drift detected {alarms} time(s); the last alarm was at {when:%H:%M:%S} UTC."
        )

    st.subheader("Active workflows")
    if workflows.empty:
        st.info("No active workflows right now.")
    else:
        st.dataframe(workflows, hide_index=True, width="stretch")
        probabilities = tables.step_probabilities(payload)
        shown = probabilities[
            probabilities["workflow_id"].isin(workflows["workflow_id"].astype(str).head(25))
        ]
        st.altair_chart(charts.probability_heatmap(shown))

    left, right = st.columns(2)
    with left:
        accuracy = tables.accuracy_by_step(payload)
        if accuracy.empty:
            st.info("No resolved predictions yet: accuracy appears once workflows take steps.")
        else:
            st.altair_chart(charts.accuracy_bars(accuracy), width="stretch")
    with right:
        try:
            bins = tables.sql_frame(api.sql(CALIBRATION_SQL))
        except ApiError as err:
            connection.banner(err, what="calibration from the history")
        else:
            if bins.empty:
                st.info("No resolved predictions in the history yet.")
            else:
                st.altair_chart(charts.reliability_chart(bins), width="stretch")

    try:
        over_time = tables.with_time(tables.sql_frame(api.sql(ACCURACY_SQL)))
    except ApiError as err:
        connection.banner(err, what="accuracy over time")
    else:
        if not over_time.empty:
            st.altair_chart(charts.accuracy_over_time(over_time), width="stretch")

    st.subheader("Recent predictions and what happened")
    recent = tables.recent_predictions(payload)
    if recent.empty:
        st.info("No predictions recorded yet.")
    else:
        st.dataframe(recent, hide_index=True, width="stretch")


live()
