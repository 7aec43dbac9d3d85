"""What every graph pass shares: a kebab-case name, failures that name the pass and the node,
fresh value names, and replacing a value without breaking the graph outputs' names.

Passes are onnx_ir `InPlacePass`es, so they also run under onnx_ir's own `PassManager`.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx_ir as ir

from compiler_core.errors import CompileError

DEFAULT_OPSET = 17


class GraphPass(ir.passes.InPlacePass):
    """An in-place pass on the main graph, known to the pass manager by `name`."""

    name: ClassVar[str] = ""

    def error(self, node: ir.Node, reason: str) -> CompileError:
        """The error a pass raises when it cannot go on: names the pass and the node."""
        label = node.name or node.op_type
        return CompileError(
            "pass_failed",
            f"{self.name}: node {label} ({node.op_type}): {reason}",
            node=label,
            details={"pass": self.name, "op_type": node.op_type},
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def model_opset(model: ir.Model) -> int:
    """The default-domain opset the model imports (its ops are interpreted at that version)."""
    version = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    return int(version) if version is not None else DEFAULT_OPSET


class NameScope:
    """Fresh value names for one pass run: never equal to a name already in the graph."""

    def __init__(self, graph: ir.Graph) -> None:
        names: set[str] = set()
        for value in (*graph.inputs, *graph.outputs, *graph.initializers.values()):
            if value.name:
                names.add(value.name)
        for node in graph:
            for value in node.outputs:
                if value.name:
                    names.add(value.name)
        self._names = names

    def reserve(self, name: str) -> None:
        """Count `name` as taken (a name from outside the main graph's own values)."""
        self._names.add(name)

    def fresh(self, hint: str) -> str:
        name = hint
        counter = 1
        while name in self._names:
            name = f"{hint}_{counter}"
            counter += 1
        self._names.add(name)
        return name


def add_initializer(graph: ir.Graph, array: np.ndarray, name: str) -> ir.Value:
    """Register `array` as a new initializer called `name` (already unique) and return it."""
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    tensor = ir.Tensor(array, name=name)  # ir.tensor's result for an array, without its checks
    value = ir.Value(
        name=name,
        shape=ir.Shape(array.shape),
        type=ir.TensorType(tensor.dtype),
        const_value=tensor,
    )
    graph.register_initializer(value)
    return value


def const_array(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    return np.asarray(value.const_value.numpy())


def static_dims(value: ir.Value | None) -> tuple[int, ...] | None:
    if value is None or value.shape is None or not value.shape.is_static():
        return None
    return tuple(int(d) for d in value.shape)  # type: ignore[arg-type]


def replace_value(old: ir.Value, new: ir.Value) -> None:
    """Point every use of `old`, graph outputs included, at `new`.

    A graph output's name is the user's contract, so when `old` is one, `new` takes its name;
    the caller removes `old`'s producer afterwards. `new` must not be a graph input,
    initializer or another graph output (callers keep the old node in those cases).
    """
    was_output = old.is_graph_output()
    name = old.name
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    if was_output:
        old.name = None
        new.name = name


def can_take_output_name(value: ir.Value) -> bool:
    """Whether `value` may be renamed to a graph output's name (see `replace_value`)."""
    return not (value.is_graph_input() or value.is_initializer() or value.is_graph_output())


def has_subgraph(node: ir.Node) -> bool:
    return any(
        attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
        for attr in node.attributes.values()
    )


def cast_node(value: ir.Value, to: ir.DataType, out_name: str | None, node_name: str) -> ir.Node:
    """A Cast of `value` to `to` (not yet in a graph)."""
    out = ir.Value(name=out_name, type=ir.TensorType(to), shape=value.shape)
    return ir.Node(
        "",
        "Cast",
        [value],
        outputs=[out],
        attributes=[ir.AttrInt64("to", to.value)],
        name=node_name,
    )


def is_cast_to(node: ir.Node, to: ir.DataType) -> bool:
    attr = node.attributes.get("to")
    return node.op_type == "Cast" and attr is not None and attr.as_int() == to.value


def prepend(graph: ir.Graph, node: ir.Node) -> None:
    """Put `node` first in the graph (a boundary Cast every reader comes after)."""
    first = next(iter(graph), None)
    if first is None:
        graph.append(node)
    else:
        graph.insert_before(first, node)
