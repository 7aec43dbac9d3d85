"""The kinds of job, each declared once: its table, its Celery task, what its claim sets, and
how a dead worker's job of that kind is failed. The worker's one claim -> heartbeat -> run
path (`worker.runner.process_job`), its tasks, the reaper and the queues all read this table;
adding a kind is a row here, a `JobKind` name and the worker's run function for it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

from app.domain import stages
from app.domain.db.models import CompileJob, ProfileJob
from app.domain.queue import JobKind

JobTable = type[CompileJob] | type[ProfileJob]


@dataclass(frozen=True)
class JobKindSpec:
    kind: JobKind
    table: JobTable
    task_name: str
    """The Celery task that runs it (a message carries only the job's id)."""
    doing: str
    """What its worker does, in messages ("the worker died while compiling the job")."""
    crash_code: str
    """The error code of a job whose worker process died under it."""
    claim_values: Mapping[str, Any] = field(default_factory=dict)
    """Columns its claim sets besides status, worker, attempts and times."""

    @property
    def cancellable(self) -> bool:
        """Whether a cancel can be requested (the table has `cancel_requested`)."""
        return hasattr(self.table, "cancel_requested")


JOB_KINDS: dict[JobKind, JobKindSpec] = {
    "compile": JobKindSpec(
        "compile",
        CompileJob,
        task_name="qpcfarm.compile",
        doing="compiling",
        crash_code="compiler_crashed",
        claim_values={"stage": stages.CLAIMED, "progress": 0.0},
    ),
    "profile": JobKindSpec(
        "profile",
        ProfileJob,
        task_name="qpcfarm.profile",
        doing="running",
        crash_code="worker_crashed",
    ),
}

KINDS: tuple[JobKind, ...] = get_args(JobKind)
