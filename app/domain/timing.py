"""How often a job's worker beats, when it is presumed dead, when a lost message is sent
again, how many times a job is retried, how far back fair share looks: declared once, for
the settings' defaults and for the worker's functions called without settings (tests,
tools)."""

from __future__ import annotations

HEARTBEAT_S = 5.0
"""How often a running job touches its heartbeat."""
STALE_AFTER_S = 60.0
"""A running job whose heartbeat is older than this is presumed dead and re-claimed."""
REQUEUE_AFTER_S = 300.0
"""A job still queued this long after its last enqueue is enqueued again (lost message)."""
JOB_TIME_LIMIT_S = 3600
"""Hard limit of one job (Celery's `task_time_limit`); the broker's visibility timeout must be
longer."""
FAIR_SHARE_WINDOW_S = 600.0
"""Fair share: a team's recent worker time is what its compiles used in this look-back."""
MAX_ATTEMPTS = 3
"""Claims a job may take before it is failed as `worker_lost`: a model that kills its worker
(out of memory, a crash) must not be handed out by the reaper forever."""


def reap_interval(stale_after_s: float) -> float:
    """How often a reaper runs: a third of the stale threshold (a dead worker's job restarts
    within ~1.3x `stale_after_s`), between 1 and 30 s."""
    return max(1.0, min(30.0, stale_after_s / 3))
