"""Pick the configured blob store: a folder under `data_dir`, or the database's blob tables.
Apart from `base` so that the backends (which import `base`) are not imported back by it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from app.domain.blobs.base import BlobStore
    from app.domain.settings import Settings


def blob_store(
    settings: Settings,
    session_factory: sessionmaker[Session] | Callable[[], Session],
    *,
    root: Path | None = None,
) -> BlobStore:
    """The configured store, recording quarantined blobs through `session_factory`; `root`
    replaces the filesystem store's folder (`data_dir/blobs`)."""
    from app.domain.blobs.quarantine import recorder

    record = recorder(session_factory)
    if settings.blob_store == "filesystem":
        from app.domain.blobs.filesystem import FilesystemBlobStore

        folder = root if root is not None else Path(settings.data_dir) / "blobs"
        return FilesystemBlobStore(folder, on_quarantine=record)
    from app.domain.blobs.database import DatabaseBlobStore

    return DatabaseBlobStore(session_factory, on_quarantine=record)


def blob_store_from_settings(
    settings: Settings, session_factory: sessionmaker[Session] | Callable[[], Session]
) -> BlobStore:
    """`blob_store` in its default folder."""
    return blob_store(settings, session_factory)
