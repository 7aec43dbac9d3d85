"""How a fused kernel is recorded on an IR node: the base op plus a chain of elementwise steps.

The fusion pass writes these into `node.meta`; lowering reads them; the runtime applies each
step to the base op's output tile. Keeping the original node names lets reports and opstats
trace a fused kernel back to every ONNX node it covers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

EPILOGUE_KEY = "qpc.epilogue"
BASE_INPUTS_KEY = "qpc.base_inputs"
FUSED_NODES_KEY = "qpc.fused_nodes"


@dataclass(frozen=True)
class EpilogueStep:
    """One elementwise op applied to the running value.

    `inputs` has one entry per input of the step's op: None marks the running value, an int is
    an index into the fused node's inputs (a bias, a residual, Clip bounds), -1 a missing
    optional input.
    """

    op_type: str
    node_name: str
    inputs: tuple[int | None, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    domain: str = ""


def epilogue(node: ir.Node) -> tuple[EpilogueStep, ...]:
    return tuple(node.meta.get(EPILOGUE_KEY, ()))


def base_input_count(node: ir.Node) -> int:
    return int(node.meta.get(BASE_INPUTS_KEY, len(node.inputs)))


def fused_node_names(node: ir.Node) -> tuple[str, ...]:
    names = node.meta.get(FUSED_NODES_KEY)
    if names:
        return tuple(names)
    return (node.name or node.op_type,)
