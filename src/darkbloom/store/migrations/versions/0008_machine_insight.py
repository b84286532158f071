"""Machine insight: usage rows name the serving machine; per machine and hour, counters of why it was
passed over, how busy it was and how fast it decoded

Revision ID: 0008
Revises: 0007
"""
import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(sa.Column("machine_id", sa.String(64), nullable=True))
        batch.create_index("ix_usage_records_machine_created", ["machine_id", "created_at"])
    op.create_table(
        "machine_insight",
        sa.Column("machine_id", sa.String(64), primary_key=True),
        sa.Column("hour", sa.BigInteger, primary_key=True),
        sa.Column("name", sa.String(48), primary_key=True),
        sa.Column("value", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("machine_insight")
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_index("ix_usage_records_machine_created")
        batch.drop_column("machine_id")
