"""Compiled QPCs as a team sees them: a team sees a QPC one of its jobs produced or reused."""

from __future__ import annotations

import uuid

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.models import CompileJob, CompileReport, Qpc, Team
from app.services.errors import not_found


def team_can_see(session: Session, team: Team, qpc_id: uuid.UUID) -> bool:
    found = session.execute(
        select(CompileJob.id)
        .where(CompileJob.team_id == team.id, CompileJob.qpc_id == qpc_id)
        .limit(1)
    ).scalar_one_or_none()
    return found is not None


def get_qpc(session: Session, team: Team, qpc_id: uuid.UUID) -> Qpc:
    qpc = session.get(Qpc, qpc_id)
    if qpc is None or not team_can_see(session, team, qpc.id):
        raise not_found("qpc", qpc_id)
    return qpc


def get_report(session: Session, qpc: Qpc) -> CompileReport | None:
    return session.execute(
        select(CompileReport).where(CompileReport.qpc_id == qpc.id)
    ).scalar_one_or_none()
