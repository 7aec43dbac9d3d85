"""Fuse chains of elementwise ops into the kernel that produces their input (epilogues).

Conv -> Add(bias) -> Relu runs as one kernel: the Conv applies each step to its output tile
while it is still in VTCM, instead of a round trip through DDR per op. The fused node keeps
its op type; `compiler_core.fusion` describes how the chain is recorded in `node.meta`.
The result is no longer plain ONNX (the fused node has extra inputs), so this runs last.

A step fuses when (the check; each failure is recorded with its reasons in `refusals`):
- the producer is a node with a registry kernel that is not an alias (Reshape...) and has
  one output, which is not a graph output and has exactly one use;
- that use is an elementwise op (OpDef.elementwise) with one output;
- that use is not itself a fused kernel (it would lose its own epilogue);
- the step's output has the producer output's shape and dtype;
- every other operand has a static shape that broadcasts into that shape.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from compiler_core.fusion import BASE_INPUTS_KEY, EPILOGUE_KEY, FUSED_NODES_KEY, EpilogueStep
from compiler_core.nodeinfo import attribute_value
from compiler_core.ops.registry import QPCFARM_DOMAIN, REGISTRY
from compiler_core.passes.base import (
    GraphPass,
    has_subgraph,
    model_opset,
    replace_value,
    static_dims,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FusionRefusal:
    """Why `consumer` (None: no single consumer) was not fused into `producer`."""

    producer: str
    consumer: str | None
    reasons: tuple[str, ...]


class FuseEpiloguePass(GraphPass):
    name = "fuse-epilogue"

    def __init__(self, opset: int | None = None) -> None:
        super().__init__()
        self.opset = opset
        self.refusals: list[FusionRefusal] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = self.opset or model_opset(model)
        graph = model.graph
        self.refusals = []
        fused = 0
        for producer in list(graph):
            if producer.graph is None:
                continue
            while True:
                consumer, reasons = check_epilogue(producer, opset)
                if consumer is None or reasons:
                    if reasons:
                        self._refuse(producer, consumer, reasons)
                    break
                _fuse(producer, consumer, graph)
                fused += 1
        if fused:
            # A fused node reads the operands of its steps, which may come later in the order.
            graph.sort()
        log.info("fuse-epilogue: fused %d elementwise steps, refused %d", fused, len(self.refusals))
        return ir.passes.PassResult(model, modified=bool(fused))

    def _refuse(self, producer: ir.Node, consumer: ir.Node | None, reasons: list[str]) -> None:
        refusal = FusionRefusal(
            producer=producer.name or producer.op_type,
            consumer=None if consumer is None else consumer.name or consumer.op_type,
            reasons=tuple(reasons),
        )
        self.refusals.append(refusal)
        log.debug(
            "fuse-epilogue: not fusing %s into %s: %s",
            refusal.consumer,
            refusal.producer,
            "; ".join(refusal.reasons),
        )


def check_epilogue(producer: ir.Node, opset: int) -> tuple[ir.Node | None, list[str]]:
    """The elementwise node that can fuse into `producer` next, or why none can.

    Returns (None, []) when there is nothing to consider (no elementwise reader at all).
    """
    if len(producer.outputs) != 1 or producer.op_type == "Constant" or has_subgraph(producer):
        return None, []
    out = producer.outputs[0]
    readers = [use.node for use in out.uses()]
    # A reader inside a subgraph (an If branch...) is not this graph's node: never fused.
    elementwise_readers = [
        node for node in readers if node.graph is producer.graph and _elementwise(node, opset)
    ]
    if not elementwise_readers:
        return None, []
    label = producer.name or producer.op_type
    reasons: list[str] = []
    base = REGISTRY.lookup(producer.op_type, producer.domain, opset)
    if base is None:
        reasons.append(f"{label} ({producer.op_type}) has no kernel")
    elif base.alias:
        reasons.append(f"{label} ({producer.op_type}) is an alias and runs no kernel")
    elif base.unit == "link":
        reasons.append(f"{label} ({producer.op_type}) moves data between devices, computes none")
    elif any(
        i < len(producer.inputs)
        and producer.inputs[i] is not None
        and producer.inputs[i].const_value is not None  # type: ignore[union-attr]
        for i in base.indexed_inputs
    ):
        reasons.append(f"{label} ({producer.op_type}) gathers from a weight: a DMA does it")
    if out.is_graph_output():
        reasons.append(f"output of {label} is a graph output")
    if len(readers) != 1:
        reasons.append(f"output of {label} has {len(readers)} uses")
    consumer = elementwise_readers[0] if len(readers) == 1 else None
    if consumer is None:
        return None, reasons
    if len(consumer.outputs) != 1:
        reasons.append(f"{consumer.op_type} has {len(consumer.outputs)} outputs")
    if EPILOGUE_KEY in consumer.meta:
        # Already a fused kernel: as a step it would lose its own epilogue and extra inputs.
        reasons.append(f"{consumer.op_type} already carries an epilogue")
    step_out = consumer.outputs[0]
    out_dims, step_dims = static_dims(out), static_dims(step_out)
    if out_dims is None or step_dims is None:
        reasons.append("shapes are not static")
    elif step_dims != out_dims:
        reasons.append(f"step output shape {list(step_dims)} differs from {list(out_dims)}")
    if step_out.dtype != out.dtype:
        reasons.append(f"step output dtype {step_out.dtype} differs from {out.dtype}")
    for index, operand in enumerate(consumer.inputs):
        if operand is None or operand is out:
            continue
        dims = static_dims(operand)
        if dims is None:
            reasons.append(f"operand {index} has no static shape")
        elif out_dims is not None and not _broadcasts_into(dims, out_dims):
            reasons.append(f"operand {index} shape {list(dims)} does not broadcast into output")
    return consumer, reasons


INTEGER_STEPS = frozenset({"QAdd", "QMul"})
"""The compiler's own int8 elementwise kernels that run as a step of the kernel before them
(a residual QAdd after a QConv: the sum is formed while the QConv's codes are in VTCM)."""


def _elementwise(node: ir.Node, opset: int) -> bool:
    """Default-domain elementwise ops become epilogue steps (a step is read at the network's
    ai.onnx opset: an ai.onnx.ml Binarizer stays a kernel of its own), and the integer steps."""
    if node.domain == QPCFARM_DOMAIN:
        return node.op_type in INTEGER_STEPS
    if node.domain not in ("", "ai.onnx"):
        return False
    opdef = REGISTRY.lookup(node.op_type, node.domain, opset)
    return opdef is not None and opdef.elementwise


def _broadcasts_into(dims: tuple[int, ...], out_dims: tuple[int, ...]) -> bool:
    if len(dims) > len(out_dims):
        return False
    try:
        return tuple(np.broadcast_shapes(dims, out_dims)) == out_dims
    except ValueError:
        return False


def _fuse(producer: ir.Node, consumer: ir.Node, graph: ir.Graph) -> None:
    out = producer.outputs[0]
    if BASE_INPUTS_KEY not in producer.meta:
        producer.meta[BASE_INPUTS_KEY] = len(producer.inputs)
        producer.meta.setdefault(FUSED_NODES_KEY, (producer.name or producer.op_type,))
        producer.meta[EPILOGUE_KEY] = ()
    step_inputs: list[int | None] = []
    for operand in consumer.inputs:
        if operand is None:
            step_inputs.append(-1)
        elif operand is out:
            step_inputs.append(None)
        else:
            step_inputs.append(_input_index(producer, operand))
    step = EpilogueStep(
        op_type=consumer.op_type,
        node_name=consumer.name or consumer.op_type,
        inputs=tuple(step_inputs),
        attrs={name: attribute_value(attr) for name, attr in consumer.attributes.items()},
        domain=consumer.domain,
    )
    producer.meta[EPILOGUE_KEY] = (*producer.meta[EPILOGUE_KEY], step)
    producer.meta[FUSED_NODES_KEY] = (*producer.meta[FUSED_NODES_KEY], step.node_name)
    step_out = consumer.outputs[0]
    replace_value(step_out, out)
    graph.remove(consumer, safe=True)


def _input_index(producer: ir.Node, operand: ir.Value) -> int:
    """The index of `operand` among the producer's inputs, appending it when absent."""
    for index, value in enumerate(producer.inputs):
        if value is operand:
            return index
    index = len(producer.inputs)
    producer.resize_inputs(index + 1)
    producer.replace_input_with(index, operand)
    return index
