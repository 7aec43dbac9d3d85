"""`/v1/sweeps`: the model configurator as a farm job. Create a sweep of a search space over
an uploaded model, read its progress and ranked results, cancel it.

Each compile group of the space is an ordinary compile job (cache hits and attaching to an
identical job in flight included); reading a sweep also moves it on (`services.sweeps`).
Every figure is the cost model's estimate (`estimated: true`).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.api.deps import CurrentTeam, QueueDep, SessionDep, SettingsDep
from app.api.models import Limit, Offset
from app.domain.db.models import Sweep
from app.domain.queue import commit_then_enqueue
from app.domain.services import models, sweeps
from app.domain.services.errors import from_compile_error
from app.domain.services.farm_options import check_farm_rules
from compiler_core.configurator.scoring import (
    OBJECTIVE_TABLE,
    OBJECTIVES,
    parse_llm_bounds,
    parse_objective,
)
from compiler_core.configurator.space import SearchSpace, parse_csv, parse_mapping
from compiler_core.errors import CompileError

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"])


class SweepCreate(BaseModel):
    """A search space in the compact form (`space`) or the vendor's CSV (`space_csv`), one
    of the two; base flags every combination shares; the mode and the objective."""

    model_config = ConfigDict(extra="forbid")

    model_id: uuid.UUID
    space: dict[str, Any] | None = Field(
        default=None,
        description='`{"parameters": {name: [values]}, "constraints": [...], '
        '"base_flags": [...]}`; names: cores, instances, batchsize, mos, ols, set_size or '
        "any compile flag.",
        examples=[
            {
                "parameters": {"cores": [2, 4, 8], "instances": [1, 2, 4], "batchsize": [1, 4]},
                "constraints": ["cores * instances <= 14"],
            }
        ],
    )
    space_csv: str | None = Field(
        default=None,
        max_length=1 << 20,
        description="The vendor's form: a header of parameter names, one row per combination.",
    )
    base_flags: list[str] = Field(default_factory=list, examples=[["-convert-to-fp16"]])
    mode: Literal["brute", "optimize"] = "brute"
    objective: str = Field(
        default="max-throughput",
        description="; ".join(f"`{o.name}`: {o.summary}" for o in OBJECTIVE_TABLE),
        json_schema_extra={"enum": list(OBJECTIVES)},
    )
    latency_bound_us: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_ttft_ms: float | None = Field(
        default=None, gt=0, allow_inf_nan=False, description="An LLM objective's bound on TTFT."
    )
    max_tpot_ms: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="An LLM objective's bound on the time per output token.",
    )

    @model_validator(mode="after")
    def _one_form(self) -> SweepCreate:
        if (self.space is None) == (self.space_csv is None):
            raise ValueError("give the search space as `space` or as `space_csv` (one of them)")
        return self


class SweepResult(BaseModel):
    """One combination: its flags and estimated figures, or its compile's error."""

    model_config = ConfigDict(extra="allow")

    rank: int | None
    index: int
    flags: list[str]
    params: dict[str, Any]
    cores: int
    instances: int
    batchsize: int
    set_size: int
    status: str
    latency_us: float | None
    throughput: float | None = Field(description="Inferences per second (estimated).")
    estimated: bool
    meets_objective: bool
    job_id: uuid.UUID | None
    qpc_id: uuid.UUID | None
    cache_hit: bool
    error: str | None


class SweepInvalid(BaseModel):
    index: int
    params: dict[str, Any]
    reason: str


class SweepOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: uuid.UUID
    model_id: uuid.UUID
    mode: str
    objective: str
    latency_bound_us: float | None
    max_ttft_ms: float | None = None
    max_tpot_ms: float | None = None
    status: str
    error: str | None
    base_flags: list[str]
    estimated: bool
    progress: dict[str, Any]
    best: SweepResult | None
    pareto_front: list[int] = Field(description="Indices of the results on the Pareto front.")
    results: list[SweepResult]
    invalid: list[SweepInvalid]


class SweepSummary(BaseModel):
    id: uuid.UUID
    model_id: uuid.UUID
    mode: str
    objective: str
    status: str
    created_at: str


class SweepList(BaseModel):
    items: list[SweepSummary]
    count: int
    limit: int
    offset: int


def parse_space(body: SweepCreate) -> SearchSpace:
    """The request's space, checked (CompileError -> 422 with its code), each compile group's
    options held to the farm's rules like a compile's (no server-side paths: a sweep's base
    flags or parameters may not carry `-operators-supported`, `-aic-binary-dir`...)."""
    try:
        if body.space_csv is not None:
            space = parse_csv(body.space_csv, body.base_flags)
        else:
            space = parse_mapping(body.space, body.base_flags)
        for group in space.groups:
            check_farm_rules(group.options)
    except CompileError as exc:
        raise from_compile_error(exc) from None
    return space


def team_sweep(sweep_id: uuid.UUID, session: SessionDep, team: CurrentTeam) -> Sweep:
    return sweeps.get_sweep(session, team, sweep_id)


TeamSweep = Annotated[Sweep, Depends(team_sweep)]


@router.post(
    "",
    status_code=201,
    response_model=SweepOut,
    responses={
        404: {"description": "`not_found`: no such model for this team"},
        422: {
            "description": "`invalid_search_space`, `invalid_option`, `invalid_objective`, "
            "`sweep_too_large` (over `QPCFARM_MAX_SWEEP_COMBINATIONS`)"
        },
    },
)
def create_sweep(
    body: SweepCreate,
    response: Response,
    session: SessionDep,
    team: CurrentTeam,
    queue: QueueDep,
    settings: SettingsDep,
) -> dict[str, Any]:
    """Check the space (invalid combinations are listed in `invalid`, never compiled) and
    start the sweep: `brute` submits every compile group at once, `optimize` its first."""
    try:
        objective, bound = parse_objective(body.objective, body.latency_bound_us)
        llm_bounds = parse_llm_bounds(objective, body.max_ttft_ms, body.max_tpot_ms)
    except CompileError as exc:
        raise from_compile_error(exc) from None
    space = parse_space(body)
    sweeps.check_size(space, settings.max_sweep_combinations)
    model = models.get_model(session, team, body.model_id)
    sweep, queued = sweeps.create_sweep(
        session, team, model, space, mode=body.mode, objective=objective,
        latency_bound_us=bound, cache_scope=settings.cache_scope,
        team_compile_limit=settings.max_team_sweep_compiles, llm_bounds=llm_bounds,
    )  # fmt: skip
    commit_then_enqueue(session, queue, queued)
    response.headers["Location"] = f"/v1/sweeps/{sweep.id}"
    return sweeps.view(session, sweep)


@router.get("", response_model=SweepList)
def list_sweeps(
    session: SessionDep, team: CurrentTeam, limit: Limit = 50, offset: Offset = 0
) -> SweepList:
    page = sweeps.list_sweeps(session, team, limit=limit, offset=offset)
    items = [
        SweepSummary(
            id=s.id,
            model_id=s.model_id,
            mode=s.mode,
            objective=s.objective,
            status=s.status.value,
            created_at=s.created_at.isoformat(),
        )  # fmt: skip
        for s in page.items
    ]
    return SweepList(items=items, count=page.total, limit=page.limit, offset=page.offset)


def advanced_view(sweep: Sweep, session: SessionDep, queue: QueueDep) -> dict[str, Any]:
    """Move the sweep on (a finished compile may let the next round start), then show it."""
    commit_then_enqueue(session, queue, sweeps.advance(session, sweep.id))
    session.refresh(sweep)
    return sweeps.view(session, sweep)


@router.get("/{sweep_id}", response_model=SweepOut)
def read_sweep(sweep: TeamSweep, session: SessionDep, queue: QueueDep) -> dict[str, Any]:
    return advanced_view(sweep, session, queue)


@router.post(
    "/{sweep_id}/cancel",
    response_model=SweepOut,
    responses={409: {"description": "`not_cancellable`: the sweep has already finished"}},
)
def cancel_sweep(sweep: TeamSweep, session: SessionDep, team: CurrentTeam) -> dict[str, Any]:
    """Stop the sweep: its queued compiles are cancelled, running ones stop at their next
    progress report; results so far stay."""
    sweep = sweeps.cancel(session, team, sweep)
    session.commit()
    return sweeps.view(session, sweep)
