"""Remove nodes whose results nobody reads and initializers nothing uses."""

from __future__ import annotations

import logging

import onnx_ir as ir

from compiler_core.passes.base import GraphPass, has_subgraph, static_dims

log = logging.getLogger(__name__)


class EliminateDeadCodePass(GraphPass):
    """Drop nodes with no used output and no graph output, then unused initializers.

    Walking the graph backwards removes whole dead chains in one sweep. Graph inputs and
    outputs are the model's signature and are never touched.
    """

    name = "eliminate-dead-code"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        nodes = 0
        for node in reversed(list(graph)):
            if any(out.uses() or out.is_graph_output() for out in node.outputs):
                continue
            graph.remove(node, safe=True)
            nodes += 1
        for node in graph:
            if has_subgraph(node):
                _unname_unread_dynamic_outputs(node)
        initializers = 0
        for value in list(graph.initializers.values()):
            if value.uses() or value.is_graph_output() or value.is_graph_input():
                continue
            assert value.name is not None
            graph.initializers.pop(value.name)
            initializers += 1
        log.info("eliminate-dead-code: removed %d nodes, %d initializers", nodes, initializers)
        return ir.passes.PassResult(model, modified=bool(nodes or initializers))


def _unname_unread_dynamic_outputs(node: ir.Node) -> None:
    """An unread result of Loop or Scan (a final loop-carried value) may have no static shape
    (ONNX lets it change across iterations): left unnamed, it is computed and dropped, like an
    omitted optional output, instead of failing the static-shape check."""
    for out in node.outputs:
        if out.name and not out.uses() and not out.is_graph_output() and static_dims(out) is None:
            out.name = None
