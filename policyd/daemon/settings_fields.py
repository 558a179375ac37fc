"""What a settings field declares, read back from its pydantic ``FieldInfo``, and pydantic's
validation errors put in the daemon's own words.

``FieldFacts.of(name, info)`` gives the plain Python type a flag or a form widget takes, the
choices (a ``Literal``), the numeric bounds (``Field(ge=..., gt=..., le=..., lt=...)``) and the
help (``description``). ``ErrorWording.explain(error)`` names the setting, its range or choices,
and quotes the bad value to at most ``QUOTE_CHARS`` characters (never echoes it whole).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from policyd.core.ratelog import QUOTE_CHARS, quote

SCALARS = (bool, int, float, str, Path)


def number_text(value: float) -> str:
    """1048576.0 -> '1048576', 0.05 -> '0.05' (a bound as people write it)."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True, slots=True)
class Bounds:
    """A numeric field's declared range; either end may be open or absent."""

    low: float | None = None
    low_exclusive: bool = False
    high: float | None = None
    high_exclusive: bool = False

    @classmethod
    def of(cls, info: FieldInfo) -> Bounds:
        low: object = None
        high: object = None
        low_exclusive = high_exclusive = False
        for item in info.metadata:
            if isinstance(item, annotated_types.Ge):
                low, low_exclusive = item.ge, False
            elif isinstance(item, annotated_types.Gt):
                low, low_exclusive = item.gt, True
            elif isinstance(item, annotated_types.Le):
                high, high_exclusive = item.le, False
            elif isinstance(item, annotated_types.Lt):
                high, high_exclusive = item.lt, True
        return cls(_float(low), low_exclusive, _float(high), high_exclusive)

    @property
    def declared(self) -> bool:
        return self.low is not None or self.high is not None

    def text(self) -> str:
        """``in (0, 1]`` when both ends are declared, else ``>= 0`` or ``<= 8``; '' when none."""
        if self.low is not None and self.high is not None:
            left = "(" if self.low_exclusive else "["
            right = ")" if self.high_exclusive else "]"
            return f"in {left}{number_text(self.low)}, {number_text(self.high)}{right}"
        if self.low is not None:
            return f"{'>' if self.low_exclusive else '>='} {number_text(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_exclusive else '<='} {number_text(self.high)}"
        return ""


def _float(value: object) -> float | None:
    """A declared bound as written (an int bound stays an int: ``"min": 1`` in the API)."""
    if value is None or isinstance(value, int | float):
        return value
    return float(value)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class FieldFacts:
    """One setting as flags, forms and messages need it: plain type (``Optional`` dropped,
    a ``Literal`` of strings is ``str`` with ``choices``), bounds, help, default."""

    name: str
    type: type
    optional: bool
    choices: tuple[str, ...] | None
    bounds: Bounds
    help: str
    default: object

    @classmethod
    def of(cls, name: str, info: FieldInfo) -> FieldFacts:
        kind, optional, choices = _plain_type(info.annotation)
        return cls(
            name=name,
            type=kind,
            optional=optional,
            choices=choices,
            bounds=Bounds.of(info),
            help=info.description or "",
            default=info.default,
        )

    def range_text(self) -> str:
        """What a valid value is: ``one of a, b`` or ``in [1, 8]`` ('' when anything goes)."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        return self.bounds.text()


def _plain_type(annotation: Any) -> tuple[type, bool, tuple[str, ...] | None]:
    if get_origin(annotation) is Annotated:  # validators inside an Optional: the type only
        return _plain_type(get_args(annotation)[0])
    args = get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"a setting takes one type, not {annotation}")
        kind, _, choices = _plain_type(inner[0])
        return kind, True, choices
    if get_origin(annotation) is Literal:
        if not all(isinstance(a, str) for a in args):
            raise TypeError(f"choices are strings, not {annotation}")
        return str, False, tuple(args)
    if annotation in SCALARS:
        return annotation, False, None
    raise TypeError(f"a setting is a bool, int, float, str, Path or Literal, not {annotation}")


def facts_of(fields: Mapping[str, FieldInfo]) -> dict[str, FieldFacts]:
    return {name: FieldFacts.of(name, info) for name, info in fields.items()}


TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "int_parsing_size": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "bool_parsing": "true or false (1/0, yes/no, on/off)",
    "path_type": "a path",
}
RANGE_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})


@dataclass(frozen=True, slots=True)
class ErrorWording:
    """Pydantic errors of one model's fields as messages naming the setting.

    ``unknown_choice``: a value outside a field's choices reads ``unknown policy 'x'; valid:
    a, b`` (a setting read at start) rather than ``policy must be one of a, b, got 'x'`` (a
    live change). A field validator's ``ValueError`` reads after the field's name (``must be
    ...``, ``is empty``); one of the whole set's reads alone."""

    facts: Mapping[str, FieldFacts]
    aliases: Mapping[str, str]  # validation alias -> field name
    unknown_choice: bool = False

    def field_name(self, error: ErrorDetails) -> str:
        """The setting an error is about ('' for one about the whole set)."""
        if not error["loc"]:
            return ""
        key = str(error["loc"][0])
        return self.aliases.get(key, key)

    def explain(self, error: ErrorDetails) -> str:
        name = self.field_name(error)
        kind, value = error["type"], error.get("input")
        if kind == "value_error":  # a validator's own words, after the field's name if any
            said = str((error.get("ctx") or {}).get("error", error["msg"]))
            return f"{name} {said}" if name else said
        facts = self.facts.get(name)
        if kind == "extra_forbidden" or facts is None:
            return f"unknown setting {quote(name)}; valid: {', '.join(self.facts)}"
        if kind == "literal_error":
            if not isinstance(value, str):
                return f"{name} must be a string, got {quote(value)}"
            if self.unknown_choice:
                return f"unknown {name} {quote(value)}; valid: {', '.join(facts.choices or ())}"
            return f"{name} must be {facts.range_text()}, got {quote(value)}"
        if kind == "finite_number":
            where = f" {facts.bounds.text()}" if facts.bounds.declared else ""
            return f"{name} must be a finite number{where}, got {quote(value)}"
        if kind in RANGE_ERRORS:
            return f"{name} must be {facts.bounds.text()}, got {quote(value)}"
        if kind in TYPE_WORDS:
            return f"{name} must be {TYPE_WORDS[kind]}, got {quote(value)}"
        return f"{name}: {error['msg']}, got {quote(value)}"

    def explain_all(self, errors: list[ErrorDetails]) -> dict[str, str]:
        """One message per setting (the first error about it), keyed by its name cut to
        ``QUOTE_CHARS`` characters; an error about the whole set is keyed ''."""
        out: dict[str, str] = {}
        for error in errors:
            out.setdefault(self.field_name(error)[:QUOTE_CHARS], self.explain(error))
        return out
