"""64-bit token counts everywhere, and the usage row's ownership_changed flag (an exclusive
self-route request whose machine changed owner mid-flight: free, nobody paid)

Revision ID: 0004
Revises: 0003
"""
import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.alter_column("prompt_tokens", type_=sa.BigInteger, existing_type=sa.Integer, existing_nullable=False)
        batch.alter_column("completion_tokens", type_=sa.BigInteger, existing_type=sa.Integer,
                           existing_nullable=False)
        batch.add_column(sa.Column("ownership_changed", sa.Boolean, nullable=False, server_default=sa.false()))
    with op.batch_alter_table("api_keys") as batch:
        batch.alter_column("itpm_limit", type_=sa.BigInteger, existing_type=sa.Integer, existing_nullable=True)
        batch.alter_column("otpm_limit", type_=sa.BigInteger, existing_type=sa.Integer, existing_nullable=True)


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.alter_column("otpm_limit", type_=sa.Integer, existing_type=sa.BigInteger, existing_nullable=True)
        batch.alter_column("itpm_limit", type_=sa.Integer, existing_type=sa.BigInteger, existing_nullable=True)
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("ownership_changed")
        batch.alter_column("completion_tokens", type_=sa.Integer, existing_type=sa.BigInteger,
                           existing_nullable=False)
        batch.alter_column("prompt_tokens", type_=sa.Integer, existing_type=sa.BigInteger, existing_nullable=False)
