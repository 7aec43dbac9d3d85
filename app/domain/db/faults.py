"""The database errors that say the server is away, not that a request or a job is wrong.

The API answers them 503 (`database_unavailable`); a worker neither fails its job nor stops
its compile over them: a progress write is skipped, and an outage at a write that matters
leaves the job to be run again (the Celery task retries, the reaper re-enqueues a job whose
heartbeat went stale).
"""

from __future__ import annotations

import sqlalchemy.exc

DATABASE_FAULTS: tuple[type[Exception], ...] = (
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
    sqlalchemy.exc.TimeoutError,
    sqlalchemy.exc.PendingRollbackError,
)
"""The database went away, restarted, or has no connection free."""
