"""Evaluate at compile time every node whose result does not depend on the graph inputs.

The kernels are the registry's (the same code the runtime runs), so a folded value is exactly
what the device would have computed. Shape and Size fold from static shapes alone, and shape
inference runs again after each round so that shapes computed from data (Reshape(x,
Concat(Shape(x), ...))) become static and the next round can fold further.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from compiler_core.importer import infer_shapes as importer_infer_shapes
from compiler_core.nodeinfo import SMALL_CONST_ELEMENTS, node_info, outer_scope_values
from compiler_core.ops.registry import REGISTRY, TileCtx
from compiler_core.passes.base import (
    GraphPass,
    NameScope,
    add_initializer,
    has_subgraph,
    model_opset,
    static_dims,
)

log = logging.getLogger(__name__)

NONDETERMINISTIC = frozenset(
    {
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
    }
)

SHAPE_FROM_DATA = frozenset({"NonZero", "Range", "Compress"})
"""Ops whose output shape depends on input values: their kernels need no output shape, so they
fold even while inference cannot give one."""

InferShapes = Callable[[ir.Model], None]


def copy_constants_into_subgraphs(graph: ir.Graph) -> int:
    """Give each subgraph its own initializer copy of the small outer constants it reads.

    ONNX shape inference sees the values of a subgraph's own initializers but not those of
    the enclosing graph, so a body's Unsqueeze(x, axes) with outer `axes` would stay unshaped
    (and with it the Scan or Loop output). Returns how many reads were redirected.
    """
    names = NameScope(graph)
    copied = 0
    for node in graph:
        if not has_subgraph(node):
            continue
        for value in outer_scope_values(node):
            tensor = value.const_value
            if tensor is None or tensor.size > SMALL_CONST_ELEMENTS:
                continue
            local: dict[int, ir.Value] = {}
            for use in list(value.uses()):
                body = use.node.graph
                if body is None or body is graph:
                    continue
                if id(body) not in local:
                    array = np.asarray(tensor.numpy())
                    local[id(body)] = add_initializer(body, array, names.fresh(f"{value.name}_in"))
                use.node.replace_input_with(use.idx, local[id(body)])
                copied += 1
    return copied


def _integer(value: ir.Value) -> bool:
    return value.dtype is not None and value.dtype.is_integer()


class FoldConstantsPass(GraphPass):
    """Replace nodes with constant results by initializers, to a fixed point.

    `size_limit` (elements) caps only folds whose inputs are not all constant (Shape, Size);
    a node whose inputs are all constant always folds, however big its output: models build
    their weights that way (ConstantOfShape, Expand) and later passes need them constant.
    """

    name = "fold-constants"

    def __init__(
        self,
        opset: int | None = None,
        size_limit: int | None = None,
        infer_shapes: InferShapes | None = None,
    ) -> None:
        super().__init__()
        self.opset = opset
        self.size_limit = size_limit
        self._infer_shapes = infer_shapes or importer_infer_shapes

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = self.opset or model_opset(model)
        graph = model.graph
        lifted = folded = 0
        while True:
            round_lifted = round_folded = 0
            for node in list(graph):
                if node.graph is None:
                    continue
                if node.op_type == "Constant" and node.domain == "":
                    round_lifted += self._lift_constant(graph, node)
                else:
                    round_folded += self._try_fold(graph, node, opset)
            round_folded += copy_constants_into_subgraphs(graph)
            lifted += round_lifted
            folded += round_folded
            if not round_folded:
                break
            self._infer_shapes(model)
        log.info("fold-constants: folded %d nodes, lifted %d Constant nodes", folded, lifted)
        return ir.passes.PassResult(model, modified=bool(folded or lifted))

    def _lift_constant(self, graph: ir.Graph, node: ir.Node) -> int:
        out = node.outputs[0]
        if out.is_graph_output():
            return 0
        try:
            tensor = ir.convenience.get_const_tensor(out)
        except ValueError:  # sparse or malformed: left for the importer's checks
            return 0
        if tensor is None:
            return 0
        self._replace_by_initializers(graph, node, [np.asarray(tensor.numpy())])
        return 1

    def _try_fold(self, graph: ir.Graph, node: ir.Node, opset: int) -> int:
        if node.domain not in ("", "ai.onnx") or not node.outputs:
            return 0
        if any(out.is_graph_output() for out in node.outputs):
            return 0
        if node.op_type in ("Shape", "Size"):
            results = self._fold_shape(node)
        elif self._foldable(node):
            results = self._evaluate(node, opset)
        else:
            return 0
        if results is None:
            return 0
        self._replace_by_initializers(graph, node, results)
        return 1

    def _foldable(self, node: ir.Node) -> bool:
        present = [value for value in node.inputs if value is not None]
        if not present or node.op_type in NONDETERMINISTIC or has_subgraph(node):
            return False
        if any(value.const_value is None for value in present):
            return False
        if node.op_type == "DequantizeLinear" and _integer(present[0]):
            return False  # quantized weights stay integers for fold-qdq (it folds the rest)
        # Kernels read output shapes from the node; unknown ones fold after the next inference.
        if node.op_type in SHAPE_FROM_DATA:
            return True
        return all(static_dims(out) is not None for out in node.outputs)

    def _fold_shape(self, node: ir.Node) -> list[np.ndarray] | None:
        source = node.inputs[0] if node.inputs else None
        dims = static_dims(source)
        if dims is None:
            return None
        if node.op_type == "Size":
            return [np.array(int(np.prod(dims, dtype=np.int64)), dtype=np.int64)]
        rank = len(dims)
        start_attr = node.attributes.get("start")
        end_attr = node.attributes.get("end")
        start = start_attr.as_int() if start_attr is not None else 0
        end = end_attr.as_int() if end_attr is not None else rank
        start = min(max(start + rank if start < 0 else start, 0), rank)
        end = min(max(end + rank if end < 0 else end, 0), rank)
        result = np.array(dims[start:end], dtype=np.int64)
        if self.size_limit is not None and result.size > self.size_limit:
            return None
        return [result]

    def _evaluate(self, node: ir.Node, opset: int) -> list[np.ndarray] | None:
        opdef = REGISTRY.lookup(node.op_type, node.domain, opset)
        if opdef is None:
            log.debug("fold-constants: no kernel for %s, not folded", node.op_type)
            return None
        info = node_info(node, opset)
        inputs: list[np.ndarray | None] = [
            None if value is None or value.const_value is None else value.const_value.numpy()
            for value in node.inputs
        ]
        try:
            results = opdef.compute(info, inputs, TileCtx.whole(info))
        except Exception as exc:
            raise self.error(node, f"evaluating constant inputs failed: {exc}") from exc
        if len(results) < len(node.outputs):
            raise self.error(
                node, f"kernel returned {len(results)} results for {len(node.outputs)} outputs"
            )
        checked = []
        for out, result in zip(node.outputs, results, strict=False):
            array = np.asarray(result)
            dims = static_dims(out)
            if dims is not None and tuple(array.shape) != dims:
                raise self.error(
                    node, f"kernel result shape {array.shape} differs from inferred {dims}"
                )
            if out.dtype is not None:
                array = array.astype(out.dtype.numpy(), copy=False)
            checked.append(array)
        return checked

    def _replace_by_initializers(
        self, graph: ir.Graph, node: ir.Node, results: list[np.ndarray]
    ) -> None:
        for out, array in zip(node.outputs, results, strict=False):
            if not out.uses():
                continue
            name = out.name or f"{node.name}_folded"
            out.name = None
            new = add_initializer(graph, array, name)
            out.replace_all_uses_with(new)
        graph.remove(node, safe=True)
