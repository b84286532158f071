"""enrollment: the machine's hardware-trust certificate from the coordinator's enrollment CA

Revision ID: 0003
Revises: 0002
"""
import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("machines") as batch:
        batch.add_column(sa.Column("certificate", sa.Text, nullable=True))
        batch.add_column(sa.Column("enrolled_at", sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("machines") as batch:
        batch.drop_column("enrolled_at")
        batch.drop_column("certificate")
