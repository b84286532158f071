"""billing: ledger, reservations, usage records, key spend windows, coordinator instances, settings

Revision ID: 0002
Revises: 0001
"""
import time

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ledger_entries",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("account_id", sa.String(64), sa.ForeignKey("accounts.id"), nullable=False, index=True),
        sa.Column("kind", sa.String(24), nullable=False),
        sa.Column("pocket", sa.String(16), nullable=False),
        sa.Column("amount_micro_usd", sa.BigInteger, nullable=False),
        sa.Column("balance_after", sa.BigInteger, nullable=False),
        sa.Column("request_id", sa.String(64), nullable=True, index=True),
        sa.Column("reference", sa.String(200), nullable=True),
        sa.Column("created_at", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "reservations",
        sa.Column("request_id", sa.String(64), primary_key=True),
        sa.Column("account_id", sa.String(64), sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("key_id", sa.String(64), nullable=True),
        sa.Column("amount_micro_usd", sa.BigInteger, nullable=False),
        sa.Column("window_start", sa.BigInteger, nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("instance_id", sa.String(64), nullable=False, index=True),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("closed_at", sa.BigInteger, nullable=True),
    )
    op.create_table(
        "usage_records",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("request_id", sa.String(64), nullable=False, unique=True),
        sa.Column("account_id", sa.String(64), sa.ForeignKey("accounts.id"), nullable=False, index=True),
        sa.Column("key_id", sa.String(64), nullable=True),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("provider_id", sa.String(64), nullable=True),
        sa.Column("provider_account_id", sa.String(64), nullable=True, index=True),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("cost_micro_usd", sa.BigInteger, nullable=False),
        sa.Column("platform_fee_micro_usd", sa.BigInteger, nullable=False),
        sa.Column("provider_payout_micro_usd", sa.BigInteger, nullable=False),
        sa.Column("self_routed", sa.Boolean, nullable=False),
        sa.Column("routed", sa.String(8), nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "key_spend",
        sa.Column("key_id", sa.String(64), primary_key=True),
        sa.Column("window_start", sa.BigInteger, primary_key=True),
        sa.Column("spent_micro_usd", sa.BigInteger, nullable=False),
        sa.Column("reserved_micro_usd", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "coordinator_instances",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("started_at", sa.BigInteger, nullable=False),
        sa.Column("last_seen", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "stored_settings",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.JSON, nullable=False),
    )
    accounts = sa.table("accounts", sa.column("id", sa.String), sa.column("email", sa.String),
                        sa.column("password_hash", sa.String), sa.column("balance_micro_usd", sa.BigInteger),
                        sa.column("withdrawable_micro_usd", sa.BigInteger), sa.column("created_at", sa.BigInteger))
    op.bulk_insert(accounts, [{"id": "acct_platform", "email": None, "password_hash": None,
                               "balance_micro_usd": 0, "withdrawable_micro_usd": 0,
                               "created_at": int(time.time())}])


def downgrade() -> None:
    op.execute("DELETE FROM accounts WHERE id = 'acct_platform'")
    for table in ("stored_settings", "coordinator_instances", "key_spend", "usage_records", "reservations",
                  "ledger_entries"):
        op.drop_table(table)
