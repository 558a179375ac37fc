"""The daemon's settings file: a TOML or JSON object of settings, as a pydantic-settings source.

``read_settings_file(path)`` returns the file's top-level keys and values as written, or raises
``SettingsFileError`` (a ``ValueError``) naming the file and what is wrong with it: unreadable,
not TOML / JSON (by its suffix, ``.toml`` or ``.json``), not an object, or a key that is no
setting (the key named, the valid ones listed). ``SettingsFileSource`` reads the file that the
sources above it in precedence name in their ``config`` value (``--config`` or
``POLICYD_CONFIG``); with none named it contributes nothing.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from policyd.core.ratelog import quote

CONFIG_FIELD = "config"  # the setting that names the file (a file cannot name another)
SUFFIXES = (".toml", ".json")


class SettingsFileError(ValueError):
    """The settings file cannot be used; the message names the file and the problem."""


def read_settings_file(path: Path, valid: Mapping[str, object]) -> dict[str, Any]:
    """The settings ``path`` holds (keys as written); every key must be in ``valid``."""
    if path.suffix.lower() not in SUFFIXES:
        raise SettingsFileError(
            f"settings file {path}: name it *.toml or *.json (its suffix says how to read it)"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise SettingsFileError(f"cannot read the settings file {path}: {why}") from None
    try:
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (ValueError, RecursionError) as exc:  # tomllib/json decode errors are ValueErrors
        raise SettingsFileError(f"settings file {path} is malformed: {_cut(str(exc))}") from None
    if not isinstance(data, dict):
        raise SettingsFileError(f"settings file {path} must hold an object of settings")
    for key in data:
        if key == CONFIG_FIELD:
            raise SettingsFileError(f"settings file {path}: {CONFIG_FIELD!r} cannot be set here")
        if key not in valid:
            raise SettingsFileError(
                f"settings file {path}: unknown setting {quote(key)}; valid: "
                + ", ".join(k for k in valid if k != CONFIG_FIELD)
            )
    return data


def _cut(message: str, limit: int = 300) -> str:
    return message if len(message) <= limit else message[:limit] + "..."


class SettingsFileSource(PydanticBaseSettingsSource):
    """The settings file named by a source of higher precedence (flags, environment), below
    them in precedence. A field with a validation alias is given under that alias, as the
    other sources give it, so that the higher source wins."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        self.path: Path | None = None

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ reads the whole file at once

    def __call__(self) -> dict[str, Any]:
        named = self.current_state.get(CONFIG_FIELD)
        if named is None or named == "":
            return {}
        self.path = Path(str(named))
        fields = self.settings_cls.model_fields
        data = read_settings_file(self.path, fields)
        return {_input_key(key, fields[key]): value for key, value in data.items()}


def _input_key(name: str, info: FieldInfo) -> str:
    alias = info.validation_alias
    return alias if isinstance(alias, str) else name
