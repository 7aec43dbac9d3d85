"""per-team quotas and retention, pinned QPCs, batch (sweep) compile jobs

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04

`teams`: `max_queued_jobs`, `max_running_jobs`, `max_stored_bytes` (NULL: no limit) and
`retention_days` (NULL: the farm's default); `qpcs.pinned_at` (a pinned QPC is never
collected); `compile_jobs.batch` (a sweep's compile: it yields to interactive compiles).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("teams") as batch:
        batch.add_column(sa.Column("max_queued_jobs", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_running_jobs", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_stored_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("retention_days", sa.Float(), nullable=True))
    with op.batch_alter_table("qpcs") as batch:
        batch.add_column(sa.Column("pinned_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("compile_jobs") as batch:
        batch.add_column(
            sa.Column("batch", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("compile_jobs") as batch:
        batch.drop_column("batch")
    with op.batch_alter_table("qpcs") as batch:
        batch.drop_column("pinned_at")
    with op.batch_alter_table("teams") as batch:
        batch.drop_column("retention_days")
        batch.drop_column("max_stored_bytes")
        batch.drop_column("max_running_jobs")
        batch.drop_column("max_queued_jobs")
