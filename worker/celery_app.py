"""The Celery app of the farm, built from settings on demand (nothing happens at import).

Delivery is at-least-once and the job row decides what runs: messages carry job ids, are
acknowledged only after the task (`task_acks_late`), go back to the broker when a worker's
process dies under them (`task_reject_on_worker_lost`), and a worker takes one message at a
time (`worker_prefetch_multiplier=1`, compiles are long). Redis redelivers an unacknowledged
message only after its visibility timeout, so that is set longer than the hard time limit of a
compile; a worker that dies without its broker noticing is covered earlier by the reaper
(`worker.reaper`), which re-enqueues from the database.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from app.domain.job_kinds import JOB_KINDS
from app.domain.services.limits import soft_time_limit

if TYPE_CHECKING:
    from celery import Celery

    from app.domain.settings import Settings

TASK_NAMES = {kind: spec.task_name for kind, spec in JOB_KINDS.items()}
"""One task per kind of job (`JOB_KINDS`); a message carries the job's id."""
TASK_NAME = TASK_NAMES["compile"]
QUEUE_NAME = "qpcfarm"
VISIBILITY_MARGIN_S = 600
"""How much longer than the hard time limit Redis waits before redelivering a message."""


def celery_config(settings: Settings) -> dict[str, Any]:
    """The app's configuration: a plain dict, so tests can read it without a broker."""
    hard = int(settings.job_time_limit_s)
    return {
        "broker_url": settings.broker_url,
        "broker_connection_retry_on_startup": True,
        "broker_connection_retry": True,
        "broker_connection_max_retries": None,  # a worker waits for the broker to come back
        "broker_transport_options": {"visibility_timeout": hard + VISIBILITY_MARGIN_S},
        "task_default_queue": QUEUE_NAME,
        "task_serializer": "json",
        "accept_content": ["json"],
        "task_ignore_result": True,
        "result_backend": None,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_time_limit": hard,
        "task_soft_time_limit": soft_time_limit(hard),
        "task_publish_retry": True,
        "task_publish_retry_policy": {
            "max_retries": 3,
            "interval_start": 0,
            "interval_step": 0.5,
            "interval_max": 2,
        },
        "worker_hijack_root_logger": False,
        "enable_utc": True,
    }


def make_celery_app(settings: Settings) -> Celery:
    """A Celery app for `settings.broker_url` (a producer for the API, or the worker's app
    once `worker.tasks.register_tasks` has added the compile task)."""
    from celery import Celery

    if not settings.broker_url:
        raise ValueError("no broker configured: set QPCFARM_BROKER_URL (e.g. redis://host:6379/0)")
    app = Celery("qpcfarm", set_as_current=False)
    app.conf.update(celery_config(settings))
    return app
