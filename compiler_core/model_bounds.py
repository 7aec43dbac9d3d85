"""Bounds a model must keep before the compiler spends memory or time on it.

A few bytes of ONNX can declare what no machine holds: an input of 2^63-1 floats, a negative
dimension, an initializer of 2^31 elements with no data, local functions that call each other
in a fan-out that expands to 2^40 nodes. Each is refused here, from the proto's declarations
and without allocating or expanding anything, with a stable code:

- `tensor_too_large`: a tensor (declared, or after binding `-batchsize` and
  `-onnx-define-symbol`) larger than `MAX_TENSOR_BYTES`, the DDR of the largest single SoC
  of any device profile (compiler_core/devices.py): no QPC could hold it;
- `invalid_model`: a negative dimension, or a tensor whose stored data does not match its
  declared element count;
- `recursive_function` / `function_expansion_too_large`: local functions that call
  themselves, or whose inlined node count (counted over the call graph, memoised, never
  expanded) exceeds `MAX_EXPANDED_NODES`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator
from typing import Any

import onnx
import onnx_ir as ir

from compiler_core.devices import MAX_SOC_DDR_BYTES
from compiler_core.errors import CompileError

MAX_TENSOR_BYTES = MAX_SOC_DDR_BYTES
"""128 GiB (the AIC200 profile's DDR): no tensor of a QPC can be larger than one SoC's DDR."""
MAX_DIMENSION = MAX_TENSOR_BYTES
"""The largest value a dimension (and so `-batchsize` or a symbol) can take: a tensor of
one-byte elements that long fills the largest SoC."""
MAX_EXPANDED_NODES = 1_000_000
"""Nodes a model may have once its local functions are inlined (about 100x the largest
exported decoder's node count): more is a function fan-out, not a network."""

_GIB = 1 << 30
_TYPED_FIELD: dict[int, tuple[str, int]] = {
    onnx.TensorProto.FLOAT: ("float_data", 1),
    onnx.TensorProto.COMPLEX64: ("float_data", 2),
    onnx.TensorProto.DOUBLE: ("double_data", 1),
    onnx.TensorProto.COMPLEX128: ("double_data", 2),
    onnx.TensorProto.INT64: ("int64_data", 1),
    onnx.TensorProto.UINT32: ("uint64_data", 1),
    onnx.TensorProto.UINT64: ("uint64_data", 1),
    onnx.TensorProto.STRING: ("string_data", 1),
}
"""Where a tensor of each type keeps inline values when it has no raw_data (every other
type: int32_data, one value per element, sub-byte types packed per byte)."""


def check_model_bounds(proto: onnx.ModelProto) -> None:
    """Refuse a model whose declarations exceed the bounds (see the module doc)."""
    check_function_expansion(proto)
    for value in _value_infos(proto):
        _check_declared(value)
    for tensor in tensor_protos(proto):
        _check_tensor(tensor)


def check_value_sizes(values: Iterable[Any], kind: str) -> None:
    """Each IR value with a static shape: no negative dimension, at most `MAX_TENSOR_BYTES`."""
    for value in values:
        shape = value.shape
        if shape is None or not shape.is_static():
            continue
        dims = [int(d) for d in shape]
        if any(d < 0 for d in dims):
            raise _negative(f"{kind} '{value.name}'", dims)
        dtype = value.dtype
        _check_size(f"{kind} '{value.name}'", dims, _bits(int(dtype)) if dtype else 8)


def tensor_protos(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the model: initializers (dense and sparse) of every graph, the
    subgraphs of If/Loop/Scan and of training info, every tensor, tensors and sparse
    tensor attribute, and the bodies of local functions."""
    graphs: list[onnx.GraphProto] = [proto.graph]
    for info in proto.training_info:
        graphs.extend((info.initialization, info.algorithm))
    nodes: list[onnx.NodeProto] = [n for f in proto.functions for n in f.node]
    while graphs or nodes:
        if graphs:
            graph = graphs.pop()
            yield from graph.initializer
            for sparse in graph.sparse_initializer:
                yield from (sparse.values, sparse.indices)
            nodes.extend(graph.node)
            continue
        for attr in nodes.pop().attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("sparse_tensor"):
                yield from (attr.sparse_tensor.values, attr.sparse_tensor.indices)
            for sparse in attr.sparse_tensors:
                yield from (sparse.values, sparse.indices)
            if attr.HasField("g"):
                graphs.append(attr.g)
            graphs.extend(attr.graphs)


# --- functions ------------------------------------------------------------------------------

FunctionKey = tuple[str, str, str]


def check_function_expansion(proto: onnx.ModelProto) -> int:
    """The model's node count with every local function inlined (subgraphs included),
    counted over the call graph with each function's count memoised; refuses recursion
    and counts above `MAX_EXPANDED_NODES`."""
    bodies = {(f.domain, f.name, f.overload): list(f.node) for f in proto.functions}
    if not bodies:
        return 0
    own: dict[FunctionKey, int] = {}
    calls: dict[FunctionKey, list[FunctionKey]] = {}
    for key, body in bodies.items():
        own[key], calls[key] = _count_nodes(body, bodies)
    expanded: dict[FunctionKey, int] = {}
    for key in bodies:
        _expand(key, own, calls, expanded)
    main_own, main_calls = _count_nodes(list(proto.graph.node), bodies)
    total = main_own + sum(expanded[c] for c in main_calls)
    if total > MAX_EXPANDED_NODES:
        raise _fan_out(f"the model expands to more than {MAX_EXPANDED_NODES:,} nodes")
    return total


def _count_nodes(
    nodes: list[onnx.NodeProto], bodies: dict[FunctionKey, Any]
) -> tuple[int, list[FunctionKey]]:
    """(nodes that are not calls of local functions, the calls), subgraphs included."""
    count = 0
    found: list[FunctionKey] = []
    pending = list(nodes)
    while pending:
        node = pending.pop()
        key = (node.domain, node.op_type, node.overload)
        if key in bodies:
            found.append(key)
        else:
            count += 1
        for attr in node.attribute:
            if attr.HasField("g"):
                pending.extend(attr.g.node)
            for graph in attr.graphs:
                pending.extend(graph.node)
    return count, found


def _expand(
    root: FunctionKey,
    own: dict[FunctionKey, int],
    calls: dict[FunctionKey, list[FunctionKey]],
    expanded: dict[FunctionKey, int],
) -> None:
    """Fill `expanded[root]` (and its callees'), depth first without recursion; counts are
    capped just above the limit so that they stay small numbers."""
    if root in expanded:
        return
    active: set[FunctionKey] = {root}
    stack: list[FunctionKey] = [root]
    while stack:
        key = stack[-1]
        waiting = [c for c in calls[key] if c not in expanded]
        for callee in waiting:
            if callee in active:
                raise CompileError(
                    "recursive_function",
                    f"local function {_name(callee)} calls itself (directly or through "
                    f"{_name(key)}): functions cannot be inlined",
                    node=_name(callee),
                )
        if waiting:
            callee = waiting[0]
            active.add(callee)
            stack.append(callee)
            continue
        total = own[key] + sum(expanded[c] for c in calls[key])
        expanded[key] = min(total, MAX_EXPANDED_NODES + 1)
        if total > MAX_EXPANDED_NODES:
            raise _fan_out(
                f"local function {_name(key)} expands to more than {MAX_EXPANDED_NODES:,} nodes"
            )
        active.discard(key)
        stack.pop()


def _name(key: FunctionKey) -> str:
    domain, name, overload = key
    return f"{domain}::{name}" + (f" (overload {overload})" if overload else "")


def _fan_out(what: str) -> CompileError:
    return CompileError(
        "function_expansion_too_large",
        f"{what} once its local functions are inlined (the limit is "
        f"{MAX_EXPANDED_NODES:,}): functions calling each other several times multiply",
        details={"max_expanded_nodes": MAX_EXPANDED_NODES},
    )


# --- shapes and tensors ---------------------------------------------------------------------


def _value_infos(proto: onnx.ModelProto) -> Iterator[onnx.ValueInfoProto]:
    graphs: list[onnx.GraphProto] = [proto.graph]
    for function in proto.functions:
        yield from function.value_info
    while graphs:
        graph = graphs.pop()
        yield from (*graph.input, *graph.output, *graph.value_info)
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("g"):
                    graphs.append(attr.g)
                graphs.extend(attr.graphs)


def _check_declared(value: onnx.ValueInfoProto) -> None:
    if not value.type.HasField("tensor_type"):
        return
    tensor_type = value.type.tensor_type
    dims = [d.dim_value for d in tensor_type.shape.dim if d.HasField("dim_value")]
    what = f"value '{value.name}'"
    if any(d < 0 for d in dims):
        raise _negative(what, dims)
    _check_size(what, dims, _bits(tensor_type.elem_type))


def _check_tensor(tensor: onnx.TensorProto) -> None:
    dims = list(tensor.dims)
    what = f"tensor '{tensor.name}'"
    if any(d < 0 for d in dims):
        raise _negative(what, dims)
    bits = _bits(tensor.data_type)
    _check_size(what, dims, bits)
    if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.data_type == 0:
        return  # external data: its length is checked against the file
    count = math.prod(dims)
    if tensor.HasField("raw_data"):
        have, need = len(tensor.raw_data), math.ceil(count * bits / 8)
        unit = "bytes"
    else:
        name, per = _TYPED_FIELD.get(tensor.data_type, ("int32_data", 1))
        have = len(getattr(tensor, name))
        need = math.ceil(count * bits / 8) if bits < 8 else count * per
        unit = "values"
    if have != need:
        raise CompileError(
            "invalid_model",
            f"{what} declares shape {dims} ({need:,} {unit} of data) but holds {have:,}",
            details={"tensor": tensor.name},
        )


@functools.cache
def _bits(data_type: int) -> int:
    """Bits per element of an ONNX element type (8 for strings and unknown types)."""
    try:
        return int(ir.DataType(data_type).bitwidth)
    except (ValueError, TypeError):
        return 8


def _check_size(what: str, dims: list[int], bits: int) -> None:
    nbytes = math.prod(dims) * bits // 8
    if nbytes <= MAX_TENSOR_BYTES and max(dims, default=0) <= MAX_DIMENSION:
        return
    for dim in dims:
        if dim > MAX_DIMENSION:
            raise _too_large(what, dims, f"dimension {dim:,} exceeds {MAX_DIMENSION:,}")
    raise _too_large(what, dims, f"{nbytes / _GIB:,.1f} GiB")


def _too_large(what: str, dims: list[int], size: str) -> CompileError:
    return CompileError(
        "tensor_too_large",
        f"{what} of shape {dims} is too large ({size}): no device holds a tensor over "
        f"{MAX_TENSOR_BYTES // _GIB} GiB (the largest SoC's DDR)",
        details={"max_tensor_bytes": MAX_TENSOR_BYTES},
    )


def _negative(what: str, dims: list[int]) -> CompileError:
    return CompileError(
        "invalid_model", f"{what} has a negative dimension: shape {dims}", details={"shape": dims}
    )
