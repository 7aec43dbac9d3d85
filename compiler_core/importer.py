"""Import an ONNX model into onnx_ir with a static shape and a dtype on every value.

The front door of the compiler: everything a user can get wrong about the model file itself
(not ONNX, truncated, unsafe or missing external data, symbolic dims left unbound, unsupported
operators) is reported here as one `CompileError` with a stable code, never as a protobuf or
onnx traceback.

Memory: the model file is parsed once; external data stays on disk as memory-mapped
`ir.ExternalTensor`s; the ONNX checker and shape inference only ever see a "lean" copy of the
model whose large initializers were turned into typed graph inputs, so a model of any size
(> 2 GiB with external data) imports while holding at most one copy of its weights.

`-batchsize=B` rule (vendor meaning: recompile the model for batch size B):
- a graph input whose first dim is symbolic gets B there (a named symbol is then bound to B
  everywhere it appears, as `-onnx-define-symbol=<sym>,B` would);
- if the FIRST graph input has a fixed first dim N, N is the model's batch: every graph input
  whose first dim is N gets B;
- other inputs and rank-0 inputs are left alone.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from compiler_core.errors import CompileError
from compiler_core.file_kinds import HEAD_BYTES, model_problem, sniff
from compiler_core.model_bounds import (
    MAX_DIMENSION,
    MAX_TENSOR_BYTES,
    check_model_bounds,
    check_value_sizes,
    tensor_protos,
)
from compiler_core.model_folder import LOCAL, ModelFolder
from compiler_core.nodeinfo import DECLARED_SHAPE, dtype_name, node_opset, norm_domain
from compiler_core.onnx_wire import WireError, strip_inline_weights
from compiler_core.tensors import load_small_external

if TYPE_CHECKING:
    from compiler_core.ops.registry import OpDef, OpRegistry

log = logging.getLogger(__name__)

ModelSource = str | os.PathLike[str] | bytes | bytearray | memoryview | onnx.ModelProto

_LEAN_TENSOR_LIMIT = 1024
"""Initializers up to this many bytes stay in the lean proto given to onnx's C++ APIs: shape
tensors (Reshape, Slice, ...) must be there for data propagation, weights need not be."""

_DATA_PROP_VECTOR_LIMIT = 65536
"""Data propagation is skipped for graphs with a 0-D/1-D value larger than this; shape
tensors are tiny, and onnx's propagation is linear in memory in the vector's length."""

_NAMES_SHOWN = 5
"""How many node names an unsupported-operator entry lists before saying 'and N more'."""


@dataclass
class ImportedModel:
    """The imported model and what the importer learned about it."""

    model: ir.Model
    opset: int
    """The default-domain ("ai.onnx") opset of the model."""
    source_path: Path | None
    warnings: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    """Names of node outputs whose shape or dtype inference could not make static (data-
    dependent ops). Constant folding may resolve them; `require_static_shapes` rechecks."""
    input_symbols: frozenset[str] = frozenset()
    """The symbolic dimensions the graph inputs had before binding (`seq_len`...)."""


def import_model(
    source: ModelSource,
    *,
    define_symbols: Mapping[str, int] | None = None,
    batchsize: int | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    registry: OpRegistry | None = None,
    allow_external_data: bool = True,
    model_folder: ModelFolder = LOCAL,
) -> ImportedModel:
    """Load, check and statically shape an ONNX model.

    `source` is a file path, the model's bytes or a ModelProto. External data is resolved
    against the model file's folder, or `base_dir` for bytes and protos, and must lie inside
    `model_folder` when it is confined (else inside the model's folder); a bare
    `model_folder` (or `allow_external_data=False`) refuses external data anywhere in the
    model: any graph, subgraph, tensor attribute or function. `registry` defaults to the
    compiler's op registry (`compiler_core.ops.REGISTRY`).
    """
    if model_folder.confined and model_folder.root is None:
        allow_external_data = False
    proto, source_path, external, moved = _read_model(source, model_folder)
    if len(external) > moved and not allow_external_data:
        raise CompileError(
            "external_data_not_allowed",
            "the model references external data files; send the model and its data files "
            "together in a .zip or .tar archive",
        )
    if base_dir is None and source_path is not None:
        base_dir = source_path.parent
    _check_structure(proto)
    check_model_bounds(proto)  # before onnx's checker, inliner or anything allocates
    folder = _external_data_folder(model_folder, base_dir)
    _check_external_data(
        external, None if base_dir is None else Path(base_dir), folder, source_path
    )
    model = _deserialize(proto)
    if base_dir is not None:
        _set_base_dir(model, os.fspath(base_dir))
        # Tensors kept in files that are all onnx_wire's references into the model file,
        # resolved against its own folder, name that file: nothing to confine.
        own_file = source_path is not None and Path(base_dir) == source_path.parent
        if not (own_file and len(external) == moved):
            _confine_external_tensors(model, folder, source_path)
        load_small_external(model.graph)
        for function in model.functions.values():
            # A function body's constants are read whole, like subgraphs': the copy given to
            # onnx's checker must not refer to files (it would look for them elsewhere).
            load_small_external(function.graph, limit=MAX_TENSOR_BYTES)

    _set_initializer_types(model.graph)
    checked: onnx.ModelProto | None = _run_checker(model)
    if model.functions:
        checked = None  # inlining rewrites the graph: shape inference needs a fresh copy
    _inline_functions(model)
    warnings = _drop_initializer_inputs(model.graph)
    if warnings or _name_nodes(model.graph):
        checked = None
    _check_io_types(model.graph)
    opset = _default_opset(model)

    if registry is None:
        from compiler_core.ops import REGISTRY  # importing the package fills the registry

        registry = REGISTRY
    _raise_unsupported(_unsupported_op_types(model, registry))

    symbols = input_symbols(model.graph)
    input_shapes = [v.shape for v in model.graph.inputs]
    warnings += _bind_input_shapes(model.graph, dict(define_symbols or {}), batchsize)
    _require_static_inputs(model.graph)
    check_value_sizes(model.graph.inputs, "input")
    declared = _declared_output_shapes(model.graph)
    cleared = _clear_node_output_shapes(model.graph)
    if checked is not None:
        rebound = [i for i, v in enumerate(model.graph.inputs) if v.shape is not input_shapes[i]]
        checked = _relean(checked, model.graph, rebound, cleared)
    all_static = infer_shapes(model, checked)
    check_value_sizes(_main_values(model.graph), "value")
    _fill_same_shapes(model, registry)
    _apply_declared_shapes(model.graph, declared, registry)
    _raise_unsupported(_unsupported_dtypes(model, registry))
    _check_value_types(model.graph)

    # What follows inference only makes shapes static: a static graph stays static.
    unresolved = [] if all_static else [v.name or "" for v in dynamic_values(model.graph)]
    if unresolved:
        warnings.append(
            f"{len(unresolved)} value(s) have no static shape after shape inference "
            f"(data-dependent): {_first_few(unresolved)}"
        )
    return ImportedModel(model, opset, source_path, warnings, unresolved, symbols)


def infer_shapes(model: ir.Model, lean: onnx.ModelProto | None = None) -> bool:
    """(Re)run ONNX shape inference (strict) and merge the result into the IR in place.

    An inferred shape replaces the IR's one unless it knows less (a static shape is never
    downgraded), so shapes set by passes for ops onnx does not know survive. Data
    propagation (Shape -> Gather -> Concat -> Reshape chains) runs only when plain inference
    leaves something dynamic, and not when the graph holds large 1-D tensors: onnx's data
    propagation expands those element by element (gigabytes for a 300 MB vector).
    `lean`: the model's lean copy (`_lean_model`) when the caller already has it, made
    after `_set_initializer_types`. Returns True when plain inference left every value
    static (False: some may still be dynamic).
    """
    if lean is None:
        _set_initializer_types(model.graph)
        lean = _lean_model(model)
    _merge_inferred(model.graph, _onnx_infer_shapes(lean, data_prop=False))
    if not dynamic_values(model.graph):
        return True
    if not _has_large_vectors(model.graph):
        _merge_inferred(model.graph, _onnx_infer_shapes(lean, data_prop=True))
    return False


def _onnx_infer_shapes(proto: onnx.ModelProto, *, data_prop: bool) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(
            proto, check_type=True, strict_mode=True, data_prop=data_prop
        )
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        text = str(exc).strip()
        if text.count("Inference error(s)") > 1:
            # The failure is inside the body of an onnx-defined function op (onnx itself
            # cannot infer e.g. MeanVarianceNormalization-13 strictly): infer the rest, leave
            # that node's outputs unresolved for later stages to report.
            log.warning("strict shape inference failed inside a function op: %s", text)
            return onnx.shape_inference.infer_shapes(
                proto, check_type=True, strict_mode=False, data_prop=data_prop
            )
        match = re.search(r"node name: ([^)]*)\)", text)
        node = match.group(1) if match else None
        where = f" at node '{node}'" if node else ""
        raise CompileError(
            "shape_inference_failed", f"shape inference failed{where}: {text}", node=node
        ) from None


def _merge_inferred(graph: ir.Graph, inferred: onnx.ModelProto) -> None:
    # The lean copy's inputs include the Constant outputs it declares (see _lean_model).
    lean = inferred.graph
    infos = {vi.name: vi for vi in (*lean.input, *lean.value_info, *lean.output)}
    for value in _main_values(graph):
        if value.dtype is not None and value.shape is not None and value.shape.is_static():
            continue  # inference cannot tell more; skipping keeps re-inference rounds cheap
        info = infos.get(value.name or "")
        if info is not None:
            _merge_type(value, info.type)


def _has_large_vectors(graph: ir.Graph) -> bool:
    return any(
        v.shape is not None
        and len(v.shape) <= 1
        and v.shape.is_static()
        and math.prod(v.shape.numpy()) > _DATA_PROP_VECTOR_LIMIT
        for v in _main_values(graph)
    )


def dynamic_values(graph: ir.Graph) -> list[ir.Value]:
    """Values of the main graph still without a static shape or without a dtype."""
    return [
        v
        for v in _main_values(graph)
        if v.dtype is None or v.shape is None or not v.shape.is_static()
    ]


def require_static_shapes(model: ir.Model) -> None:
    """Raise `dynamic_shape` naming every value (and its producer) that is still dynamic."""
    values = dynamic_values(model.graph)
    if not values:
        return
    lines = []
    for value in values:
        producer = value.producer()
        origin = f" (output of {producer.op_type} node '{producer.name}')" if producer else ""
        lines.append(f"'{value.name}'{origin} has shape {value.shape}, dtype {value.dtype}")
    first = values[0].producer()
    raise CompileError(
        "dynamic_shape",
        f"{len(values)} value(s) have no static shape (data-dependent): " + "; ".join(lines),
        node=first.name if first is not None else None,
        details={"values": [v.name for v in values]},
    )


# --- reading ------------------------------------------------------------------------------


def _read_model(
    source: ModelSource, folder: ModelFolder = LOCAL
) -> tuple[onnx.ModelProto, Path | None, list[onnx.TensorProto], int]:
    """The parsed model, its path, the tensors that keep their data in a file (anywhere:
    every graph, subgraph, tensor attribute and function) and how many of those are
    references into the model file itself (onnx_wire's, not external data files). Messages
    name a model file as `folder` shows it (relative to a confined folder: no server path)."""
    if isinstance(source, onnx.ModelProto):
        return source, None, list(_external_tensor_protos(source)), 0
    if isinstance(source, bytes | bytearray | memoryview):
        if len(source) == 0:
            raise CompileError("invalid_model", "the model is empty (0 bytes)")
        proto = _parse(source, "the given bytes")
        return proto, None, list(_external_tensor_protos(proto)), 0
    path = Path(source)
    shown = folder.shown(path)
    if not path.exists():
        raise CompileError("model_not_found", f"model file '{shown}' does not exist")
    if not path.is_file():
        raise CompileError("invalid_model", f"model path '{shown}' is not a file")
    if path.stat().st_size == 0:
        raise CompileError("invalid_model", f"model file '{shown}' is empty (0 bytes)")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        with memoryview(mapped) as view:
            try:
                # Weights stay in the file: large raw_data become references into it.
                stripped = strip_inline_weights(view, path.name)
            except WireError:
                stripped = None
            proto = _parse(view if stripped is None else stripped.data, f"'{shown}'")
    # The references into the model file itself that stripping made are not external files.
    moved = stripped.moved if stripped is not None else 0
    return proto, path.resolve(), list(_external_tensor_protos(proto)), moved


def _parse(data: bytes | bytearray | memoryview, what: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    problem = model_problem(sniff(bytes(data[:HEAD_BYTES])), what.strip("'"))
    if problem is not None:  # a QPC, an .npz...: say what it is
        raise CompileError("invalid_model", problem)
    try:
        proto.ParseFromString(data)
    except DecodeError as exc:
        raise CompileError(
            "invalid_model",
            f"{what} is not an ONNX model: the protobuf does not parse ({exc}); "
            "is the file truncated or of another format?",
        ) from None
    return proto


def _check_structure(proto: onnx.ModelProto) -> None:
    """Catch what parses as protobuf but is no model (protobuf accepts many byte strings)."""
    if not proto.HasField("graph") or proto.ir_version <= 0:
        missing = "graph" if not proto.HasField("graph") else "ir_version"
        raise CompileError(
            "invalid_model",
            f"not an ONNX model: it has no {missing} (is the file truncated or of another format?)",
        )


def _deserialize(proto: onnx.ModelProto) -> ir.Model:
    try:
        return ir.serde.deserialize_model(proto)
    except Exception as exc:  # onnx_ir raises plain errors for malformed protos
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CompileError("invalid_model", f"the model cannot be read: {first}") from None


def _run_checker(model: ir.Model) -> onnx.ModelProto:
    """The ONNX checker on the model without its large weights; returns the lean copy it
    checked. A mutated model can make the re-serialisation itself fail (onnx_ir's SerdeError,
    a tensor of an undefined type): that is the model's fault as much as a checker refusal,
    so every failure of this step is a clean `invalid_model`."""
    try:
        lean = _lean_model(model)
        onnx.checker.check_model(lean, full_check=False)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CompileError(
            "invalid_model", f"the ONNX checker rejects the model: {first[:300]}"
        ) from None
    return lean


# --- external data --------------------------------------------------------------------------


def _external_data_folder(
    folder: ModelFolder, base_dir: str | os.PathLike[str] | None
) -> ModelFolder:
    """Where external data may be: the confined folder, else the model's own folder."""
    if folder.confined or base_dir is None:
        return folder
    return ModelFolder.at(base_dir)


def _check_external_data(
    external: Sequence[onnx.TensorProto],
    base_dir: Path | None,
    folder: ModelFolder,
    model_file: Path | None,
) -> None:
    """Reject external data that escapes `folder`, is missing or is too short (`external`:
    the model's tensors kept in files, as `_read_model` found them). Messages name the tensor
    and its location as the model writes them, never a resolved server path."""
    files: dict[str, os.stat_result] = {}  # location -> stat, once per file
    for tensor in external:
        info = onnx.external_data_helper.ExternalDataInfo(tensor)
        location = str(info.location)
        where = f"tensor '{tensor.name}' (external data location '{location}')"
        if base_dir is None:
            raise CompileError(
                "external_data_missing",
                f"{where} keeps its data in an external file, but the model was given without "
                "a folder: pass the model by its file path (or give base_dir)",
            )
        if location not in files:
            real = _external_file(location, base_dir, folder, model_file, where)
            if not real.is_file():
                raise CompileError(
                    "external_data_missing",
                    f"{where}: file '{location}' not found in the model's folder",
                )
            files[location] = real.stat()
        stat = files[location]
        nbytes = _tensor_nbytes(tensor)
        length = info.length if info.length not in (None, -1) else nbytes
        if length != nbytes:
            raise CompileError(
                "invalid_model",
                f"{where}: length {length} does not match the tensor's size, {nbytes} bytes",
            )
        offset = max(int(info.offset or 0), 0)
        size = stat.st_size
        if offset + length > size:
            raise CompileError(
                "external_data_missing",
                f"{where}: file is {size} bytes but the tensor needs bytes "
                f"[{offset}, {offset + length})",
            )
        if stat.st_nlink > 1:
            raise CompileError(
                "unsafe_external_data",
                f"{where}: the file has several hard links, which onnx_ir refuses to map "
                "(a hard link can smuggle a file from outside the model's folder); copy it",
            )


def _external_file(
    location: str, base_dir: Path, folder: ModelFolder, model_file: Path | None, where: str
) -> Path:
    """The real path of an external data file, which must be inside `folder` (or be the
    model file itself: its own large tensors, see onnx_wire)."""
    parts = re.split(r"[\\/]", location)
    if os.path.isabs(location) or location.startswith(("/", "\\")) or re.match(r"^\w:", location):
        reason = "is an absolute path"
    elif ".." in parts:
        reason = "contains '..'"
    else:
        if model_file is not None and (base_dir / location).resolve() == model_file:
            return model_file
        try:
            return folder.resolve(location, where, relative_to=base_dir)
        except CompileError:
            reason = "resolves through a symlink to outside the model's folder"
    raise CompileError(
        "unsafe_external_data",
        f"{where} {reason}: external data must be a file inside the model's folder",
        details={"tensor": _tensor_name(where), "location": location},
    )


def _set_base_dir(model: ir.Model, base_dir: str) -> None:
    """External tensors resolve against the model's folder: the main graph with its
    subgraphs (onnx_ir's helper) and every local function's body (which it skips)."""
    ir.external_data.set_base_dir(model.graph, base_dir)
    for function in model.functions.values():
        ir.external_data.set_base_dir(function.graph, base_dir)


def _confine_external_tensors(
    model: ir.Model, folder: ModelFolder, model_file: Path | None
) -> None:
    """Every external tensor the IR will read, wherever it sits, resolves inside `folder`
    (or is the model file itself): the check on what is actually opened, after the check of
    the locations the proto names. Each distinct path is resolved once (a model's weights
    mostly share one or two files: resolving is a system call per path component)."""
    confined: set[str] = set()
    for tensor in _ir_tensors(model):
        if not isinstance(tensor, ir.ExternalTensor):
            continue
        path = tensor.path
        if path in confined:
            continue
        if model_file is not None and Path(path).resolve() == model_file:
            confined.add(path)
            continue
        try:
            folder.resolve(path, "external data")
            confined.add(path)
        except CompileError:
            raise CompileError(
                "unsafe_external_data",
                f"tensor '{tensor.name}' (external data location '{tensor.location}') is not a "
                "file inside the model's folder",
                details={"tensor": tensor.name or "", "location": tensor.location},
            ) from None


def _ir_tensors(model: ir.Model) -> Iterator[ir.TensorProtocol]:
    graphs: list[ir.Graph] = [model.graph, *(f.graph for f in model.functions.values())]
    for graph in graphs:
        for value in graph.initializers.values():
            if value.const_value is not None:
                yield value.const_value
        for node in ir.traversal.RecursiveGraphIterator(graph):
            for attr in node.attributes.values():
                if attr.is_ref() or attr.value is None:
                    continue
                if attr.type == ir.AttributeType.TENSOR:
                    yield attr.value
                elif attr.type == ir.AttributeType.TENSORS:
                    yield from attr.value
                elif attr.type == ir.AttributeType.GRAPH:
                    yield from _initializer_tensors(attr.value)
                elif attr.type == ir.AttributeType.GRAPHS:
                    for body in attr.value:
                        yield from _initializer_tensors(body)


def _initializer_tensors(graph: ir.Graph) -> Iterator[ir.TensorProtocol]:
    for value in graph.initializers.values():
        if value.const_value is not None:
            yield value.const_value


def _tensor_name(where: str) -> str:
    match = re.match(r"tensor '([^']*)'", where)
    return match.group(1) if match else ""


def _tensor_nbytes(tensor: onnx.TensorProto) -> int:
    dtype = ir.DataType(tensor.data_type)
    return math.ceil(dtype.itemsize * math.prod(tensor.dims))


def _external_tensor_protos(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the model that keeps its data in a file (see `tensor_protos`)."""
    for tensor in tensor_protos(proto):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            yield tensor


# --- normalising the graph ------------------------------------------------------------------


def _inline_functions(model: ir.Model) -> None:
    if not model.functions:
        return
    import onnx_ir.passes.common as common_passes  # a dozen passes; only inlining is used

    try:
        common_passes.InlinePass()(model)
    except Exception as exc:  # e.g. recursive functions
        raise CompileError(
            "invalid_model", f"model-local functions cannot be inlined: {exc}"
        ) from None


def _drop_initializer_inputs(graph: ir.Graph) -> list[str]:
    """Graph inputs that are also initializers are constants here (their default is used)."""
    constant = [v for v in graph.inputs if v.is_initializer()]
    if not constant:
        return []
    kept = [v for v in graph.inputs if not v.is_initializer()]
    graph.inputs.clear()
    graph.inputs.extend(kept)
    names = [v.name or "" for v in constant]
    return [
        f"{len(names)} graph input(s) have initializers and are compiled as constants: "
        + _first_few(names)
    ]


def _name_nodes(graph: ir.Graph) -> bool:
    """Give unnamed (and duplicate-named) nodes `<op_type>_<index>`, unique and stable;
    whether any node was (re)named."""
    used = {node.name for node in graph if node.name}
    if len(used) == len(graph):
        return False  # every node has a name of its own
    seen: set[str] = set()
    for index, node in enumerate(graph):
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        base = f"{node.name}_{index}" if node.name else f"{node.op_type}_{index}"
        name, suffix = base, 1
        while name in used:
            name, suffix = f"{base}_{suffix}", suffix + 1
        node.name = name
        used.add(name)
        seen.add(name)
    return True


def _check_io_types(graph: ir.Graph) -> None:
    problems = []
    for kind, values in (("input", graph.inputs), ("output", graph.outputs)):
        for value in values:
            if value.type is not None and not isinstance(value.type, ir.TensorType):
                problems.append(f"{kind} '{value.name}' is a {value.type}")
            elif value.dtype == ir.DataType.STRING:
                problems.append(f"{kind} '{value.name}' is a string tensor")
            elif value.dtype is not None and dtype_name(value.dtype) not in _ELEMENT_TYPES:
                problems.append(f"{kind} '{value.name}' has element type {dtype_name(value.dtype)}")
            elif kind == "input" and value.dtype is None:
                problems.append(f"{kind} '{value.name}' has no element type")
    if problems:
        raise CompileError(
            "unsupported_type",
            "only numeric tensors can be graph inputs and outputs: " + "; ".join(problems),
        )


_ELEMENT_TYPES = frozenset(
    {"float16", "float32", "float64", "bool"}
    | {f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64)}
)
"""Element types a QPC can hold (bfloat16, 8/4/2-bit floats and ints have no kernels)."""


def _check_value_types(graph: ir.Graph) -> None:
    """Reject intermediate values of element types no kernel handles (Cast to float8...)."""
    problems: dict[str, list[str]] = {}
    names: dict[ir.DataType, str] = {}  # a few element types for many values
    for node in graph:
        for value in node.outputs:
            if value.dtype is None or value.dtype == ir.DataType.STRING:
                continue
            name = names.get(value.dtype)
            if name is None:
                name = names[value.dtype] = dtype_name(value.dtype)
            if name not in _ELEMENT_TYPES:
                problems.setdefault(f"{node.op_type} producing {name}", []).append(node.name or "")
    if problems:
        first = next(iter(problems.values()))[0]
        raise CompileError(
            "unsupported_type",
            "element types without kernels: "
            + "; ".join(f"{what} at {_first_few(nodes)}" for what, nodes in problems.items()),
            node=first,
        )


def _default_opset(model: ir.Model) -> int:
    """The default-domain opset; 0 for a model that uses only other domains (ai.onnx.ml...)."""
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


def _set_initializer_types(graph: ir.Graph) -> None:
    for value in graph.initializers.values():
        tensor = value.const_value
        if tensor is None:
            continue
        if value.dtype is None:
            value.dtype = tensor.dtype
        if value.shape is None or not value.shape.is_static():
            value.shape = ir.Shape(tensor.shape.numpy())


# --- operator support -----------------------------------------------------------------------


@dataclass
class _Unsupported:
    op_type: str
    domain: str
    opset: int
    reason: str
    nodes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        op = f"{self.domain}::{self.op_type}" if self.domain else self.op_type
        count = len(self.nodes)
        return (
            f"{op} (opset {self.opset}){self.reason} at {count} node{'s' if count > 1 else ''}: "
            + _first_few(self.nodes)
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "op_type": self.op_type,
            "domain": self.domain,
            "opset": self.opset,
            "reason": self.reason.strip(" ,"),
            "count": len(self.nodes),
            "nodes": self.nodes,
        }


def _node_opset(model: ir.Model, node: ir.Node) -> int:
    return node_opset(node, model.opset_imports)


def _domain(node: ir.Node) -> str:
    return norm_domain(node.domain)


def _unsupported_op_types(model: ir.Model, registry: OpRegistry) -> list[_Unsupported]:
    found: dict[tuple[str, str, int], _Unsupported] = {}
    supported: dict[tuple[str, str, int], bool] = {}  # by op kind: a few for many nodes
    # Nodes inside subgraphs (If branches, Loop/Scan bodies) run on our kernels too.
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        key = (node.op_type, _domain(node), _node_opset(model, node))
        if key not in supported:
            supported[key] = registry.lookup(*key) is not None
        if not supported[key]:
            entry = found.setdefault(key, _Unsupported(*key, reason=""))
            entry.nodes.append(node.name or f"{node.op_type} (in a subgraph)")
    return list(found.values())


def _unsupported_dtypes(model: ir.Model, registry: OpRegistry) -> list[_Unsupported]:
    """Check each node's data type: its first input's element type (the output's if it has no
    inputs) must be in `OpDef.dtypes`. Index-like inputs (shapes, axes, indices) are not checked."""
    found: dict[tuple[str, str, int, str], _Unsupported] = {}
    # A model has a few op kinds and element types for many nodes: each looked up once.
    opdefs: dict[tuple[str, str, int], OpDef | None] = {}
    names: dict[ir.DataType, str] = {}
    for node in model.graph:
        opset = _node_opset(model, node)
        kind = (node.op_type, _domain(node), opset)
        if kind not in opdefs:
            opdefs[kind] = registry.lookup(*kind)
        opdef = opdefs[kind]
        data = node.inputs[0] if node.inputs else (node.outputs[0] if node.outputs else None)
        if opdef is None or data is None or data.dtype is None:
            continue
        name = names.get(data.dtype)
        if name is None:
            name = names[data.dtype] = dtype_name(data.dtype)
        if name in opdef.dtypes:
            continue
        key = (node.op_type, _domain(node), opset, name)
        supported = ", ".join(sorted(opdef.dtypes))
        reason = f" with element type {name} (supported: {supported}),"
        entry = found.setdefault(key, _Unsupported(*key[:3], reason=reason))
        entry.nodes.append(node.name or "")
    return list(found.values())


def _raise_unsupported(entries: Sequence[_Unsupported]) -> None:
    if not entries:
        return
    nodes = sum(len(e.nodes) for e in entries)
    raise CompileError(
        "unsupported_operator",
        f"{len(entries)} unsupported operator kind(s) at {nodes} node(s): "
        + "; ".join(e.describe() for e in entries),
        node=entries[0].nodes[0],
        details={"unsupported": [e.as_dict() for e in entries]},
    )


def _first_few(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return f"{shown} and {more} more" if more > 0 else shown


# --- binding symbols and batch size ---------------------------------------------------------


def _bind_input_shapes(
    graph: ir.Graph, symbols: dict[str, int], batchsize: int | None
) -> list[str]:
    """Apply `-onnx-define-symbol` and `-batchsize` to the graph inputs; return warnings."""
    for name, size in symbols.items():
        if not _dimension_value(size):
            raise CompileError(
                "invalid_option",
                f"-onnx-define-symbol={name},{size}: the value must be an integer from 1 to "
                f"{MAX_DIMENSION}",
                flag="-onnx-define-symbol",
            )
    if batchsize is not None and not _dimension_value(batchsize):
        raise CompileError(
            "invalid_option",
            f"-batchsize={batchsize} must be an integer from 1 to {MAX_DIMENSION}",
            flag="-batchsize",
        )
    declared = input_symbols(graph)
    if batchsize is not None:
        _apply_batchsize(graph, symbols, int(batchsize))
    for value in _main_values(graph):
        if value.shape is not None and not value.shape.is_static():
            value.shape = ir.Shape([_bound(d, symbols) for d in value.shape])
    return [
        f"-onnx-define-symbol={name},{size}: no graph input uses symbol '{name}'"
        for name, size in symbols.items()
        if name not in declared
    ]


def _dimension_value(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        return False
    return 1 <= int(value) <= MAX_DIMENSION


def input_symbols(graph: ir.Graph) -> frozenset[str]:
    """The named symbolic dimensions of the graph inputs."""
    return frozenset(
        d.value
        for v in graph.inputs
        if v.shape is not None
        for d in v.shape
        if isinstance(d, ir.SymbolicDim) and d.value
    )


def _apply_batchsize(graph: ir.Graph, symbols: dict[str, int], batchsize: int) -> None:
    shaped = [v for v in graph.inputs if v.shape is not None and len(v.shape) > 0]
    model_batch = shaped[0].shape[0] if shaped else None  # type: ignore[index]
    for value in shaped:
        assert value.shape is not None
        first = value.shape[0]
        if isinstance(first, ir.SymbolicDim):
            if first.value:
                if symbols.get(first.value, batchsize) != batchsize:
                    raise CompileError(
                        "invalid_option",
                        f"-batchsize={batchsize} conflicts with -onnx-define-symbol="
                        f"{first.value},{symbols[first.value]} (input '{value.name}' dim 0)",
                        flag="-batchsize",
                    )
                symbols[first.value] = batchsize
        elif not isinstance(model_batch, int) or first != model_batch:
            continue
        value.shape = ir.Shape([batchsize, *list(value.shape)[1:]])


def _bound(dim: int | ir.SymbolicDim, symbols: Mapping[str, int]) -> int | ir.SymbolicDim:
    if isinstance(dim, ir.SymbolicDim) and dim.value is not None and dim.value in symbols:
        return symbols[dim.value]
    return dim


def _require_static_inputs(graph: ir.Graph) -> None:
    problems: list[str] = []
    for value in graph.inputs:
        if value.shape is None:
            problems.append(
                f"input '{value.name}' has no shape (unknown rank): the model must declare it"
            )
            continue
        for index, dim in enumerate(value.shape):
            if isinstance(dim, int):
                continue
            batch_hint = " (or -batchsize)" if index == 0 else ""
            if dim.value:
                problems.append(
                    f"input '{value.name}' dim {index} is symbolic '{dim.value}': set "
                    f"-onnx-define-symbol={dim.value},<value>{batch_hint}"
                )
            elif index == 0:
                problems.append(
                    f"input '{value.name}' dim 0 is dynamic and unnamed: set -batchsize=<value>"
                )
            else:
                problems.append(
                    f"input '{value.name}' dim {index} is dynamic and unnamed: the model must "
                    "name it (dim_param) or fix it"
                )
    if problems:
        raise CompileError(
            "dynamic_shape",
            "every input dimension must be static; " + "; ".join(problems),
            flag="-onnx-define-symbol",
            details={"problems": problems},
        )


_SHAPE_KEEPING = frozenset({"Identity", "Cast", "CastLike"})


def _declared_output_shapes(graph: ir.Graph) -> dict[int, ir.Shape]:
    return {
        id(value): value.shape
        for value in graph.outputs
        if value.shape is not None and value.shape.is_static() and value.producer() is not None
    }


def _fill_same_shapes(model: ir.Model, registry: OpRegistry) -> None:
    """Output 0 of a `same_shape` op takes input 0's static shape when inference left it open."""
    for node in model.graph:
        if not node.inputs or not node.outputs or node.inputs[0] is None:
            continue
        source, out = node.inputs[0], node.outputs[0]
        if out.shape is not None and out.shape.is_static():
            continue
        if source.shape is None or not source.shape.is_static():
            continue
        opdef = registry.lookup(node.op_type, _domain(node), _node_opset(model, node))
        if opdef is not None and opdef.same_shape:
            out.shape = ir.Shape(list(source.shape.numpy()))


def _apply_declared_shapes(
    graph: ir.Graph, declared: dict[int, ir.Shape], registry: OpRegistry
) -> None:
    """Give a data-dependent graph output the static shape the model declares for it.

    A static compiler needs every shape ahead of time; when a shape depends on the value of a
    runtime input (axes, pads, sizes, k...), the model's own declaration of the output is the
    contract, and the runtime checks each run against it. The declared shape also flows back
    through elementwise ops (ReduceSum -> Log -> output; Range -> Mul(x, 2.0) -> output:
    every operand whose shape is open gets the output's when the others are single elements).
    Inferred static shapes always win over declarations, so a stale annotation never overrides
    a rebinding.
    """
    for value in graph.outputs:
        shape = declared.get(id(value))
        if shape is not None and (value.shape is None or not value.shape.is_static()):
            value.shape = ir.Shape(list(shape.numpy()))
            value.meta[DECLARED_SHAPE] = True
    for node in reversed(list(graph)):
        outputs = [v for v in node.outputs if v.meta.get(DECLARED_SHAPE)]
        data = [v for v in node.inputs if v is not None]
        if node.op_type == "CastLike":
            data = data[:1]  # the second input only lends its element type
        if len(node.outputs) != 1 or not outputs or not data:
            continue
        opdef = registry.lookup(node.op_type, node.domain)
        if opdef is None or not (opdef.elementwise or node.op_type in _SHAPE_KEEPING):
            continue
        if len(data) > 1 and not opdef.elementwise:
            continue
        dims = list(outputs[0].shape.numpy())  # type: ignore[union-attr]
        dynamic = [v for v in data if v.shape is None or not v.shape.is_static()]
        if not dynamic or any(v.producer() is None for v in dynamic):
            continue
        if not all(_broadcast_neutral(v, len(dims)) for v in data if v not in dynamic):
            continue  # a full-size static operand leaves the dynamic one's shape open
        for source in dynamic:
            source.shape = ir.Shape(dims)
            source.meta[DECLARED_SHAPE] = True


def _broadcast_neutral(value: ir.Value, rank: int) -> bool:
    """A static operand of one element and no higher rank than the output: broadcasting it
    leaves the other operands' shape as the output's (Mul(x, 2.0) has x's shape)."""
    assert value.shape is not None
    dims = list(value.shape.numpy())
    return len(dims) <= rank and all(d == 1 for d in dims)


def _clear_node_output_shapes(graph: ir.Graph) -> list[ir.Value]:
    """Forget annotated intermediate shapes: after binding they are recomputed from the inputs,
    so stale exporter annotations (e.g. the old batch) cannot conflict with them. Returns the
    values that had a shape."""
    cleared = []
    for node in graph:
        for value in node.outputs:
            if value.shape is not None:
                cleared.append(value)
                value.shape = None
    return cleared


# --- shape inference plumbing ---------------------------------------------------------------


def _main_values(graph: ir.Graph) -> Iterator[ir.Value]:
    yield from graph.inputs
    yield from graph.initializers.values()
    for node in graph:
        # An omitted optional output (empty name, never read) has no shape to find.
        yield from (v for v in node.outputs if v.name or v.uses() or v.is_graph_output())


def _merge_type(value: ir.Value, type_proto: onnx.TypeProto) -> None:
    inferred_type = ir.serde.deserialize_type_proto_for_type(type_proto)
    if value.dtype is None and inferred_type is not None and inferred_type.dtype is not None:
        value.dtype = inferred_type.dtype
    if value.type is None and inferred_type is not None:
        value.type = inferred_type
    shape = ir.serde.deserialize_type_proto_for_shape(type_proto)
    if shape is None:
        return
    if value.shape is None or (shape.is_static() or not value.shape.is_static()):
        value.shape = shape


def _lean_model(model: ir.Model) -> onnx.ModelProto:
    """The copy of the model that onnx's C++ checker and shape inference receive.

    It holds no weights and no reference to a file: onnx resolves external data against the
    working directory when it is given a proto (not the model's folder), so a tensor left in
    a file would make the check depend on where the compile runs. The importer has read every
    other tensor attribute kept in a file (`load_small_external`).
    """
    with _lean_graph(model):
        lean = ir.serde.serialize_model(model)
    _external_constants_to_inputs(lean.graph)
    return lean


def _relean(
    lean: onnx.ModelProto, graph: ir.Graph, rebound: Sequence[int], cleared: Sequence[ir.Value]
) -> onnx.ModelProto | None:
    """The lean copy the checker saw, brought up to date with the graph as shape inference
    receives it: the inputs at `rebound` given their bound shapes, the node outputs of
    `cleared` their shapes removed. That is what `_lean_model` would serialise again, at a
    fraction of the cost (the checked copy is used up: it is changed in place). None when a
    cleared value is not a named tensor (serialising again is then simplest)."""
    names = set()
    for value in cleared:
        if not value.name or not isinstance(value.type, ir.TensorType):
            return None
        names.add(value.name)
    proto = lean.graph
    for index in rebound:
        proto.input[index].CopyFrom(ir.serde.serialize_value(graph.inputs[index]))
    if names:
        for info in (*proto.value_info, *proto.output):
            if info.name in names:
                info.type.tensor_type.ClearField("shape")
    return lean


def _external_constants_to_inputs(graph: onnx.GraphProto) -> None:
    """Replace each Constant node whose tensor lives in a file by a typed graph input.

    Large Constant-node tensors of the main graph stay in the model file (onnx_wire moves
    them there like initializers); the lean copy declares their type instead, as it does
    for large initializers. A Constant that is also a graph output stays one: an input may
    be listed as an output.
    """
    external = [
        index
        for index, node in enumerate(graph.node)
        if node.op_type == "Constant"
        and node.domain in ("", "ai.onnx")
        and len(node.attribute) == 1
        and node.attribute[0].name == "value"
        and node.attribute[0].t.data_location == onnx.TensorProto.EXTERNAL
    ]
    for index in reversed(external):
        node = graph.node[index]
        tensor = node.attribute[0].t
        graph.input.append(
            onnx.helper.make_tensor_value_info(node.output[0], tensor.data_type, tensor.dims)
        )
        del graph.node[index]


@contextmanager
def _lean_graph(model: ir.Model) -> Iterator[None]:
    """Temporarily turn large (and data-less) initializers into typed graph inputs.

    What onnx's C++ checker and shape inference receive is then small whatever the weights
    weigh; small external tensors are read (they may be shape operands). Restores the graph
    exactly, initializer order included.
    """
    graph = model.graph
    values = list(graph.initializers.values())
    tensors = [v.const_value for v in values]
    input_count = len(graph.inputs)
    try:
        for value, tensor in zip(values, tensors, strict=True):
            if tensor is not None and tensor.nbytes <= _LEAN_TENSOR_LIMIT:
                if isinstance(tensor, ir.ExternalTensor):
                    value.const_value = ir.Tensor(tensor.numpy(), name=tensor.name)
                continue
            graph.initializers.pop(value.name or "")
            value.const_value = None
            if not value.is_graph_input():
                graph.inputs.append(value)
        yield
    finally:
        while len(graph.inputs) > input_count:
            graph.inputs.pop()
        graph.initializers.clear()
        for value, tensor in zip(values, tensors, strict=True):
            value.const_value = tensor
            graph.initializers.add(value)
