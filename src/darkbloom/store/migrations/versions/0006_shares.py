"""Shares: an owner lets another account use their machines, with daily limits and optional prices;
usage rows name the share that served them; keys may be shared-only

Revision ID: 0006
Revises: 0005
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "shares",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner_account_id", sa.String(64), sa.ForeignKey("accounts.id"), nullable=False, index=True),
        sa.Column("grantee_email", sa.String(320), nullable=False, index=True),
        sa.Column("machine_ids", sa.JSON, nullable=True),
        sa.Column("daily_request_limit", sa.BigInteger, nullable=True),
        sa.Column("daily_token_limit", sa.BigInteger, nullable=True),
        sa.Column("input_price", sa.BigInteger, nullable=False),
        sa.Column("output_price", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.BigInteger, nullable=True),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("revoked_at", sa.BigInteger, nullable=True),
    )
    op.create_table(
        "share_days",
        sa.Column("share_id", sa.String(64), primary_key=True),
        sa.Column("day", sa.Integer, primary_key=True),
        sa.Column("requests", sa.BigInteger, nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
        sa.Column("held_tokens", sa.BigInteger, nullable=False),
    )
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(sa.Column("share_id", sa.String(64), nullable=True))
        batch.create_index("ix_usage_records_share_id", ["share_id"])
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("shared_only", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("shared_only")
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_index("ix_usage_records_share_id")
        batch.drop_column("share_id")
    op.drop_table("share_days")
    op.drop_table("shares")
