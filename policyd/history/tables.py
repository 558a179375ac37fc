"""The history tables, declared once: ``METADATA`` is the newest schema.

``METADATA`` (SQLAlchemy) holds every table with its columns in order, their types and
nullability, the lookup indexes and each table's key sequence. What follows from it:

* the writer's Arrow schemas (``policyd.history.schema``);
* the migrations: ``migrations/env.py`` compares this declaration with a file at the current
  head, so ``alembic revision --autogenerate`` drafts the next revision (docs/HISTORY.md,
  *Changing the schema*), and ``tests/test_migrations.py`` checks with the same comparison that
  the revisions, applied in turn, build exactly this declaration.

Every table has the surrogate key ``id`` (``KEY_COLUMN``: BIGINT NOT NULL, default
``nextval('<table>_id_seq')``, as DuckDB's autoincrement does not work; the writer never
supplies it) and ``ts DOUBLE NOT NULL``: wall-clock unix seconds. Types are SQLAlchemy's
generic ones as DuckDB spells them: ``Double`` DOUBLE, ``BigInteger`` BIGINT, ``String`` VARCHAR,
``Boolean`` BOOLEAN. Loads SQLAlchemy only (not Arrow): the migrations import it.
"""

from __future__ import annotations

from typing import Any, Final

import sqlalchemy as sa

METADATA: Final = sa.MetaData()
KEY_COLUMN: Final = "id"

_C = sa.Column
_F8: sa.Double[float] = sa.Double()
_I8 = sa.BigInteger()
_STR = sa.String()
_BOOL = sa.Boolean()


def _history_table(name: str, *items: sa.Column[Any] | sa.Index) -> sa.Table:
    """A table with the key ``id`` (from the sequence ``<name>_id_seq``) and ``ts`` first."""
    sequence = sa.Sequence(f"{name}_id_seq", metadata=METADATA)
    key = _C(KEY_COLUMN, _I8, nullable=False, server_default=sequence.next_value())
    return sa.Table(name, METADATA, key, _C("ts", _F8, nullable=False), *items)


_history_table(
    "requests",
    _C("request_id", _STR, nullable=False),
    _C("source", _STR),
    _C("workflow_id", _STR),
    _C("workflow_type", _STR),
    _C("agent", _STR),
    _C("prompt_tokens", _I8),
    _C("prompt_blocks", _I8),
    _C("gpu_hit_blocks", _I8),
    _C("host_hit_blocks", _I8),
    _C("recomputed_blocks", _I8),
    _C("finished_ts", _F8),
    _C("output_tokens", _I8),
    sa.Index("requests_request_id_idx", "request_id"),
)
# the high-volume append table: no index (scans by ts use DuckDB's zone maps)
_history_table(
    "block_accesses",
    _C("kind", _STR, nullable=False),
    _C("tier", _STR),
    _C("block_hash", _I8, nullable=False),
    _C("request_id", _STR),
    _C("sample_rate", _F8),
)
_history_table(
    "decisions",
    _C("kind", _STR, nullable=False),
    _C("tier", _STR),
    _C("request_id", _STR),
    _C("workflow_id", _STR),
    _C("n_blocks", _I8),
    _C("reason", _STR),
    _C("policy", _STR),
    _C("snapshot_version", _I8),
    sa.Index("decisions_workflow_id_idx", "workflow_id"),
)
_history_table(
    "predictions",
    _C("workflow_id", _STR, nullable=False),
    _C("workflow_type", _STR),
    _C("step", _I8),
    _C("predicted_agent", _STR),
    _C("probability", _F8),
    _C("p_alive", _F8),
    _C("actual_agent", _STR),
    _C("correct", _BOOL),
    _C("resolved_ts", _F8),
    sa.Index("predictions_workflow_id_idx", "workflow_id"),
)
_history_table(
    "mrc_points",
    _C("capacity_blocks", _I8),
    _C("capacity_gib", _F8),
    _C("hit_ratio", _F8),
    _C("host_hit_ratio", _F8),
    _C("source", _STR),
)
_history_table(
    "sizing",
    _C("working_set_blocks", _I8),
    _C("achievable_hit_ratio", _F8),
    _C("coverage", _F8),
    _C("current_host_gib", _F8),
    _C("recommended_host_gib", _F8),
    _C("closed_form_gib", _F8),
    _C("recomputed_tokens_current", _I8),
    _C("recomputed_tokens_recommended", _I8),
    _C("reason", _STR),
)
_history_table(
    "cache_stats",
    _C("interval_s", _F8),
    _C("requests", _I8),
    _C("prompt_blocks", _I8),
    _C("gpu_hit_blocks", _I8),
    _C("host_hit_blocks", _I8),
    _C("recomputed_blocks", _I8),
    _C("host_written_bytes", _I8),
    _C("host_loaded_bytes", _I8),
    _C("write_declined_blocks", _I8),
    _C("lru_recomputed_blocks", _I8),
    _C("events", _I8),
    _C("events_shed", _I8),
)
_history_table(
    "settings_changes",
    _C("key", _STR, nullable=False),
    _C("old_value", _STR),
    _C("new_value", _STR),
    _C("actor", _STR),
    sa.Index("settings_changes_key_idx", "key"),
)
