"""team admin keys and server-side web sessions

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03

`api_keys.admin`: a team admin's key manages the team's keys over `/v1/keys`. `web_sessions`:
a signed-in browser's cookie holds a random token instead of the API key; the row keeps the
token's sha256, its team and key, and when it expires.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(
            sa.Column("admin", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
    op.create_table(
        "web_sessions",
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("team_id", sa.Uuid(), nullable=False),
        sa.Column("api_key_id", sa.Uuid(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["api_key_id"],
            ["api_keys.id"],
            name=op.f("fk_web_sessions_api_key_id_api_keys"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["team_id"],
            ["teams.id"],
            name=op.f("fk_web_sessions_team_id_teams"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("token_hash", name=op.f("pk_web_sessions")),
    )
    op.create_index(op.f("ix_web_sessions_api_key_id"), "web_sessions", ["api_key_id"])
    op.create_index(op.f("ix_web_sessions_expires_at"), "web_sessions", ["expires_at"])
    op.create_index(op.f("ix_web_sessions_team_id"), "web_sessions", ["team_id"])


def downgrade() -> None:
    op.drop_table("web_sessions")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("admin")
