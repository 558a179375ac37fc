"""``block_accesses.sample_rate``: the share of block rows kept when a row was written.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

Written by hand. The history keeps block-level rows for a hash-chosen sample of blocks, and
since this revision the daemon lowers that share by itself while the writer falls behind (and
raises it again once it has caught up), so the share is no longer one setting for the whole
file. Each row says the rate it was sampled at: ``SUM(1 / sample_rate)`` estimates the block
events a query's rows stand for. Rows written before this revision keep NULL (their rate was
the ``block_sample_rate`` setting then in force, in ``settings_changes``).
``block_accesses`` has no index, so the column is added in place.
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE block_accesses ADD COLUMN sample_rate DOUBLE")


def downgrade() -> None:
    op.execute("ALTER TABLE block_accesses DROP COLUMN sample_rate")
