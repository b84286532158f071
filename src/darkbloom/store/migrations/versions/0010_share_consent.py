"""Consent for shares: a share routes nothing until its grantee accepts it, by an invite code the
owner hands over or from an account whose email address is verified; keys may cap the price of the
shares they route through. Shares made before consent existed start pending.

Revision ID: 0010
Revises: 0009
"""
import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("accounts") as batch:
        batch.add_column(sa.Column("email_verified_at", sa.BigInteger, nullable=True))
    with op.batch_alter_table("shares") as batch:
        batch.add_column(sa.Column("status", sa.String(16), nullable=False, server_default="pending"))
        batch.add_column(sa.Column("grantee_account_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("invite_code_hash", sa.String(64), nullable=True))
        batch.add_column(sa.Column("answered_at", sa.BigInteger, nullable=True))
        batch.create_index("ix_shares_grantee_account_id", ["grantee_account_id"])
        batch.create_index("ix_shares_invite_code_hash", ["invite_code_hash"], unique=True)
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("max_shared_price", sa.BigInteger, nullable=True))
    op.create_table(
        "email_verifications",
        sa.Column("account_id", sa.String(64), sa.ForeignKey("accounts.id"), primary_key=True),
        sa.Column("email", sa.String(320), nullable=False),
        sa.Column("code_hash", sa.String(64), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("sent_at", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("email_verifications")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("max_shared_price")
    with op.batch_alter_table("shares") as batch:
        batch.drop_index("ix_shares_invite_code_hash")
        batch.drop_index("ix_shares_grantee_account_id")
        batch.drop_column("answered_at")
        batch.drop_column("invite_code_hash")
        batch.drop_column("grantee_account_id")
        batch.drop_column("status")
    with op.batch_alter_table("accounts") as batch:
        batch.drop_column("email_verified_at")
