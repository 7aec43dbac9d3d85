"""Compute each distinct expression once: equal nodes merge, equal small constants merge.

Two nodes are equal when they have the same op, domain, attributes and the very same input
values; merging them in graph order lets whole repeated chains collapse in one sweep.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

import numpy as np
import onnx_ir as ir

from compiler_core.fusion import EPILOGUE_KEY
from compiler_core.passes.base import GraphPass, has_subgraph
from compiler_core.passes.fold_constants import NONDETERMINISTIC

log = logging.getLogger(__name__)


class EliminateCommonSubexpressionsPass(GraphPass):
    """Merge identical nodes, and identical initializers of at most `initializer_size_limit`
    elements (big weights are rarely equal and hashing them costs a pass over the bytes)."""

    name = "eliminate-common-subexpressions"

    def __init__(self, initializer_size_limit: int = 1024, tensor_attr_limit: int = 1024) -> None:
        super().__init__()
        self.initializer_size_limit = initializer_size_limit
        self.tensor_attr_limit = tensor_attr_limit

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        initializers = self._merge_initializers(graph)
        nodes = self._merge_nodes(graph)
        log.info(
            "eliminate-common-subexpressions: merged %d nodes, %d initializers",
            nodes,
            initializers,
        )
        return ir.passes.PassResult(model, modified=bool(nodes or initializers))

    def _merge_initializers(self, graph: ir.Graph) -> int:
        seen: dict[tuple[Hashable, ...], ir.Value] = {}
        merged = 0
        for value in list(graph.initializers.values()):
            tensor = value.const_value
            if tensor is None or tensor.size > self.initializer_size_limit:
                continue
            if value.is_graph_input() or value.is_graph_output():
                continue
            array = np.asarray(tensor.numpy())
            key = (str(tensor.dtype), array.shape, array.tobytes())
            kept = seen.setdefault(key, value)
            if kept is value:
                continue
            value.replace_all_uses_with(kept)
            assert value.name is not None
            graph.initializers.pop(value.name)
            merged += 1
        return merged

    def _merge_nodes(self, graph: ir.Graph) -> int:
        seen: dict[tuple[Hashable, ...], ir.Node] = {}
        merged = 0
        for node in list(graph):
            key = self._key(node)
            if key is None:
                continue
            kept = seen.setdefault(key, node)
            if kept is node:
                continue
            if any(out.is_graph_output() for out in node.outputs):
                # Its output name is the user's contract; keep the duplicate (rare).
                continue
            for old, new in zip(node.outputs, kept.outputs, strict=True):
                old.replace_all_uses_with(new)
            graph.remove(node, safe=True)
            merged += 1
        return merged

    def _key(self, node: ir.Node) -> tuple[Hashable, ...] | None:
        if node.op_type in NONDETERMINISTIC or has_subgraph(node) or EPILOGUE_KEY in node.meta:
            return None
        attrs: list[tuple[str, Hashable]] = []
        for name, attr in sorted(node.attributes.items()):
            if attr.is_ref():
                return None
            if attr.type == ir.AttributeType.TENSOR:
                tensor = attr.as_tensor()
                if tensor.size > self.tensor_attr_limit:
                    return None
                array = np.asarray(tensor.numpy())
                attrs.append((name, (str(tensor.dtype), array.shape, array.tobytes())))
            elif attr.type in (
                ir.AttributeType.INTS,
                ir.AttributeType.FLOATS,
                ir.AttributeType.STRINGS,
            ):
                attrs.append((name, tuple(attr.value)))
            elif attr.type in (
                ir.AttributeType.INT,
                ir.AttributeType.FLOAT,
                ir.AttributeType.STRING,
            ):
                attrs.append((name, attr.value))
            else:
                return None
        return (
            node.domain,
            node.op_type,
            node.overload,
            len(node.outputs),
            tuple(id(value) for value in node.inputs),
            tuple(attrs),
        )
