"""`/v1/compare`: two compiles side by side (metrics with ratio and change bucket, warnings
added and removed, pass times); the work is `app.domain.services.compare`."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from app.api.deps import CurrentTeam, SessionDep
from app.domain.services import compare as comparing

router = APIRouter(prefix="/v1/compare", tags=["qpcs"])


class CompareSideOut(BaseModel):
    ref: str = Field(description="The id given (a QPC or a compile job).")
    kind: str = Field(description="`qpc` or `job`.")
    status: str = Field(description="`passed` (a QPC) or `failed` (a failed job).")
    qpc_id: str | None
    job_id: str | None
    compiler_version: str | None
    device: str | None
    error: dict[str, Any] | None = Field(description="A failed job's `code` and `message`.")


class CompareRowOut(BaseModel):
    name: str = Field(description="Metric (dotted for nested figures) or pass name.")
    a: float | None
    b: float | None
    ratio: float | None = Field(description="b / a; null when a is 0 or a side lacks it.")
    bucket: str = Field(
        description="`same`, `1.1x`, `1.2x`, `1.5x`, `2x`, `5x`, `10x` (the largest factor "
        "either way reached), `added` or `removed`."
    )
    direction: str | None = Field(description="`up`, `down` or `same`.")


class CompareOut(BaseModel):
    a: CompareSideOut
    b: CompareSideOut
    status: str = Field(description="`passed -> passed`, `failed -> passed`, ...")
    changed: dict[str, int] = Field(description="Number of metrics in each change bucket.")
    metrics: list[CompareRowOut]
    warnings_added: list[Any]
    warnings_removed: list[Any]
    pass_times: list[CompareRowOut]


Ref = Annotated[uuid.UUID, Query(description="A QPC id or a compile job id of the team.")]


@router.get(
    "",
    response_model=CompareOut,
    responses={
        404: {"description": "`not_found`: no such QPC or compile job for this team"},
        409: {"description": "`not_comparable`: a job that is queued, running or cancelled"},
    },
)
def compare(a: Ref, b: Ref, session: SessionDep, team: CurrentTeam) -> CompareOut:
    """Compare two compiles of the team, `a` before and `b` after: each a QPC, or a compile
    job (a succeeded job stands for its QPC, a failed one for its failure)."""
    return CompareOut.model_validate(comparing.compare(session, team, a, b))
