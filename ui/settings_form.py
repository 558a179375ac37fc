"""The tuning form, built from the JSON Schema of the daemon's tunables (``GET /api/settings``'s
``schema``): one widget per property, chosen by its JSON type; an ``enum`` is a select box, so
only valid names are offered. A widget's help is the property's ``description`` and its bounds.

The daemon is the validator: number inputs carry no client-side bounds (the daemon's ranges
can be open, e.g. ``discount`` in (0, 1]), so an out-of-range value reaches the daemon and its
error is shown verbatim.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import streamlit as st

SEEN_KEY: Final = "settings_seen"  # the daemon's values the widgets were last synced to


def widget_key(key: str) -> str:
    return f"setting:{key}"


@dataclass(frozen=True, slots=True)
class FormField:
    """One property of the schema: its JSON type (``integer``, ``number``, ``boolean``,
    ``string``), choices, bounds and help."""

    key: str
    kind: str
    help: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None
    exclusive_maximum: float | None = None

    @classmethod
    def of(cls, key: str, prop: Mapping[str, Any]) -> FormField:
        enum = prop.get("enum")
        return cls(
            key=key,
            kind=str(prop.get("type") or "string"),
            help=str(prop.get("description") or ""),
            choices=tuple(str(c) for c in enum) if isinstance(enum, list) else None,
            minimum=prop.get("minimum"),
            exclusive_minimum=prop.get("exclusiveMinimum"),
            maximum=prop.get("maximum"),
            exclusive_maximum=prop.get("exclusiveMaximum"),
        )

    def help_text(self) -> str:
        """The description, then the bounds: ``... (> 0, <= 1)``."""
        bounds = [
            f"{op} {bound}"
            for op, bound in (
                (">", self.exclusive_minimum),
                (">=", self.minimum),
                ("<", self.exclusive_maximum),
                ("<=", self.maximum),
            )
            if bound is not None
        ]
        return f"{self.help} ({', '.join(bounds)})" if bounds else self.help


def form_fields(schema: Mapping[str, Any]) -> list[FormField]:
    """The schema's properties as fields, in the schema's order."""
    properties = schema.get("properties") or {}
    return [FormField.of(str(key), prop) for key, prop in properties.items()]


def _as_int(value: object) -> int:
    return int(value)  # type: ignore[call-overload, no-any-return]


def _as_float(value: object) -> float:
    return float(value)  # type: ignore[arg-type]


def _as_bool(value: object) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in {"1", "true", "yes", "on"}


def _as_str(value: object) -> str:
    return "" if value is None else str(value)


def _int_input(field: FormField) -> None:
    st.number_input(field.key, step=1, key=widget_key(field.key), help=field.help_text())


def _float_input(field: FormField) -> None:
    top = field.maximum if field.maximum is not None else field.exclusive_maximum
    step = 0.05 if top is not None and float(top) <= 1.0 else 0.5
    st.number_input(
        field.key, step=step, format="%g", key=widget_key(field.key), help=field.help_text()
    )


def _bool_input(field: FormField) -> None:
    st.checkbox(field.key, key=widget_key(field.key), help=field.help_text())


def _str_input(field: FormField) -> None:
    if field.choices:
        st.selectbox(
            field.key, list(field.choices), key=widget_key(field.key), help=field.help_text()
        )
    else:
        st.text_input(field.key, key=widget_key(field.key), help=field.help_text())


# JSON type -> (widget, coercion of the daemon's value to the widget's value)
WIDGETS: Final[dict[str, tuple[Callable[[FormField], None], Callable[[object], Any]]]] = {
    "integer": (_int_input, _as_int),
    "number": (_float_input, _as_float),
    "boolean": (_bool_input, _as_bool),
    "string": (_str_input, _as_str),
}


def _kind(field: FormField) -> tuple[Callable[[FormField], None], Callable[[object], Any]]:
    if field.choices:
        return WIDGETS["string"]
    return WIDGETS.get(field.kind, WIDGETS["string"])


def sync_widgets(fields: Sequence[FormField], values: Mapping[str, object]) -> None:
    """Set each widget to the daemon's value when that value changed since the last sync (a
    change made elsewhere shows up); a value the user typed and the daemon refused stays."""
    seen: dict[str, object] = st.session_state.setdefault(SEEN_KEY, {})
    for field in fields:
        value = values.get(field.key)
        if (
            field.key in seen
            and seen[field.key] == value
            and widget_key(field.key) in (st.session_state)
        ):
            continue
        if value is None:
            continue
        _, coerce = _kind(field)
        try:
            st.session_state[widget_key(field.key)] = coerce(value)
        except (TypeError, ValueError):
            st.session_state[widget_key(field.key)] = str(value)
        seen[field.key] = value


def widget(field: FormField) -> None:
    """The input for one setting."""
    render, _ = _kind(field)
    render(field)


def changes(fields: Sequence[FormField], values: Mapping[str, object]) -> dict[str, object]:
    """The settings whose widget differs from the daemon's current value."""
    out: dict[str, object] = {}
    for field in fields:
        if widget_key(field.key) not in st.session_state:
            continue
        typed = st.session_state[widget_key(field.key)]
        _, coerce = _kind(field)
        try:
            current = coerce(values.get(field.key))
        except (TypeError, ValueError):
            current = values.get(field.key)
        if typed != current:
            out[field.key] = typed
    return out


def values_of(rows: Sequence[Mapping[str, Any]]) -> dict[str, object]:
    """``{key: value}`` from the daemon's settings rows (a ``PUT``'s answer)."""
    return {str(row.get("key")): row.get("value") for row in rows}


def mark_applied(values: Mapping[str, object]) -> None:
    """Remember the daemon's values after a successful update (the widgets already show them)."""
    seen: dict[str, object] = st.session_state.setdefault(SEEN_KEY, {})
    seen.update(values)
