"""Model uploads: stream to the blob store, check with the compiler's importer, record."""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import onnx
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.domain.blobs import BlobStore, BlobTooLarge, local_path
from app.domain.blobs.base import Source
from app.domain.blobs.integrity import spill_verified, verified_path, verify_blob
from app.domain.db.models import Model, Team
from app.domain.services.archives import bad_archive, extract_archive, is_archive_name, sniff_kind
from app.domain.services.describer import inspect_in_child
from app.domain.services.errors import ServiceError, from_compile_error, not_found
from app.domain.services.pages import Page, paginate
from compiler_core import CompileError
from compiler_core.importer import import_model

log = logging.getLogger(__name__)

KIND_ONNX = "onnx"
KIND_ARCHIVE = "archive"
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
) -> Model:
    """Store an uploaded `.onnx`, or a `.zip`/`.tar`/`.tar.gz` of one `.onnx` with its
    external data, after checking it with the importer (in a describer process: see
    `describer`). The caller commits.

    The blob is stored as uploaded (archives too: the worker extracts again), so the bytes
    the client sent are the bytes the cache key names. The kind is decided by content; a
    name that says archive over content that is not one is a `bad_archive`.
    """
    check_filename(filename)
    try:
        ref = store.put(stream, max_bytes=max_bytes)
    except BlobTooLarge as exc:
        raise too_large(exc) from None
    if ref.size == 0:
        raise ServiceError("empty_upload", "the upload is empty: send an .onnx or an archive", 422)
    with tempfile.TemporaryDirectory(prefix="qpcfarm-upload-") as tmp:
        work = Path(tmp)
        with local_path(store, ref.sha256, work, "upload") as path:
            # In a describer process: the importer's CPU and crashes stay out of the API's.
            kind, described = inspect_in_child(path, filename, max_bytes, work)
    opset, inputs, outputs = described
    model = Model(
        team_id=team.id,
        sha256=ref.sha256,
        size=ref.size,
        name=_display_name(filename, ref.sha256),
        kind=kind,
        opset=opset,
        inputs=inputs,
        outputs=outputs,
    )
    session.add(model)
    session.flush()
    return model


def inspect_upload(
    path: Path, filename: str | None, max_bytes: int, work: Path
) -> tuple[str, tuple[int, list[dict[str, Any]], list[dict[str, Any]]]]:
    """(kind, description) of a stored upload at `path`: an `.onnx` the importer accepts (it
    may not reference external files), or an archive holding one with its data (extracted
    into `work`). ServiceError when it is neither. Run by `describer.inspect_in_child`."""
    with open(path, "rb") as handle:
        kind = sniff_kind(handle.read(512))
    if kind == KIND_ONNX:
        if is_archive_name(filename):
            raise bad_archive(f"{filename!r} is not a .zip, .tar or .tar.gz archive")
        # A bare .onnx may not reference external files: resolving them next to the stored
        # blob would read other blobs.
        return KIND_ONNX, describe_model(path, allow_external_data=False)
    onnx_path = extract_archive(path, work / "archive", max_bytes=max_bytes)
    return KIND_ARCHIVE, describe_model(onnx_path)


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
    verify_blob(store, model.sha256, found_by="compile")
    return hint


def describe_model(
    path: Path, *, allow_external_data: bool = True
) -> tuple[int, list[dict[str, Any]], list[dict[str, Any]]]:
    """(opset, inputs, outputs) of a model the importer accepts.

    Symbolic dims are fine at upload (they are bound per compile with -batchsize or
    -onnx-define-symbol), so a `dynamic_shape` refusal falls back to the declared I/O.
    """
    try:
        imported = import_model(path, allow_external_data=allow_external_data)
    except CompileError as exc:
        if exc.code != "dynamic_shape":
            error = from_compile_error(exc)
            # The path is a blob or temp file of the server: not the client's business.
            error.message = error.message.replace(repr(str(path)), "the model")
            error.message = error.message.replace(str(path), "the model")
            raise error from None
        return _declared_io(path)
    except Exception as exc:  # an importer bug met on this input: still a refused model
        log.warning("the importer failed unexpectedly on an upload", exc_info=True)
        raise ServiceError(
            "invalid_model",
            f"the model cannot be read (the importer failed with {type(exc).__name__})",
            422,
        ) from None
    graph = imported.model.graph
    return imported.opset, [_ir_io(v) for v in graph.inputs], [_ir_io(v) for v in graph.outputs]


def _ir_io(value: Any) -> dict[str, Any]:
    shape = None
    if value.shape is not None:
        shape = [d if isinstance(d, int) else (d.value or None) for d in value.shape]
    dtype = value.dtype.name.lower() if value.dtype is not None else None
    return {"name": value.name, "dtype": dtype, "shape": shape}


def _declared_io(path: Path) -> tuple[int, list[dict[str, Any]], list[dict[str, Any]]]:
    proto = onnx.load(str(path), load_external_data=False)
    initializers = {t.name for t in proto.graph.initializer}
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    inputs = [_proto_io(v) for v in proto.graph.input if v.name not in initializers]
    return opset, inputs, [_proto_io(v) for v in proto.graph.output]


def _proto_io(value: onnx.ValueInfoProto) -> dict[str, Any]:
    tensor = value.type.tensor_type
    shape = None
    if tensor.HasField("shape"):
        shape = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor.shape.dim
        ]
    dtype = onnx.TensorProto.DataType.Name(tensor.elem_type).lower()
    return {"name": value.name, "dtype": dtype, "shape": shape}


def _display_name(filename: str | None, sha256: str) -> str:
    name = os.path.basename((filename or "").replace("\\", "/")).strip()
    return (name or f"model-{sha256[:12]}")[:255]
