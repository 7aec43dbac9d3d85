"""A MatMul whose result is only scaled down by a scalar constant (the attention scores'
`Div(sqrt(d))` or `Mul(1/sqrt(d))`) is computed, under float16, with the scale applied to an
operand first, so the float16 result never holds the unscaled products (they pass 65504 where
the scaled scores do not).

The scale goes into constants when the operand is a linear chain back to them
(Q = Transpose(Reshape(x @ Wq + bq)) gives Wq*s and bq*s: no new kernel, one rounding of each
scaled constant, as converting it to float16 rounds it anyway); otherwise the smaller operand
is scaled by the same op and constant right before the MatMul, one extra float16 rounding of
that operand (at most 2^-11 of each value, the rounding float16 operands already carry). A
scale so small that an operand of magnitude 1 would leave float16's normal range (below
2^-14) keeps the MatMul and its scale in float32 instead. Models without the pattern are not
touched.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

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
from compiler_core.passes.convert_precision import FP16_ROUNDS_TO_ZERO, KEEP_FP32, Fp16Scope
from compiler_core.passes.value_ranges import LINEAR_MOVES

log = logging.getLogger(__name__)

MIN_OPERAND_SCALE = 2.0**-14
"""The smallest scale applied to an activation operand: 1 * scale stays a normal float16."""
FLOAT = ir.DataType.FLOAT


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
    """Move a float16 MatMul's down-scale onto an operand (see the module's docstring)."""

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
    """`array` times the scale: one correctly rounded float32 operation per value, as the
    scale node computed it; None when float16 would flush to 0 a value it holds unscaled
    (the fold would lose it)."""
    if array.dtype != np.float32:
        return None
    constant = np.asarray(const_array(scale.constant), np.float32).reshape(())
    result = array * constant if scale.op == "Mul" else array / constant
    # 2^-25 itself rounds to 0 too (a tie, to even)
    lost = (np.abs(result) <= FP16_ROUNDS_TO_ZERO) & (np.abs(array) > FP16_ROUNDS_TO_ZERO)
    return None if bool(lost.any()) else result.astype(np.float32, copy=False)


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
