"""The writer's Arrow schema follows from the declared tables (``policyd.history.tables``): every
column but the key, in order, by the SQLAlchemy-to-Arrow map; a type the map lacks is a clear
error, not a guess."""

from __future__ import annotations

import pyarrow as pa  # type: ignore[import-untyped]
import pytest
import sqlalchemy as sa

from policyd.history.schema import ARROW_SCHEMAS, TABLES, UnmappedType, arrow_columns
from policyd.history.tables import KEY_COLUMN, METADATA


def test_every_declared_column_but_the_key_is_in_the_writers_schema_in_order() -> None:
    assert list(TABLES) == list(METADATA.tables)
    for name, table in METADATA.tables.items():
        declared = [c.name for c in table.columns]
        assert declared[:2] == [KEY_COLUMN, "ts"]
        assert ARROW_SCHEMAS[name].names == declared[1:]


def test_sqlalchemy_types_become_the_arrow_types_duckdb_stores() -> None:
    assert TABLES["block_accesses"] == (
        ("ts", pa.float64()),
        ("kind", pa.string()),
        ("tier", pa.string()),
        ("block_hash", pa.int64()),
        ("request_id", pa.string()),
        ("sample_rate", pa.float64()),
    )
    assert ARROW_SCHEMAS["predictions"].field("correct").type == pa.bool_()


def test_a_type_without_an_arrow_type_is_a_clear_error() -> None:
    metadata = sa.MetaData()
    sa.Table("t", metadata, sa.Column("ts", sa.Double), sa.Column("ratio", sa.Float))
    with pytest.raises(UnmappedType, match=r"t\.ratio: no Arrow type for SQLAlchemy type Float"):
        arrow_columns(metadata)
