"""`/v1/keys`: a team's admins list, create and revoke the team's API keys.

A revoked key stops working in every API process within `deps.TEAM_CACHE_TTL_S` (0.5 s), and
the web sessions opened with it end at once. Keys that are not a team admin's get 403
`forbidden`; another team's key is 404 like any unknown id.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Response

from app.api.deps import Caller, CurrentCaller, SessionDep
from app.api.errors import ApiError
from app.api.schemas import KeyCreate, KeyCreated, KeyList, KeyOut
from app.domain.services import teams

router = APIRouter(prefix="/v1/keys", tags=["keys"])

ADMIN_ONLY: dict[int | str, dict[str, Any]] = {
    403: {"description": "`forbidden`: the key is not a team admin's"}
}


async def team_admin(caller: CurrentCaller) -> Caller:
    if not caller.admin:
        raise ApiError("forbidden", "only a team admin's key may manage the team's keys", 403)
    return caller


AdminCaller = Annotated[Caller, Depends(team_admin)]


@router.get("", response_model=KeyList, responses=ADMIN_ONLY)
def list_keys(caller: AdminCaller, session: SessionDep) -> KeyList:
    """The team's keys, revoked ones included, oldest first."""
    rows = teams.list_keys(session, caller.team)
    return KeyList(items=[KeyOut.model_validate(k, from_attributes=True) for _, k in rows],
                   count=len(rows))  # fmt: skip


@router.post("", status_code=201, response_model=KeyCreated, responses=ADMIN_ONLY)
def create_key(
    body: KeyCreate, caller: AdminCaller, session: SessionDep, response: Response
) -> KeyCreated:
    """A new key of the team; the answer holds the key itself, once."""
    secret, row = teams.create_api_key(session, caller.team, body.name, admin=body.admin)
    session.commit()
    response.headers["Location"] = f"/v1/keys/{row.id}"
    out = KeyOut.model_validate(row, from_attributes=True)
    return KeyCreated(**out.model_dump(), key=secret)


@router.post(
    "/{key_id}/revoke",
    response_model=KeyOut,
    responses={**ADMIN_ONLY, 404: {"description": "`not_found`"}},
)
def revoke_key(key_id: str, caller: AdminCaller, session: SessionDep) -> KeyOut:
    """Revoke a key of the team by its id or prefix (revoking twice is harmless)."""
    row = teams.revoke_key(session, teams.find_key(session, key_id, caller.team))
    session.commit()
    return KeyOut.model_validate(row, from_attributes=True)
