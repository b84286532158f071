"""Machine insight kept for the stats' longest window: an index by hour for the hourly deletion of
older counters, and the counters of the sampling meter before it (never read since) deleted

Revision ID: 0009
Revises: 0008
"""
import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_machine_insight_hour", "machine_insight", ["hour"])
    op.execute(sa.text("DELETE FROM machine_insight WHERE name IN ('slots_busy', 'slots_total') "
                       "OR name LIKE 'tps:%'"))


def downgrade() -> None:
    op.drop_index("ix_machine_insight_hour", table_name="machine_insight")
