"""Tiles of one product that multiply the same activation by parts of one constant weight,
computed as one product.

A matrix kernel split over cores along its weight repeats its activation in every tile:
BERT-base's projections on 14 cores are 14 products of the same all-gathered (128, 768)
activation by 55 columns of one weight each, a channel-split Conv convolves the same input
rows with each core's output channels (and builds the same windows each time). Column
slices of a weight make BLAS stride through it, so 14 thin products take up to 1.6x the
time of the one they form. So the first tile of such a group to run computes the product
of the whole group, from its own activation and the weight's union box, keeps a copy of
that activation, and a later tile of the group takes its part of that product when, at its
own turn:

- each constant operand it is handed is the constant itself, in place (the view a deferred
  load gives: same address, shape and strides as that box of the constant tensor), and
- each other operand holds the same bytes as the copy kept (so a tile that reads bytes a
  missing semaphore wait left stale or unwritten computes with those, alone), and
- its weight rows are not all equal (the kernels compute one row of such a weight and
  repeat it; see `uniform_rows`).

Otherwise it computes alone, as before. The part must be the same numbers as the tile's
own product. For large products it is (numpy's OpenBLAS sums an output over the same
operand values in the same order whatever the product's other rows or columns), for small
ones not always (OpenBLAS's small-matrix kernels sum in another order). So the first time
each tile of a group takes its part in a session, it also computes its own product, and a
single bit of difference turns the group off for the session: every tile then computes
alone. Which kernel BLAS picks depends on the shapes, not on the values. Nothing here moves
VTCM or DDR bytes, so the byte counts are the instructions', as before.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compiler_core.lowering.program import (
    KIND_CONSTANT,
    DmaLoad,
    Operand,
    Program,
    RunKernel,
    cores_in,
)
from compiler_core.ops.conv import uniform_rows
from compiler_core.ops.registry import Box, NodeInfo, OpDef, TileCtx, box_shape

Results = list[np.ndarray]
Compute = Callable[[NodeInfo, list[np.ndarray | None], TileCtx], Results]

Expected = tuple[int, int, tuple[int, ...], tuple[int, ...], np.dtype]

_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True, eq=False)
class RunTile(TileCtx):
    """A tile the runtime keeps for the session (an instruction's, a shared group's, a join
    member's): a kernel may keep in `kept` what it works out of the tile and its input
    arrays once (ops/conv.py `_conv_tile`), instead of at every inference. A tile made for
    one call is a plain TileCtx, and nothing is kept for it."""

    kept: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def _uniform_weight(op_type: str, inputs: Sequence[np.ndarray | None]) -> bool:
    """Whether the kernel would take its one-row shortcut for this tile's weight."""
    w = inputs[1]
    if w is None:
        return True
    if op_type == "MatMul":
        return w.ndim == 2 and uniform_rows(w.T)
    return uniform_rows(w.reshape(len(w), -1)) if w.ndim else True


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _bits(a: np.ndarray) -> np.ndarray | None:
    """`a` as unsigned integers of its item size (bytes compare, -0.0 and NaNs included),
    or None when it cannot be seen so without a copy."""
    kind = _BITS.get(a.dtype.itemsize)
    if kind is None or a.dtype.kind not in "fiub":
        return None
    try:
        return a.view(kind)
    except ValueError:  # a last axis that is not contiguous
        return None


def _same_bytes(a: np.ndarray | None, kept: np.ndarray | None) -> bool:
    if a is None or kept is None:
        return a is None and kept is None
    if a.shape != kept.shape or a.dtype != kept.dtype:
        return False
    x: np.ndarray | None
    y: np.ndarray | None
    if a.flags.c_contiguous and kept.flags.c_contiguous and a.nbytes % 8 == 0:
        # the same bytes, compared eight at a time
        x, y = a.reshape(-1).view(np.uint64), kept.reshape(-1).view(np.uint64)
    else:
        x, y = _bits(a), _bits(kept)
    return x is not None and y is not None and bool((x == y).all())


def _keep(a: np.ndarray, old: np.ndarray | None) -> np.ndarray:
    """A copy of `a`, in `old` (the previous inference's copy) when it has the same shape."""
    if old is None or old.shape != a.shape or old.dtype != a.dtype:
        return np.array(a)
    np.copyto(old, a)
    return old


@dataclass
class Group:
    """The tiles of one kernel that read the same boxes of its activations."""

    op_type: str
    info: NodeInfo
    compute: Compute
    constant: tuple[int, ...]
    """Positions of the base inputs that are constant tensors."""
    union: list[np.ndarray | None]
    """The base inputs of the whole group's product: constants' union boxes (views of the
    constant tensors), None where the activation goes."""
    tile: TileCtx
    out_box: Box
    inference: int = -1
    """The inference whose product `results` holds (-1: none yet)."""
    kept: list[np.ndarray | None] = field(default_factory=list)
    results: Results = field(default_factory=list)
    taken: int = 0
    """Tiles that took their part of a group product (the first of each included)."""
    off: bool = False
    """A tile's part differed from its own product: every tile computes alone."""


@dataclass
class SharedTile:
    """One tile's place in its group: where its constants must be and its part of the
    group's outputs."""

    group: Group
    expected: tuple[Expected, ...]
    """Per constant input: (position, address, shape, strides, dtype) of the constant in
    place."""
    part: tuple[slice, ...]
    tile: TileCtx
    """The tile's own place, to compute its product alone."""
    checked: bool = False
    """Its part was once compared with its own product, bit for bit, and was equal."""
    seen: list[np.ndarray | None] = field(default_factory=list)
    """Per constant input, the last array found to be the constant in place: the same
    object again is that constant (a view's address, shape, strides and dtype are fixed;
    the runtime hands the same view while the same load or resident buffer stands for it)."""
    uniform: bool | None = None
    """Whether its weight, found in place, has all rows equal (None: not known yet). The
    constant in place cannot change, so this is worked out once."""

    def results(self, inputs: list[np.ndarray | None], inference: int) -> Results | None:
        """This tile's outputs from the group's product, or None (it computes alone)."""
        if not constants_in_place(self.seen, self.expected, inputs):
            return None
        group = self.group
        if group.off:
            return None
        uniform = self.uniform
        if uniform is None:
            uniform = _uniform_weight(group.op_type, inputs)
            if 1 in group.constant:  # the weight is the constant in place
                self.uniform = uniform
        if uniform:
            return None
        if group.inference != inference:
            previous = group.kept or [None] * len(inputs)
            kept = [
                None if p in group.constant or a is None else _keep(a, previous[p])
                for p, a in enumerate(inputs)
            ]
            union = [kept[p] if c is None else c for p, c in enumerate(group.union)]
            results = [np.asarray(r) for r in group.compute(group.info, union, group.tile)]
            for r in results:
                r.flags.writeable = False
            group.kept, group.results, group.inference = kept, results, inference
        else:
            for p, a in enumerate(inputs):
                if p not in group.constant and not _same_bytes(a, group.kept[p]):
                    return None
        parts = [r[self.part] for r in group.results]
        if not self.checked:
            own = [np.asarray(r) for r in group.compute(group.info, inputs, self.tile)]
            if len(own) != len(parts) or not all(map(_same_bytes, own, parts)):
                group.off = True
                return own
            self.checked = True
        group.taken += 1
        return parts


def _disjoint(a: Box, b: Box) -> bool:
    return any(a1 <= b0 or b1 <= a0 for (a0, a1), (b0, b1) in zip(a, b, strict=True))


def _volume(box: Box) -> int:
    return int(np.prod(box_shape(box), dtype=np.int64))


def _resident(program: Program) -> list[dict[int, tuple[int, int, Box]]]:
    """Per core, the resident buffers activation filled with a whole constant box, by VTCM
    start: (end, tensor, box). Inferences cannot write them (the runtime faults)."""
    found: list[dict[int, tuple[int, int, Box]]] = [{} for _ in range(program.num_cores)]
    for stream in program.setup:
        for instr in stream:
            if not isinstance(instr, DmaLoad):
                continue
            t = program.tensors[instr.tensor]
            end = instr.vtcm + _volume(instr.buf_box) * np.dtype(t.dtype).itemsize
            for core in cores_in(instr.cores):
                if core >= program.num_cores:
                    continue
                held = found[core]
                for start in [s for s, (e, _, _) in held.items() if s < end and instr.vtcm < e]:
                    del held[start]
                if t.kind == KIND_CONSTANT and instr.box == instr.buf_box:
                    held[instr.vtcm] = (end, instr.tensor, instr.box)
    return found


InPlace = Callable[[int, int, Operand], np.ndarray]


def in_place_views(
    program: Program,
    constant_view: Callable[[int, Box], np.ndarray],
    vtcm_view: Callable[[int, int, Box, Box, str], np.ndarray],
) -> InPlace:
    """`in_place(core, tensor, operand)`: the operand as the kernel gets it when it holds
    that box of the constant: the resident VTCM activation filled with it, else the
    constant (a deferred load's)."""
    tensors = program.tensors
    resident = _resident(program)

    def in_place(core: int, tensor: int, operand: Operand) -> np.ndarray:
        piece = operand.pieces[0]
        held = resident[core].get(piece.vtcm)
        if len(operand.pieces) == 1 and held is not None and held[1:] == (tensor, piece.box):
            dtype = tensors[tensor].dtype
            end = piece.vtcm + _volume(piece.box) * np.dtype(dtype).itemsize
            if held[0] == end <= program.resident:
                return vtcm_view(core, piece.vtcm, piece.box, operand.box, dtype)
        return constant_view(tensor, operand.box)

    return in_place


def expected_in_place(view: np.ndarray, position: int) -> Expected:
    """What a constant operand handed in place looks like (see `SharedTile.expected`)."""
    return (position, _address(view), view.shape, view.strides, view.dtype)


def is_in_place(a: np.ndarray | None, expected: Expected) -> bool:
    """Whether `a` is the view `expected` describes (the constant still where it was)."""
    _, address, shape, strides, dtype = expected
    return (
        a is not None
        and a.shape == shape
        and a.strides == strides
        and a.dtype == dtype
        and _address(a) == address
    )


def constants_in_place(
    seen: list[np.ndarray | None],
    expected: Sequence[Expected],
    inputs: Sequence[np.ndarray | None],
) -> bool:
    """Whether each constant input of a tile is the constant in place (`expected`), the
    same object as last time (`seen`, per constant, updated) counting as in place without
    comparing again."""
    if not seen:
        seen.extend([None] * len(expected))
    for i, want in enumerate(expected):
        a = inputs[want[0]]
        if a is not None and a is seen[i]:
            continue
        if not is_in_place(a, want):
            return False
        seen[i] = a
    return True


def plan(
    program: Program,
    kernels: Sequence[tuple[OpDef, NodeInfo]],
    constant_view: Callable[[int, Box], np.ndarray],
    vtcm_view: Callable[[int, int, Box, Box, str], np.ndarray],
) -> dict[tuple[int, int], SharedTile]:
    """The tiles that share products, by (core, position in the core's stream).

    `kernels`: each kernel's op and node; `constant_view(tensor, box)`: that box of a
    constant tensor as the kernels' deferred loads hand it (read-only, in place);
    `vtcm_view(core, offset, buffer box, box, dtype)`: a box of a VTCM buffer. Called after
    activation: a weight activation loaded is read where it lies, in the resident VTCM."""
    tensors = program.tensors
    in_place = in_place_views(program, constant_view, vtcm_view)

    candidates: dict[tuple[int, tuple[Box | None, ...]], list[tuple[int, int, RunKernel]]]
    candidates = defaultdict(list)
    for core, stream in enumerate(program.streams):
        for index, instr in enumerate(stream):
            if not isinstance(instr, RunKernel) or not 0 <= instr.kernel < len(kernels):
                continue
            opdef, info = kernels[instr.kernel]
            if opdef.op_type not in ("MatMul", "Conv") or len(info.out_shapes) != 1:
                continue
            if opdef.op_type == "Conv" and int(info.attr("group", 1)) != 1:
                continue
            desc = program.kernels[instr.kernel]
            n_base = len(info.in_shapes)
            if len(instr.inputs) < n_base or len(instr.outputs) != 1:
                continue
            inputs = instr.inputs[:n_base]
            if any(op is None for op in inputs[:2]):
                continue
            key_boxes = tuple(
                None if op is None or tensors[desc.inputs[p]].kind == KIND_CONSTANT else op.box
                for p, op in enumerate(inputs)
            )
            candidates[(instr.kernel, key_boxes)].append((core, index, instr))
    shared: dict[tuple[int, int], SharedTile] = {}
    for (kernel, key_boxes), tiles in candidates.items():
        if len(tiles) < 2:
            continue
        opdef, info = kernels[kernel]
        desc = program.kernels[kernel]
        n_base = len(info.in_shapes)
        boxes = [t[2].out_box for t in tiles]
        union_out: Box = tuple(
            (min(b[a][0] for b in boxes), max(b[a][1] for b in boxes)) for a in range(len(boxes[0]))
        )
        if sum(_volume(b) for b in boxes) != _volume(union_out) or not all(
            _disjoint(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :]
        ):
            continue
        union_in = [*opdef.input_boxes(info, union_out), *[None] * n_base][:n_base]
        given = [None if op is None else op.box for op in tiles[0][2].inputs[:n_base]]
        if any(union_in[p] != key_boxes[p] for p in range(n_base) if key_boxes[p] is not None):
            continue
        if any(
            [*opdef.input_boxes(info, instr.out_box), *[None] * n_base][:n_base]
            != [None if op is None else op.box for op in instr.inputs[:n_base]]
            for _, _, instr in tiles
        ):
            continue
        constant = tuple(p for p in range(n_base) if key_boxes[p] is None and given[p] is not None)
        union: list[np.ndarray | None] = [None] * n_base
        for p in constant:
            box = union_in[p]
            assert box is not None
            union[p] = constant_view(desc.inputs[p], box)
        group = Group(
            op_type=opdef.op_type,
            info=info,
            compute=opdef.compute,
            constant=constant,
            union=union,
            tile=RunTile(out_box=union_out, in_boxes=tuple(union_in[:n_base])),
            out_box=union_out,
        )
        for core, index, instr in tiles:
            expected: list[Expected] = []
            for p in constant:
                operand = instr.inputs[p]
                assert operand is not None
                view = in_place(core, desc.inputs[p], operand)
                expected.append((p, _address(view), view.shape, view.strides, view.dtype))
            part = tuple(
                slice(a - u, b - u) for (a, b), (u, _) in zip(instr.out_box, union_out, strict=True)
            )
            tile = RunTile(
                out_box=instr.out_box,
                in_boxes=tuple(None if op is None else op.box for op in instr.inputs[:n_base]),
            )
            shared[(core, index)] = SharedTile(group, tuple(expected), part, tile)
    return shared
