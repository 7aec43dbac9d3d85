"""Reduction-axis (K) splits: a MatMul/Gemm cut along K, with a cross-core reduction.

An output cut (rows, columns) gives each core a part of the output; when the output is small
and K large (a decode step's projection at one row, a classifier head, a tall-skinny Gemm)
it leaves cores idle, or pads a few columns to a whole HMX block on every core. A K split
gives each core a slice of K instead: it reads that slice of the activation and of the
weights and computes a full-size partial product. The program then holds two kernels:

1. `PartialMatMul` (ops/partial_matmul.py): output `[P, *out]`, row p the product of K slice
   p; cut over the slices (and, for P < cores, over the output too). Its output stays in
   the VTCM of the cores that computed it.
2. `ReduceSum` over axis 0, cut over the output (a reduce-scatter): each core receives, by
   NoC copies from every core that holds a slice, the part of every partial it reduces, adds
   them, and applies what the original kernel fused (Gemm's C, bias, activation...).

The chooser (`splits.SplitChooser`) prices a K split beside the output cuts, in the same
units: the slowest core's partial product, the reduction's NoC bytes, the slowest core's
reduction, the operands' transfers and the weights' residency; a kernel takes it only when
that is faster. This module says which kernels may be K-split and into what, and rewrites
the lowered graph for those that were.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from compiler_core.cost_rates import DMA_DESCRIPTOR_CYCLES, HMX_DEPTH, KERNEL_LAUNCH_CYCLES
from compiler_core.lowering.lowered import LKernel, LoweredGraph, LTensor
from compiler_core.lowering.program import KIND_ACTIVATION, EpilogueDesc, KernelDesc
from compiler_core.lowering.tiling import TileSpec, TilingRequest, split_axes
from compiler_core.ops import REGISTRY
from compiler_core.ops.registry import FLOATS, QPCFARM_DOMAIN, NodeInfo

MIN_SLICE = 2 * HMX_DEPTH["fp16"]
"""The least K a slice must have: less and the partial products are mostly padding."""

MARGIN = 1.1
"""A K split's price is its modelled time times this. The per-kernel price cannot see that
the reduction is a barrier (every reducing core waits for every slice, so later kernels
cannot start on a core as soon as its own part is done); measured on BERT-base (4 cores),
K splits that won by 5% per kernel left the network 0.1% slower, so they must win by more.
Heads with few columns win by 20-60%."""

HOP = 2 * (KERNEL_LAUNCH_CYCLES + DMA_DESCRIPTOR_CYCLES)
"""Cycles a K split adds to the critical path beyond its priced work: the reduction's kernel
launch and a copy's descriptor after the last partial, twice for the semaphore round.
Measured: without it, tiny products the per-kernel price put 5% ahead (1x4096x100 on 14
cores: 200 against 210 cycles) came out 10% slower in the program's estimate."""

REDUCE_OPSET = 11
"""ReduceSum with `axes` as an attribute (from opset 13 it is an input)."""


@dataclass(frozen=True)
class KChoice:
    """A K split the chooser picked: the slices and both kernels' tiles, cores assigned."""

    slices: int
    partial: list[TileSpec]
    reduce: list[TileSpec]


def slice_counts(req: TilingRequest, cores: int) -> list[int]:
    """How many K slices a kernel may be cut into (empty: no K split for it).

    MatMul with a 2-D B, or Gemm (C only with beta 1), in a float type, whose output
    rows x slices do not exceed K (the partials then move no more bytes than the activation
    they replace), each slice at least MIN_SLICE deep. Slice counts divide the cores."""
    info = req.info
    if cores < 2 or info.domain not in ("", "ai.onnx") or not split_axes(req):
        return []
    if info.op_type not in ("MatMul", "Gemm") or len(info.out_shapes) != 1:
        return []
    a, b = info.in_shapes[0], info.in_shapes[1]
    if a is None or b is None or len(b) != 2 or len(a) < 2:
        return []
    dtypes = {*info.in_dtypes[:2], info.out_dtypes[0]}
    if len(dtypes) != 1 or not dtypes <= FLOATS:
        return []
    if info.op_type == "Gemm" and info.has_input(2) and float(info.attr("beta", 1.0)) != 1.0:
        return []
    depth = reduction_depth(info)
    rows = math.prod(info.out_shapes[0][:-1])
    return [
        p
        for p in range(2, cores + 1)
        if cores % p == 0 and depth >= MIN_SLICE * p and rows * p <= depth
    ]


def reduction_depth(info: NodeInfo) -> int:
    """K of a MatMul (A's last axis) or a Gemm (transA honoured)."""
    a = info.in_shapes[0]
    assert a is not None
    if info.op_type == "Gemm" and int(info.attr("transA", 0)):
        return int(a[0])
    return int(a[-1])


def partial_info(info: NodeInfo, slices: int) -> NodeInfo:
    """The PartialMatMul node of a K split of `info` into `slices`."""
    attrs: dict[str, object] = {"slices": slices, "base": info.op_type}
    if info.op_type == "Gemm":
        attrs.update(
            transA=int(info.attr("transA", 0)),
            transB=int(info.attr("transB", 0)),
            alpha=float(info.attr("alpha", 1.0)),
        )
    return NodeInfo(
        op_type="PartialMatMul",
        name=f"{info.name}.partial",
        attrs=attrs,
        in_shapes=info.in_shapes[:2],
        in_dtypes=info.in_dtypes[:2],
        out_shapes=((slices, *info.out_shapes[0]),),
        out_dtypes=info.out_dtypes[:1],
        opset=1,
        domain=QPCFARM_DOMAIN,
    )


def reduce_info(info: NodeInfo, slices: int) -> NodeInfo:
    """The ReduceSum node that adds the partials of a K split of `info`."""
    out = info.out_shapes[0]
    return NodeInfo(
        op_type="ReduceSum",
        name=f"{info.name}.reduce",
        attrs={"axes": [0], "keepdims": 0},
        in_shapes=((slices, *out),),
        in_dtypes=info.out_dtypes[:1],
        out_shapes=(out,),
        out_dtypes=info.out_dtypes[:1],
        opset=REDUCE_OPSET,
    )


def _bias_slot(info: NodeInfo) -> int | None:
    """Gemm's C: the original operand that becomes the reduction's first epilogue operand."""
    return 2 if info.op_type == "Gemm" and info.has_input(2) else None


def requests(req: TilingRequest, slices: int) -> tuple[TilingRequest, TilingRequest]:
    """The tiling requests of the partial product and of the reduction."""
    info = req.info
    partial_def = REGISTRY.lookup("PartialMatMul", QPCFARM_DOMAIN, 1)
    reduce_def = REGISTRY.lookup("ReduceSum", "", REDUCE_OPSET)
    assert partial_def is not None and reduce_def is not None
    bias = _bias_slot(info)
    extra_shapes = req.extra_shapes
    extra_dtypes = req.extra_dtypes
    if bias is not None:
        c_shape, c_dtype = info.in_shapes[bias], info.in_dtypes[bias]
        assert c_shape is not None and c_dtype is not None
        extra_shapes, extra_dtypes = (c_shape, *extra_shapes), (c_dtype, *extra_dtypes)
    partial = dataclasses.replace(
        req,
        info=partial_info(info, slices),
        opdef=partial_def,
        extra_shapes=(),
        extra_dtypes=(),
        indexed=frozenset(),
    )
    reduce = dataclasses.replace(
        req,
        info=reduce_info(info, slices),
        opdef=reduce_def,
        extra_shapes=extra_shapes,
        extra_dtypes=extra_dtypes,
        indexed=frozenset(),
    )
    return partial, reduce


def operand_slots(info: NodeInfo, n_operands: int) -> tuple[list[int], list[int]]:
    """For each original operand index: its index among the partial's operands (A, B; -1:
    not read there) and among the reduction's (-1: not read there)."""
    n_base = len(info.in_shapes)
    bias = _bias_slot(info)
    partial = [i if i < 2 else -1 for i in range(n_operands)]
    reduce = [-1] * n_operands
    first_extra = 1
    if bias is not None:
        reduce[bias] = 1
        first_extra = 2
    for i in range(n_base, n_operands):
        reduce[i] = first_extra + i - n_base
    return partial, reduce


def as_kernel_operands(
    info: NodeInfo, n_operands: int, partial: list[TileSpec], reduce: list[TileSpec]
) -> list[TileSpec]:
    """Both kernels' tiles with their operand boxes at the original kernel's operand indices
    (None where a kernel does not read that operand): what the chooser prices transfers and
    resident weights from."""
    to_partial, to_reduce = operand_slots(info, n_operands)
    out: list[TileSpec] = []
    for tiles, slots in ((partial, to_partial), (reduce, to_reduce)):
        for t in tiles:
            boxes = tuple(t.in_boxes[s] if s >= 0 else None for s in slots)
            out.append(TileSpec(t.out_box, boxes, t.working_set, t.core))
    return out


def reduction_bytes(
    partial: list[TileSpec], reduce: list[TileSpec], itemsize: int
) -> tuple[int, int]:
    """(bytes, pieces) the reduction's cores receive: of each partial box a reduction tile
    reads, what its own core did not compute (one array comparison: the chooser asks this
    for every cut of the reduction it tries)."""
    if not partial or not reduce:
        return 0, 0
    held = np.array([t.out_box for t in partial], dtype=np.int64)
    wanted = np.array([t.in_boxes[0] for t in reduce], dtype=np.int64)
    lo = np.maximum(held[None, :, :, 0], wanted[:, None, :, 0])
    hi = np.minimum(held[None, :, :, 1], wanted[:, None, :, 1])
    overlap = np.prod(np.clip(hi - lo, 0, None), axis=2)
    remote = np.array([t.core for t in reduce])[:, None] != np.array([t.core for t in partial])
    moved = overlap * remote
    return int(moved.sum()) * itemsize, int(np.count_nonzero(moved))


def apply(graph: LoweredGraph, chosen: dict[int, KChoice]) -> None:
    """Replace every K-split kernel by its partial product and its reduction, in place."""
    if not chosen:
        return
    kernels: list[LKernel] = []
    for index, lk in enumerate(graph.kernels):
        choice = chosen.get(index)
        if choice is None:
            kernels.append(lk)
            continue
        assert lk.request is not None
        desc = lk.desc
        info = desc.info
        out = graph.tensors[desc.outputs[0]]
        partial_tid = len(graph.tensors)
        graph.tensors.append(
            LTensor(
                id=partial_tid,
                name=f"{out.name}.partials",
                dtype=out.dtype,
                shape=(choice.slices, *out.shape),
                kind=KIND_ACTIVATION,
            )
        )
        p_req, r_req = requests(lk.request, choice.slices)
        n_base = len(info.in_shapes)
        bias = _bias_slot(info)
        _, to_reduce = operand_slots(info, len(desc.inputs))
        steps: list[EpilogueDesc] = []
        if bias is not None:
            steps.append(
                EpilogueDesc(
                    op_type="Add",
                    node_name=desc.nodes[0],
                    inputs=(None, 1),
                    attrs={},
                    opset=14,
                    out_dtype=info.out_dtypes[0],
                )
            )
        for step in desc.epilogue:
            refs = tuple(r if r is None or r < 0 else to_reduce[r] for r in step.inputs)
            steps.append(dataclasses.replace(step, inputs=refs))
        reduce_inputs = (
            partial_tid,
            *(() if bias is None else (desc.inputs[bias],)),
            *desc.inputs[n_base:],
        )
        out_elems = math.prod(out.shape)
        kernels.append(
            LKernel(
                desc=KernelDesc(
                    id=0,
                    name=p_req.info.name,
                    info=p_req.info,
                    inputs=desc.inputs[:2],
                    outputs=(partial_tid,),
                    epilogue=(),
                    kernel="partial_matmul",
                    unit="hmx",
                    macs=int(REGISTRY.lookup("PartialMatMul", QPCFARM_DOMAIN, 1).macs(p_req.info)),  # type: ignore[union-attr]
                    nodes=desc.nodes[:1],
                    op_types=desc.op_types[:1],
                ),
                tiles=choice.partial,
                request=p_req,
            )
        )
        kernels.append(
            LKernel(
                desc=KernelDesc(
                    id=0,
                    name=r_req.info.name,
                    info=r_req.info,
                    inputs=reduce_inputs,
                    outputs=desc.outputs,
                    epilogue=tuple(steps),
                    kernel="reducesum",
                    unit="hvx",
                    macs=choice.slices * out_elems + out_elems * len(steps),
                    nodes=desc.nodes,
                    op_types=("ReduceSum", *desc.op_types[1:]),
                ),
                tiles=choice.reduce,
                request=r_req,
            )
        )
    for index, lk in enumerate(kernels):
        if lk.desc.id != index:
            lk.desc = dataclasses.replace(lk.desc, id=index)
    graph.kernels = kernels
