"""QPC rows per team

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03

`qpcs.team_id`: a QPC row belongs to one team, unique per (team, sha256) instead of per
sha256, so a team never sees another team's QPC id or its creation time (the bytes stay one
blob). Existing rows are split: the team whose job made a QPC first keeps the row; every other
team that reached it (a cache hit, the same compile) gets a copy with its report, and its
jobs, validations and profiles point at the copy. A QPC no job points at is dropped.
"""

import uuid
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

qpcs = sa.table(
    "qpcs",
    sa.column("id", sa.Uuid()),
    sa.column("team_id", sa.Uuid()),
    sa.column("sha256", sa.String()),
    sa.column("size", sa.BigInteger()),
    sa.column("compiler_version", sa.String()),
    sa.column("options_key", sa.String()),
    sa.column("device", sa.String()),
    sa.column("requirements", sa.JSON()),
    sa.column("created_at", sa.DateTime(timezone=True)),
)
reports = sa.table(
    "compile_reports",
    sa.column("id", sa.Uuid()),
    sa.column("qpc_id", sa.Uuid()),
    sa.column("metrics", sa.JSON()),
    sa.column("warnings", sa.JSON()),
    sa.column("pass_times", sa.JSON()),
    sa.column("log", sa.Text()),
    sa.column("created_at", sa.DateTime(timezone=True)),
)
REFERRERS = ("compile_jobs", "validations", "profile_jobs")


def _referrer(name: str) -> sa.TableClause:
    return sa.table(
        name,
        sa.column("qpc_id", sa.Uuid()),
        sa.column("team_id", sa.Uuid()),
        sa.column("created_at", sa.DateTime(timezone=True)),
    )


def upgrade() -> None:
    with op.batch_alter_table("qpcs") as batch:
        batch.add_column(sa.Column("team_id", sa.Uuid(), nullable=True))
        batch.drop_constraint("uq_qpcs_sha256", type_="unique")
    bind = op.get_bind()
    for qpc in bind.execute(sa.select(qpcs)).mappings().all():
        teams: list[uuid.UUID] = []
        for name in REFERRERS:
            table = _referrer(name)
            rows = bind.execute(
                sa.select(table.c.team_id)
                .where(table.c.qpc_id == qpc["id"])
                .group_by(table.c.team_id)
                .order_by(sa.func.min(table.c.created_at))
            ).scalars()
            teams += [team for team in rows if team not in teams]
        if not teams:
            bind.execute(sa.delete(reports).where(reports.c.qpc_id == qpc["id"]))
            bind.execute(sa.delete(qpcs).where(qpcs.c.id == qpc["id"]))
            continue
        bind.execute(sa.update(qpcs).where(qpcs.c.id == qpc["id"]).values(team_id=teams[0]))
        report = (
            bind.execute(sa.select(reports).where(reports.c.qpc_id == qpc["id"]))
            .mappings()
            .one_or_none()
        )
        for team in teams[1:]:
            copy_id = uuid.uuid4()
            bind.execute(sa.insert(qpcs).values(**{**qpc, "id": copy_id, "team_id": team}))
            if report is not None:
                bind.execute(
                    sa.insert(reports).values(**{**report, "id": uuid.uuid4(), "qpc_id": copy_id})
                )
            for name in REFERRERS:
                table = _referrer(name)
                bind.execute(
                    sa.update(table)
                    .where(table.c.qpc_id == qpc["id"], table.c.team_id == team)
                    .values(qpc_id=copy_id)
                )
    with op.batch_alter_table("qpcs") as batch:
        batch.alter_column("team_id", existing_type=sa.Uuid(), nullable=False)
        batch.create_foreign_key(
            op.f("fk_qpcs_team_id_teams"), "teams", ["team_id"], ["id"], ondelete="CASCADE"
        )
        batch.create_unique_constraint(op.f("uq_qpcs_team_id_sha256"), ["team_id", "sha256"])
        batch.create_index(op.f("ix_qpcs_team_id"), ["team_id"], unique=False)
        batch.create_index(op.f("ix_qpcs_sha256"), ["sha256"], unique=False)


def downgrade() -> None:
    raise NotImplementedError("QPC rows split per team cannot be merged back automatically")
