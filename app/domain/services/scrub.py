"""The blob store's scrub (`qpcfarm admin verify-blobs`): every stored blob read and hashed,
the corrupt ones quarantined, and the blobs rows name that the store no longer holds listed.

Reads do the same check one blob at a time (app.domain.blobs.integrity); the scrub finds damage
before a reader does, e.g. from a nightly job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.domain.blobs import BlobCorrupt, BlobNotFound, BlobStore
from app.domain.blobs.integrity import verify_blob
from app.domain.db.models import Model, ProfileJob, Qpc, QuarantinedBlob


@dataclass
class MissingBlob:
    sha256: str
    referenced_by: str
    """`model`, `qpc`, `profile inputs` or `profile trace`."""
    quarantined: bool
    """Moved aside as corrupt (now or earlier), rather than never stored or deleted."""


@dataclass
class ScrubReport:
    checked: int = 0
    bytes: int = 0
    corrupt: list[str] = field(default_factory=list)
    """Blobs found corrupt by this scrub (now quarantined)."""
    missing: list[MissingBlob] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.corrupt and not self.missing

    def to_dict(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "bytes": self.bytes,
            "corrupt": self.corrupt,
            "missing": [m.__dict__ for m in self.missing],
            "clean": self.clean,
        }


def scrub(session: Session, store: BlobStore) -> ScrubReport:
    """Check every blob of `store` and every blob the database names."""
    report = ScrubReport()
    stored: set[str] = set()
    for sha256 in store.list_blobs():
        try:
            report.bytes += verify_blob(store, sha256, found_by="scrub")
        except BlobCorrupt:
            report.corrupt.append(sha256)
        except BlobNotFound:
            continue  # deleted or quarantined by someone else meanwhile
        else:
            stored.add(sha256)
        report.checked += 1
    quarantined = set(session.execute(select(QuarantinedBlob.sha256)).scalars())
    for sha256, what in _referenced(session):
        if sha256 in stored or store.exists(sha256):
            continue
        report.missing.append(MissingBlob(sha256, what, sha256 in quarantined))
    session.commit()
    return report


def _referenced(session: Session) -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    queries = (
        ("model", select(Model.sha256)),
        ("qpc", select(Qpc.sha256)),
        ("profile inputs", select(ProfileJob.inputs_sha256)),
        ("profile trace", select(ProfileJob.trace_sha256)),
    )
    for what, query in queries:
        for sha256 in session.execute(query.distinct()).scalars():
            if sha256 is not None:
                seen.setdefault(sha256, what)
    return sorted(seen.items())
