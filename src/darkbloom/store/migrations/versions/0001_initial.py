"""accounts, console sessions, API keys, device login, machines, admin credits

Revision ID: 0001
Revises:
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "accounts",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("email", sa.String(320), unique=True, nullable=True),
        sa.Column("password_hash", sa.String(256), nullable=True),
        sa.Column("balance_micro_usd", sa.BigInteger, nullable=False),
        sa.Column("withdrawable_micro_usd", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "console_sessions",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("account_id", sa.String(64), sa.ForeignKey("accounts.id"), nullable=False, index=True),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("account_id", sa.String(64), sa.ForeignKey("accounts.id"), nullable=False, index=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("key_prefix", sa.String(16), nullable=False),
        sa.Column("self_route_only", sa.Boolean, nullable=False),
        sa.Column("limit_micro_usd", sa.BigInteger, nullable=True),
        sa.Column("limit_reset", sa.String(16), nullable=False),
        sa.Column("rpm_limit", sa.Integer, nullable=True),
        sa.Column("itpm_limit", sa.Integer, nullable=True),
        sa.Column("otpm_limit", sa.Integer, nullable=True),
        sa.Column("allowed_models", sa.JSON, nullable=True),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("last_used_at", sa.BigInteger, nullable=True),
        sa.Column("revoked_at", sa.BigInteger, nullable=True),
    )
    op.create_table(
        "device_codes",
        sa.Column("device_code_hash", sa.String(64), primary_key=True),
        sa.Column("user_code", sa.String(9), nullable=False, unique=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("account_id", sa.String(64), sa.ForeignKey("accounts.id"), nullable=True),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "machines",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("account_id", sa.String(64), sa.ForeignKey("accounts.id"), nullable=False, index=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("trust_level", sa.String(16), nullable=False),
        sa.Column("private_only", sa.Boolean, nullable=False),
        sa.Column("models", sa.JSON, nullable=False),
        sa.Column("identity_key", sa.String(64), nullable=True),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("last_seen", sa.BigInteger, nullable=True),
        sa.Column("unlinked_at", sa.BigInteger, nullable=True),
    )
    op.create_table(
        "device_tokens",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("machine_id", sa.String(64), sa.ForeignKey("machines.id"), nullable=False, index=True),
        sa.Column("account_id", sa.String(64), sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("revoked_at", sa.BigInteger, nullable=True),
    )
    op.create_table(
        "admin_credits",
        sa.Column("reference", sa.String(200), primary_key=True),
        sa.Column("account_id", sa.String(64), sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("amount_micro_usd", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    for table in ("admin_credits", "device_tokens", "machines", "device_codes", "api_keys",
                  "console_sessions", "accounts"):
        op.drop_table(table)
