"""Content-addressed blob storage (sha256 -> bytes), streamed both ways."""

from app.domain.blobs.base import (
    BlobCorrupt,
    BlobNotFound,
    BlobRef,
    BlobStore,
    BlobTooLarge,
    local_path,
)
from app.domain.blobs.factory import blob_store_from_settings

__all__ = [
    "BlobCorrupt",
    "BlobNotFound",
    "BlobRef",
    "BlobStore",
    "BlobTooLarge",
    "blob_store_from_settings",
    "local_path",
]
