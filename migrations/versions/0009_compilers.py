"""compiler backends and versions

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04

`worker_compilers`: the compilers (backend, version) each live worker has, with when it last
said so; `compile_jobs.compiler`: the `backend@version` a job asked for (null: the default).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "worker_compilers",
        sa.Column("worker", sa.String(length=255), nullable=False),
        sa.Column("backend", sa.String(length=16), nullable=False),
        sa.Column("version", sa.String(length=48), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("worker", "backend", "version"),
    )
    op.create_index("ix_worker_compilers_seen_at", "worker_compilers", ["seen_at"])
    with op.batch_alter_table("compile_jobs") as batch:
        batch.add_column(sa.Column("compiler", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("compile_jobs") as batch:
        batch.drop_column("compiler")
    op.drop_index("ix_worker_compilers_seen_at", table_name="worker_compilers")
    op.drop_table("worker_compilers")
