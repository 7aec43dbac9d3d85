"""float16's range (+-65504) under `-convert-to-fp16`: avoid what the compiler can, name what it
cannot guarantee.

`FoldMatMulScalePass`: a MatMul whose result is only scaled down by a scalar constant (the
attention scores' `Div(sqrt(d))` or `Mul(1/sqrt(d))`) is computed with the scale applied to an
operand first, so the float16 result never holds the unscaled products. The scale goes into
constants when the operand is a linear chain back to them (Q = Transpose(Reshape(x @ Wq + bq))
gives Wq*s and bq*s: no new kernel, one rounding of each scaled constant, as converting it to
float16 rounds it anyway); otherwise the smaller operand is scaled by the same op and constant
right before the MatMul, one extra float16 rounding of that operand (relative 2^-11 per element,
the size of the rounding float16 operands already carry). A scale so small that an operand of
magnitude 1 would leave float16's normal range (below 2^-14) keeps the MatMul and its scale in
float32 instead. Programs of models without the pattern do not change.

`CheckFp16RangePass`: bounds every float value from what is known (constants, and ops whose
result is bounded whatever their input: Softmax, Sigmoid, Tanh, LayerNormalization, a Cast from
an 8- or 16-bit integer, a Gather from a constant table) through the ops that follow, and
warns (`fp16_range`) of each float16 MatMul, Gemm, Conv, ConvTranspose or ReduceSum whose
result's bound exceeds 65504, with the `-node-precision-info` line that keeps it in float32.
Values fed by float graph inputs have no known range; the run-time diagnosis covers those.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from compiler_core.fusion import FUSED_NODES_KEY, fused_node_names
from compiler_core.passes.base import (
    GraphPass,
    NameScope,
    add_initializer,
    const_array,
    model_opset,
    replace_value,
    static_dims,
)
from compiler_core.passes.convert_precision import FP16_MAX, KEEP_FP32, NODE_PRECISION_FIX
from compiler_core.tensors import release_mapping

log = logging.getLogger(__name__)

MIN_OPERAND_SCALE = 2.0**-14
"""The smallest scale applied to an activation operand: 1 * scale stays a normal float16."""
FLOAT = ir.DataType.FLOAT
LINEAR_MOVES = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
"""Ops through which a scale moves to their input unchanged."""
Interval = tuple[float, float]


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


@dataclass
class _Scale:
    """A MatMul's scale node and what it multiplies by (`op`: Mul or Div by `constant`)."""

    node: ir.Node
    op: str
    constant: ir.Value
    factor: float
    """The multiplier: the constant, or its reciprocal for Div."""


@dataclass
class _Plan:
    """Constants to replace by scaled copies: (reader, input index, array)."""

    constants: list[tuple[ir.Node, int, np.ndarray]] = field(default_factory=list)


class FoldMatMulScalePass(GraphPass):
    name = "fold-matmul-scale"

    def __init__(self, scope: Fp16Scope) -> None:
        super().__init__()
        self.scope = scope
        self.folded: dict[str, str] = {}
        """MatMul name -> where its scale went ("constants" or the scaled operand's name)."""
        self.kept_fp32: list[str] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.folded, self.kept_fp32 = {}, []
        if model_opset(model) < 7:  # Mul and Div broadcast from opset 7
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        names = NameScope(graph)
        for node in list(graph):
            if node.op_type != "MatMul" or not self.scope.covers(node):
                continue
            scale = _scale_of(node)
            if scale is None or not self.scope.covers(scale.node):
                continue
            self._fold(graph, node, scale, names)
        log.info(
            "fold-matmul-scale: %d folded, %d kept in float32",
            len(self.folded),
            len(self.kept_fp32),
        )
        return ir.passes.PassResult(model, modified=bool(self.folded or self.kept_fp32))

    def _fold(self, graph: ir.Graph, matmul: ir.Node, scale: _Scale, names: NameScope) -> None:
        label = matmul.name or matmul.op_type
        for index in (0, 1):
            plan = _Plan()
            operand = matmul.inputs[index]
            if operand is not None and _plan_constants(matmul, index, scale, plan):
                for reader, slot, array in plan.constants:
                    _replace_constant(graph, reader, slot, array, names)
                self.folded[label] = "constants"
                _bypass(graph, matmul, scale)
                return
        if abs(scale.factor) < MIN_OPERAND_SCALE:
            matmul.meta[KEEP_FP32] = True
            scale.node.meta[KEEP_FP32] = True
            self.kept_fp32.append(label)
            return
        index = _smaller_operand(matmul)
        operand = matmul.inputs[index]
        assert operand is not None
        out = ir.Value(
            name=names.fresh(f"{operand.name or label}_scaled"),
            type=operand.type,
            shape=operand.shape,
        )
        step = ir.Node(
            "",
            scale.op,
            [operand, scale.constant],
            outputs=[out],
            name=f"{label}/{scale.op.lower()}_{index}",
        )
        graph.insert_before(matmul, step)
        matmul.replace_input_with(index, out)
        self.folded[label] = operand.name or str(index)
        _bypass(graph, matmul, scale)


def _scale_of(matmul: ir.Node) -> _Scale | None:
    """The Mul/Div by a scalar constant of magnitude below 1 that alone reads `matmul`."""
    out = matmul.outputs[0]
    uses = list(out.uses())
    if len(matmul.outputs) != 1 or out.is_graph_output() or len(uses) != 1 or out.dtype != FLOAT:
        return None
    node, slot = uses[0].node, uses[0].idx
    if node.op_type not in ("Mul", "Div") or node.domain not in ("", "ai.onnx"):
        return None
    if len(node.inputs) != 2 or (node.op_type == "Div" and slot != 0):
        return None
    constant = node.inputs[1 - slot]
    array = const_array(constant)
    rank = static_dims(out)
    if constant is None or array is None or array.size != 1 or constant.dtype != FLOAT:
        return None
    if rank is None or array.ndim > len(rank) or node.outputs[0].dtype != FLOAT:
        return None
    value = float(array.reshape(()))
    if not math.isfinite(value) or value == 0.0:
        return None
    factor = value if node.op_type == "Mul" else 1.0 / value
    if abs(factor) >= 1.0:
        return None  # scaling up first would only bring an overflow forward
    return _Scale(node, node.op_type, constant, factor)


def _plan_constants(reader: ir.Node, slot: int, scale: _Scale, plan: _Plan) -> bool:
    """Whether `reader`'s input `slot` is linear in constants only (and the plan that scales
    them): a constant, or a single-use chain of moves, Add/Sub of a constant, or a
    MatMul/Gemm/Conv with constant weights and bias."""
    value = reader.inputs[slot]
    if value is None:
        return False
    array = const_array(value)
    if array is not None:
        scaled = _scaled(array, scale)
        if scaled is None:
            return False
        plan.constants.append((reader, slot, scaled))
        return True
    producer = value.producer()
    if producer is None or value.is_graph_output() or len(list(value.uses())) != 1:
        return False
    if len(producer.outputs) != 1 or producer.domain not in ("", "ai.onnx"):
        return False
    op = producer.op_type
    if op in LINEAR_MOVES:
        return _plan_constants(producer, 0, scale, plan)
    if op in ("Add", "Sub") and len(producer.inputs) == 2:
        return all(_plan_constants(producer, i, scale, plan) for i in (0, 1))
    if op in ("MatMul", "Gemm", "Conv"):
        weight = 0 if op == "MatMul" and const_array(producer.inputs[0]) is not None else 1
        slots = [weight] + ([2] if op != "MatMul" and len(producer.inputs) > 2 else [])
        if any(const_array(producer.inputs[i]) is None for i in slots if producer.inputs[i]):
            return False
        return all(_plan_constants(producer, i, scale, plan) for i in slots if producer.inputs[i])
    return False


def _scaled(array: np.ndarray, scale: _Scale) -> np.ndarray | None:
    """`array` times the scale, rounded once; None when float16 would flush to 0 a value it
    holds unscaled (the fold would lose it)."""
    if array.dtype != np.float32:
        return None
    wide = array.astype(np.float64)
    constant = float(np.asarray(const_array(scale.constant)).reshape(()))
    result = (wide * constant if scale.op == "Mul" else wide / constant).astype(np.float32)
    with np.errstate(over="ignore"):
        lost = (result.astype(np.float16) == 0) & (array.astype(np.float16) != 0)
    return None if bool(lost.any()) else result


def _replace_constant(
    graph: ir.Graph, reader: ir.Node, slot: int, array: np.ndarray, names: NameScope
) -> None:
    """`reader` reads `array` at `slot`: in place when it alone read the constant there
    (same name in reports and constants.bin), else from a new initializer."""
    value = reader.inputs[slot]
    assert value is not None
    if len(list(value.uses())) == 1 and not value.is_graph_output() and value.is_initializer():
        value.const_value = ir.tensor(array, name=value.name)
        return
    scaled = add_initializer(graph, array, names.fresh(f"{value.name or 'const'}_scaled"))
    reader.replace_input_with(slot, scaled)


def _smaller_operand(matmul: ir.Node) -> int:
    sizes = [static_dims(v) for v in matmul.inputs[:2]]
    if sizes[0] is None or sizes[1] is None:
        return 0
    return 0 if math.prod(sizes[0]) <= math.prod(sizes[1]) else 1


def _bypass(graph: ir.Graph, matmul: ir.Node, scale: _Scale) -> None:
    """The MatMul's output replaces the scale node's, which goes (its name stays on the
    MatMul, so -node-precision-info and reports still find it)."""
    replace_value(scale.node.outputs[0], matmul.outputs[0])
    matmul.meta[FUSED_NODES_KEY] = (
        *fused_node_names(matmul),
        scale.node.name or scale.node.op_type,
    )
    graph.remove(scale.node, safe=True)


# -- range check ----------------------------------------------------------------------------


class CheckFp16RangePass(GraphPass):
    name = "check-fp16-range"

    def __init__(self, scope: Fp16Scope) -> None:
        super().__init__()
        self.scope = scope
        self.bounds: dict[str, float] = {}
        """Node -> the bound of its result, for every float16 node checked."""
        self.warnings: list[dict[str, Any]] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        ranges = _Ranges()
        self.bounds = {}
        for node in model.graph:
            bound = ranges.visit(node)
            if bound is not None and self.scope.covers(node):
                self.bounds[node.name or node.op_type] = bound
        unsafe = {name: b for name, b in self.bounds.items() if b > FP16_MAX}
        self.warnings = [_range_warning(unsafe)] if unsafe else []
        for warning in self.warnings:
            log.warning("%s", warning["message"])
        return ir.passes.PassResult(model, modified=False)


def _range_warning(unsafe: dict[str, float]) -> dict[str, Any]:
    nodes = list(unsafe)
    listed = ", ".join(f"{name} (up to {bound:.3g})" for name, bound in unsafe.items())
    fix = NODE_PRECISION_FIX.format(", ".join(nodes))
    return {
        "code": "fp16_range",
        "message": f"convert-to-fp16: float16's range (+-{FP16_MAX:g}) is not guaranteed at "
        f"{len(nodes)} node(s): {listed}: the largest result the known ranges of their "
        "inputs allow (constants, Softmax/LayerNormalization/Sigmoid/Tanh outputs...) "
        "exceeds it",
        "nodes": nodes,
        "suggestion": "if a run gives inf or NaN there (the run names the node), keep them in "
        f"float32: {fix}",
    }


_TYPE_RANGES: dict[ir.DataType, Interval] = {
    ir.DataType.BOOL: (0.0, 1.0),
    ir.DataType.INT8: (-128.0, 127.0),
    ir.DataType.UINT8: (0.0, 255.0),
    ir.DataType.INT16: (-32768.0, 32767.0),
    ir.DataType.UINT16: (0.0, 65535.0),
}
"""Integer types narrow enough for their range to bound what a Cast to float holds."""
_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE})
_BOUNDED: dict[str, Interval] = {
    "Sigmoid": (0.0, 1.0),
    "HardSigmoid": (0.0, 1.0),
    "Softmax": (0.0, 1.0),
    "Tanh": (-1.0, 1.0),
    "Erf": (-1.0, 1.0),
    "Sin": (-1.0, 1.0),
    "Cos": (-1.0, 1.0),
    "Softsign": (-1.0, 1.0),
}
"""Ops whose result is bounded whatever their input."""
_SAME = frozenset(
    {
        *LINEAR_MOVES,
        "Expand",
        "Slice",
        "Gather",
        "GatherElements",
        "GatherND",
        "Tile",
        "Split",
        "MaxPool",
        "AveragePool",
        "GlobalAveragePool",
        "GlobalMaxPool",
        "ReduceMean",
        "ReduceMax",
        "ReduceMin",
        "DepthToSpace",
        "SpaceToDepth",
        "Dropout",
    }
)
"""Ops whose float results lie within their first input's range."""
_UNION = frozenset({"Concat", "Max", "Min", "Where", "Sum", "Mean"})
"""Ops whose result lies within the union of their float inputs' ranges (Sum adds them)."""
ACCUMULATING = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "ReduceSum"})
"""Ops whose result can outgrow every operand: the ones checked."""


class _Ranges:
    """Interval bounds of float values, None where nothing is known."""

    def __init__(self) -> None:
        self.known: dict[int, Interval | None] = {}
        self.abs_sums: dict[tuple[int, str], float] = {}

    def of(self, value: ir.Value | None) -> Interval | None:
        if value is None:
            return None
        key = id(value)
        if key not in self.known:
            self.known[key] = self._leaf(value)
        return self.known[key]

    def _leaf(self, value: ir.Value) -> Interval | None:
        if value.const_value is not None:
            return _const_interval(value)
        if value.is_graph_input() and value.dtype in _TYPE_RANGES:
            return _TYPE_RANGES[value.dtype]
        return None

    def visit(self, node: ir.Node) -> float | None:
        """Set the intervals of `node`'s results; for a checked op, return its result bound."""
        if node.domain not in ("", "ai.onnx"):
            return None
        handler = _HANDLERS.get(node.op_type)
        found: Interval | None = None
        if node.op_type in _BOUNDED:
            found = _BOUNDED[node.op_type]
        elif node.op_type in _SAME:
            found = self.of(node.inputs[0]) if node.inputs else None
        elif node.op_type in _UNION:
            found = self._union(node)
        elif handler is not None:
            found = handler(self, node)
        for out in node.outputs:
            if out.dtype in _FLOATS:
                self.known[id(out)] = found
            elif out.dtype in _TYPE_RANGES and node.op_type in _SAME:
                self.known[id(out)] = found
        if node.op_type in ACCUMULATING and found is not None:
            return _magnitude(found)
        return None

    def _union(self, node: ir.Node) -> Interval | None:
        floats = [v for v in node.inputs if v is not None and v.dtype in _FLOATS]
        if node.op_type == "Where":
            floats = [v for v in node.inputs[1:] if v is not None]
        parts = [self.of(v) for v in floats]
        if not parts or any(p is None for p in parts):
            return None
        known = [p for p in parts if p is not None]
        if node.op_type == "Sum":
            return (sum(p[0] for p in known), sum(p[1] for p in known))
        return (min(p[0] for p in known), max(p[1] for p in known))

    def abs_sum(self, value: ir.Value, axis: int | tuple[int, ...], key: str) -> float | None:
        """The largest sum of |value| over `axis` (a constant's worst-case row or column)."""
        cache = (id(value), key)
        if cache not in self.abs_sums:
            tensor = value.const_value
            array = const_array(value)
            if array is None or array.dtype.kind != "f" or array.ndim == 0:
                return None
            sums = np.abs(array.astype(np.float64)).sum(axis=axis)
            self.abs_sums[cache] = float(sums.max()) if sums.size else 0.0
            del array, sums
            release_mapping(tensor)
        return self.abs_sums[cache]


def _const_interval(value: ir.Value) -> Interval | None:
    tensor = value.const_value
    array = const_array(value)
    if array is None or array.size == 0 or array.dtype.kind not in "fiub":
        return None
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        return None
    found = (float(array.min()), float(array.max()))
    del array
    release_mapping(tensor)
    return found


def _magnitude(interval: Interval) -> float:
    return max(abs(interval[0]), abs(interval[1]))


def _symmetric(bound: float) -> Interval:
    return (-bound, bound)


def _add(a: Interval, b: Interval) -> Interval:
    return (a[0] + b[0], a[1] + b[1])


def _mul(a: Interval, b: Interval) -> Interval:
    products = [x * y for x in a for y in b]
    return (min(products), max(products))


def _binary(ranges: _Ranges, node: ir.Node) -> Interval | None:
    if len(node.inputs) != 2:
        return None
    a, b = ranges.of(node.inputs[0]), ranges.of(node.inputs[1])
    if a is None or b is None:
        return None
    op = node.op_type
    if op == "Add":
        return _add(a, b)
    if op == "Sub":
        return (a[0] - b[1], a[1] - b[0])
    if op == "Mul":
        return _mul(a, b)
    if b[0] <= 0.0 <= b[1]:  # Div by something that may be 0
        return None
    return _mul(a, (1.0 / b[1], 1.0 / b[0]))


def _unary(ranges: _Ranges, node: ir.Node) -> Interval | None:
    x = ranges.of(node.inputs[0]) if node.inputs else None
    if x is None:
        return None
    lo, hi = x
    op = node.op_type
    if op == "Relu":
        return (max(lo, 0.0), max(hi, 0.0))
    if op == "Neg":
        return (-hi, -lo)
    if op == "Abs":
        return (0.0 if lo <= 0.0 <= hi else min(abs(lo), abs(hi)), _magnitude(x))
    if op == "LeakyRelu":
        alpha = node.attributes.get("alpha")
        a = alpha.as_float() if alpha is not None else 0.01
        return (min(lo, a * lo, 0.0), max(hi, a * hi, 0.0))
    if op == "Gelu":
        return (min(lo, -0.17), max(hi, 0.0))
    if op == "Exp":
        return (math.exp(min(lo, 709.0)), math.exp(min(hi, 709.0)))
    if op == "Sqrt" and lo >= 0.0:
        return (math.sqrt(lo), math.sqrt(hi))
    return None


def _cast(ranges: _Ranges, node: ir.Node) -> Interval | None:
    source = node.inputs[0] if node.inputs else None
    if source is None:
        return None
    if source.dtype in _TYPE_RANGES:
        return ranges.of(source) or _TYPE_RANGES[source.dtype]
    return ranges.of(source) if source.dtype in _FLOATS else None


def _clip(ranges: _Ranges, node: ir.Node) -> Interval | None:
    x = ranges.of(node.inputs[0]) if node.inputs else None
    lo, hi = -math.inf, math.inf
    if "min" in node.attributes:
        lo = node.attributes["min"].as_float()
    if "max" in node.attributes:
        hi = node.attributes["max"].as_float()
    for index, pick in ((1, max), (2, min)):
        bound = const_array(node.inputs[index]) if len(node.inputs) > index else None
        if bound is not None and bound.size == 1:
            if index == 1:
                lo = pick(lo, float(bound.reshape(())))
            else:
                hi = pick(hi, float(bound.reshape(())))
    if x is not None:
        lo, hi = max(lo, x[0]), min(hi, x[1])
    if math.isinf(lo) or math.isinf(hi):
        return None
    return (lo, hi)


def _pad(ranges: _Ranges, node: ir.Node) -> Interval | None:
    x = ranges.of(node.inputs[0]) if node.inputs else None
    if x is None:
        return None
    fill = 0.0
    constant = const_array(node.inputs[2]) if len(node.inputs) > 2 else None
    if constant is not None and constant.size == 1:
        fill = float(constant.reshape(()))
    elif "value" in node.attributes:
        fill = node.attributes["value"].as_float()
    mode = node.attributes.get("mode")
    if mode is not None and mode.as_string() != "constant":
        return x
    return (min(x[0], fill), max(x[1], fill))


def _layer_norm(ranges: _Ranges, node: ir.Node) -> Interval | None:
    """|normalized| <= sqrt(N - 1) over N elements (Samuelson), then scale and bias."""
    dims = static_dims(node.inputs[0])
    gamma = ranges.of(node.inputs[1]) if len(node.inputs) > 1 else None
    if dims is None or gamma is None:
        return None
    attr = node.attributes.get("axis")
    axis = attr.as_int() if attr is not None else -1
    count = math.prod(dims[axis % len(dims) :])
    beta = ranges.of(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else (0.0, 0.0)
    if beta is None:
        return None
    return _add(_mul(_symmetric(math.sqrt(max(count - 1, 1))), gamma), beta)


def _matmul(ranges: _Ranges, node: ir.Node) -> Interval | None:
    a_value, b_value = node.inputs[0], node.inputs[1]
    if a_value is None or b_value is None:
        return None
    if _rows_sum_to_one(a_value.producer()):
        b = ranges.of(b_value)  # each result a weighted mean of B's values
        return None if b is None else _symmetric(_magnitude(b))
    if b_value.const_value is not None:  # |A row| . |B column|, the largest column
        a = ranges.of(a_value)
        axis = -2 if len(b_value.shape or ()) > 1 else 0
        column = ranges.abs_sum(b_value, axis, "columns")
        return None if a is None or column is None else _symmetric(_magnitude(a) * column)
    if a_value.const_value is not None:
        b = ranges.of(b_value)
        row = ranges.abs_sum(a_value, -1, "rows")
        return None if b is None or row is None else _symmetric(_magnitude(b) * row)
    a, b = ranges.of(a_value), ranges.of(b_value)
    dims = static_dims(a_value)
    if a is None or b is None or dims is None:
        return None
    bound = dims[-1] * _magnitude(a) * _magnitude(b)
    return (0.0, bound) if a[0] >= 0 and b[0] >= 0 else _symmetric(bound)


def _rows_sum_to_one(producer: ir.Node | None) -> bool:
    """A Softmax over the last axis (opset 13+, or a 2-D input): each row a weighting."""
    if producer is None or producer.op_type != "Softmax" or not producer.inputs:
        return False
    dims = static_dims(producer.inputs[0])
    attr = producer.attributes.get("axis")
    axis = attr.as_int() if attr is not None else -1
    return dims is not None and axis % len(dims) == len(dims) - 1


def _gemm(ranges: _Ranges, node: ir.Node) -> Interval | None:
    a, b_value = ranges.of(node.inputs[0]), node.inputs[1]
    if a is None or b_value is None:
        return None
    trans_a = node.attributes.get("transA")
    trans_b = node.attributes.get("transB")
    alpha = node.attributes.get("alpha")
    beta = node.attributes.get("beta")
    if b_value.const_value is not None:
        axis = 1 if trans_b is not None and trans_b.as_int() else 0
        column = ranges.abs_sum(b_value, axis, f"gemm{axis}")
        if column is None:
            return None
        bound = _magnitude(a) * column
    else:
        b = ranges.of(b_value)
        dims = static_dims(node.inputs[0])
        if b is None or dims is None:
            return None
        k = dims[0] if trans_a is not None and trans_a.as_int() else dims[1]
        bound = k * _magnitude(a) * _magnitude(b)
    bound *= abs(alpha.as_float()) if alpha is not None else 1.0
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        c = ranges.of(node.inputs[2])
        if c is None:
            return None
        bound += (abs(beta.as_float()) if beta is not None else 1.0) * _magnitude(c)
    return _symmetric(bound)


def _conv(ranges: _Ranges, node: ir.Node) -> Interval | None:
    """Per output channel, the sum of |w| over what it reads times the input's magnitude,
    plus the bias. Conv weights are [M, C/g, k...]: output channel m reads all of w[m].
    ConvTranspose weights are [C, M/g, k...]: an output gathers at most every tap of every
    input channel, w[:, m]."""
    x, w = ranges.of(node.inputs[0]), node.inputs[1]
    if x is None or w is None:
        return None
    transposed = node.op_type == "ConvTranspose"
    if w.const_value is not None:
        dims = static_dims(w)
        if dims is None or len(dims) < 2:
            return None
        reduce = (0, *range(2, len(dims))) if transposed else tuple(range(1, len(dims)))
        taps = ranges.abs_sum(w, reduce, "transposed" if transposed else "conv")
        if taps is None:
            return None
        bound = _magnitude(x) * taps
    else:
        weights, dims = ranges.of(w), static_dims(w)
        if weights is None or dims is None:
            return None
        count = math.prod(dims[1:]) * (dims[0] if transposed else 1)
        bound = count * _magnitude(x) * _magnitude(weights)
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        bias = ranges.of(node.inputs[2])
        if bias is None:
            return None
        bound += _magnitude(bias)
    return _symmetric(bound)


def _reduce_sum(ranges: _Ranges, node: ir.Node) -> Interval | None:
    x = ranges.of(node.inputs[0]) if node.inputs else None
    dims = static_dims(node.inputs[0]) if node.inputs else None
    out = static_dims(node.outputs[0])
    if x is None or dims is None or out is None:
        return None
    count = max(math.prod(dims) // max(math.prod(out), 1), 1)
    return (count * x[0], count * x[1])


def _batch_norm(ranges: _Ranges, node: ir.Node) -> Interval | None:
    if len(node.inputs) < 5:
        return None
    x = ranges.of(node.inputs[0])
    params = [const_array(v) for v in node.inputs[1:5]]
    if x is None or any(p is None for p in params):
        return None
    gamma, beta, mean, var = (np.asarray(p, np.float64) for p in params)
    eps = node.attributes.get("epsilon")
    scale = gamma / np.sqrt(var + (eps.as_float() if eps is not None else 1e-5))
    shift = beta - mean * scale
    return _symmetric(_magnitude(x) * float(np.abs(scale).max()) + float(np.abs(shift).max()))


_HANDLERS: dict[str, Callable[[_Ranges, ir.Node], Interval | None]] = {
    "Add": _binary,
    "Sub": _binary,
    "Mul": _binary,
    "Div": _binary,
    "Relu": _unary,
    "Neg": _unary,
    "Abs": _unary,
    "LeakyRelu": _unary,
    "Gelu": _unary,
    "Exp": _unary,
    "Sqrt": _unary,
    "Cast": _cast,
    "Clip": _clip,
    "Pad": _pad,
    "LayerNormalization": _layer_norm,
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Conv": _conv,
    "ConvTranspose": _conv,
    "ReduceSum": _reduce_sum,
    "BatchNormalization": _batch_norm,
}
