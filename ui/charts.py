"""Altair (Vega-Lite) charts for the dashboard, built from the frames in ``ui.tables``.

Vega-Lite is what ``st.altair_chart`` renders, so the same chart appears in the browser, in
Streamlit's AppTest (``at.get("vega_lite_chart")``) and in the screenshots under docs/figures/ui/.
"""

from __future__ import annotations

from typing import Final

import altair as alt
import pandas as pd  # type: ignore[import-untyped]

TIER_COLORS: Final = {"gpu": "#2e7d32", "host": "#1565c0", "recomputed": "#c62828"}
TIER_SCALE: Final = alt.Scale(domain=list(TIER_COLORS), range=list(TIER_COLORS.values()))
ACCURACY_COLOR: Final = "#1565c0"
COUNT_COLOR: Final = "#00695c"
HEIGHT: Final = 260
# the page images are checked for these colours (tests/test_ui_live.py): keep them distinct
MRC_COLORS: Final = {"hit ratio (all tiers)": "#2e7d32", "host-tier hit ratio": "#1565c0"}
MARK_COLORS: Final = {"current": "#424242", "recommended": "#ef6c00"}

AnyChart = alt.Chart | alt.LayerChart | alt.FacetChart
# the history's ts are UTC wall-clock seconds; say so, and show seconds (runs are short)
TIME_X: Final = alt.X("time:T", title="time (UTC)", axis=alt.Axis(format="%H:%M:%S"))
TIME_TIP: Final = alt.Tooltip("time:T", format="%H:%M:%S", title="time (UTC)")


def hit_ratio_over_time(long: pd.DataFrame) -> AnyChart:
    """Hit ratio per tier per interval (and the recomputed share), as lines."""
    chart: AnyChart = (
        alt.Chart(long, height=HEIGHT, title="Prompt blocks by where they came from")
        .mark_line(point=True)
        .encode(
            x=TIME_X,
            y=alt.Y("ratio:Q", title="share of prompt blocks", axis=alt.Axis(format="%")),
            color=alt.Color("tier:N", scale=TIER_SCALE, title="tier"),
            tooltip=[TIME_TIP, "tier:N", alt.Tooltip("ratio:Q", format=".1%")],
        )
    )
    return chart


def saved_tokens_over_time(frame: pd.DataFrame) -> AnyChart:
    """Cumulative recomputed prompt tokens saved against the LRU counterfactual."""
    chart: AnyChart = (
        alt.Chart(frame, height=HEIGHT, title="Recomputed tokens saved vs LRU (cumulative)")
        .mark_area(line=True, opacity=0.3, color="#6a1b9a")
        .encode(
            x=TIME_X,
            y=alt.Y("saved_tokens_cum:Q", title="tokens saved"),
            tooltip=[TIME_TIP, alt.Tooltip("saved_tokens_cum:Q", format=",.0f")],
        )
    )
    return chart


def bytes_over_time(long: pd.DataFrame) -> AnyChart:
    """MiB written to and loaded from the host tier per interval."""
    chart: AnyChart = (
        alt.Chart(long, height=HEIGHT, title="Host-tier traffic per interval")
        .mark_line(point=True)
        .encode(
            x=TIME_X,
            y=alt.Y("mib:Q", title="MiB per interval"),
            color=alt.Color(
                "direction:N",
                scale=alt.Scale(
                    domain=["written to host", "loaded from host"], range=["#1565c0", "#6a1b9a"]
                ),
                title=None,
            ),
            tooltip=[TIME_TIP, "direction:N", alt.Tooltip("mib:Q", format=",.2f")],
        )
    )
    return chart


def declines_over_time(frame: pd.DataFrame) -> AnyChart:
    """Blocks the write filter declined to store on the host, per interval."""
    chart: AnyChart = (
        alt.Chart(frame, height=HEIGHT, title="Write-filter declines per interval")
        .mark_bar(color="#ef6c00")
        .encode(
            x=TIME_X,
            y=alt.Y("write_declined_blocks:Q", title="blocks declined"),
            tooltip=[TIME_TIP, "write_declined_blocks:Q"],
        )
    )
    return chart


def mrc_chart(
    long: pd.DataFrame, current_gib: float | None, recommended_gib: float | None
) -> AnyChart:
    """Hit ratio vs host capacity, with the current size and the recommendation as rules."""
    curve = (
        alt.Chart(long)
        .mark_line(point=alt.OverlayMarkDef(size=20))
        .encode(
            x=alt.X("capacity_gib:Q", title="host-tier capacity (GiB)"),
            y=alt.Y("value:Q", title="hit ratio", axis=alt.Axis(format="%")),
            color=alt.Color(
                "curve:N",
                scale=alt.Scale(domain=list(MRC_COLORS), range=list(MRC_COLORS.values())),
                title=None,
                legend=alt.Legend(orient="bottom"),
            ),
            tooltip=[
                alt.Tooltip("capacity_gib:Q", format=",.2f"),
                "curve:N",
                alt.Tooltip("value:Q", format=".1%"),
            ],
        )
    )
    marks = pd.DataFrame(
        [
            {"capacity_gib": gib, "mark": label, "label_y": label_y}
            for gib, label, label_y in (
                (current_gib, "current", 4),
                (recommended_gib, "recommended", 20),  # below, in case the two are close
            )
            if gib is not None
        ],
        columns=["capacity_gib", "mark", "label_y"],
    )
    mark_colors = alt.Scale(domain=list(MARK_COLORS), range=list(MARK_COLORS.values()))
    rules = (
        alt.Chart(marks)
        .mark_rule(strokeDash=[6, 3], strokeWidth=2)
        .encode(
            x="capacity_gib:Q",
            color=alt.Color("mark:N", scale=mark_colors, title=None),
            tooltip=["mark:N", alt.Tooltip("capacity_gib:Q", format=",.2f")],
        )
    )
    labels = (
        alt.Chart(marks)
        .mark_text(align="left", dx=4, dy=-6, baseline="top", fontWeight="bold")
        .encode(
            x="capacity_gib:Q",
            y=alt.Y("label_y:Q", scale=None),
            text="mark:N",
            color=alt.Color("mark:N", scale=mark_colors, legend=None),
        )
    )
    chart: AnyChart = alt.layer(
        curve, rules, labels, height=320, title="Miss-ratio curve (as hit ratio)"
    ).resolve_scale(color="independent")
    return chart


def series_over_time(frame: pd.DataFrame, column: str, title: str, y_title: str) -> AnyChart:
    """One numeric column over time as a line."""
    chart: AnyChart = (
        alt.Chart(frame, height=HEIGHT, title=title)
        .mark_line(point=True)
        .encode(
            x=TIME_X,
            y=alt.Y(f"{column}:Q", title=y_title),
            tooltip=[TIME_TIP, alt.Tooltip(f"{column}:Q", format=",.3g")],
        )
    )
    return chart


def accuracy_bars(frame: pd.DataFrame) -> AnyChart:
    """Rolling top-1 accuracy per lookahead step."""
    chart: AnyChart = (
        alt.Chart(frame, height=HEIGHT, title="Rolling top-1 accuracy per step")
        .mark_bar(color=ACCURACY_COLOR)
        .encode(
            x=alt.X("step:O", title="steps ahead"),
            y=alt.Y("accuracy:Q", title="accuracy", scale=alt.Scale(domain=[0, 1])),
            tooltip=["step:O", alt.Tooltip("accuracy:Q", format=".1%")],
        )
    )
    return chart


def accuracy_over_time(frame: pd.DataFrame) -> AnyChart:
    """Top-1 accuracy per step per time bucket (from the predictions history)."""
    chart: AnyChart = (
        alt.Chart(frame, height=HEIGHT, title="Accuracy over time per step")
        .mark_line(point=True)
        .encode(
            x=TIME_X,
            y=alt.Y("accuracy:Q", scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%")),
            color=alt.Color("step:O", title="step"),
            tooltip=[TIME_TIP, "step:O", alt.Tooltip("accuracy:Q", format=".1%"), "n:Q"],
        )
    )
    return chart


def reliability_chart(frame: pd.DataFrame) -> AnyChart:
    """Calibration: observed frequency vs predicted probability per bin, with the diagonal."""
    diagonal = (
        alt.Chart(pd.DataFrame({"p": [0.0, 1.0]}))
        .mark_line(strokeDash=[4, 4], color="#9e9e9e")
        .encode(x="p:Q", y="p:Q")
    )
    points = (
        alt.Chart(frame)
        .mark_line(point=alt.OverlayMarkDef(size=60, filled=True), color="#c62828")
        .encode(
            x=alt.X("predicted:Q", title="predicted probability", scale=alt.Scale(domain=[0, 1])),
            y=alt.Y("observed:Q", title="observed frequency", scale=alt.Scale(domain=[0, 1])),
            tooltip=[
                alt.Tooltip("predicted:Q", format=".2f"),
                alt.Tooltip("observed:Q", format=".2f"),
                "n:Q",
            ],
        )
    )
    chart: AnyChart = alt.layer(
        diagonal, points, height=HEIGHT, title="Calibration (top-1 predictions)"
    )
    return chart


def probability_heatmap(long: pd.DataFrame) -> AnyChart:
    """Predicted next-agent probabilities: workflow x agent, one panel per step."""
    chart: AnyChart = (
        alt.Chart(long, title="Next-agent probabilities per workflow")
        .mark_rect()
        .encode(
            x=alt.X("agent:N", title=None),
            y=alt.Y("workflow_id:N", title=None),
            color=alt.Color(
                "probability:Q", scale=alt.Scale(scheme="blues", domain=[0, 1]), title="p"
            ),
            column=alt.Column("step:O", title="steps ahead"),
            tooltip=[
                "workflow_id:N",
                "step:O",
                "agent:N",
                alt.Tooltip("probability:Q", format=".2f"),
            ],
        )
    )
    return chart


def counts_bar(frame: pd.DataFrame, category: str, title: str) -> AnyChart:
    """Horizontal bars of ``n`` per ``category`` (e.g. decisions by reason)."""
    chart: AnyChart = (
        alt.Chart(frame, title=title, height=alt.Step(24))
        .mark_bar(color=COUNT_COLOR)
        .encode(
            x=alt.X("n:Q", title="count"),
            y=alt.Y(
                f"{category}:N",
                sort="-x",
                title=None,
                axis=alt.Axis(labelLimit=360, labelOverlap=False),
            ),
            tooltip=[f"{category}:N", "n:Q"],
        )
    )
    return chart
