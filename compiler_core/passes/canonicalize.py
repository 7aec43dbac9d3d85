"""Rewrite ops into the few forms later passes and lowering handle, without changing results.

- Identity and inference-mode Dropout disappear (their input takes their place);
- Sum becomes a chain of Add;
- Sub by a float constant becomes Add of its negation (exact), Div by a constant power of two
  becomes Mul by its reciprocal (exact: both round the same real number);
- Flatten, Squeeze and Unsqueeze with a static output shape become Reshape to a constant shape.
Graph output names never change: when a removed node produced one, the value that replaces it
takes its name, or the node stays when that value cannot be renamed (a graph input).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from compiler_core.passes.base import (
    GraphPass,
    NameScope,
    add_initializer,
    can_take_output_name,
    const_array,
    replace_value,
    static_dims,
)

log = logging.getLogger(__name__)

FLOAT_DTYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE})
TO_RESHAPE = frozenset({"Flatten", "Squeeze", "Unsqueeze"})


class CanonicalizePass(GraphPass):
    name = "canonicalize"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = NameScope(graph)
        counts = {"forwarded": 0, "sum": 0, "sub_div": 0, "reshape": 0}
        for node in list(graph):
            if node.domain not in ("", "ai.onnx"):
                continue
            op = node.op_type
            if op in ("Identity", "Dropout") or (op == "Sum" and len(node.inputs) == 1):
                counts["forwarded"] += self._forward_input(graph, node)
            elif op == "Sum":
                counts["sum"] += self._sum_to_adds(graph, node, names)
            elif op in ("Sub", "Div"):
                counts["sub_div"] += self._sub_div_by_constant(graph, node, names)
            elif op in TO_RESHAPE:
                counts["reshape"] += self._to_reshape(graph, node, names)
        log.info(
            "canonicalize: %d forwarded (Identity/Dropout), %d Sum, %d Sub/Div, %d Reshape",
            counts["forwarded"],
            counts["sum"],
            counts["sub_div"],
            counts["reshape"],
        )
        return ir.passes.PassResult(model, modified=any(counts.values()))

    def _forward_input(self, graph: ir.Graph, node: ir.Node) -> int:
        """Remove a node whose first output equals its first input."""
        if not node.inputs or node.inputs[0] is None:
            return 0
        if node.op_type == "Dropout" and not _inference_dropout(node):
            return 0
        source, out = node.inputs[0], node.outputs[0]
        if out.is_graph_output() and not can_take_output_name(source):
            return 0
        if out.dtype is not None and source.dtype is not None and out.dtype != source.dtype:
            return 0
        if source.shape is None:
            source.shape = out.shape
        replace_value(out, source)
        graph.remove(node, safe=True)
        return 1

    def _sum_to_adds(self, graph: ir.Graph, node: ir.Node, names: NameScope) -> int:
        inputs = list(node.inputs)
        if any(value is None for value in inputs):
            return 0
        out = node.outputs[0]
        label = node.name or "Sum"
        running = inputs[0]
        adds: list[ir.Node] = []
        for index, operand in enumerate(inputs[1:], start=1):
            assert running is not None and operand is not None
            last = index == len(inputs) - 1
            result = ir.Value(
                name=names.fresh(f"{label}/add{index}"),
                type=ir.TensorType(out.dtype) if out.dtype is not None else None,
                shape=_broadcast_shape(running, operand) if not last else out.shape,
            )
            adds.append(
                ir.Node(
                    "",
                    "Add",
                    [running, operand],
                    outputs=[result],
                    name=f"{label}/add{index}",
                )
            )
            running = result
        assert running is not None
        graph.insert_before(node, adds)
        replace_value(out, running)
        graph.remove(node, safe=True)
        return 1

    def _sub_div_by_constant(self, graph: ir.Graph, node: ir.Node, names: NameScope) -> int:
        if len(node.inputs) != 2 or node.inputs[0] is None:
            return 0
        operand = node.inputs[1]
        array = const_array(operand)
        if operand is None or array is None or operand.dtype not in FLOAT_DTYPES:
            return 0
        if node.op_type == "Sub":
            new_op, replacement = "Add", np.negative(array)
        else:
            reciprocal = _exact_reciprocal(array)
            if reciprocal is None:
                return 0
            new_op, replacement = "Mul", reciprocal
        hint = f"{operand.name or node.name}_{'neg' if new_op == 'Add' else 'recip'}"
        constant = add_initializer(graph, replacement, names.fresh(hint))
        node.op_type = new_op
        node.replace_input_with(1, constant)
        return 1

    def _to_reshape(self, graph: ir.Graph, node: ir.Node, names: NameScope) -> int:
        out = node.outputs[0]
        dims = static_dims(out)
        if dims is None or 0 in dims or not node.inputs or node.inputs[0] is None:
            return 0
        shape = add_initializer(
            graph,
            np.array(dims, dtype=np.int64),
            names.fresh(f"{node.name or node.op_type}_shape"),
        )
        node.op_type = "Reshape"
        for attr in list(node.attributes):
            node.attributes.pop(attr)
        if len(node.inputs) < 2:
            node.resize_inputs(2)
        node.replace_input_with(1, shape)
        if len(node.inputs) > 2:
            node.resize_inputs(2)
        return 1


def _inference_dropout(node: ir.Node) -> bool:
    """True when Dropout is the identity: no training_mode (or a constant False) and no mask
    anybody reads."""
    if len(node.inputs) >= 3 and node.inputs[2] is not None:
        training = const_array(node.inputs[2])
        if training is None or bool(training.reshape(-1)[0]):
            return False
    is_test = node.attributes.get("is_test")
    if is_test is not None and is_test.as_int() == 0:
        return False
    return all(not (out.uses() or out.is_graph_output()) for out in node.outputs[1:])


def _exact_reciprocal(array: np.ndarray) -> np.ndarray | None:
    """1/array when every element is a power of two whose reciprocal is exact in its dtype."""
    if array.size == 0 or not np.all(np.isfinite(array)) or np.any(array == 0):
        return None
    mantissa, _ = np.frexp(np.abs(array))
    if not np.all(mantissa == 0.5):
        return None
    reciprocal = (np.ones((), dtype=array.dtype) / array).astype(array.dtype)
    if not np.all(np.isfinite(reciprocal)) or np.any(reciprocal == 0):
        return None
    back, _ = np.frexp(np.abs(reciprocal))
    if not np.all(back == 0.5):
        return None
    return reciprocal


def _broadcast_shape(a: ir.Value, b: ir.Value) -> ir.Shape | None:
    da, db = static_dims(a), static_dims(b)
    if da is None or db is None:
        return None
    try:
        return ir.Shape(np.broadcast_shapes(da, db))
    except ValueError:
        return None
