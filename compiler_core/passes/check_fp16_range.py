"""`fp16_range`: name the float16 nodes whose result the compiler cannot keep within +-65504.

Interval bounds (`compiler_core.passes.value_ranges`) over what the compile knows: constants,
and ops whose result is bounded whatever their input (Softmax, Sigmoid, Tanh,
LayerNormalization, a Cast from an 8- or 16-bit integer, a Gather from a constant table),
carried through the ops that follow. Each float16 MatMul, Gemm, Conv, ConvTranspose or
ReduceSum whose result's bound exceeds 65504 is named, with the `-node-precision-info` line
that keeps it in float32. Values fed by float graph inputs have no known range: the run-time
diagnosis covers those. The graph is not changed.
"""

from __future__ import annotations

import logging
from typing import Any

import onnx_ir as ir

from compiler_core.passes.base import GraphPass
from compiler_core.passes.convert_precision import FP16_MAX, NODE_PRECISION_FIX, Fp16Scope
from compiler_core.passes.value_ranges import ValueRanges

log = logging.getLogger(__name__)


class CheckFp16RangePass(GraphPass):
    """Warn `fp16_range` of the float16 nodes in `scope` whose result may pass 65504."""

    name = "check-fp16-range"

    def __init__(self, scope: Fp16Scope) -> None:
        super().__init__()
        self.scope = scope
        self.bounds: dict[str, float] = {}
        """Node -> the bound of its result, for every float16 node checked."""
        self.warnings: list[dict[str, Any]] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        ranges = ValueRanges()
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
