"""The record of quarantined blobs: a row per blob a store moved aside (`quarantined_blobs`).

A store quarantines a blob when a reader finds that its bytes do not hash to its name; the
row says which blob, what its bytes hashed to, where they were put and who found them, so an
operator (`qpcfarm admin verify-blobs`) and the API (`blob_corrupt` instead of
`blob_missing`) can tell a damaged blob from one that was never there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.domain.blobs.base import Quarantined, QuarantineRecorder
from app.domain.db.models import QuarantinedBlob

log = logging.getLogger(__name__)


def recorder(session_factory: Callable[[], Session]) -> QuarantineRecorder:
    """A store's `on_quarantine`: log the event and add its row (its own transaction)."""

    def record(event: Quarantined) -> None:
        log.error(
            "blob %s is corrupt (its bytes hash to %s); found by %s, quarantined to %s",
            event.sha256,
            event.actual_sha256,
            event.found_by,
            event.location,
        )
        with session_factory() as session:
            session.add(
                QuarantinedBlob(
                    sha256=event.sha256,
                    actual_sha256=event.actual_sha256,
                    size=event.size,
                    found_by=event.found_by[:32],
                    location=event.location[:255],
                )
            )
            session.commit()

    return record


def was_quarantined(session: Session, sha256: str) -> bool:
    found = session.execute(
        select(QuarantinedBlob.id).where(QuarantinedBlob.sha256 == sha256).limit(1)
    ).scalar_one_or_none()
    return found is not None
