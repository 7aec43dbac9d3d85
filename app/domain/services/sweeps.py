"""Model-configurator sweeps on the farm: a search space fanned out as ordinary compile jobs.

A sweep row holds the space; each compile group it needs becomes a compile job through
`jobs.submit_job`, so the QPC cache, attaching to an identical job in flight, the queue, the
claims and the reaper all work as for any compile. The sweep's own state is derived
from its jobs: `advance` (run on create, on every read, and by the periodic sweep of every API
process and worker) records finished jobs' figures, asks `configurator.search` what to compile
next (optimize rounds), submits it, and closes the sweep when nothing is left. It is
idempotent: two processes advancing at once propose the same groups, and a group's row is
unique per sweep.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.domain.db.base import utcnow
from app.domain.db.models import (
    CompileJob,
    CompileReport,
    JobStatus,
    Model,
    Sweep,
    SweepCompile,
    Team,
)
from app.domain.db.ops import insert_or_ignore
from app.domain.services import jobs, quotas
from app.domain.services.errors import ServiceError, not_found
from app.domain.services.pages import Page, paginate
from compiler_core.configurator.scoring import LlmBounds, meets, pareto_front
from compiler_core.configurator.search import Result, best, next_groups, ranked, results
from compiler_core.configurator.space import SearchSpace
from compiler_core.options import CompileOptions

log = logging.getLogger(__name__)

SCORING_FIELDS = ("device", "estimated_device_latency_us", "estimated_latency_us",
                  "host_transfer_us", "host_bytes", "host_buffers", "num_cores")  # fmt: skip
"""What scoring reads of a compile's metrics (plus the DDR totals, below)."""

Enqueue = Callable[[uuid.UUID], None]


def scoring_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a compile report's metrics that scoring needs (kept on the sweep's row):
    an LLM QPC's `llm` section and, of its specializations, those the section names."""
    total = (metrics.get("memory_traffic") or {}).get("total") or {}
    kept = {
        **{k: metrics.get(k) for k in SCORING_FIELDS},
        "memory_traffic": {
            "total": {
                "ddr_read_bytes": int(total.get("ddr_read_bytes", 0)),
                "ddr_write_bytes": int(total.get("ddr_write_bytes", 0)),
            }
        },
    }
    llm = metrics.get("llm")
    if isinstance(llm, Mapping):
        each = metrics.get("specializations") or {}
        named = {d.get("specialization") for d in llm.get("decode") or []}
        named.add(llm.get("prefill_specialization"))
        kept["llm"] = dict(llm)
        kept["specializations"] = {n: scoring_metrics(each[n]) for n in named if n in each}
    return kept


@dataclass
class GroupState:
    row: SweepCompile
    job: CompileJob

    @property
    def finished(self) -> bool:
        return not self.job.status.is_active

    @property
    def error(self) -> str | None:
        if self.job.status == JobStatus.succeeded:
            return None if self.row.metrics is not None else "the compile report has no metrics"
        if self.job.status == JobStatus.cancelled:
            return "cancelled"
        if self.job.status == JobStatus.failed:
            return f"{self.job.error_code}: {self.job.error_message}"
        return None


@dataclass
class SweepState:
    sweep: Sweep
    space: SearchSpace
    groups: dict[int, GroupState]

    @property
    def done(self) -> dict[int, Mapping[str, Any] | None]:
        return {
            g: (s.row.metrics if s.job.status == JobStatus.succeeded else None)
            for g, s in self.groups.items()
            if s.finished
        }

    @property
    def pending(self) -> set[int]:
        return {g for g, s in self.groups.items() if not s.finished}

    def results(self) -> list[Result]:
        errors = {g: s.error or "" for g, s in self.groups.items() if s.finished and s.error}
        return results(self.space, self.done, errors)


_SPACES: OrderedDict[uuid.UUID, SearchSpace] = OrderedDict()
SPACE_CACHE_SIZE = 64
"""Rebuilt spaces by sweep id: a sweep's space never changes, and checking every combination
again on each poll of a page would cost more than everything else the read does."""


_SPACES_LOCK = threading.Lock()


def space_of(sweep: Sweep) -> SearchSpace:
    with _SPACES_LOCK:
        space = _SPACES.get(sweep.id)
    if space is None:
        space = SearchSpace.from_json(sweep.space)
        with _SPACES_LOCK:
            _SPACES[sweep.id] = space
            while len(_SPACES) > SPACE_CACHE_SIZE:
                _SPACES.popitem(last=False)
    return space


def load_state(session: Session, sweep: Sweep) -> SweepState:
    """The sweep's groups and their jobs; copies the scoring figures of newly succeeded jobs
    onto their rows (flushed, not committed)."""
    rows = session.execute(
        select(SweepCompile, CompileJob)
        .join(CompileJob, CompileJob.id == SweepCompile.compile_job_id)
        .where(SweepCompile.sweep_id == sweep.id)
    ).all()
    groups = {row.group_index: GroupState(row, job) for row, job in rows}
    missing = [
        s for s in groups.values()
        if s.job.status == JobStatus.succeeded and s.row.metrics is None and s.job.qpc_id
    ]  # fmt: skip
    if missing:
        reports = session.execute(
            select(CompileReport.qpc_id, CompileReport.metrics).where(
                CompileReport.qpc_id.in_({s.job.qpc_id for s in missing})
            )
        ).all()
        by_qpc = {qpc_id: metrics for qpc_id, metrics in reports}
        for s in missing:
            metrics = by_qpc.get(s.job.qpc_id)
            if metrics and metrics.get("estimated_device_latency_us") is not None:
                s.row.metrics = scoring_metrics(metrics)
        session.flush()
    return SweepState(sweep, space_of(sweep), groups)


def _lock(session: Session, sweep_id: uuid.UUID) -> Sweep | None:
    """The sweep row, locked for this transaction where the database can (PostgreSQL)."""
    query = select(Sweep).where(Sweep.id == sweep_id)
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update()
    return session.execute(query).scalar_one_or_none()


TEAM_COMPILE_LIMIT_KEY = "team_compile_limit"
"""Where a sweep's row keeps the per-team bound it was created under (every process that
advances it then applies the same one)."""


def sweep_compile_allowance(session: Session, team_id: uuid.UUID, limit: int) -> int:
    """How many more compiles the team's sweeps may submit now: `limit` less the team's
    sweep compiles still queued or running.

    Never more than the team's queue quota leaves room for (`quotas.queue_room`): a sweep
    never meets a 429; every sweep (create, reads, the periodic advance) obeys it."""
    active = session.execute(
        select(func.count(func.distinct(SweepCompile.compile_job_id)))
        .join(Sweep, Sweep.id == SweepCompile.sweep_id)
        .join(CompileJob, CompileJob.id == SweepCompile.compile_job_id)
        .where(
            Sweep.team_id == team_id,
            CompileJob.status.in_((JobStatus.queued, JobStatus.running)),
        )
    ).scalar_one()
    room = quotas.queue_room(session, team_id)
    allowed = max(0, limit - int(active))
    return allowed if room is None else min(allowed, room)


def advance(session: Session, sweep_id: uuid.UUID) -> list[uuid.UUID]:
    """Move a running sweep on: submit the groups the search wants now, close it when the
    search is finished. Returns the ids of new queued jobs; the caller commits, then enqueues
    them.

    A cache hit is taken from the QPC's row and report without reading its blob back (a
    compile job's submit hashes the whole QPC first): a sweep of a hundred cached ResNet-50
    QPCs would otherwise read gigabytes to rank them by their reports. The bytes are checked
    where they are used: a download verifies them, and quarantines a damaged blob."""
    sweep = _lock(session, sweep_id)
    if sweep is None or sweep.status != JobStatus.running:
        return []
    state = load_state(session, sweep)
    wanted = next_groups(
        state.space, sweep.mode, state.done, state.pending, sweep.objective,
        sweep.latency_bound_us, llm_bounds_of(sweep),
    )  # fmt: skip
    to_enqueue: list[uuid.UUID] = []
    if wanted:
        limit = int(sweep.space.get(TEAM_COMPILE_LIMIT_KEY) or _default_team_limit())
        # At most the team's allowance now; the rest when those finish (a later advance).
        wanted = wanted[: sweep_compile_allowance(session, sweep.team_id, limit)]
        team = session.get(Team, sweep.team_id)
        model = session.get(Model, sweep.model_id)
        if team is None or model is None:
            _finish(sweep, JobStatus.failed, "the sweep's model no longer exists")
            return []
        rounds = [s.row.round for s in state.groups.values()]
        next_round = (max(rounds) + 1) if rounds and sweep.mode == "optimize" else 0
        scope = sweep.space.get("cache_scope", "team")
        for g in wanted:
            try:
                job, created = jobs.submit_job(
                    session, team, model, state.space.groups[g].options, store=None,
                    cache_scope=scope, batch=True,
                )  # fmt: skip
            except ServiceError as exc:
                if exc.code not in QUOTA_CODES:
                    raise
                break  # the rest when the team is under its quotas again (a later advance)
            inserted = insert_or_ignore(
                session,
                SweepCompile,
                {
                    "id": uuid.uuid4(),
                    "sweep_id": sweep.id,
                    "group_index": g,
                    "compile_job_id": job.id,
                    "created_job": created and not job.cache_hit,
                    "round": next_round,
                    "created_at": utcnow(),
                },
                ["sweep_id", "group_index"],
            )
            if inserted and created and job.status == JobStatus.queued:
                to_enqueue.append(job.id)
        session.flush()
        return to_enqueue
    if not state.pending:
        scored = [r for r in state.results() if r.score is not None]
        if state.groups and not scored:
            _finish(sweep, JobStatus.failed, "every compile of the sweep failed")
        else:
            _finish(sweep, JobStatus.succeeded, None)
    return to_enqueue


QUOTA_CODES = frozenset({"queue_quota", "storage_quota"})


def _default_team_limit() -> int:
    from app.domain.settings import get_settings

    return get_settings().max_team_sweep_compiles


def check_size(space: SearchSpace, max_combinations: int) -> None:
    """One request's sweep holds at most `max_combinations` combinations (422
    `sweep_too_large`), before any of them is checked further or submitted."""
    if len(space.points) > max_combinations:
        raise ServiceError(
            "sweep_too_large",
            f"the search space has {len(space.points):,} combinations; a sweep may hold at "
            f"most {max_combinations:,} (QPCFARM_MAX_SWEEP_COMBINATIONS): split it",
            422,
            {"max_combinations": max_combinations},
        )


def _finish(sweep: Sweep, status: JobStatus, message: str | None) -> None:
    sweep.status = status
    sweep.error_message = message
    sweep.finished_at = utcnow()


LLM_BOUNDS_KEY = "llm_bounds"
"""Where a sweep keeps its LLM objective's bounds (`scoring.LlmBounds`) in its stored space,
beside the cache scope and the team's compile limit."""


def llm_bounds_of(sweep: Sweep) -> LlmBounds | None:
    stored = sweep.space.get(LLM_BOUNDS_KEY)
    return LlmBounds(**stored) if isinstance(stored, dict) else None


def create_sweep(
    session: Session,
    team: Team,
    model: Model,
    space: SearchSpace,
    *,
    mode: str,
    objective: str,
    latency_bound_us: float | None,
    cache_scope: str = "team",
    team_compile_limit: int | None = None,
    llm_bounds: LlmBounds | None = None,
) -> tuple[Sweep, list[uuid.UUID]]:
    """A new running sweep with its first compiles submitted; (sweep, job ids to enqueue
    after the commit). A space with no valid combination is refused (422). The team's sweeps
    have at most `team_compile_limit` compiles queued or running at once (default: the
    setting `max_team_sweep_compiles`); the rest are submitted as those finish."""
    if model.team_id != team.id:
        raise not_found("model", model.id)
    if not space.groups:
        reasons = sorted({p.reason for p in space.invalid_points})[:3]
        raise ServiceError(
            "invalid_search_space",
            "no combination of the search space is valid: " + "; ".join(reasons),
            422,
        )
    sweep = Sweep(
        team_id=team.id,
        model_id=model.id,
        mode=mode,
        objective=objective,
        latency_bound_us=latency_bound_us,
        space={
            **space.to_json(),
            "cache_scope": cache_scope,
            TEAM_COMPILE_LIMIT_KEY: team_compile_limit or _default_team_limit(),
            **({LLM_BOUNDS_KEY: dataclasses.asdict(llm_bounds)} if llm_bounds else {}),
        },
        status=JobStatus.running,
    )
    session.add(sweep)
    session.flush()
    return sweep, advance(session, sweep.id)


def get_sweep(session: Session, team: Team, sweep_id: uuid.UUID) -> Sweep:
    sweep = session.get(Sweep, sweep_id)
    if sweep is None or sweep.team_id != team.id:
        raise not_found("sweep", sweep_id)
    return sweep


def list_sweeps(session: Session, team: Team, *, limit: int = 50, offset: int = 0) -> Page[Sweep]:
    query = (
        select(Sweep).where(Sweep.team_id == team.id).order_by(Sweep.created_at.desc(), Sweep.id)
    )
    return paginate(session, query, limit, offset)


def cancel(session: Session, team: Team, sweep: Sweep) -> Sweep:
    """Stop a running sweep: it is cancelled at once, and the compile jobs it created that
    are still queued or running are cancelled (jobs it attached to are someone else's and
    keep running). A finished sweep cannot be cancelled (409). Caller commits."""
    locked = _lock(session, sweep.id)
    if locked is None or locked.team_id != team.id:
        raise not_found("sweep", sweep.id)
    if locked.status != JobStatus.running:
        raise ServiceError(
            "not_cancellable", f"sweep {sweep.id} has already {locked.status.value}", 409
        )
    _finish(locked, JobStatus.cancelled, None)
    state = load_state(session, locked)
    for s in state.groups.values():
        if s.row.created_job and not s.finished:
            try:
                jobs.cancel(session, team, s.job)
            except ServiceError:  # it finished meanwhile
                pass
    session.flush()
    return locked


def active_sweep_ids(session: Session) -> list[uuid.UUID]:
    return list(
        session.execute(select(Sweep.id).where(Sweep.status == JobStatus.running)).scalars()
    )


# ------------------------------------------------------------------------------ the view


def _result_json(r: Result, state: SweepState, sweep: Sweep, rank: int | None) -> dict[str, Any]:
    point = r.point
    group = state.groups.get(point.group)
    job = group.job if group else None
    figures = r.score.to_json() if r.score else {}
    return {
        "rank": rank,
        "index": point.index,
        "group": point.group,
        "params": dict(point.params),
        "flags": point.flags(),
        "cores": point.cores,
        "instances": point.instances,
        "batchsize": point.batchsize,
        "set_size": point.set_size,
        "status": job.status.value if job else "pending",
        "latency_us": figures.get("latency_us"),
        "throughput": figures.get("throughput"),
        "device_latency_us": figures.get("device_latency_us"),
        "host_transfer_us": figures.get("host_transfer_us"),
        "host_overhead_us": figures.get("host_overhead_us"),
        "instances_per_soc": point.instances,
        "socs": figures.get("socs"),
        "cards": figures.get("cards"),
        "ddr_bound": figures.get("ddr_bound"),
        **{
            k: figures[k]
            for k in ("tokens_per_s", "decode_tokens_per_s", "ttft_ms", "tpot_ms")
            if k in figures
        },  # fmt: skip
        "estimated": True,
        "meets_objective": meets(
            r.score, sweep.objective, sweep.latency_bound_us, llm_bounds_of(sweep)
        ),
        "job_id": str(job.id) if job else None,
        "qpc_id": str(job.qpc_id) if job and job.qpc_id else None,
        "cache_hit": bool(job.cache_hit) if job else False,
        "error": r.error,
    }


def view(session: Session, sweep: Sweep) -> dict[str, Any]:
    """The sweep as the API shows it: status, progress, every result (ranked, then the
    points still compiling), the best, the Pareto front and the invalid combinations."""
    state = load_state(session, sweep)
    scored = state.results()
    order = ranked(scored, sweep.objective, sweep.latency_bound_us, llm_bounds_of(sweep))
    top = best(scored, sweep.objective, sweep.latency_bound_us, llm_bounds_of(sweep))
    items = [
        _result_json(r, state, sweep, rank + 1 if r.score is not None else None)
        for rank, r in enumerate(order)
    ]
    for g in sorted(state.pending):
        for index in state.space.groups[g].points:
            items.append(_result_json(Result(state.space.points[index], None), state, sweep, None))
    with_scores = [i for i in items if i["throughput"] is not None]
    front = pareto_front([(i["latency_us"], i["throughput"]) for i in with_scores])
    front_indices = sorted(with_scores[i]["index"] for i in front)
    finished = [s for s in state.groups.values() if s.finished]
    total_groups = len(state.space.groups)
    submitted = len(state.groups)
    done = len(finished)
    if sweep.status != JobStatus.running:
        fraction = 1.0
    else:
        fraction = done / (total_groups if sweep.mode == "brute" else max(submitted, 1))
    return {
        "id": str(sweep.id),
        "model_id": str(sweep.model_id),
        "mode": sweep.mode,
        "objective": sweep.objective,
        "latency_bound_us": sweep.latency_bound_us,
        "max_ttft_ms": (sweep.space.get(LLM_BOUNDS_KEY) or {}).get("max_ttft_ms"),
        "max_tpot_ms": (sweep.space.get(LLM_BOUNDS_KEY) or {}).get("max_tpot_ms"),
        "status": sweep.status.value,
        "error": sweep.error_message,
        "base_flags": CompileOptions.from_json(state.space.base).to_flags(),
        "created_at": sweep.created_at.isoformat(),
        "finished_at": sweep.finished_at.isoformat() if sweep.finished_at else None,
        "estimated": True,
        "progress": {
            "fraction": round(min(1.0, fraction), 4),
            "combinations": len(state.space.points),
            "valid_combinations": len(state.space.valid_points),
            "invalid_combinations": len(state.space.invalid_points),
            "compile_groups": total_groups,
            "compiles_submitted": submitted,
            "compiles_done": done,
            "compiles_failed": sum(1 for s in finished if s.job.status != JobStatus.succeeded),
            "cache_hits": sum(1 for s in state.groups.values() if s.job.cache_hit),
            "compiles_run": sum(
                1 for s in finished if s.job.status == JobStatus.succeeded and not s.job.cache_hit
            ),
            "rounds": 1 + max((s.row.round for s in state.groups.values()), default=0),
            "scored_combinations": len(with_scores),
        },
        "best": next((i for i in items if top is not None and i["index"] == top.point.index), None),
        "pareto_front": front_indices,
        "results": items,
        "invalid": [
            {"index": p.index, "params": dict(p.params), "reason": p.reason}
            for p in state.space.invalid_points
        ],
    }
