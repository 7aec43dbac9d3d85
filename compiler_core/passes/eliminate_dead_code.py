"""Remove nodes whose results nobody reads and initializers nothing uses."""

from __future__ import annotations

import logging

import onnx_ir as ir

from compiler_core.passes.base import GraphPass

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
        initializers = 0
        for value in list(graph.initializers.values()):
            if value.uses() or value.is_graph_output() or value.is_graph_input():
                continue
            assert value.name is not None
            graph.initializers.pop(value.name)
            initializers += 1
        log.info("eliminate-dead-code: removed %d nodes, %d initializers", nodes, initializers)
        return ir.passes.PassResult(model, modified=bool(nodes or initializers))
