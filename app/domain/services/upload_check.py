"""What an upload is, decided in a checker process (`describer`): an `.onnx` the compiler's
importer accepts, or an archive holding one with its data. Apart from `models` (which sends
uploads to the checkers) so that the checker's code does not import its caller back."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import onnx

from app.domain.services.archives import bad_archive, extract_archive, is_archive_name, sniff_kind
from app.domain.services.errors import ServiceError, from_compile_error
from compiler_core import CompileError
from compiler_core.importer import import_model

log = logging.getLogger(__name__)

KIND_ONNX = "onnx"
KIND_ARCHIVE = "archive"


def inspect_upload(
    path: Path,
    filename: str | None,
    max_bytes: int,
    work: Path,
    input_shapes: list[tuple[str, list[int]]] | None = None,
) -> tuple[str, tuple[int, list[dict[str, Any]], list[dict[str, Any]]]]:
    """(kind, description) of a stored upload at `path`: an `.onnx` the importer accepts (it
    may not reference external files), an archive holding one with its data (extracted
    into `work`), or a framework model that converts (with `input_shapes`, the parsed
    `-input-shapes`, where its format leaves shapes open; ONNX ignores them). ServiceError
    when it is none of these. Run by `describer.inspect_in_child`."""
    framework = _framework_upload(path, work, input_shapes or [])
    if framework is not None:
        return framework
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


def _framework_upload(
    path: Path, work: Path, input_shapes: list[tuple[str, list[int]]]
) -> tuple[str, tuple[int, list[dict[str, Any]], list[dict[str, Any]]]] | None:
    """A TensorFlow or PyTorch model (compiler_core/convert), checked by converting it (in a
    limited process of its own) with `input_shapes` and described by its ONNX; its kind is
    its format's key. None for any other file. A TorchScript module records no input
    shapes: given them (the upload's `input_shapes`, as the compile's `-input-shapes`), it
    is converted like the other formats; without them it is only loaded (its inputs are
    named, their shapes unknown) and a module that loads but does not convert fails at the
    compile, with the converter's code."""
    from compiler_core.convert import convert, recognise

    recognised = recognise(path)
    if recognised is None:
        return None
    if recognised.format is None:
        raise ServiceError("invalid_model", f"the upload is {recognised.looks_like}", 422)
    try:
        converted = convert(recognised, work / "converted.onnx", input_shapes, check_only=True)
    except CompileError as exc:  # a SavedModel archive's bomb is a 413, as an ONNX archive's
        error = from_compile_error(exc, 413 if exc.code == "archive_too_large" else 422)
        for where in (str(path.resolve()), str(path), str(work)):
            error.message = error.message.replace(where, "the model")
        raise error from None
    if converted.checked_inputs:
        inputs = [{"name": n, "dtype": None, "shape": None} for n in converted.checked_inputs]
        return recognised.format.key, (0, inputs, [])
    return recognised.format.key, describe_model(converted.onnx_path, allow_external_data=False)


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
