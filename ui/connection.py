"""Which daemon the dashboard talks to, how often it refreshes, and the banner for failures.

The address and token are read once per session, first match wins: the sidebar (session
state), ``streamlit run ui/app.py -- --api URL --token T``, then ``POLICYD_API_URL`` /
``POLICYD_API_TOKEN``, then the default ``http://127.0.0.1:8470``. Likewise the refresh period
(``--refresh-s`` / ``POLICYD_UI_REFRESH_S``, default 5 s) and the read timeout of each call
(``--timeout-s`` / ``POLICYD_UI_TIMEOUT_S``, default 5 s). Pages call
``client()`` and ``live_interval()`` and hand any ``ApiError`` to ``banner()``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

import streamlit as st

from ui.client import DEFAULT_API_URL, READ_TIMEOUT_S, ApiError, Client, DaemonRejectedError

DEFAULT_REFRESH_S: Final = 5.0
# the session's values; the sidebar's widgets use these keys with a "w_" prefix and copy their
# value back on change (a widget's own key is dropped on page switches, these are not)
KEY_URL: Final = "api_url"
KEY_TOKEN: Final = "api_token"
KEY_REFRESH: Final = "refresh_s"
KEY_PAUSED: Final = "paused"
KEY_TIMEOUT: Final = "timeout_s"
WIDGET_PREFIX: Final = "w_"


@dataclass(frozen=True)
class Target:
    """Where the daemon is and how to authenticate to it."""

    url: str
    token: str | None
    refresh_s: float
    timeout_s: float


def resolve_target(argv: Sequence[str], env: dict[str, str] | os._Environ[str]) -> Target:
    """The daemon address from command-line arguments, then the environment, then the default."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--api", default=None)
    parser.add_argument("--token", default=None)
    parser.add_argument("--refresh-s", type=float, default=None)
    parser.add_argument("--timeout-s", type=float, default=None)
    args, _ = parser.parse_known_args(list(argv))
    url = args.api or env.get("POLICYD_API_URL") or DEFAULT_API_URL
    token = args.token or env.get("POLICYD_API_TOKEN") or None
    refresh = _seconds(args.refresh_s, env.get("POLICYD_UI_REFRESH_S"), DEFAULT_REFRESH_S)
    timeout = _seconds(args.timeout_s, env.get("POLICYD_UI_TIMEOUT_S"), READ_TIMEOUT_S)
    return Target(url=url.rstrip("/"), token=token, refresh_s=max(refresh, 1.0), timeout_s=timeout)


def _seconds(given: float | None, env_value: str | None, default: float) -> float:
    """The first usable positive number of seconds: the argument, the environment, the default."""
    if given is not None and given > 0:
        return given
    try:
        value = float(env_value) if env_value else default
    except ValueError:
        return default
    return value if value > 0 else default


def init_session(argv: Sequence[str]) -> None:
    """Seed the session's connection settings once; the sidebar may change them afterwards."""
    if KEY_URL in st.session_state:
        return
    target = resolve_target(argv, os.environ)
    st.session_state[KEY_URL] = target.url
    st.session_state[KEY_TOKEN] = target.token or ""
    st.session_state[KEY_REFRESH] = target.refresh_s
    st.session_state[KEY_PAUSED] = False
    st.session_state[KEY_TIMEOUT] = target.timeout_s


def widget_key(key: str) -> str:
    """The sidebar widget's key for a session value, seeded from that value for this run."""
    wkey = WIDGET_PREFIX + key
    st.session_state[wkey] = st.session_state[key]
    return wkey


def keep(key: str) -> None:
    """Widget callback: copy the widget's new value into the session value."""
    st.session_state[key] = st.session_state[WIDGET_PREFIX + key]


def client() -> Client:
    """A client for the daemon this session points at."""
    url = str(st.session_state.get(KEY_URL) or DEFAULT_API_URL).strip()
    token = str(st.session_state.get(KEY_TOKEN) or "").strip() or None
    timeout_s = float(st.session_state.get(KEY_TIMEOUT, READ_TIMEOUT_S))
    return Client(base_url=url, token=token, read_timeout_s=timeout_s)


def live_interval() -> timedelta | None:
    """The refresh period for live fragments; None while paused."""
    if st.session_state.get(KEY_PAUSED, False):
        return None
    return timedelta(seconds=float(st.session_state.get(KEY_REFRESH, DEFAULT_REFRESH_S)))


def banner(err: ApiError, *, what: str = "") -> None:
    """One clear error box for a failed call (never a traceback)."""
    context = f" while loading {what}" if what else ""
    if isinstance(err, DaemonRejectedError):
        st.error(f"**{err.title}**{context} (HTTP {err.status}): {err}", icon="🚫")
    else:
        st.error(
            f"**{err.title}**{context}: {err}  \n"
            f"Check that `policyd serve` runs and that the sidebar's API URL is right.",
            icon="⚠️",
        )
