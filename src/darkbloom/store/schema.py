"""Tables, as SQLAlchemy Core. Times are integer Unix seconds; money is integer µUSD."""

from __future__ import annotations

from sqlalchemy import JSON, BigInteger, Boolean, Column, ForeignKey, Integer, MetaData, String, Table

metadata = MetaData()

accounts = Table(
    "accounts", metadata,
    Column("id", String(64), primary_key=True),
    Column("email", String(320), unique=True, nullable=True),
    Column("password_hash", String(256), nullable=True),
    Column("balance_micro_usd", BigInteger, nullable=False, default=0),
    Column("withdrawable_micro_usd", BigInteger, nullable=False, default=0),
    Column("created_at", BigInteger, nullable=False),
)

console_sessions = Table(
    "console_sessions", metadata,
    Column("token_hash", String(64), primary_key=True),
    Column("account_id", String(64), ForeignKey("accounts.id"), nullable=False, index=True),
    Column("created_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger, nullable=False),
)

api_keys = Table(
    "api_keys", metadata,
    Column("id", String(64), primary_key=True),
    Column("account_id", String(64), ForeignKey("accounts.id"), nullable=False, index=True),
    Column("name", String(200), nullable=False),
    Column("key_hash", String(64), nullable=False, unique=True),
    Column("key_prefix", String(16), nullable=False),
    Column("self_route_only", Boolean, nullable=False, default=False),
    Column("limit_micro_usd", BigInteger, nullable=True),
    Column("limit_reset", String(16), nullable=False, default="none"),
    Column("rpm_limit", Integer, nullable=True),
    Column("itpm_limit", Integer, nullable=True),
    Column("otpm_limit", Integer, nullable=True),
    Column("allowed_models", JSON, nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("last_used_at", BigInteger, nullable=True),
    Column("revoked_at", BigInteger, nullable=True),
)

device_codes = Table(
    "device_codes", metadata,
    Column("device_code_hash", String(64), primary_key=True),
    Column("user_code", String(9), nullable=False, unique=True),
    Column("status", String(16), nullable=False),  # pending | approved | issued
    Column("account_id", String(64), ForeignKey("accounts.id"), nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger, nullable=False),
)

machines = Table(
    "machines", metadata,
    Column("id", String(64), primary_key=True),
    Column("account_id", String(64), ForeignKey("accounts.id"), nullable=False, index=True),
    Column("name", String(200), nullable=False),
    Column("trust_level", String(16), nullable=False, default="none"),
    Column("private_only", Boolean, nullable=False, default=False),
    Column("models", JSON, nullable=False, default=list),
    Column("identity_key", String(64), nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("last_seen", BigInteger, nullable=True),
    Column("unlinked_at", BigInteger, nullable=True),
)

device_tokens = Table(
    "device_tokens", metadata,
    Column("token_hash", String(64), primary_key=True),
    Column("machine_id", String(64), ForeignKey("machines.id"), nullable=False, index=True),
    Column("account_id", String(64), ForeignKey("accounts.id"), nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Column("revoked_at", BigInteger, nullable=True),
)

admin_credits = Table(
    "admin_credits", metadata,
    Column("reference", String(200), primary_key=True),
    Column("account_id", String(64), ForeignKey("accounts.id"), nullable=False),
    Column("amount_micro_usd", BigInteger, nullable=False),
    Column("created_at", BigInteger, nullable=False),
)
