"""The tuning form: one widget per daemon setting, chosen by the setting's declared type.

The daemon is the validator: number inputs carry no client-side bounds (the daemon's ranges
can be open, e.g. ``discount`` in (0, 1]), so an out-of-range value reaches the daemon and its
error is shown verbatim. Choices become a select box, so only valid names are offered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import streamlit as st

SEEN_KEY: Final = "settings_seen"  # the daemon's values the widgets were last synced to

Setting = Mapping[str, Any]


def widget_key(key: str) -> str:
    return f"setting:{key}"


def _help(setting: Setting) -> str:
    bounds = []
    if setting.get("min") is not None:
        op = ">" if setting.get("min_exclusive") else ">="
        bounds.append(f"{op} {setting['min']}")
    if setting.get("max") is not None:
        bounds.append(f"<= {setting['max']}")
    text = str(setting.get("help") or "")
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _as_int(value: object) -> int:
    return int(value)  # type: ignore[call-overload, no-any-return]


def _as_float(value: object) -> float:
    return float(value)  # type: ignore[arg-type]


def _as_bool(value: object) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in {"1", "true", "yes", "on"}


def _as_str(value: object) -> str:
    return "" if value is None else str(value)


def _int_input(setting: Setting) -> None:
    st.number_input(setting["key"], step=1, key=widget_key(setting["key"]), help=_help(setting))


def _float_input(setting: Setting) -> None:
    top = setting.get("max")
    step = 0.05 if top is not None and float(top) <= 1.0 else 0.5
    st.number_input(
        setting["key"], step=step, format="%g", key=widget_key(setting["key"]), help=_help(setting)
    )


def _bool_input(setting: Setting) -> None:
    st.checkbox(setting["key"], key=widget_key(setting["key"]), help=_help(setting))


def _str_input(setting: Setting) -> None:
    choices = setting.get("choices")
    if choices:
        st.selectbox(
            setting["key"],
            [str(c) for c in choices],
            key=widget_key(setting["key"]),
            help=_help(setting),
        )
    else:
        st.text_input(setting["key"], key=widget_key(setting["key"]), help=_help(setting))


# type name -> (widget, coercion of the daemon's value to the widget's value)
WIDGETS: Final[dict[str, tuple[Callable[[Setting], None], Callable[[object], Any]]]] = {
    "int": (_int_input, _as_int),
    "integer": (_int_input, _as_int),
    "float": (_float_input, _as_float),
    "number": (_float_input, _as_float),
    "bool": (_bool_input, _as_bool),
    "boolean": (_bool_input, _as_bool),
    "str": (_str_input, _as_str),
    "string": (_str_input, _as_str),
    "choice": (_str_input, _as_str),
    "enum": (_str_input, _as_str),
}


def _kind(setting: Setting) -> tuple[Callable[[Setting], None], Callable[[object], Any]]:
    kind = str(setting.get("type") or "str").lower()
    if setting.get("choices"):
        kind = "str"
    return WIDGETS.get(kind, WIDGETS["str"])


def sync_widgets(settings: Sequence[Setting]) -> None:
    """Set each widget to the daemon's value when that value changed since the last sync (a
    change made elsewhere shows up); a value the user typed and the daemon refused stays."""
    seen: dict[str, object] = st.session_state.setdefault(SEEN_KEY, {})
    for setting in settings:
        key, value = str(setting["key"]), setting.get("value")
        if key in seen and seen[key] == value and widget_key(key) in st.session_state:
            continue
        if value is None:
            continue
        _, coerce = _kind(setting)
        try:
            st.session_state[widget_key(key)] = coerce(value)
        except (TypeError, ValueError):
            st.session_state[widget_key(key)] = str(value)
        seen[key] = value


def widget(setting: Setting) -> None:
    """The input for one setting."""
    render, _ = _kind(setting)
    render(setting)


def changes(settings: Sequence[Setting]) -> dict[str, object]:
    """The settings whose widget differs from the daemon's current value."""
    out: dict[str, object] = {}
    for setting in settings:
        key = str(setting["key"])
        if widget_key(key) not in st.session_state:
            continue
        value = st.session_state[widget_key(key)]
        _, coerce = _kind(setting)
        try:
            current = coerce(setting.get("value"))
        except (TypeError, ValueError):
            current = setting.get("value")
        if value != current:
            out[key] = value
    return out


def mark_applied(settings: Sequence[Setting]) -> None:
    """Remember the daemon's values after a successful update (the widgets already show them)."""
    seen: dict[str, object] = st.session_state.setdefault(SEEN_KEY, {})
    for setting in settings:
        seen[str(setting["key"])] = setting.get("value")
