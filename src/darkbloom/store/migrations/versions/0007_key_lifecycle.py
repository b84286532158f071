"""Key lifecycle: keys may expire, be disabled and carry a fallback budget for prefer requests; a
reservation remembers the fallback window it holds against

Revision ID: 0007
Revises: 0006
"""
import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("expires_at", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("disabled", sa.Boolean, nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("fallback_limit_micro_usd", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("fallback_limit_reset", sa.String(16), nullable=False, server_default="none"))
    with op.batch_alter_table("reservations") as batch:
        batch.add_column(sa.Column("fallback_window_start", sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("reservations") as batch:
        batch.drop_column("fallback_window_start")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("fallback_limit_reset")
        batch.drop_column("fallback_limit_micro_usd")
        batch.drop_column("disabled")
        batch.drop_column("expires_at")
