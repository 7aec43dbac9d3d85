"""A worker tells the farm which compilers it has (`app.domain.services.compilers`): once at
start, then every `interval_s` from a daemon thread, and withdraws them when it stops."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from sqlalchemy.orm import Session, sessionmaker

from app.domain.compilers import Compiler
from app.domain.db.session import session_scope
from app.domain.services import compilers as offered

log = logging.getLogger(__name__)


class Advertiser:
    def __init__(
        self,
        session_factory: sessionmaker[Session],
        worker: str,
        compilers: Sequence[Compiler],
        *,
        stale_after_s: float,
    ) -> None:
        self._sessions = session_factory
        self.worker = worker
        self.compilers = list(compilers)
        self._interval = offered.advertise_interval(stale_after_s)
        self._fresh = offered.fresh_s(stale_after_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qpcfarm-advertise", daemon=True)

    def advertise(self) -> None:
        with session_scope(self._sessions) as session:
            offered.advertise(session, self.worker, self.compilers, fresh_s=self._fresh)

    def start(self) -> Advertiser:
        """Advertise now (a submit right after start finds the compilers), then keep at it;
        a database away now is tried again at the next interval."""
        try:
            self.advertise()
        except Exception:
            log.warning("could not advertise this worker's compilers", exc_info=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        try:
            with session_scope(self._sessions) as session:
                offered.withdraw(session, self.worker)
        except Exception:  # its rows age out instead
            log.warning("could not withdraw this worker's compilers", exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.advertise()
            except Exception:
                log.warning("could not advertise this worker's compilers", exc_info=True)
