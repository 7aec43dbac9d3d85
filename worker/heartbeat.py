"""The thread that keeps a claimed job's heartbeat fresh while its work runs.

The reaper re-enqueues running jobs whose heartbeat is old, so a worker deep inside one long
step (a compile stage, a profile run) must keep beating on its own session. What a beat
writes differs per kind of job; the thread around it does not.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

from sqlalchemy.orm import Session

from app.domain.db.base import utcnow
from app.domain.job_kinds import JobTable
from app.domain.timing import HEARTBEAT_S
from worker.claims import touch

log = logging.getLogger(__name__)


class HeartbeatThread:
    """Calls `beat(session)` every `interval_s` on a fresh session until the `with` block
    ends; `beat` returns False once the job is no longer this worker's to run (cancelled or
    taken over), which stops the beats and sets `stop_requested()`."""

    def __init__(
        self,
        session_factory: Callable[[], Session],
        beat: Callable[[Session], bool],
        interval_s: float,
        name: str,
    ) -> None:
        self._sessions = session_factory
        self._beat = beat
        self._interval = interval_s
        self._name = name
        self._done = threading.Event()
        self._stop = threading.Event()
        self.beats = 0
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{name}", daemon=True)

    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def _run(self) -> None:
        while not self._done.wait(self._interval):
            try:
                with self._sessions() as session:
                    keep_going = self._beat(session)
            except Exception:  # a database hiccup: try again at the next beat
                log.warning("heartbeat of %s failed", self._name, exc_info=True)
                continue
            self.beats += 1
            if not keep_going:
                self._stop.set()
                return

    def __enter__(self) -> HeartbeatThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


class JobHeartbeat(HeartbeatThread):
    """Keeps a claimed job's heartbeat fresh while its work runs (a compile inside one long
    stage, a profile run), on its own session. `stop_requested()` turns True once the job is
    cancelled or taken over; a compile passes it to run_compile as `should_cancel`."""

    def __init__(
        self,
        session_factory: Callable[[], Session],
        table: JobTable,
        job_id: uuid.UUID,
        worker: str,
        interval_s: float = HEARTBEAT_S,
    ) -> None:
        def beat(session: Session) -> bool:
            mine, cancel = touch(session, table, job_id, worker, {"heartbeat_at": utcnow()})
            return mine and not cancel

        super().__init__(session_factory, beat, interval_s, f"{table.__tablename__} {job_id}")
