"""Optional values: OptionalHasElement and OptionalGetElement (opset 15; tensors from 18).

A compiled network has no optional or sequence types at its boundary, so an optional here is
either a tensor (present) or a missing input (absent): whether it holds an element is known
from the node's wiring, and getting the element of a tensor is the tensor itself.
"""

from __future__ import annotations

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.registry import ALL, NodeInfo, TileCtx, register

Array = np.ndarray


def has_element_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    present = node.has_input(0) and bool(inputs) and inputs[0] is not None
    return [np.array(present)]


def get_element_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    if not node.has_input(0) or not inputs or inputs[0] is None:
        raise CompileError(
            "invalid_model", "OptionalGetElement of an empty optional", node=node.name
        )
    return [inputs[0]]


register(
    "OptionalHasElement",
    has_element_compute,
    since=15,
    dtypes=ALL,
    kernel="optional_has_element",
    macs=lambda node: 1,
    doc="True for a tensor input, False for a missing one (no optional types at run time).",
)
register(
    "OptionalGetElement",
    get_element_compute,
    since=15,
    dtypes=ALL,
    kernel="identity",
    alias=True,
    macs=lambda node: 0,
    doc="The tensor itself; an empty optional is an invalid model.",
)
