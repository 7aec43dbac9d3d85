"""The lowered graph: tensors and kernels with tiles on cores, before memory is placed.

What `lower.py` produces and every later stage reads (the split choice, depth-first grouping,
memory planning, placement, emission and the metrics); its own module so that the stages that
rewrite it (`ksplit`, `depth_first`) need not import the lowering that builds it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from compiler_core.lowering.program import KernelDesc
from compiler_core.lowering.tiling import TileSpec, TilingRequest


@dataclass
class LTensor:
    id: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str
    alias_of: int | None = None
    data: ir.TensorProtocol | None = None
    alias_offset: int = 0
    """Bytes into `alias_of` where this tensor starts: non-zero only for one image group's
    view of a graph input or output (see `depth_first`); a reinterpretation starts at 0."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


class Mxint8Tensor(LTensor):
    """Retained state stored as MXINT8 blocks along its last axis (compiler_core/mxint8.py):
    its DDR size is the stored size; loads and stores move stored bytes."""

    @property
    def nbytes(self) -> int:
        from compiler_core.mxint8 import mxint8_nbytes

        return mxint8_nbytes(self.shape)


@functools.cache
def _itemsize(dtype: str) -> int:
    return int(np.dtype(dtype).itemsize)


@dataclass
class LKernel:
    desc: KernelDesc
    tiles: list[TileSpec]
    request: TilingRequest | None = None
    layer: int = -1
    """The kernel this one is an image group's clone of (see `depth_first`): clones of a
    layer share its resident weights. -1: the kernel is its own layer."""


@dataclass
class LoweredGraph:
    tensors: list[LTensor]
    kernels: list[LKernel]
    inputs: list[int]
    outputs: list[int]
    num_cores: int
    network_name: str
    warnings: list[dict[str, object]] = field(default_factory=list)
    retained: dict[int, int] = field(default_factory=dict)
    """-retained-state: each retained input -> the `<input>_RetainedState` output that feeds
    it. They are one device buffer: the output aliases the input when a scatter writes it in
    place, else a device copy kernel at the end writes the output into the input."""

    def root(self, tensor_id: int) -> int:
        t = self.tensors[tensor_id]
        while t.alias_of is not None:
            t = self.tensors[t.alias_of]
        return t.id

    def offset_in_root(self, tensor_id: int) -> int:
        """Where a tensor's bytes start inside its root's (non-zero for group views)."""
        t = self.tensors[tensor_id]
        offset = 0
        while t.alias_of is not None:
            offset += t.alias_offset
            t = self.tensors[t.alias_of]
        return offset

    def layer(self, kernel: int) -> int:
        """The layer whose resident weights kernel `kernel` reads (itself unless a clone)."""
        layer = self.kernels[kernel].layer
        return kernel if layer < 0 else layer
