"""Raise a model's default-domain opset, so that operators a pass inserts are valid in it.

The quantize pass writes QuantizeLinear/DequantizeLinear (opset 10; `axis` from 13; 16-bit
codes from 21) into models that the classic model zoo ships at opsets 7-9. Rather than put
operators the model's opset does not define into its graph, the pass raises the model first.

Each node whose schema differs between the two versions goes through ONNX's version converter
on its own: a model of that one node, its inputs as graph inputs (no weight is copied), at the
model's opset. The nodes the converter returns take its place (Softmax-9 becomes
Flatten/Softmax/Reshape, Upsample-9 becomes Resize, attribute operands become constants);
a node whose conversion is the node itself stays the same object with its metadata. Nodes
inside If and Loop bodies are converted the same way; If and Loop themselves only gained
element types from opset 1 to 21, Scan changed its meaning at 9.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import onnx
import onnx.defs
import onnx.version_converter
import onnx_ir as ir

from compiler_core.errors import CompileError
from compiler_core.passes.base import (
    GraphPass,
    NameScope,
    add_initializer,
    has_subgraph,
    model_opset,
)

log = logging.getLogger(__name__)

SUBGRAPH_UNCHANGED_SINCE = {"If": 1, "Loop": 1, "Scan": 9}
"""Ops holding subgraphs, and the version from which every later one only accepts more
element types (the body is converted node by node, the op itself needs nothing)."""

COERCED_2D = frozenset({"Softmax", "LogSoftmax", "Hardmax"})
"""Before opset 13 these flatten to 2-D around `axis`; over the last axis that is the same as
the opset-13 definition, so such a node needs no Flatten/Reshape around it."""


class RaiseOpsetPass(GraphPass):
    """Raise the model to `target` for operators a later pass writes. In the pipeline it runs
    before epilogue fusion, which records each fused step at the model's opset."""

    name = "raise-opset"

    def __init__(self, target: int, reason: str) -> None:
        super().__init__()
        self.target = target
        self.reason = reason

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        before = model_opset(model)
        raise_opset(model, self.target, self.reason)
        return ir.passes.PassResult(model, modified=model_opset(model) != before)


def raise_opset(model: ir.Model, target: int, reason: str) -> int:
    """Convert `model` in place to default-domain opset `target` when it imports less; the
    number of nodes rewritten. `reason` (the operators needing it) goes into the log and into
    the error when a node cannot be converted."""
    current = model_opset(model)
    if current >= target:
        return 0
    names = _ModelNames(model.graph)
    seen: dict[bytes, onnx.ModelProto | None] = {}
    rewritten = 0
    for node in list(_all_nodes(model.graph)):
        if node.domain not in ("", "ai.onnx") or node.version is not None:
            continue
        if not _schema_changes(node.op_type, current, target):
            continue
        if has_subgraph(node):
            _check_subgraph_op(node, current, target, reason)
            continue
        if node.op_type in COERCED_2D and _over_last_axis(node):
            continue
        rewritten += _convert(node, current, target, names, reason, seen)
    for key in ("", "ai.onnx"):
        if key in model.opset_imports:
            model.opset_imports[key] = target
    if "" not in model.opset_imports and "ai.onnx" not in model.opset_imports:
        model.opset_imports[""] = target
    log.info("raised opset %d -> %d for %s: %d nodes rewritten", current, target, reason, rewritten)
    return rewritten


def _all_nodes(graph: ir.Graph) -> Iterator[ir.Node]:
    return iter(ir.traversal.RecursiveGraphIterator(graph))


def _schema_changes(op_type: str, current: int, target: int) -> bool:
    try:
        before = onnx.defs.get_schema(op_type, current, "").since_version
    except onnx.defs.SchemaError:
        return False  # not an op at the model's opset: the importer already named it
    try:
        after = onnx.defs.get_schema(op_type, target, "").since_version
    except onnx.defs.SchemaError:
        return True
    return bool(after != before)


def _check_subgraph_op(node: ir.Node, current: int, target: int, reason: str) -> None:
    since = SUBGRAPH_UNCHANGED_SINCE.get(node.op_type)
    if since is None or current < since:
        raise CompileError(
            "unsupported_operator",
            f"node {node.name or node.op_type} ({node.op_type}, opset {current}): {reason} "
            f"needs opset {target}, and {node.op_type} with a subgraph cannot be converted "
            f"from opset {current}; export the model at opset {target} or later",
            node=node.name or node.op_type,
            details={"op_type": node.op_type, "opset": current, "needed_opset": target},
        )


def _over_last_axis(node: ir.Node) -> bool:
    value = node.inputs[0] if node.inputs else None
    if value is None or value.shape is None:
        return False
    rank = len(value.shape)
    attr = node.attributes.get("axis")
    axis = attr.as_int() if attr is not None else 1
    return rank > 0 and axis % rank == rank - 1


class _ModelNames(NameScope):
    """Fresh names unique across the model, subgraphs included (value names are one scope)."""

    def __init__(self, graph: ir.Graph) -> None:
        super().__init__(graph)
        for node in _all_nodes(graph):
            if node.graph is graph:
                continue
            for value in node.outputs:
                if value.name:
                    self.reserve(value.name)
        for sub in _subgraphs(graph):
            for value in (*sub.inputs, *sub.initializers.values()):
                if value.name:
                    self.reserve(value.name)


def _subgraphs(graph: ir.Graph) -> Iterator[ir.Graph]:
    for node in _all_nodes(graph):
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                yield attr.as_graph()
            elif attr.type == ir.AttributeType.GRAPHS:
                yield from attr.as_graphs()


def _convert(
    node: ir.Node,
    current: int,
    target: int,
    names: NameScope,
    reason: str,
    seen: dict[bytes, onnx.ModelProto | None],
) -> int:
    """Replace `node` by what the version converter makes of it; 1 when it changed.

    `seen` maps each single-node model already converted to the converter's answer (None:
    the node as it was): nodes of one op type with the same attributes and operand types and
    ranks repeat through a network, and the converter is asked once for all of them."""
    tiny, sources = _single_node_model(node, current)
    proto = ir.serde.serialize_model(tiny)
    key = proto.SerializeToString(deterministic=True)
    if key not in seen:
        seen[key] = _converted(node, proto, current, target, reason)
    converted = seen[key]
    if converted is None:
        return 0
    _splice(node, _with_shapes(converted, node, sources), sources, names)
    return 1


def _with_shapes(
    converted: onnx.ModelProto, node: ir.Node, sources: dict[str, ir.Value]
) -> ir.Graph:
    """The converted single-node model with `node`'s own operand and result shapes, its new
    intermediate values' shapes inferred from them."""
    proto = onnx.ModelProto()
    proto.CopyFrom(converted)
    declared = {name: value.shape for name, value in sources.items()}
    declared |= {f"out{k}": value.shape for k, value in enumerate(node.outputs)}
    for info in (*proto.graph.input, *proto.graph.output):
        shape = declared.get(info.name)
        if shape is None or not shape.is_static():
            continue
        dims = info.type.tensor_type.shape
        dims.Clear()
        for size in shape.numpy():
            dims.dim.add().dim_value = int(size)
    proto = onnx.shape_inference.infer_shapes(proto, strict_mode=True, data_prop=True)
    return ir.serde.deserialize_model(proto).graph


def _converted(
    node: ir.Node, proto: onnx.ModelProto, current: int, target: int, reason: str
) -> onnx.ModelProto | None:
    before = onnx.NodeProto()
    before.CopyFrom(proto.graph.node[0])
    try:
        converted = onnx.version_converter.convert_version(proto, target)
    except Exception as exc:  # the converter raises bare RuntimeErrors
        label = node.name or node.op_type
        raise CompileError(
            "unsupported_operator",
            f"node {label} ({node.op_type}, opset {current}): {reason} needs opset {target}, "
            f"and ONNX's version converter cannot convert it: {exc}",
            node=label,
            details={"op_type": node.op_type, "opset": current, "needed_opset": target},
        ) from exc
    if len(converted.graph.node) == 1 and converted.graph.node[0] == before:
        return None
    return converted


def _single_node_model(node: ir.Node, opset: int) -> tuple[ir.Model, dict[str, ir.Value]]:
    """A model of `node` alone, its distinct inputs as graph inputs `in<k>`, its outputs as
    graph outputs `out<k>`; and the original value behind each input name.

    Operands keep their element type and rank, not their dimensions (the converter's
    adapters rewrite by attributes and ranks), so that equal nodes give equal models."""
    sources: dict[str, ir.Value] = {}
    by_id: dict[int, ir.Value] = {}
    inputs: list[ir.Value | None] = []
    for value in node.inputs:
        if value is None:
            inputs.append(None)
            continue
        if id(value) not in by_id:
            name = f"in{len(by_id)}"
            by_id[id(value)] = ir.Value(name=name, type=value.type, shape=_rank_only(value))
            sources[name] = value
        inputs.append(by_id[id(value)])
    outputs = [
        ir.Value(name=f"out{k}" if value.name else "", type=value.type, shape=_rank_only(value))
        for k, value in enumerate(node.outputs)
    ]
    copy = ir.Node(
        "",
        node.op_type,
        inputs,
        attributes=[attr for attr in node.attributes.values() if not attr.is_ref()],
        outputs=outputs,
    )
    graph = ir.Graph(
        [by_id[key] for key in by_id],
        [v for v in outputs if v.name],
        nodes=[copy],
        opset_imports={"": opset},
        name="single_node",
    )
    return ir.Model(graph, ir_version=7 if opset >= 12 else 4), sources


def _rank_only(value: ir.Value) -> ir.Shape | None:
    if value.shape is None:
        return None
    return ir.Shape([f"d{axis}" for axis in range(len(value.shape))])


def _splice(node: ir.Node, tiny: ir.Graph, sources: dict[str, ir.Value], names: NameScope) -> None:
    """Put the converted nodes of `tiny` where `node` is, reading and writing its values."""
    graph = node.graph
    assert graph is not None
    label = node.name or node.op_type
    mapped: dict[int, ir.Value] = {}
    for value in tiny.inputs:
        mapped[id(value)] = sources[value.name or ""]
    for value in tiny.initializers.values():  # operands the converter made initializers
        array = value.const_value
        assert array is not None
        mapped[id(value)] = add_initializer(
            graph, array.numpy(), names.fresh(f"{label}/{value.name or 'const'}")
        )
    outputs = {v.name: v for v in tiny.outputs}
    tiny.outputs.clear()
    new_nodes: list[ir.Node] = []
    for piece in list(tiny):
        tiny.remove(piece)
        for index, operand in enumerate(piece.inputs):
            if operand is not None and id(operand) in mapped:
                piece.replace_input_with(index, mapped[id(operand)])
        if piece.op_type == "Constant" and "value" in piece.attributes:
            tensor = piece.attributes["value"].as_tensor()
            constant = add_initializer(
                graph, tensor.numpy(), names.fresh(f"{label}/{piece.outputs[0].name or 'const'}")
            )
            mapped[id(piece.outputs[0])] = constant
            continue
        for result in piece.outputs:
            if result.name not in outputs and result.name:
                result.name = names.fresh(f"{label}/{result.name}")
        new_nodes.append(piece)
    graph.insert_before(node, new_nodes)
    for k, old in enumerate(node.outputs):
        new = outputs.get(f"out{k}")
        if new is None:
            continue
        new.shape = old.shape
        new.type = old.type
        new.meta.update(old.meta)
        name = old.name
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        old.name = None
        new.name = name
    main = outputs.get("out0")
    for index, piece in enumerate(new_nodes):
        if main is not None and piece is main.producer():
            piece.name = node.name  # what -node-precision-info and reports know it by
            piece.meta.update(node.meta)
        else:
            piece.name = f"{label}/{piece.op_type}_{index}"
    graph.remove(node, safe=True)
