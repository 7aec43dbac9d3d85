"""model-configurator sweeps

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03

`sweeps`: a search space swept over a model (mode, objective, the space as JSON, status);
`sweep_compiles`: each compile group of a sweep and the ordinary compile job that runs it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("team_id", sa.Uuid(), nullable=False),
        sa.Column("model_id", sa.Uuid(), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("objective", sa.String(length=40), nullable=False),
        sa.Column("latency_bound_us", sa.Float(), nullable=True),
        sa.Column("space", sa.JSON(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "queued",
                "running",
                "succeeded",
                "failed",
                "cancelled",
                name="jobstatus",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_sweeps_model_id_models"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["team_id"], ["teams.id"], name=op.f("fk_sweeps_team_id_teams"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweeps")),
    )
    op.create_index(op.f("ix_sweeps_model_id"), "sweeps", ["model_id"], unique=False)
    op.create_index(op.f("ix_sweeps_status"), "sweeps", ["status"], unique=False)
    op.create_index(op.f("ix_sweeps_team_id"), "sweeps", ["team_id"], unique=False)
    op.create_table(
        "sweep_compiles",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("sweep_id", sa.Uuid(), nullable=False),
        sa.Column("group_index", sa.Integer(), nullable=False),
        sa.Column("compile_job_id", sa.Uuid(), nullable=False),
        sa.Column("created_job", sa.Boolean(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["compile_job_id"],
            ["compile_jobs.id"],
            name=op.f("fk_sweep_compiles_compile_job_id_compile_jobs"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["sweep_id"],
            ["sweeps.id"],
            name=op.f("fk_sweep_compiles_sweep_id_sweeps"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweep_compiles")),
        sa.UniqueConstraint(
            "sweep_id", "group_index", name=op.f("uq_sweep_compiles_sweep_id_group_index")
        ),
    )
    op.create_index(
        op.f("ix_sweep_compiles_compile_job_id"), "sweep_compiles", ["compile_job_id"], unique=False
    )
    op.create_index(
        op.f("ix_sweep_compiles_sweep_id"), "sweep_compiles", ["sweep_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_sweep_compiles_sweep_id"), table_name="sweep_compiles")
    op.drop_index(op.f("ix_sweep_compiles_compile_job_id"), table_name="sweep_compiles")
    op.drop_table("sweep_compiles")
    op.drop_index(op.f("ix_sweeps_team_id"), table_name="sweeps")
    op.drop_index(op.f("ix_sweeps_status"), table_name="sweeps")
    op.drop_index(op.f("ix_sweeps_model_id"), table_name="sweeps")
    op.drop_table("sweeps")
