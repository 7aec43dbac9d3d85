"""one active compile per team and cache key

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03

A partial unique index on `compile_jobs (team_id, options_key)` over the jobs in flight
(queued or running, no cancel requested): identical submits racing in several API processes
can no longer both insert a job, so a (team, model bytes, canonical options, compiler
version) compiles once. Duplicates already in flight are resolved first, the oldest kept:
a queued duplicate is cancelled, a running one is asked to cancel (its worker stops it).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACTIVE = "status IN ('queued', 'running') AND NOT cancel_requested"


def upgrade() -> None:
    jobs = sa.table(
        "compile_jobs",
        sa.column("id", sa.Uuid()),
        sa.column("team_id", sa.Uuid()),
        sa.column("options_key", sa.String()),
        sa.column("status", sa.String()),
        sa.column("stage", sa.String()),
        sa.column("cancel_requested", sa.Boolean()),
        sa.column("created_at", sa.DateTime(timezone=True)),
        sa.column("finished_at", sa.DateTime(timezone=True)),
    )
    bind = op.get_bind()
    rows = bind.execute(
        sa.select(jobs.c.id, jobs.c.team_id, jobs.c.options_key, jobs.c.status)
        .where(sa.text(ACTIVE))
        .order_by(jobs.c.team_id, jobs.c.options_key, jobs.c.created_at, jobs.c.id)
    ).all()
    seen: set[tuple[object, str]] = set()
    for job_id, team_id, key, status in rows:
        if (team_id, key) not in seen:
            seen.add((team_id, key))
            continue
        if status == "queued":
            values = {
                "status": "cancelled",
                "stage": "cancelled",
                "finished_at": sa.func.current_timestamp(),
            }
        else:
            values = {"cancel_requested": True}
        bind.execute(sa.update(jobs).where(jobs.c.id == job_id).values(**values))
    op.create_index(
        "uq_compile_jobs_active_team_key",
        "compile_jobs",
        ["team_id", "options_key"],
        unique=True,
        sqlite_where=sa.text(ACTIVE),
        postgresql_where=sa.text(ACTIVE),
    )


def downgrade() -> None:
    op.drop_index("uq_compile_jobs_active_team_key", table_name="compile_jobs")
