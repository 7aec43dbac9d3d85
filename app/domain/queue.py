"""What the API needs of the job queue: hand a committed job's id to the workers. The queues
themselves (Celery in the farm, threads in the embedded mode) live in `worker.queues`; the
API holds one through this protocol only.

The API commits a job row, then enqueues its id. A failed enqueue is logged, not raised: the
job is safely in the database and the sweep enqueues it again after `requeue_after_s`, or at
once when the broker comes back having lost its messages (`BrokerWatch`).
"""

from __future__ import annotations

import uuid
from typing import Literal, Protocol, runtime_checkable

JobKind = Literal["compile", "profile"]
"""The table a job id names (`compile_jobs`, `profile_jobs`); each kind has its own task."""


@runtime_checkable
class JobQueue(Protocol):
    def enqueue(self, job_id: uuid.UUID, kind: JobKind = "compile") -> None:
        """Ask a worker to run the job (at least once; the worker's claim decides)."""
        ...

    def close(self) -> None:
        """Release threads and connections (the app's shutdown)."""
        ...

    def ping(self) -> bool:
        """Whether jobs can be handed over now (readiness)."""
        ...


@runtime_checkable
class BrokerWatch(Protocol):
    """A queue over a broker that can lose its messages (a restart without persistence, a
    flush): the sweep asks it each time whether that happened since it last asked."""

    def broker_lost_messages(self) -> bool:
        """True once per loss of the broker's data, to one caller across the farm (who then
        enqueues every queued job again); False otherwise."""
        ...
