"""Batches: OpenAI's Files and Batch APIs — stored files, batches and their lines (each leased by
one coordinator instance while it runs), and each batch line's usage row marked with its batch and
custom_id.

Revision ID: 0011
Revises: 0010
"""
import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(sa.Column("batch_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("custom_id", sa.String(512), nullable=True))
        batch.create_index("ix_usage_records_batch_id", ["batch_id"])
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("account_id", sa.String(64), sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(256), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("lines", sa.Integer, nullable=True),
        sa.Column("content", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_files_account_created", "files", ["account_id", "created_at"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("account_id", sa.String(64), sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("caller_kind", sa.String(16), nullable=False),
        sa.Column("key_id", sa.String(64), nullable=True),
        sa.Column("machine_id", sa.String(64), nullable=True),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("completion_window", sa.String(8), nullable=False),
        sa.Column("route", sa.String(8), nullable=False),
        sa.Column("pinned_machine_id", sa.String(64), nullable=True),
        sa.Column("share_id", sa.String(64), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("metadata", sa.JSON, nullable=True),
        sa.Column("total", sa.Integer, nullable=False),
        sa.Column("completed", sa.Integer, nullable=False),
        sa.Column("failed", sa.Integer, nullable=False),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("in_progress_at", sa.BigInteger, nullable=True),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
        sa.Column("finalizing_at", sa.BigInteger, nullable=True),
        sa.Column("completed_at", sa.BigInteger, nullable=True),
        sa.Column("failed_at", sa.BigInteger, nullable=True),
        sa.Column("expired_at", sa.BigInteger, nullable=True),
        sa.Column("cancelling_at", sa.BigInteger, nullable=True),
        sa.Column("cancelled_at", sa.BigInteger, nullable=True),
    )
    op.create_index("ix_batches_account_created", "batches", ["account_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(64), sa.ForeignKey("batches.id"), primary_key=True),
        sa.Column("line_no", sa.Integer, primary_key=True),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("lease_owner", sa.String(64), nullable=True),
        sa.Column("lease_until", sa.BigInteger, nullable=True),
        sa.Column("not_before", sa.BigInteger, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("request_id", sa.String(64), nullable=True),
        sa.Column("result", sa.Text, nullable=True),
        sa.Column("finished_at", sa.BigInteger, nullable=True),
    )
    op.create_index("ix_batch_lines_state", "batch_lines", ["batch_id", "state", "not_before"])


def downgrade() -> None:
    op.drop_table("batch_lines")
    op.drop_table("batches")
    op.drop_table("files")
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_index("ix_usage_records_batch_id")
        batch.drop_column("custom_id")
        batch.drop_column("batch_id")
