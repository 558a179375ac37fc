"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}

Written by hand (DESIGN.md §4: autogenerate does not work on duckdb-engine). DuckDB rules: no
autoincrement (use a sequence default), no ALTER on an indexed table's columns (drop the index,
alter, recreate), no foreign keys added by ALTER.
"""

from __future__ import annotations

from alembic import op

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}
