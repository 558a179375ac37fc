"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}

Drafted by ``alembic revision --autogenerate`` from policyd/history/tables.py, then reviewed by
hand (docs/HISTORY.md, *Changing the schema*). Once released a revision is frozen: it never
imports the live declaration. DuckDB rules: no autoincrement (create a sequence, use its
nextval as the default: autogenerate does not see sequences), no ALTER on an indexed table's
columns (drop the index, alter, recreate), no foreign keys added by ALTER.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
${imports if imports else ""}
revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}
