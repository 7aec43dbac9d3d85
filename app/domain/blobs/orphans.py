"""A refused upload leaves no blob behind.

An upload is stored while it streams in (hashing it needs all of it) and judged after: a
model the importer refuses, inputs that are no `.npz`, a QPC sent with a bad device. The
upload's route runs its service through `discarded_on_refusal`, which records the blobs that
upload's `put` created and, when the service refuses, deletes each one that no row names.

Only blobs the refused upload itself created are candidates (content already stored belongs
to someone else), and a candidate some row references (a model, QPC, validation or profile of
any team, e.g. a blob that was missing and this upload restored) is kept. What is left is a
narrow race: the same bytes uploaded at the same moment by a second client whose upload is
accepted, and whose row is committed after this check. That model's compile then reports the
blob missing, and uploading it again stores it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from sqlalchemy import exists, or_, select
from sqlalchemy.orm import Session

from app.domain.blobs.base import BlobRef, BlobStore, FileDigest, Source
from app.domain.db.models import Model, ProfileJob, Qpc, Validation

log = logging.getLogger(__name__)


class RecordingStore:
    """A blob store that remembers the blobs its `put` created; everything else passes
    through to the store it wraps."""

    def __init__(self, store: BlobStore) -> None:
        self._store = store
        self.created: list[BlobRef] = []

    def put(self, data: Source, *, max_bytes: int | None = None) -> BlobRef:
        return self._record(self._store.put(data, max_bytes=max_bytes))

    def put_file(
        self, path: Path, *, max_bytes: int | None = None, digest: FileDigest | None = None
    ) -> BlobRef:
        return self._record(self._store.put_file(path, max_bytes=max_bytes, digest=digest))

    def _record(self, ref: BlobRef) -> BlobRef:
        if ref.created:
            self.created.append(ref)
        return ref

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def is_referenced(session: Session, sha256: str) -> bool:
    """Whether any row of any team names the blob."""
    names = or_(
        exists().where(Model.sha256 == sha256),
        exists().where(Qpc.sha256 == sha256),
        exists().where(Validation.qpc_sha256 == sha256),
        exists().where(or_(ProfileJob.inputs_sha256 == sha256, ProfileJob.trace_sha256 == sha256)),
    )
    return bool(session.execute(select(names)).scalar())


def discard_unreferenced(sessions: Callable[[], Session], store: BlobStore, sha256: str) -> bool:
    """Delete the blob unless a row names it; True if it was deleted."""
    with sessions() as session:
        if is_referenced(session, sha256):
            return False
    return store.delete(sha256)


@contextmanager
def discarded_on_refusal(store: BlobStore, sessions: Callable[[], Session]) -> Iterator[BlobStore]:
    """A store to hand an upload's service: if the block raises, the blobs its `put`
    created and no row names are deleted, then the error goes on."""
    recording = RecordingStore(store)
    try:
        yield cast(BlobStore, recording)
    except BaseException:
        for ref in recording.created:
            try:
                discard_unreferenced(sessions, store, ref.sha256)
            except Exception:  # noqa: BLE001 - the refusal is what the client must get
                log.warning("could not remove a refused upload's blob", exc_info=True)
        raise
