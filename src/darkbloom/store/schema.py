"""Tables, as SQLAlchemy Core. Times are integer Unix seconds; money is integer µUSD."""

from __future__ import annotations

from sqlalchemy import (JSON, BigInteger, Boolean, Column, ForeignKey, Index, Integer, LargeBinary, MetaData, String,
                        Table, Text, false)

metadata = MetaData()

accounts = Table(
    "accounts", metadata,
    Column("id", String(64), primary_key=True),
    Column("email", String(320), unique=True, nullable=True),
    Column("password_hash", String(256), nullable=True),
    Column("balance_micro_usd", BigInteger, nullable=False, default=0),
    Column("withdrawable_micro_usd", BigInteger, nullable=False, default=0),
    Column("created_at", BigInteger, nullable=False),
    Column("email_verified_at", BigInteger, nullable=True),  # the owner of the address proved it (0010)
)

# an email address's verification code, one at a time per account (migration 0010)
email_verifications = Table(
    "email_verifications", metadata,
    Column("account_id", String(64), ForeignKey("accounts.id"), primary_key=True),
    Column("email", String(320), nullable=False),         # the address the code was sent to
    Column("code_hash", String(64), nullable=False),
    Column("attempts", Integer, nullable=False),          # wrong codes tried against this one
    Column("sent_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger, nullable=False),
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
    Column("shared_only", Boolean, nullable=False, default=False, server_default=false()),  # migration 0006
    Column("limit_micro_usd", BigInteger, nullable=True),
    Column("limit_reset", String(16), nullable=False, default="none"),
    Column("rpm_limit", Integer, nullable=True),
    Column("itpm_limit", BigInteger, nullable=True),
    Column("otpm_limit", BigInteger, nullable=True),
    Column("allowed_models", JSON, nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("last_used_at", BigInteger, nullable=True),
    Column("revoked_at", BigInteger, nullable=True),
    # migration 0007: the key lifecycle and the fallback budget of prefer requests
    Column("expires_at", BigInteger, nullable=True),
    Column("disabled", Boolean, nullable=False, default=False, server_default=false()),
    Column("fallback_limit_micro_usd", BigInteger, nullable=True),
    Column("fallback_limit_reset", String(16), nullable=False, default="none", server_default="none"),
    # migration 0010: shared routing on this key never uses a share priced above this (µUSD per 1M tokens)
    Column("max_shared_price", BigInteger, nullable=True),
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
    Column("certificate", Text, nullable=True),       # PEM from the enrollment CA (migration 0003)
    Column("enrolled_at", BigInteger, nullable=True),
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

# billing (migration 0002)

PLATFORM_ACCOUNT_ID = "acct_platform"
FALLBACK_PREFIX = "fallback:"  # key_spend rows of a key's fallback budget: FALLBACK_PREFIX + key id

ledger_entries = Table(
    "ledger_entries", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("account_id", String(64), ForeignKey("accounts.id"), nullable=False, index=True),
    Column("kind", String(24), nullable=False),      # admin_credit|reservation|refund|charge|payout|platform_fee
    Column("pocket", String(16), nullable=False),    # balance | withdrawable
    Column("amount_micro_usd", BigInteger, nullable=False),
    Column("balance_after", BigInteger, nullable=False),
    Column("request_id", String(64), nullable=True, index=True),
    Column("reference", String(200), nullable=True),
    Column("created_at", BigInteger, nullable=False),
)

reservations = Table(
    "reservations", metadata,
    Column("request_id", String(64), primary_key=True),
    Column("account_id", String(64), ForeignKey("accounts.id"), nullable=False),
    Column("key_id", String(64), nullable=True),
    Column("amount_micro_usd", BigInteger, nullable=False),
    Column("window_start", BigInteger, nullable=True),  # the key's spend-cap window, when it has a cap
    Column("status", String(16), nullable=False),       # open | settled | refunded
    Column("instance_id", String(64), nullable=False, index=True),
    Column("created_at", BigInteger, nullable=False),
    Column("closed_at", BigInteger, nullable=True),
    Column("fallback_window_start", BigInteger, nullable=True),  # the key's fallback window (prefer; 0007)
)

usage_records = Table(
    "usage_records", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("request_id", String(64), nullable=False, unique=True),
    Column("account_id", String(64), ForeignKey("accounts.id"), nullable=False, index=True),
    Column("key_id", String(64), nullable=True),
    Column("model", String(256), nullable=False),
    Column("provider_id", String(64), nullable=True),
    Column("provider_account_id", String(64), nullable=True, index=True),
    Column("prompt_tokens", BigInteger, nullable=False),
    Column("completion_tokens", BigInteger, nullable=False),
    Column("cost_micro_usd", BigInteger, nullable=False),
    Column("platform_fee_micro_usd", BigInteger, nullable=False),
    Column("provider_payout_micro_usd", BigInteger, nullable=False),
    Column("self_routed", Boolean, nullable=False),
    Column("routed", String(8), nullable=False),        # owned | shared | fleet
    Column("share_id", String(64), nullable=True, index=True),  # routed through this share (migration 0006)
    # an exclusive request whose machine changed owner mid-flight: still free, nobody paid
    Column("ownership_changed", Boolean, nullable=False, server_default=false()),
    Column("created_at", BigInteger, nullable=False),
    # the machine (mach_…) of the serving session (migration 0008; null on older rows and unlinked nodes)
    Column("machine_id", String(64), nullable=True),
    # a batch line's request (migration 0011): its batch and the line's custom_id
    Column("batch_id", String(64), nullable=True, index=True),
    Column("custom_id", String(512), nullable=True),
    Index("ix_usage_records_machine_created", "machine_id", "created_at"),
)

# a key's spend window: key_id is the key's id (its spend cap, limit_usd) or FALLBACK_PREFIX + the id
# (its fallback budget, fallback_limit_usd: what prefer requests spend on the public fleet)
key_spend = Table(
    "key_spend", metadata,
    Column("key_id", String(64), primary_key=True),
    Column("window_start", BigInteger, primary_key=True),
    Column("spent_micro_usd", BigInteger, nullable=False),
    Column("reserved_micro_usd", BigInteger, nullable=False),
)

coordinator_instances = Table(
    "coordinator_instances", metadata,
    Column("id", String(64), primary_key=True),
    Column("started_at", BigInteger, nullable=False),
    Column("last_seen", BigInteger, nullable=False),
    Column("fabric_key", String(64), nullable=True),  # a replica's Ed25519 key for fabric messages (base64)
)

stored_settings = Table(
    "stored_settings", metadata,
    Column("name", String(64), primary_key=True),
    Column("value", JSON, nullable=False),
)

# shares (migration 0006): an owner lets the account with an email use some or all of their machines

shares = Table(
    "shares", metadata,
    Column("id", String(64), primary_key=True),
    Column("owner_account_id", String(64), ForeignKey("accounts.id"), nullable=False, index=True),
    Column("grantee_email", String(320), nullable=False, index=True),  # trimmed, lower-cased; may have no account yet
    Column("machine_ids", JSON, nullable=True),                        # null: all the owner's machines, future ones too
    Column("daily_request_limit", BigInteger, nullable=True),
    Column("daily_token_limit", BigInteger, nullable=True),
    Column("input_price", BigInteger, nullable=False, default=0),      # µUSD per 1M tokens; 0 and 0: free
    Column("output_price", BigInteger, nullable=False, default=0),
    Column("expires_at", BigInteger, nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("revoked_at", BigInteger, nullable=True),
    # consent (migration 0010): pending (created, or its prices or machines changed) | accepted | declined;
    # the account that answered it, by its invite code or from the verified address, is its grantee
    Column("status", String(16), nullable=False, default="pending", server_default="pending"),
    Column("grantee_account_id", String(64), nullable=True, index=True),
    Column("invite_code_hash", String(64), nullable=True),  # cleared once an account answers
    Column("answered_at", BigInteger, nullable=True),
    Index("ix_shares_invite_code_hash", "invite_code_hash", unique=True),
)

share_days = Table(
    "share_days", metadata,
    Column("share_id", String(64), primary_key=True),
    Column("day", Integer, primary_key=True),             # UTC day: Unix seconds // 86400
    Column("requests", BigInteger, nullable=False),       # admitted today (a request that failed unserved gives its back)
    Column("tokens", BigInteger, nullable=False),         # prompt + completion tokens of settled requests
    Column("held_tokens", BigInteger, nullable=False),    # the estimates of requests in flight
)

# machine insight (migration 0008): per machine and UTC hour, counters every replica adds to in batches
# (coordinator/fleet/insight.py): "passed_over:<reason>", "busy_slot_ms" / "slot_ms" (milliseconds times
# active slots, and times slots, while online), "tps_ms:<bucket>" (milliseconds at a decode speed, 10 % wide
# buckets). Hours older than the stats' longest window are deleted hourly (migration 0009: the index by hour,
# and the sampling meter's rows, "slots_busy", "slots_total", "tps:<bucket>", deleted).

machine_insight = Table(
    "machine_insight", metadata,
    Column("machine_id", String(64), primary_key=True),
    Column("hour", BigInteger, primary_key=True),         # Unix seconds of the hour's start
    Column("name", String(48), primary_key=True),
    Column("value", BigInteger, nullable=False),
    Index("ix_machine_insight_hour", "hour"),
)

# batches (migration 0011): OpenAI's Files and Batch APIs (coordinator/batches/)

files = Table(
    "files", metadata,
    Column("id", String(64), primary_key=True),                       # file-…
    Column("account_id", String(64), ForeignKey("accounts.id"), nullable=False),
    Column("purpose", String(32), nullable=False),                    # batch | batch_output | batch_error | …
    Column("filename", String(256), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("lines", Integer, nullable=True),                          # a checked batch input file's line count
    Column("content", LargeBinary, nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Index("ix_files_account_created", "account_id", "created_at"),
)

batches = Table(
    "batches", metadata,
    Column("id", String(64), primary_key=True),                       # batch_…
    Column("account_id", String(64), ForeignKey("accounts.id"), nullable=False),
    Column("caller_kind", String(16), nullable=False),                # who created it: api_key | console_session | device
    Column("key_id", String(64), nullable=True),                      # its lines run as this key (its limits, its route)
    Column("machine_id", String(64), nullable=True),                  # a device token's machine
    Column("input_file_id", String(64), nullable=False),
    Column("endpoint", String(32), nullable=False),
    Column("completion_window", String(8), nullable=False),
    Column("route", String(8), nullable=False),                       # self | shared | prefer | fleet
    Column("pinned_machine_id", String(64), nullable=True),           # X-Darkbloom-Machine at creation
    Column("share_id", String(64), nullable=True),                    # X-Darkbloom-Share at creation
    Column("status", String(16), nullable=False),
    Column("metadata", JSON, nullable=True),
    Column("total", Integer, nullable=False),
    Column("completed", Integer, nullable=False, default=0),          # lines answered
    Column("failed", Integer, nullable=False, default=0),             # lines failed (expired and cancelled ones at the end)
    Column("output_file_id", String(64), nullable=True),
    Column("error_file_id", String(64), nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("in_progress_at", BigInteger, nullable=True),
    Column("expires_at", BigInteger, nullable=False),
    Column("finalizing_at", BigInteger, nullable=True),
    Column("completed_at", BigInteger, nullable=True),
    Column("failed_at", BigInteger, nullable=True),
    Column("expired_at", BigInteger, nullable=True),
    Column("cancelling_at", BigInteger, nullable=True),
    Column("cancelled_at", BigInteger, nullable=True),
    Index("ix_batches_account_created", "account_id", "created_at"),
    Index("ix_batches_status", "status"),
)

# one row per input line: pending → running (leased by one coordinator instance until lease_until) →
# answered | failed | expired | cancelled; a running line whose lease ran out is anyone's to take over
batch_lines = Table(
    "batch_lines", metadata,
    Column("batch_id", String(64), ForeignKey("batches.id"), primary_key=True),
    Column("line_no", Integer, primary_key=True),                     # 1-based, as in the input file
    Column("custom_id", String(512), nullable=False),
    Column("body", Text, nullable=False),
    Column("state", String(16), nullable=False),
    Column("lease_owner", String(64), nullable=True),
    Column("lease_until", BigInteger, nullable=True),
    Column("not_before", BigInteger, nullable=False, default=0),      # a line waiting for a machine: not tried before
    Column("attempts", Integer, nullable=False, default=0),
    Column("request_id", String(64), nullable=True),                  # the attempt that answered (or failed) it
    Column("result", Text, nullable=True),                            # its output- or error-file line (JSON)
    Column("finished_at", BigInteger, nullable=True),
    Index("ix_batch_lines_state", "batch_id", "state", "not_before"),
)
