"""SQL: a read-only query over the daemon's history (POST /api/sql, run by the daemon on its
published snapshot), with saved example queries; a refusal is shown as an error box. When the
daemon has a fleet history (GET /api/fleet), a switch runs the query over every replica's
history instead (each table with a ``replica`` column)."""

from __future__ import annotations

import pandas as pd  # type: ignore[import-untyped]
import streamlit as st

from ui import connection, tables
from ui.client import ApiError, DaemonRejectedError

EXAMPLES = {
    "Hit ratio per minute": """SELECT time_bucket(INTERVAL 1 MINUTE, to_timestamp(ts)) AS minute,
       sum(gpu_hit_blocks) / nullif(sum(prompt_blocks), 0) AS gpu_hit_ratio,
       sum(host_hit_blocks) / nullif(sum(prompt_blocks), 0) AS host_hit_ratio,
       sum(prompt_blocks) AS prompt_blocks
FROM cache_stats GROUP BY minute ORDER BY minute""",
    "Top workflows by recomputed blocks": """SELECT workflow_id, workflow_type,
       count(*) AS requests, sum(recomputed_blocks) AS recomputed_blocks,
       sum(prompt_blocks) AS prompt_blocks
FROM requests GROUP BY ALL ORDER BY recomputed_blocks DESC LIMIT 20""",
    "Prediction accuracy per step": """SELECT step, count(*) AS resolved,
       avg(CASE WHEN correct THEN 1.0 ELSE 0.0 END) AS accuracy,
       avg(probability) AS mean_probability
FROM predictions WHERE correct IS NOT NULL GROUP BY step ORDER BY step""",
    "Decisions by reason": """SELECT kind, reason, count(*) AS n, sum(n_blocks) AS blocks
FROM decisions GROUP BY ALL ORDER BY n DESC LIMIT 30""",
    "Settings changes": """SELECT to_timestamp(ts) AS at, key, old_value, new_value, actor
FROM settings_changes ORDER BY ts DESC""",
}
KEY_SQL = "sql_text"
KEY_EXAMPLE = "sql_example"
KEY_RESULT = "sql_result"  # the last query's answer (or error), shown until the next run
KEY_SCOPE = "sql_scope"
THIS_REPLICA = "this replica"
THE_FLEET = "the fleet"


def _load_example() -> None:
    st.session_state[KEY_SQL] = EXAMPLES[st.session_state[KEY_EXAMPLE]]


st.title("SQL over the history")
st.caption(
    "Read-only DuckDB SQL on the daemon's published history snapshot: no file or network "
    "access, time and row limits. Tables: requests, block_accesses, decisions, predictions, "
    "mrc_points, sizing, cache_stats, settings_changes."
)
st.session_state.setdefault(KEY_SQL, next(iter(EXAMPLES.values())))
st.selectbox("Saved examples", list(EXAMPLES), key=KEY_EXAMPLE, on_change=_load_example)
sql = st.text_area("Query", key=KEY_SQL, height=160)


def fleet_available() -> bool:
    """Whether to offer the switch; a daemon that cannot say is treated as having no fleet
    (the query's own call shows the banner)."""
    try:
        return connection.client().fleet_enabled()
    except ApiError:
        return False


fleet = False
if fleet_available():
    scope = st.radio(
        "History", (THIS_REPLICA, THE_FLEET), horizontal=True, key=KEY_SCOPE,
        help="the fleet: every replica's exported history, each table with a replica column",
    )  # fmt: skip
    fleet = scope == THE_FLEET
controls = st.columns([1, 1, 4])
max_rows = int(
    controls[0].number_input("Max rows", min_value=1, max_value=10_000, value=1000, key="sql_max")
)
run = controls[1].button("Run query", type="primary", key="sql_run")


def execute(query: str, limit: int, over_fleet: bool) -> dict[str, object] | ApiError:
    try:
        return connection.client().sql(query, max_rows=limit, fleet=over_fleet)
    except ApiError as err:
        return err


def show(outcome: dict[str, object] | ApiError) -> None:
    if isinstance(outcome, DaemonRejectedError):
        st.error(f"Query refused: {outcome}", icon="🚫")
        return
    if isinstance(outcome, ApiError):
        connection.banner(outcome, what="the query")
        return
    frame = tables.sql_frame(outcome)
    snapshot_ts = outcome.get("snapshot_ts")
    as_of = ""
    if isinstance(snapshot_ts, int | float):
        when = pd.to_datetime(float(snapshot_ts), unit="s", utc=True)
        as_of = f" · snapshot of {when:%H:%M:%S} UTC"
    fleet_info = outcome.get("fleet")
    if isinstance(fleet_info, dict):
        replicas = fleet_info.get("replicas")
        count = len(replicas) if isinstance(replicas, list) else "?"
        as_of = f" · the fleet: {count} replicas, {fleet_info.get('segments', '?')} segments"
    more = " (truncated at max rows)" if outcome.get("truncated") else ""
    elapsed_ms = outcome.get("elapsed_ms")
    took = f"{elapsed_ms:,.1f} ms" if isinstance(elapsed_ms, int | float) else "?"
    st.caption(f"{len(frame):,} rows{more} in {took}{as_of}")
    st.dataframe(frame, hide_index=True, width="stretch")


# the first visit runs the first example, so the page opens on an answer
if run or KEY_RESULT not in st.session_state:
    st.session_state[KEY_RESULT] = execute(sql, max_rows, fleet)
show(st.session_state[KEY_RESULT])
