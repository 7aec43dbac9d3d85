"""Content-addressed blob storage (sha256 -> bytes), streamed both ways."""

from app.domain.blobs.base import (
    BlobCorrupt,
    BlobNotFound,
    BlobRef,
    BlobStore,
    BlobTooLarge,
    blob_store_from_settings,
    local_path,
)

__all__ = [
    "BlobCorrupt",
    "BlobNotFound",
    "BlobRef",
    "BlobStore",
    "BlobTooLarge",
    "blob_store_from_settings",
    "local_path",
]
