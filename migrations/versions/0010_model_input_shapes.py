"""input shapes recorded with a framework model

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04

`models.input_shapes`: the `-input-shapes` a TensorFlow / PyTorch model was uploaded with
(`x:1x3x224x224,...`; NULL: none), the default of its compiles.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("input_shapes", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("input_shapes")
