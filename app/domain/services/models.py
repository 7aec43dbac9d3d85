"""Model uploads: stream to the blob store, check with the compiler's importer, record."""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.domain.blobs import BlobStore, BlobTooLarge, local_path
from app.domain.blobs import guard as blob_guard
from app.domain.blobs.base import Source
from app.domain.blobs.integrity import spill_verified, verified_path, verify_for_use
from app.domain.db.models import Model, Team
from app.domain.services import quotas
from app.domain.services.archives import extract_archive
from app.domain.services.describer import inspect_in_child
from app.domain.services.errors import ServiceError, from_compile_error, not_found
from app.domain.services.pages import Page, paginate
from app.domain.services.upload_check import KIND_ARCHIVE
from compiler_core import CompileError
from compiler_core.convert import FORMAT_KEYS, format_input_shapes, parse_input_shapes

EXTRACT_LIMIT = 1 << 40
"""Extraction bound when a stored archive is unpacked again for a compile: the upload already
enforced the real limit, this only keeps a corrupted blob from filling the disk."""


def too_large(exc: BlobTooLarge) -> ServiceError:
    return ServiceError("too_large", str(exc), 413, {"max_bytes": exc.max_bytes})


def store_model(
    session: Session,
    store: BlobStore,
    team: Team,
    stream: Source,
    filename: str | None = None,
    *,
    max_bytes: int,
    input_shapes: str | None = None,
) -> Model:
    """Store an uploaded `.onnx`, or a `.zip`/`.tar`/`.tar.gz` of one `.onnx` with its
    external data, after checking it with the importer (in a describer process: see
    `describer`). The caller commits.

    A team at its storage quota is refused before the upload is read, and one the upload
    would take beyond it after (413 `storage_quota`, with the numbers; the unreferenced blob
    is left to the collector).

    The blob is stored as uploaded (archives too: the worker extracts again), so the bytes
    the client sent are the bytes the cache key names. The kind is decided by content; a
    name that says archive over content that is not one is a `bad_archive`.

    `input_shapes` (the compile's `-input-shapes` syntax, `x:1x3x224x224,...`) are the shapes
    a framework model's conversion is checked with where its format leaves them open: with
    them a TorchScript module is converted at upload (refused 422 when it does not convert);
    without them it is only loaded. A framework model records them (in one spelling) as the
    default of its compiles (`jobs.with_model_shapes`: a compile's own `-input-shapes` wins);
    an ONNX model's shapes are its own, and it records none.
    """
    check_filename(filename)
    shapes = _parse_shapes(input_shapes)
    quotas.check_storage(session, team)
    try:
        ref = store.put(stream, max_bytes=max_bytes)
    except BlobTooLarge as exc:
        raise too_large(exc) from None
    if ref.size == 0:
        raise ServiceError("empty_upload", "the upload is empty: send an .onnx or an archive", 422)
    quotas.check_storage(session, team, ref.size)
    with tempfile.TemporaryDirectory(prefix="qpcfarm-upload-") as tmp:
        work = Path(tmp)
        with local_path(store, ref.sha256, work, "upload") as path:
            # In a describer process: the importer's CPU and crashes stay out of the API's.
            kind, described = inspect_in_child(path, filename, max_bytes, work, shapes)
    opset, inputs, outputs = described
    blob_guard.lock_for_write(session, ref.sha256)
    if not store.exists(ref.sha256):  # collected by retention between the put and the lock
        raise ServiceError(
            "busy", "the upload's content was collected meanwhile; upload again", 503
        )
    model = Model(
        team_id=team.id,
        sha256=ref.sha256,
        size=ref.size,
        name=_display_name(filename, ref.sha256),
        kind=kind,
        opset=opset,
        inputs=inputs,
        outputs=outputs,
        input_shapes=format_input_shapes(shapes) if shapes and kind in FORMAT_KEYS else None,
    )
    session.add(model)
    session.flush()
    return model


def _parse_shapes(text: str | None) -> list[tuple[str, list[int]]]:
    try:
        return parse_input_shapes(text)
    except CompileError as exc:
        raise from_compile_error(exc) from None


def check_filename(filename: str | None) -> None:
    """A model's name is shown and stored as text: no NUL or other control characters."""
    if filename is not None and any(ord(c) < 32 or ord(c) == 127 for c in filename):
        raise ServiceError(
            "invalid_filename", "the file name contains a control character (e.g. NUL)", 422
        )


def get_model(session: Session, team: Team, model_id: uuid.UUID) -> Model:
    model = session.get(Model, model_id)
    if model is None or model.team_id != team.id:
        raise not_found("model", model_id)
    return model


def list_models(session: Session, team: Team, *, limit: int = 50, offset: int = 0) -> Page[Model]:
    query = (
        select(Model).where(Model.team_id == team.id).order_by(Model.created_at.desc(), Model.id)
    )
    return paginate(session, query, limit, offset)


def materialize_model(store: BlobStore, model: Model, work: Path) -> Path:
    """A local path of the model's .onnx for the compiler, inside `work` (a private temp
    folder) so that external data resolves only against the model's own files. The blob is
    checked against its sha256 first (BlobCorrupt: quarantined)."""
    if model.kind == KIND_ARCHIVE:
        with verified_path(store, model.sha256, work, "archive", found_by="compile") as archive:
            return extract_archive(archive, work / "model", max_bytes=EXTRACT_LIMIT)
    hint = store.path_hint(model.sha256)
    if hint is None:
        return spill_verified(store, model.sha256, work / "model.onnx", found_by="compile")
    # Compiled in place: the upload check guarantees a bare .onnx references no external
    # files, and the compiler maps its weights straight from this file (a hard link would
    # have two links, which the IR refuses to map).
    verify_for_use(store, model.sha256, found_by="compile")
    return hint


def _display_name(filename: str | None, sha256: str) -> str:
    name = os.path.basename((filename or "").replace("\\", "/")).strip()
    return (name or f"model-{sha256[:12]}")[:255]
