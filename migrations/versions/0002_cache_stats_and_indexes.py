"""The dashboard's time series (``cache_stats``, one row per interval) and the lookup indexes.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

Written by hand. The indexes serve the lookups the daemon and users make by id (a request's row,
a workflow's predictions, a setting's history). DuckDB cannot DROP/RENAME/ALTER a column of an
indexed table ("Cannot alter entry"): a later revision that alters these tables drops the index
first and recreates it after. ``block_accesses`` stays unindexed: it is the high-volume append
table, and range scans by ``ts`` use DuckDB's zone maps.
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

INDEXES = {
    "requests_request_id_idx": "requests (request_id)",
    "predictions_workflow_id_idx": "predictions (workflow_id)",
    "decisions_workflow_id_idx": "decisions (workflow_id)",
    "settings_changes_key_idx": "settings_changes (key)",
}


def upgrade() -> None:
    op.execute("CREATE SEQUENCE cache_stats_id_seq")
    op.execute(
        """CREATE TABLE cache_stats (
        id BIGINT NOT NULL DEFAULT nextval('cache_stats_id_seq'),
        ts DOUBLE NOT NULL,
        interval_s DOUBLE,
        requests BIGINT,
        prompt_blocks BIGINT,
        gpu_hit_blocks BIGINT,
        host_hit_blocks BIGINT,
        recomputed_blocks BIGINT,
        host_written_bytes BIGINT,
        host_loaded_bytes BIGINT,
        write_declined_blocks BIGINT,
        lru_recomputed_blocks BIGINT,
        events BIGINT,
        events_shed BIGINT)"""
    )
    for name, target in INDEXES.items():
        op.execute(f"CREATE INDEX {name} ON {target}")


def downgrade() -> None:
    for name in reversed(INDEXES):
        op.execute(f"DROP INDEX {name}")
    op.execute("DROP TABLE cache_stats")
    op.execute("DROP SEQUENCE cache_stats_id_seq")
