"""Each coordinator replica's public key for authenticating its fabric (NATS) messages

Revision ID: 0005
Revises: 0004
"""
import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("coordinator_instances") as batch:
        batch.add_column(sa.Column("fabric_key", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("coordinator_instances") as batch:
        batch.drop_column("fabric_key")
