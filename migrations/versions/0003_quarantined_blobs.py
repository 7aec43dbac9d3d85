"""quarantined blobs

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03

`quarantined_blobs`: a row per blob a store moved aside because its bytes did not hash to its
name (app.domain.blobs.integrity), so the API answers `blob_corrupt` for it and
`qpcfarm admin verify-blobs` can report it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "quarantined_blobs",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("actual_sha256", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("found_by", sa.String(length=32), nullable=False),
        sa.Column("location", sa.String(length=255), nullable=False),
        sa.Column("found_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_quarantined_blobs")),
    )
    op.create_index(
        op.f("ix_quarantined_blobs_sha256"), "quarantined_blobs", ["sha256"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_quarantined_blobs_sha256"), table_name="quarantined_blobs")
    op.drop_table("quarantined_blobs")
