"""The first history schema: requests, block accesses, decisions, predictions, MRC points,
sizing recommendations and settings changes.

Revision ID: 0001
Revises:
Create Date: 2026-11-30

Written by hand (autogenerate does not work on duckdb-engine). Every table has
``ts DOUBLE`` (wall-clock unix seconds) and a surrogate key ``id`` drawn from a sequence: DuckDB
has no working autoincrement. No index here: revision 0002 adds them.
"""

from __future__ import annotations

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TABLES = {
    "requests": """
        ts DOUBLE NOT NULL,
        request_id VARCHAR NOT NULL,
        source VARCHAR,
        workflow_id VARCHAR,
        workflow_type VARCHAR,
        agent VARCHAR,
        prompt_tokens BIGINT,
        prompt_blocks BIGINT,
        gpu_hit_blocks BIGINT,
        host_hit_blocks BIGINT,
        recomputed_blocks BIGINT,
        finished_ts DOUBLE,
        output_tokens BIGINT""",
    "block_accesses": """
        ts DOUBLE NOT NULL,
        kind VARCHAR NOT NULL,
        tier VARCHAR,
        block_hash BIGINT NOT NULL,
        request_id VARCHAR""",
    "decisions": """
        ts DOUBLE NOT NULL,
        kind VARCHAR NOT NULL,
        tier VARCHAR,
        request_id VARCHAR,
        workflow_id VARCHAR,
        n_blocks BIGINT,
        reason VARCHAR,
        policy VARCHAR,
        snapshot_version BIGINT""",
    "predictions": """
        ts DOUBLE NOT NULL,
        workflow_id VARCHAR NOT NULL,
        workflow_type VARCHAR,
        step BIGINT,
        predicted_agent VARCHAR,
        probability DOUBLE,
        p_alive DOUBLE,
        actual_agent VARCHAR,
        correct BOOLEAN,
        resolved_ts DOUBLE""",
    "mrc_points": """
        ts DOUBLE NOT NULL,
        capacity_blocks BIGINT,
        capacity_gib DOUBLE,
        hit_ratio DOUBLE,
        host_hit_ratio DOUBLE,
        source VARCHAR""",
    "sizing": """
        ts DOUBLE NOT NULL,
        working_set_blocks BIGINT,
        achievable_hit_ratio DOUBLE,
        coverage DOUBLE,
        current_host_gib DOUBLE,
        recommended_host_gib DOUBLE,
        closed_form_gib DOUBLE,
        recomputed_tokens_current BIGINT,
        recomputed_tokens_recommended BIGINT,
        reason VARCHAR""",
    "settings_changes": """
        ts DOUBLE NOT NULL,
        key VARCHAR NOT NULL,
        old_value VARCHAR,
        new_value VARCHAR,
        actor VARCHAR""",
}


def upgrade() -> None:
    for table, columns in TABLES.items():
        op.execute(f"CREATE SEQUENCE {table}_id_seq")
        op.execute(
            f"CREATE TABLE {table} (id BIGINT NOT NULL DEFAULT nextval('{table}_id_seq'),"
            f"{columns})"
        )


def downgrade() -> None:
    for table in reversed(TABLES):
        op.execute(f"DROP TABLE {table}")
        op.execute(f"DROP SEQUENCE {table}_id_seq")
