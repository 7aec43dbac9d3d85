"""AllGather (qpcfarm domain): the parts every device of a tensor-sliced partition holds,
concatenated along `axis` in device order, on every device.

Inserted by multi-device partitioning (compiler_core/mdp/shard.py), never written by users.
It is not a kernel: lowering makes it link transfers (`LINK_KERNEL`): the device sends its
part to every peer (and to itself) over the partition's links and waits until all `devices`
parts have landed. The transfers read and write DDR only (`ddr_to_ddr`): no VTCM budget
bounds them, so a 1024-token prefill's gather of a 7 B decoder fits as well as one token's.
An all-reduce is an AllGather along a new leading axis followed by a
ReduceSum over it, summed in device order, so every device computes bit-identical sums.
"""

from __future__ import annotations

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.lowering.program import LINK_KERNEL
from compiler_core.ops.registry import ALL, QPCFARM_DOMAIN, NodeInfo, TileCtx, register


def gather_axis(node: NodeInfo) -> int:
    rank = len(node.out_shapes[0])
    return int(node.attr("axis", 0)) % max(rank, 1)


def _compute(node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx) -> list[np.ndarray]:
    raise CompileError(
        "runtime_fault",
        f"AllGather {node.name} moves data between devices: it runs as link transfers, "
        "not as a kernel on one device",
        node=node.name,
    )


register(
    "AllGather",
    _compute,
    domain=QPCFARM_DOMAIN,
    dtypes=ALL,
    kernel=LINK_KERNEL,
    unit="link",
    ddr_to_ddr=True,
    macs=lambda node: 0,
    doc="Internal (multi-device partitioning): every device's part, concatenated in device "
    "order, on every device; runs as link transfers.",
)
