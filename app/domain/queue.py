"""What the API needs of the job queue: hand a committed job's id to the workers. The queues
themselves (Celery in the farm, threads in the embedded mode) live in `worker.queues`; the
web face holds one through this protocol only, built by a `QueueFactory` that its composition
root (`app.console.serve`) passes in.

The API commits a job row, then enqueues its id. A failed enqueue is logged, not raised: the
job is safely in the database and the reaper enqueues it again after `requeue_after_s`, or at
once when the broker comes back having lost its messages (`BrokerWatch`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from app.domain.blobs import BlobStore
    from app.domain.settings import Settings

JobKind = Literal["compile", "profile"]
"""The table a job id names (`compile_jobs`, `profile_jobs`); each kind has its own task."""


class Enqueuer(Protocol):
    """What a request needs of the queue: hand a committed job id to the workers."""

    def enqueue(self, job_id: uuid.UUID, kind: JobKind = "compile") -> None:
        """Ask a worker to run the job (at least once; the worker's claim decides)."""
        ...


@runtime_checkable
class JobQueue(Enqueuer, Protocol):
    def close(self) -> None:
        """Release threads and connections (the app's shutdown)."""
        ...

    def ping(self) -> bool:
        """Whether jobs can be handed over now (readiness)."""
        ...


@runtime_checkable
class BrokerWatch(Protocol):
    """A queue over a broker that can lose its messages (a restart without persistence, a
    flush): the reaper asks it each time whether that happened since it last asked."""

    def broker_lost_messages(self) -> bool:
        """True once per loss of the broker's data, to one caller across the farm (who then
        enqueues every queued job again); False otherwise."""
        ...


QueueFactory = Callable[["Settings", "sessionmaker[Session]", "BlobStore"], JobQueue]
"""Builds the queue of an opened farm (`worker.queues.queue_from_settings`)."""


def commit_then_enqueue(
    session: Session,
    queue: Enqueuer,
    job_ids: Iterable[uuid.UUID | None],
    kind: JobKind = "compile",
) -> None:
    """Commit the session, then hand each job id (None: none) to the workers: in that order,
    so a worker never receives an id whose row it cannot read yet, and a failed enqueue leaves
    the job safely queued in the database for the reaper."""
    session.commit()
    for job_id in job_ids:
        if job_id is not None:
            queue.enqueue(job_id, kind)
