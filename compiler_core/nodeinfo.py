"""Build the IR-independent `NodeInfo` that kernels and tiling rules see, from an onnx_ir node."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, overload

import numpy as np
import onnx
import onnx_ir as ir

from compiler_core.errors import CompileError
from compiler_core.ops.registry import (  # noqa: F401  (re-exported: the IR side's names)
    OUTER_SCOPE,
    SMALL_CONST_ELEMENTS,
    NodeInfo,
    norm_domain,
)

DECLARED_SHAPE = "qpcfarm.declared_shape"
"""Value metadata key: the value's static shape comes from the model's declaration of a graph
output, not from inference (a data-dependent shape such as Reshape's with a runtime `shape`)."""


@overload
def dtype_name(dtype: ir.DataType) -> str: ...
@overload
def dtype_name(dtype: ir.DataType | None) -> str | None: ...
def dtype_name(dtype: ir.DataType | None) -> str | None:
    """The numpy name of an element type (`float32`), or its ONNX name when numpy has none."""
    if dtype is None:
        return None
    try:
        return str(np.dtype(dtype.numpy()))
    except (TypeError, ValueError, NotImplementedError):  # no numpy type: the ONNX name
        return dtype.name.lower()


def static_shape(value: ir.Value) -> tuple[int, ...] | None:
    shape = value.shape
    if shape is None or not shape.is_static():
        return None
    return tuple(int(d) for d in shape)  # type: ignore[arg-type]


def attribute_value(attr: ir.Attr, opset_imports: Mapping[str, int] | None = None) -> Any:
    """An attribute as a plain Python value (tensors as numpy arrays, strings as str).

    A graph (If branches, Loop/Scan bodies, FlexAttention modifiers) becomes the bytes of a
    ModelProto holding it with the enclosing model's `opset_imports`: self-contained, so it
    travels in the QPC and the kernel reads its nodes at the right opsets.
    """
    kind = attr.type
    if kind == ir.AttributeType.GRAPH:
        return subgraph_bytes(attr.as_graph(), opset_imports or {})
    if kind == ir.AttributeType.TENSOR:
        return np.asarray(attr.as_tensor().numpy())
    if kind == ir.AttributeType.TENSORS:
        return [np.asarray(t.numpy()) for t in attr.as_tensors()]
    if kind == ir.AttributeType.STRING:
        return attr.as_string()
    if kind == ir.AttributeType.STRINGS:
        return list(attr.as_strings())
    if kind == ir.AttributeType.INTS:
        return [int(v) for v in attr.as_ints()]
    if kind == ir.AttributeType.FLOATS:
        return [float(v) for v in attr.as_floats()]
    if kind == ir.AttributeType.INT:
        return int(attr.as_int())
    if kind == ir.AttributeType.FLOAT:
        return float(attr.as_float())
    raise CompileError(
        "unsupported_attribute",
        f"attribute '{attr.name}' of type {kind.name} is not supported",
    )


def subgraph_bytes(graph: ir.Graph, opset_imports: Mapping[str, int]) -> bytes:
    proto = onnx.ModelProto(ir_version=10)
    for domain, version in sorted(opset_imports.items()):
        proto.opset_import.add(domain=domain, version=int(version))
    proto.graph.CopyFrom(ir.serde.serialize_graph(graph))
    return bytes(proto.SerializeToString(deterministic=True))


def outer_scope_values(node: ir.Node) -> list[ir.Value]:
    """Values of enclosing graphs that the node's subgraphs read by name, in first-use order.

    Lowering hands them to the kernel as extra inputs after the node's own (their names are in
    the `OUTER_SCOPE` attribute), since a kernel sees only its operands.
    """
    defined: set[int] = set()
    used: dict[int, ir.Value] = {}

    def walk(graph: ir.Graph) -> None:
        defined.update(id(v) for v in (*graph.inputs, *graph.initializers.values()))
        for inner in graph:
            for value in inner.inputs:
                if value is not None and id(value) not in defined:
                    used.setdefault(id(value), value)
            defined.update(id(v) for v in inner.outputs)
            for attr in inner.attributes.values():
                if attr.type == ir.AttributeType.GRAPH:
                    walk(attr.as_graph())

    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            walk(attr.as_graph())
    return [v for key, v in used.items() if key not in defined]


def const_value(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    return np.asarray(value.const_value.numpy())


def node_opset(node: ir.Node, opset_imports: Mapping[str, int], default: int = 0) -> int:
    """The opset a node is read at: its own version, else what the model imports for its
    domain (each domain has its own numbering: ai.onnx.ml 3 is not ai.onnx 3)."""
    if node.version is not None:
        return node.version
    domain = norm_domain(node.domain)
    for name, version in opset_imports.items():
        if norm_domain(name) == domain:
            return int(version)
    return default


def node_info(node: ir.Node, opset: int, *, with_consts: bool = True) -> NodeInfo:
    opsets = node.graph.opset_imports if node.graph is not None else {}
    attrs = {name: attribute_value(attr, opsets) for name, attr in node.attributes.items()}
    in_shapes: list[tuple[int, ...] | None] = []
    in_dtypes: list[str | None] = []
    consts: dict[int, np.ndarray] = {}
    for index, value in enumerate(node.inputs):
        if value is None:
            in_shapes.append(None)
            in_dtypes.append(None)
            continue
        in_shapes.append(static_shape(value))
        in_dtypes.append(dtype_name(value.dtype))
        if with_consts and value.const_value is not None:
            if value.const_value.size <= SMALL_CONST_ELEMENTS:
                consts[index] = np.asarray(value.const_value.numpy())
    out_shapes: list[tuple[int, ...]] = []
    out_dtypes: list[str] = []
    for value in node.outputs:
        shape = static_shape(value)
        out_shapes.append(shape if shape is not None else ())
        out_dtypes.append(dtype_name(value.dtype) or "float32")
    return NodeInfo(
        op_type=node.op_type,
        name=node.name or node.op_type,
        attrs=attrs,
        in_shapes=tuple(in_shapes),
        in_dtypes=tuple(in_dtypes),
        out_shapes=tuple(out_shapes),
        out_dtypes=tuple(out_dtypes),
        opset=opset,
        domain=node.domain,
        consts=consts,
    )
