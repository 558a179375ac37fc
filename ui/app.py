"""AgentKV dashboard: ``streamlit run ui/app.py -- --api http://127.0.0.1:8470 [--token T]``.

A Streamlit multipage app (``st.navigation``) over the daemon's HTTP API only (docs/UI.md). The
sidebar holds the connection (API URL, token), the refresh interval and a pause toggle; each page
refreshes its live parts in a fragment and shows a banner, not a traceback, when the daemon is down,
slow or refuses a request.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # `streamlit run ui/app.py` puts ui/ on sys.path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import streamlit as st

from ui import charts, connection, tables  # noqa: F401 - imported once per server, not per page
from ui.client import ApiError
from ui.views import PAGES, PAGES_DIR


def sidebar() -> None:
    """Connection and refresh controls, and a one-line daemon status that refreshes itself."""
    key, keep = connection.widget_key, connection.keep
    with st.sidebar:
        st.text_input(
            "API URL",
            key=key(connection.KEY_URL),
            on_change=keep,
            args=(connection.KEY_URL,),
            help="The daemon's HTTP API.",
        )
        st.text_input(
            "API token",
            key=key(connection.KEY_TOKEN),
            on_change=keep,
            args=(connection.KEY_TOKEN,),
            type="password",
            help="Bearer token for admin calls (POLICYD_API_TOKEN); empty if none is set.",
        )
        st.number_input(
            "Refresh every (s)",
            min_value=1.0,
            max_value=600.0,
            step=1.0,
            key=key(connection.KEY_REFRESH),
            on_change=keep,
            args=(connection.KEY_REFRESH,),
        )
        st.toggle(
            "Pause live refresh",
            key=key(connection.KEY_PAUSED),
            on_change=keep,
            args=(connection.KEY_PAUSED,),
        )


def status() -> None:
    """Daemon status line in the sidebar, refreshed at the live interval."""
    st.fragment(_status, run_every=connection.live_interval())()


def _status() -> None:
    """Daemon status line in the sidebar."""
    try:
        stats = connection.client().stats()
    except ApiError as err:
        st.caption(f":red[● {err.title}]")
        return
    policy = stats.get("policy", "?")
    uptime_s = float(stats.get("uptime_s") or 0.0)
    st.caption(f":green[● connected] · policy **{policy}** · up {uptime_s:,.0f} s")


def main() -> None:
    st.set_page_config(page_title="AgentKV", page_icon=":material/memory:", layout="wide")
    connection.init_session(sys.argv[1:])
    pages = [
        st.Page(
            str(PAGES_DIR / file),
            title=title,
            icon=icon,
            url_path=url_path,
            default=index == 0,
        )
        for index, (file, title, icon, url_path) in enumerate(PAGES)
    ]
    page = st.navigation(pages)
    sidebar()
    page.run()
    with st.sidebar:  # after the page, so that its content is not held up by this call
        status()


main()
