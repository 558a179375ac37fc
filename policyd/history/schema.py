"""The history tables as the writer builds them: Arrow types per column, from the declaration.

``TABLES`` / ``ARROW_SCHEMAS`` are each declared table's columns but the key
(``policyd.history.tables``), in order, typed by ``ARROW_TYPES``, a map from SQLAlchemy types to
Arrow types; a declared column of a type the map lacks is an error when this module is imported
(``UnmappedType``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

import pyarrow as pa  # type: ignore[import-untyped]
import sqlalchemy as sa

from policyd.history.tables import KEY_COLUMN, METADATA

# a column's SQLAlchemy type (its exact class) -> the Arrow type the writer builds it as
ARROW_TYPES: Final[Mapping[type[sa.types.TypeEngine[Any]], pa.DataType]] = {
    sa.Double: pa.float64(),
    sa.BigInteger: pa.int64(),
    sa.String: pa.string(),
    sa.Boolean: pa.bool_(),
}


class UnmappedType(TypeError):  # noqa: N818 (a kind of TypeError, named for what is missing)
    """A declared column's SQLAlchemy type has no Arrow type in ``ARROW_TYPES``."""


def arrow_type(table: str, column: sa.Column[Any]) -> pa.DataType:
    """The Arrow type of a declared column; ``UnmappedType`` for a type ``ARROW_TYPES`` lacks.
    Types match by exact class: ``sa.Float`` (DuckDB's 4-byte FLOAT) is not ``sa.Double``."""
    found = ARROW_TYPES.get(type(column.type))
    if found is None:
        known = ", ".join(sorted(t.__name__ for t in ARROW_TYPES))
        raise UnmappedType(
            f"{table}.{column.name}: no Arrow type for SQLAlchemy type "
            f"{type(column.type).__name__}; add it to policyd.history.schema.ARROW_TYPES "
            f"(known: {known})"
        )
    return found


def arrow_columns(metadata: sa.MetaData) -> dict[str, tuple[tuple[str, pa.DataType], ...]]:
    """Each table's columns but the key, in order, as (name, Arrow type)."""
    return {
        name: tuple(
            (column.name, arrow_type(name, column))
            for column in table.columns
            if column.name != KEY_COLUMN
        )
        for name, table in metadata.tables.items()
    }


TABLES: Final[dict[str, tuple[tuple[str, pa.DataType], ...]]] = arrow_columns(METADATA)
ARROW_SCHEMAS: Final[dict[str, pa.Schema]] = {
    table: pa.schema(list(columns)) for table, columns in TABLES.items()
}
COLUMN_NAMES: Final[dict[str, frozenset[str]]] = {
    table: frozenset(name for name, _ in columns) for table, columns in TABLES.items()
}


def check_rows(table: str, rows: Iterable[Mapping[str, object]]) -> None:
    """Raise ValueError for an unknown table or a row naming a column the table lacks."""
    columns = COLUMN_NAMES.get(table)
    if columns is None:
        raise ValueError(f"unknown history table {table!r}; valid: {', '.join(sorted(TABLES))}")
    for row in rows:
        if not columns.issuperset(row):
            unknown = sorted(set(row) - columns)
            valid = ", ".join(sorted(columns))
            raise ValueError(f"{table}: unknown column(s) {', '.join(unknown)}; valid: {valid}")
