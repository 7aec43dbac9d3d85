"""The sweep pages: `/sweeps` (the team's sweeps) and `/sweeps/{id}`: progress, the
throughput-vs-latency scatter with its Pareto front, and the results table, sortable by any
column through links (the server sorts; no script). The changing part is polled like a
job's (`poll.js`), with the sort kept in the polled URL."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api.deps import QueueDep, SessionDep
from app.domain.db.models import JobStatus, Sweep, Team
from app.domain.queue import commit_then_enqueue
from app.domain.services import sweeps
from app.web.deps import FragmentSweep, FragmentTeam, PageSweep, PageTeam
from app.web.routes import POLL_DONE_HEADER, render
from app.web.sweep_chart import build_chart

router = APIRouter(include_in_schema=False)

SORTS: dict[str, Any] = {
    "rank": lambda r: (r["rank"] is None, r["rank"] or 0),
    "cores": lambda r: r["cores"],
    "instances": lambda r: r["instances"],
    "batchsize": lambda r: r["batchsize"],
    "mos": lambda r: (r["params"].get("mos") is None, r["params"].get("mos") or 0),
    "ols": lambda r: (r["params"].get("ols") is None, r["params"].get("ols") or 0),
    "set_size": lambda r: r["set_size"],
    "latency": lambda r: (r["latency_us"] is None, r["latency_us"] or 0.0),
    "throughput": lambda r: (r["throughput"] is None, -(r["throughput"] or 0.0)),
    "status": lambda r: r["status"],
}
"""Sort keys by column; `desc=1` reverses (throughput sorts highest first by default)."""
COLUMNS = (
    ("rank", "Rank"), ("cores", "Cores"), ("instances", "Instances"), ("batchsize", "Batch"),
    ("mos", "mos"), ("ols", "ols"), ("set_size", "Set size"), ("latency", "Latency (µs)"),
    ("throughput", "Inferences/s"), ("status", "Status"),
)  # fmt: skip


def sweep_context(
    session: Any, queue: Any, team: Team, sweep: Sweep, sort: str, desc: bool
) -> dict[str, Any]:
    queued = sweeps.advance(session, sweep.id)
    commit_then_enqueue(session, queue, queued)
    session.refresh(sweep)
    data = sweeps.view(session, sweep)
    sort = sort if sort in SORTS else "rank"
    rows = sorted(data["results"], key=SORTS[sort], reverse=desc)
    return {
        "team": team,
        "sweep": data,
        "rows": rows,
        "sort": sort,
        "desc": desc,
        "columns": COLUMNS,
        "chart": build_chart(data["results"], data["pareto_front"], data["best"]),
        "front": set(data["pareto_front"]),
        "active": sweep.status == JobStatus.running,
    }


@router.get("/sweeps", response_model=None)
def sweep_list(request: Request, session: SessionDep, team: PageTeam) -> Response:
    items = sweeps.list_sweeps(session, team, limit=100).items
    return render(request, "sweeps.html", {"team": team, "sweeps": items})


@router.get("/sweeps/{sweep_id}", response_model=None)
def sweep_page(
    request: Request,
    session: SessionDep,
    team: PageTeam,
    sweep: PageSweep,
    queue: QueueDep,
    sort: str = "rank",
    desc: bool = False,
) -> Response:
    return render(request, "sweep.html", sweep_context(session, queue, team, sweep, sort, desc))


@router.get("/sweeps/{sweep_id}/live", response_model=None)
def sweep_live(
    request: Request,
    session: SessionDep,
    team: FragmentTeam,
    sweep: FragmentSweep,
    queue: QueueDep,
    sort: str = "rank",
    desc: bool = False,
) -> Response:
    """The sweep page's changing part, polled while the sweep runs."""
    context = sweep_context(session, queue, team, sweep, sort, desc)
    response = render(request, "_sweep_body.html", context)
    if not context["active"]:
        response.headers[POLL_DONE_HEADER] = "1"
    return response
