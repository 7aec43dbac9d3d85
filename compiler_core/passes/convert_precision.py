"""`-convert-to-fp16`: compute in float16 inside, keep the float32 signature outside.

Every float32 constant and intermediate becomes float16; graph inputs and outputs stay float32
with a Cast at the boundary, so callers feed and read exactly what the ONNX model declares.
Constants beyond float16's range would become infinities, so they are clipped to +-65504
and named in one warning (`warnings`), as the vendor compiler does, with the nodes that read
them; constants whose every value is too small for float16 (a norm's epsilon of 1e-12)
become 0 and are named in another: both say which nodes to keep in float32. What a
constant cannot show (an activation that outgrows float16) the runtime reports when it runs
(`compiler_core.runtime.numerics`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from compiler_core.errors import CompileError
from compiler_core.fusion import epilogue, fused_node_names
from compiler_core.passes.base import GraphPass, NameScope, cast_node, is_cast_to, prepend
from compiler_core.tensors import SMALL_TENSOR_BYTES, release_mapping

log = logging.getLogger(__name__)

FP16_MAX = 65504.0
FP16_ROUNDS_TO_ZERO = 2.0**-25
"""Magnitudes below this round to 0 in float16 (its smallest subnormal is 2^-24)."""
NODE_PRECISION_FIX = "-node-precision-info with FP32NodeInstanceNames: [{}]"
FLOAT = ir.DataType.FLOAT
FLOAT16 = ir.DataType.FLOAT16
KEEP_FP32 = "qpc.keep_fp32"
"""Node meta set by a pass that keeps the node in float32 whatever the options say
(`compiler_core.passes.fold_matmul_scale`: a MatMul whose scale is too small to fold)."""

FLOAT32_ONLY_INPUTS = frozenset({("Resize", 2), ("Upsample", 1)})
"""(op type, input index) slots whose type the ONNX spec fixes to float32."""


@dataclass(frozen=True)
class Fp16Scope:
    """Which nodes the precision pass computes in float16: every node but `fp32` (names)
    under `-convert-to-fp16`, else the nodes named in `fp16` or of an op type in `types`."""

    everything: bool
    fp32: frozenset[str] = frozenset()
    fp16: frozenset[str] = frozenset()
    types: frozenset[str] = frozenset()

    def covers(self, node: ir.Node) -> bool:
        if node.meta.get(KEEP_FP32) or node.domain not in ("", "ai.onnx"):
            return False
        labels = {node.name or "", *fused_node_names(node), *(v.name or "" for v in node.outputs)}
        if self.everything:
            return not labels & self.fp32
        return node.op_type in self.types or bool(labels & self.fp16)


DTYPE_ATTR_OPS = frozenset(
    {"EyeLike", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike"}
)


class ConvertToFp16Pass(GraphPass):
    """`keep_fp32`: nodes (by name or output name, `-node-precision-info`) that stay float32
    inside the float16 network. `only`: convert just these nodes, in a float32 network."""

    name = "convert-to-fp16"

    def __init__(
        self,
        keep_fp32: frozenset[str] = frozenset(),
        only: frozenset[str] | None = None,
        only_types: frozenset[str] | None = None,
    ) -> None:
        """`only_types`: convert the nodes of these op types (`-execute-nodes-in-fp16`)."""
        super().__init__()
        self.only_types = only_types
        self.warnings: list[dict[str, Any]] = []
        """`fp16_clipped` / `fp16_flushed`, each naming the constants and the nodes reading
        them (`code`, `message`, `nodes`, `suggestion`, as compile warnings are)."""
        self.keep_fp32 = keep_fp32
        self.only = only

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = NameScope(graph)
        self.warnings = []
        if self.only_types is not None:
            types = self.only_types
            chosen = {
                node
                for node in graph
                if node.domain == ""
                and (node.op_type in types or any(e.op_type in types for e in epilogue(node)))
            }
            if self.only:
                chosen |= find_nodes(graph, self.only, "FP16NodeInstanceNames")
            convert = lambda node: node in chosen  # noqa: E731
        elif self.only is not None:
            chosen = find_nodes(graph, self.only, "FP16NodeInstanceNames")
            convert = lambda node: node in chosen  # noqa: E731
        else:
            kept = find_nodes(graph, self.keep_fp32, "FP32NodeInstanceNames")
            convert = lambda node: node not in kept  # noqa: E731
        original = set(graph)
        converting = {node for node in original if convert(node) and not node.meta.get(KEEP_FP32)}
        kept_fp32 = _float32_only_initializers(graph)
        risks = _Risks()
        converted = 0
        for value in list(graph.initializers.values()):
            if value.dtype != FLOAT or value.is_graph_input() or value in kept_fp32:
                continue
            if all(use.node in converting for use in value.uses()):
                converted += self._convert_initializer(value, risks)
        for node in converting:
            converted += _convert_node(node, risks)
        if self.only is None:
            converted += _insert_input_casts(graph, names, converting)
        converted += _insert_output_casts(graph, names)
        converted += _restore_float32_slots(graph, names)
        odd = converting if self.only is not None else original - converting
        inner, outer = (FLOAT16, FLOAT) if self.only is not None else (FLOAT, FLOAT16)
        converted += _isolate(graph, odd, inner, outer, names)
        self.warnings = risks.warnings()
        for warning in self.warnings:  # reported once, by the compile's warnings
            log.info("%s (nodes: %s)", warning["message"], ", ".join(warning["nodes"]))
        log.info("convert-to-fp16: converted %d values and attributes", converted)
        return ir.passes.PassResult(model, modified=converted > 0)

    def _convert_initializer(self, value: ir.Value, risks: _Risks) -> int:
        tensor = value.const_value
        assert tensor is not None
        name = value.name or "?"
        readers = [use.node.name or use.node.op_type for use in value.uses()]
        if tensor.nbytes <= SMALL_TENSOR_BYTES:
            value.const_value = ir.tensor(
                _to_fp16(np.asarray(tensor.numpy()), name, risks, readers), name=value.name
            )
        else:
            # Large weights: look for out-of-range values now (for the warning), convert only
            # when the constants are written, so fp32 and fp16 copies never coexist.
            source = np.asarray(tensor.numpy())
            risks.look(source, name, readers)
            del source
            release_mapping(tensor)
            value.const_value = ir.LazyTensor(
                functools.partial(_lazy_fp16, tensor),
                dtype=FLOAT16,
                shape=ir.Shape(tensor.shape.numpy()),
            )
        value.type = ir.TensorType(FLOAT16)
        return 1


@dataclass
class _Risks:
    """Constants float16 changes beyond rounding, each with the nodes that read it."""

    clipped: dict[str, list[str]] = field(default_factory=dict)
    flushed: dict[str, float] = field(default_factory=dict)
    """Constant -> its largest magnitude (every value of it becomes 0)."""
    readers: dict[str, list[str]] = field(default_factory=dict)

    def look(self, array: np.ndarray, name: str, readers: list[str]) -> bool:
        """Note `array` if float16 clips it or flushes it to 0; True when it must be clipped."""
        if array.size == 0:
            return False
        finite = array[np.isfinite(array)] if not np.isfinite(array).all() else array
        largest = float(max(finite.max(), -finite.min())) if finite.size else 0.0
        if largest > FP16_MAX:
            self.clipped[name] = readers
            self.readers[name] = readers
            return True
        if 0.0 < largest < FP16_ROUNDS_TO_ZERO:
            self.flushed[name] = largest
            self.readers[name] = readers
        return False

    def warnings(self) -> list[dict[str, Any]]:
        out = []
        if self.clipped:
            nodes = _readers(self.clipped)
            out.append(
                _precision_warning(
                    "fp16_clipped",
                    f"convert-to-fp16: clipped values outside the float16 range "
                    f"(+-{FP16_MAX:g}) in {len(self.clipped)} constant(s): "
                    f"{', '.join(self.clipped)}",
                    nodes,
                    "if the nodes reading them need those values, keep them in float32:",
                )
            )
        if self.flushed:
            nodes = _readers({name: self.readers[name] for name in self.flushed})
            shown = ", ".join(f"{name} (|x| <= {v:.3g})" for name, v in self.flushed.items())
            out.append(
                _precision_warning(
                    "fp16_flushed",
                    f"convert-to-fp16: {len(self.flushed)} constant(s) are too small for "
                    f"float16 and become 0: {shown}; an epsilon or divisor of 0 gives inf or NaN",
                    nodes,
                    "keep the nodes reading them in float32:",
                )
            )
        return out


def _readers(constants: dict[str, list[str]]) -> list[str]:
    return list(dict.fromkeys(n for readers in constants.values() for n in readers))


def _precision_warning(code: str, message: str, nodes: list[str], advice: str) -> dict[str, Any]:
    fix = NODE_PRECISION_FIX.format(", ".join(nodes)) if nodes else "-node-precision-info"
    return {"code": code, "message": message, "nodes": nodes, "suggestion": f"{advice} {fix}"}


def _lazy_fp16(tensor: ir.TensorProtocol) -> ir.TensorProtocol:
    source = np.asarray(tensor.numpy())
    result = _to_fp16(source, "", _Risks(), [])
    del source
    release_mapping(tensor)
    return ir.tensor(result)


def _to_fp16(array: np.ndarray, name: str, risks: _Risks, readers: list[str]) -> np.ndarray:
    if risks.look(array, name, readers):
        array = np.where(np.isfinite(array), np.clip(array, -FP16_MAX, FP16_MAX), array)
    return array.astype(np.float16)


def _convert_node(node: ir.Node, risks: _Risks) -> int:
    converted = 0
    for out in node.outputs:
        if out.dtype == FLOAT:
            out.type = ir.TensorType(FLOAT16)
            converted += 1
    # A constant held in an attribute is read by the nodes its output feeds (a Constant,
    # ConstantOfShape); other ops' tensor attributes by the node itself.
    fed = [use.node.name or use.node.op_type for out in node.outputs for use in out.uses()]
    readers = fed if node.op_type in ("Constant", "ConstantOfShape") else [node.name or "?"]
    for name, attr in list(node.attributes.items()):
        if attr.is_ref():
            continue
        if attr.type == ir.AttributeType.TENSOR and attr.as_tensor().dtype == FLOAT:
            label = f"{node.name or node.op_type}.{name}"
            array = _to_fp16(np.asarray(attr.as_tensor().numpy()), label, risks, readers)
            node.attributes[name] = ir.AttrTensor(name, ir.tensor(array))
            converted += 1
        elif node.op_type == "Constant" and name in ("value_float", "value_floats"):
            label = f"{node.name or node.op_type}.{name}"
            array = _to_fp16(np.asarray(attr.value, dtype=np.float32), label, risks, readers)
            node.attributes.pop(name)
            node.attributes["value"] = ir.AttrTensor("value", ir.tensor(array))
            converted += 1
    if node.op_type == "ConstantOfShape" and "value" not in node.attributes:
        # The default fill is a float32 zero.
        node.attributes["value"] = ir.AttrTensor("value", ir.tensor(np.zeros(1, np.float16)))
        converted += 1
    to = node.attributes.get("to")
    if node.op_type == "Cast" and to is not None and to.as_int() == FLOAT.value:
        node.attributes["to"] = ir.AttrInt64("to", FLOAT16.value)
        converted += 1
    dtype = node.attributes.get("dtype")
    if node.op_type in DTYPE_ATTR_OPS and dtype is not None and dtype.as_int() == FLOAT.value:
        node.attributes["dtype"] = ir.AttrInt64("dtype", FLOAT16.value)
        converted += 1
    return converted


def _insert_input_casts(graph: ir.Graph, names: NameScope, readers: set[ir.Node]) -> int:
    """Converted readers of a float32 graph input read a float16 copy of it."""
    inserted = 0
    for value in graph.inputs:
        uses = [use for use in value.uses() if use.node in readers]
        if value.dtype != FLOAT or not uses:
            continue
        half = cast_node(value, FLOAT16, names.fresh(f"{value.name}_fp16"), f"{value.name}/to_fp16")
        for use in uses:
            use.node.replace_input_with(use.idx, half.outputs[0])
        prepend(graph, half)
        inserted += 1
    return inserted


def _insert_output_casts(graph: ir.Graph, names: NameScope) -> int:
    """A float32 graph output computed in float16 gets a Cast back, under its own name."""
    inserted = 0
    for position, value in enumerate(list(graph.outputs)):
        if value.dtype != FLOAT16 or value.is_graph_input():
            continue
        original_name = value.name
        value.name = names.fresh(f"{original_name}_fp16")
        cast = cast_node(value, FLOAT, None, f"{original_name}/to_fp32")
        if value.is_initializer():
            prepend(graph, cast)
        else:
            graph.append(cast)
        graph.outputs[position] = cast.outputs[0]
        cast.outputs[0].name = original_name
        inserted += 1
    return inserted


def find_nodes(graph: ir.Graph, wanted: frozenset[str], key: str) -> set[ir.Node]:
    """The nodes `-node-precision-info` names, by node name, output name or the name of a
    node fused into them; an unknown name is an `invalid_option`."""
    found: set[ir.Node] = set()
    seen: set[str] = set()
    for node in graph:
        labels = {node.name or "", *fused_node_names(node), *(v.name or "" for v in node.outputs)}
        hit = labels & wanted
        if hit:
            found.add(node)
            seen |= hit
    missing = sorted(wanted - seen)
    if missing:
        raise CompileError(
            "invalid_option",
            f"-node-precision-info: {key} names {', '.join(missing)}, which is neither a node "
            "nor a node output of the model",
            flag="-node-precision-info",
        )
    return found


def _isolate(
    graph: ir.Graph, nodes: set[ir.Node], inner: ir.DataType, outer: ir.DataType, names: NameScope
) -> int:
    """Nodes computing in `inner` inside an `outer` network: Casts where they meet it."""
    inserted = 0
    for node in [n for n in graph if n in nodes]:
        label = node.name or node.op_type
        for index, value in enumerate(node.inputs):
            fixed = (node.op_type, index) in FLOAT32_ONLY_INPUTS
            if value is None or value.dtype != outer or fixed:
                continue
            _cast_input(graph, node, index, inner, names)
            inserted += 1
        for value in node.outputs:
            others = [
                use
                for use in value.uses()
                if use.node not in nodes and not is_cast_to(use.node, outer)
            ]
            if value.dtype != inner or not others:
                continue
            to_outer = cast_node(
                value,
                outer,
                names.fresh(f"{value.name}_{_short(outer)}"),
                f"{label}/to_{_short(outer)}",
            )
            graph.insert_after(node, to_outer)
            for use in others:
                use.node.replace_input_with(use.idx, to_outer.outputs[0])
            inserted += 1
    return inserted


def _cast_input(
    graph: ir.Graph, node: ir.Node, index: int, to: ir.DataType, names: NameScope
) -> None:
    """Node input `index` is read through a Cast to `to`, inserted just before the node."""
    value = node.inputs[index]
    assert value is not None
    label = node.name or node.op_type
    cast = cast_node(
        value,
        to,
        names.fresh(f"{value.name}_{_short(to)}"),
        f"{label}/to_{_short(to)}_{index}",
    )
    graph.insert_before(node, cast)
    node.replace_input_with(index, cast.outputs[0])


def _short(dtype: ir.DataType) -> str:
    return {FLOAT: "fp32", FLOAT16: "fp16"}.get(dtype, dtype.name.lower())


def _float32_only_initializers(graph: ir.Graph) -> set[ir.Value]:
    """Initializers read only by slots the spec fixes to float32 (Resize scales)."""
    kept = set()
    for value in graph.initializers.values():
        uses = value.uses()
        if uses and all((use.node.op_type, use.idx) in FLOAT32_ONLY_INPUTS for use in uses):
            kept.add(value)
    return kept


def _restore_float32_slots(graph: ir.Graph, names: NameScope) -> int:
    """A float16 value read by a float32-only slot goes through a Cast back to float32."""
    inserted = 0
    for node in list(graph):
        for index, value in enumerate(node.inputs):
            if value is None or (node.op_type, index) not in FLOAT32_ONLY_INPUTS:
                continue
            if value.dtype != FLOAT16:
                continue
            _cast_input(graph, node, index, FLOAT, names)
            inserted += 1
    return inserted
