"""Tuning: the daemon's settings (GET /api/settings) as a form built from their JSON Schema; a
change is PUT to the daemon, which validates it (its error is shown verbatim), applies it live and
records it in the settings history (GET /api/settings/history)."""

from __future__ import annotations

import streamlit as st

from ui import connection, settings_form, tables
from ui.client import ApiError, DaemonRejectedError, LiveSettings

st.title("Tuning")
st.caption(
    "The daemon validates every change and applies all or none; bounds shown in each help text "
    "are the daemon's."
)

api = connection.client()
live: LiveSettings | None = None
try:
    live = api.live_settings()
except ApiError as err:
    connection.banner(err, what="the settings")

if live is not None:
    fields = settings_form.form_fields(live.schema)
    settings_form.sync_widgets(fields, live.values)
    with st.form("settings"):
        columns = st.columns(2)
        for index, field in enumerate(fields):
            with columns[index % 2]:
                settings_form.widget(field)
        submitted = st.form_submit_button("Apply changes", type="primary")
    if submitted:
        changes = settings_form.changes(fields, live.values)
        if not changes:
            st.info("Nothing changed.")
        else:
            try:
                applied = api.update_settings(changes)
            except DaemonRejectedError as err:
                st.error(f"The daemon refused the change (HTTP {err.status}): {err}", icon="🚫")
                for key, message in err.errors.items():
                    st.error(f"`{key}`: {message}")
            except ApiError as err:
                connection.banner(err, what="the settings update")
            else:
                settings_form.mark_applied(settings_form.values_of(applied))
                summary = ", ".join(f"`{k}` = `{v}`" for k, v in changes.items())
                st.success(f"Applied live: {summary}")

st.subheader("History of changes")
try:
    history = api.settings_history()
except ApiError as err:
    connection.banner(err, what="the settings history")
else:
    frame = tables.log_frame(history, first=("time", "key", "old_value", "new_value"))
    if frame.empty:
        st.info("No settings changes recorded yet.")
    else:
        st.dataframe(frame, hide_index=True, width="stretch")
