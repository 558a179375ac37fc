"""The history tables as the writer sees them: column names and Arrow types, per table.

The DDL itself lives in the hand-written Alembic revisions under ``migrations/versions`` (frozen,
one per schema version); this module is the newest schema's shape, used to build Arrow batches.
``tests/test_migrations.py`` checks that the two agree column for column.
Every table has ``ts DOUBLE``: wall-clock unix seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

import pyarrow as pa  # type: ignore[import-untyped]

_F8 = pa.float64()
_I8 = pa.int64()
_STR = pa.string()
_BOOL = pa.bool_()

TABLES: Final[dict[str, tuple[tuple[str, pa.DataType], ...]]] = {
    "requests": (
        ("ts", _F8),
        ("request_id", _STR),
        ("source", _STR),
        ("workflow_id", _STR),
        ("workflow_type", _STR),
        ("agent", _STR),
        ("prompt_tokens", _I8),
        ("prompt_blocks", _I8),
        ("gpu_hit_blocks", _I8),
        ("host_hit_blocks", _I8),
        ("recomputed_blocks", _I8),
        ("finished_ts", _F8),
        ("output_tokens", _I8),
    ),
    "block_accesses": (
        ("ts", _F8),
        ("kind", _STR),
        ("tier", _STR),
        ("block_hash", _I8),
        ("request_id", _STR),
        ("sample_rate", _F8),
    ),
    "decisions": (
        ("ts", _F8),
        ("kind", _STR),
        ("tier", _STR),
        ("request_id", _STR),
        ("workflow_id", _STR),
        ("n_blocks", _I8),
        ("reason", _STR),
        ("policy", _STR),
        ("snapshot_version", _I8),
    ),
    "predictions": (
        ("ts", _F8),
        ("workflow_id", _STR),
        ("workflow_type", _STR),
        ("step", _I8),
        ("predicted_agent", _STR),
        ("probability", _F8),
        ("p_alive", _F8),
        ("actual_agent", _STR),
        ("correct", _BOOL),
        ("resolved_ts", _F8),
    ),
    "mrc_points": (
        ("ts", _F8),
        ("capacity_blocks", _I8),
        ("capacity_gib", _F8),
        ("hit_ratio", _F8),
        ("host_hit_ratio", _F8),
        ("source", _STR),
    ),
    "sizing": (
        ("ts", _F8),
        ("working_set_blocks", _I8),
        ("achievable_hit_ratio", _F8),
        ("coverage", _F8),
        ("current_host_gib", _F8),
        ("recommended_host_gib", _F8),
        ("closed_form_gib", _F8),
        ("recomputed_tokens_current", _I8),
        ("recomputed_tokens_recommended", _I8),
        ("reason", _STR),
    ),
    "cache_stats": (
        ("ts", _F8),
        ("interval_s", _F8),
        ("requests", _I8),
        ("prompt_blocks", _I8),
        ("gpu_hit_blocks", _I8),
        ("host_hit_blocks", _I8),
        ("recomputed_blocks", _I8),
        ("host_written_bytes", _I8),
        ("host_loaded_bytes", _I8),
        ("write_declined_blocks", _I8),
        ("lru_recomputed_blocks", _I8),
        ("events", _I8),
        ("events_shed", _I8),
    ),
    "settings_changes": (
        ("ts", _F8),
        ("key", _STR),
        ("old_value", _STR),
        ("new_value", _STR),
        ("actor", _STR),
    ),
}

ARROW_SCHEMAS: Final[dict[str, pa.Schema]] = {
    table: pa.schema(list(columns)) for table, columns in TABLES.items()
}
COLUMN_NAMES: Final[dict[str, frozenset[str]]] = {
    table: frozenset(name for name, _ in columns) for table, columns in TABLES.items()
}
# a surrogate key per table, assigned by a sequence (DuckDB autoincrement does not work, see
# duckdb-engine); the writer never supplies it
KEY_COLUMN: Final = "id"


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
