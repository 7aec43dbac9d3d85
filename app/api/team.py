"""`/v1/team`: the signed-in team's usage against its quotas."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import CurrentTeam, SessionDep
from app.api.schemas import TeamOut
from app.domain.services import quotas

router = APIRouter(prefix="/v1/team", tags=["team"])


@router.get("", response_model=TeamOut)
def read_team(session: SessionDep, team: CurrentTeam) -> TeamOut:
    """Queued and running compile jobs and stored bytes beside the team's limits (set by an
    operator with `qpcfarm admin set-limits`; None: no limit)."""
    return TeamOut.model_validate(quotas.describe(session, team))
