"""Row bands of one conv or MatMul computed as one product, at the first turn their inputs
are final.

On 14 cores a conv is split into row bands (and output-channel halves), one tile per core,
each read from its own core's VTCM. Cores run in turn, so a band's tile runs at its core's
turn, with a thin product (ResNet-50's layer 3: 28 output positions per band, half the
speed BLAS reaches on a whole layer). Often a later band's input is already final when an
earlier band's tile runs: that tile can compute the product of both, and the later tile
takes its part, provided that at its own turn its input holds the bytes the product used.

Which bands join at which turn is learned: the cores' order of turns is the same in every
inference (it depends on the program, not on the data). The session's first inference
records it; in the second, at each tile's turn, the inputs of the tiles after it are read
and kept where they changed since the last read, and each tile joins the product of the
turn since which its input has held its bytes (a rolling join: that turn's tile may itself
take its part of an earlier product), or else computes its own; the joins apply from the
third inference on. A 1x1 conv at stride 1 reads its bands straight into the product's
matrix (its columns are its input), and the tiles compare their inputs with those.

A MatMul by a constant matrix split into row bands (BERT-base's attention output projection
on 14 cores: 7 bands of 18 or 19 rows, each by two column halves; its feed-forward output:
2 bands of 64 rows) joins the same way: the bands' input rows are read straight into the
rows of one left matrix, multiplied by the weight columns of all the joined tiles (one
product of 128 rows instead of 7 thin ones, each of which packed the whole weight again).

A tile in a join still compares its input with the one the product used, at its own turn,
and computes alone (or in its shared product) when they differ, so a missing semaphore
wait still shows; its constants must be in place, as for shared
products (runtime/shared.py), and the first time it takes its part it also computes its
own product, one bit of difference turning the conv's joins off for the session.
Nothing here moves VTCM or DDR bytes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from compiler_core.lowering.program import KIND_CONSTANT, Operand, Program, RunKernel
from compiler_core.ops.conv import conv_columns_into, uniform_rows
from compiler_core.ops.registry import Box, NodeInfo, OpDef, TileCtx, box_shape
from compiler_core.runtime.shared import (
    Compute,
    Expected,
    RunTile,
    SharedTile,
    _same_bytes,
    constants_in_place,
    expected_in_place,
    in_place_views,
)

THIN = 100
"""Output positions of a band up to which joining pays (ResNet-50 on 14 cores, thread CPU
per conv shape, joins of every width against none, 3 runs): layer 3's 28-position bands
gain up to 25% (the 3x3 convs 36-39 -> 26-31 ms), where BLAS runs thin bands well under
its whole-layer speed; layer 2's 112-position bands are even (-2.6 to +2.0 ms of about
55), layer 1's 224-448-position bands lose 5-40%: the copies and compares a join adds,
and a product matrix that leaves the L2 cache, cost more than the larger product saves."""


@dataclass
class Member:
    """One tile of a joined conv."""

    core: int
    out_box: Box
    x_box: Box
    read: Callable[[np.ndarray | None], np.ndarray]
    """A copy of its input as its core's VTCM holds it now (read at another tile's turn),
    into the array given (of the input's shape) or a new one."""
    expected: tuple[Expected, ...]
    tile: TileCtx
    fallback: SharedTile | None
    """Its shared product (channel halves of one band), when it does not join."""
    checked: bool = False
    seen: list[np.ndarray | None] = field(default_factory=list)
    """Per constant input, the last array found to be the constant in place (as
    `SharedTile.seen`: the same object again is that constant)."""


@dataclass
class Join:
    """The tiles of one conv, and what the session learned of their turns."""

    info: NodeInfo
    compute: Compute
    weight: np.ndarray
    """The whole weight (the constant, read-only), as (output channels, C * taps)."""
    bias: np.ndarray | None
    members: list[Member]
    pointwise: bool
    """A 1x1 conv at stride 1 whose bands read their own positions: a band's columns are
    its input, read straight into the product's matrix."""
    matmul: bool = False
    """A MatMul by a constant matrix (`weight`: K x N): its bands are rows of its input,
    read straight into the rows of the product's left matrix."""
    order: list[int] = field(default_factory=list)
    """Members by turn, as the first inference ran them."""
    ordered: bool = False
    joins: dict[int, int] = field(default_factory=dict)
    """Member -> the turn whose product it takes its part of (learned)."""
    learning: bool = False
    """This inference learns the joins (the session's second: the first records the order)."""
    done: bool = False
    """The joins were learned (or are being learned)."""
    learned: dict[int, int] = field(default_factory=dict)
    """Joins learned in this inference, used from the next."""
    batches: dict[int, list[int]] = field(default_factory=dict)
    """Turn -> the members whose product it computes (its own tile first if it is one)."""
    batched: tuple[object, ...] = ()
    """The order and joins (a copy) `batches` was worked out from."""
    copies: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)
    """While learning: member -> its input as last read, and the first turn it was so."""
    inference: int = -1
    turn: int = 0
    parts: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """This inference's joined outputs, by member, with the input its product read."""
    off: bool = False
    taken: int = 0


@dataclass
class JoinTile:
    """A conv tile that may take its part of a joined product (`results`, as SharedTile)."""

    join: Join
    member: int

    def results(self, inputs: list[np.ndarray | None], inference: int) -> list[np.ndarray] | None:
        join, m = self.join, self.member
        member = join.members[m]
        fallback = member.fallback
        if join.off:
            return None if fallback is None else fallback.results(inputs, inference)
        if join.inference != inference:
            _begin(join, inference)
        turn = join.turn
        join.turn += 1
        if not join.ordered:
            join.order.append(m)
            join.ordered = len(join.order) == len(join.members)
        elif join.order[turn] != m:  # not the order learned: no joins in this session
            join.off = True
            return None if fallback is None else fallback.results(inputs, inference)
        x = inputs[0]
        if join.learning and x is not None:
            _learn(join, m, turn, x)
        if x is None or not constants_in_place(member.seen, member.expected, inputs):
            return None
        batch = join.batches.get(turn)
        if batch is not None:
            _compute(join, batch, m, x)
        joined = join.parts.pop(m, None)
        if joined is None:
            return None if fallback is None else fallback.results(inputs, inference)
        part, kept = joined
        if kept is not x and not _same_bytes(x, kept):
            return None if fallback is None else fallback.results(inputs, inference)
        if not member.checked:
            own = np.asarray(join.compute(join.info, inputs, member.tile)[0])
            if not _same_bytes(own, part):
                join.off = True
                return [own]
            member.checked = True
        join.taken += 1
        return [part]


def _learn(join: Join, m: int, turn: int, x: np.ndarray) -> None:
    """The learning inference, at member `m`'s turn: it joins the product of the earliest
    turn since which its input has held the bytes it holds now (a rolling join: any
    earlier tile's turn, not only a leading one's); if none, it computes its own. The
    inputs of the tiles after it are read now, and kept where they changed."""
    seen = join.copies.pop(m, None)
    if seen is not None and _same_bytes(x, seen[1]):
        join.learned[m] = seen[0]
    for later in join.order[turn + 1 :]:
        now = join.members[later].read(None)
        copy = join.copies.get(later)
        if copy is None or not _same_bytes(now, copy[1]):
            join.copies[later] = (turn, now)


def _begin(join: Join, inference: int) -> None:
    """A new inference: the second of the session learns the joins, the later ones use them."""
    if not join.ordered:  # the last inference did not finish: record the order again
        join.order.clear()
    elif join.learning:
        join.joins = dict(join.learned)
        join.learning = False
    elif not join.done:
        join.learning = join.done = True
    order = tuple(join.order)
    if join.batched != (order, join.joins):  # `_batches`' inputs changed
        join.batches, join.batched = _batches(join), (order, dict(join.joins))
    join.copies.clear()
    join.parts.clear()
    join.inference, join.turn = inference, 0


def _batches(join: Join) -> dict[int, list[int]]:
    """Turn -> the members computed at it: those joined to it, after its own tile unless
    that one takes its part of an earlier turn's product."""
    found: dict[int, list[int]] = defaultdict(list)
    for m, turn in sorted(join.joins.items()):
        found[turn].append(m)
    for turn, batch in found.items():
        if turn < len(join.order) and join.order[turn] not in join.joins:
            batch.insert(0, join.order[turn])
    return dict(found)


def _compute(join: Join, batch: list[int], m: int, own: np.ndarray) -> None:
    """The product of the bands of `batch` (member `m`, the running tile, reads `own`; the
    others read their cores' VTCM as it is now), each member's part kept with its input."""
    if join.matmul:
        _matmul_product(join, batch, m, own)
        return
    members = join.members
    bands: dict[tuple[Box, Box], tuple[int, int, np.ndarray]] = {}
    width = 0
    for n in batch:
        key = (members[n].x_box, members[n].out_box[2:])
        if key not in bands:
            count = math.prod(box_shape(key[1]))
            bands[key] = (width, count, own)
            width += count
    columns = np.empty((join.weight.shape[1], width), dtype=np.float32)
    done = set()
    for n in batch:
        member = members[n]
        key = (member.x_box, member.out_box[2:])
        if key in done:
            continue
        done.add(key)
        start, count, _ = bands[key]
        into = columns[:, start : start + count]
        if join.pointwise:  # the columns are the input: read it there, kept there
            x = np.reshape(into, box_shape(member.x_box), copy=False)
            if n == m:
                np.copyto(x, own)
            else:
                member.read(x)
            bands[key] = (start, count, own if n == m else x)
        else:
            x = own if n == m else member.read(None)
            bands[key] = (start, count, x)
            conv_columns_into(join.info, x, member.tile, into)
    lo = min(members[n].out_box[1][0] for n in batch)
    hi = max(members[n].out_box[1][1] for n in batch)
    y = np.matmul(join.weight[lo:hi], columns)
    if join.bias is not None:
        np.add(y, join.bias[lo:hi, None], out=y)
    y.flags.writeable = False
    snapshot: np.ndarray | None = None
    for n in batch:
        member = members[n]
        start, count, x = bands[(member.x_box, member.out_box[2:])]
        if x is own and n != m:  # another tile compares with `own` later: keep its bytes
            snapshot = np.array(own) if snapshot is None else snapshot
            x = snapshot
        (c0, c1), spatial = member.out_box[1], box_shape(member.out_box[2:])
        part = y[c0 - lo : c1 - lo, start : start + count].reshape((1, c1 - c0, *spatial))
        join.parts[n] = (part, x)


def _matmul_product(join: Join, batch: list[int], m: int, own: np.ndarray) -> None:
    """`_compute` for a MatMul: the bands' inputs (rows of the whole input) stacked into one
    left matrix, multiplied by the weight columns of all their tiles."""
    members = join.members
    bands: dict[Box, tuple[int, int, np.ndarray]] = {}
    rows = 0
    for n in batch:
        key = members[n].x_box
        if key not in bands:
            count = box_shape(key)[-2]
            bands[key] = (rows, count, own)
            rows += count
    matrix = np.empty((rows, join.weight.shape[0]), dtype=np.float32)
    done = set()
    for n in batch:
        member = members[n]
        if member.x_box in done:  # a band of several tiles: read once
            continue
        done.add(member.x_box)
        start, count, _ = bands[member.x_box]
        x = np.reshape(matrix[start : start + count], box_shape(member.x_box), copy=False)
        if n == m:
            np.copyto(x, own)
        else:
            member.read(x)
        bands[member.x_box] = (start, count, own if n == m else x)
    lo = min(members[n].out_box[-1][0] for n in batch)
    hi = max(members[n].out_box[-1][1] for n in batch)
    y = np.matmul(matrix, join.weight[:, lo:hi])
    y.flags.writeable = False
    snapshot: np.ndarray | None = None
    for n in batch:
        member = members[n]
        start, count, x = bands[member.x_box]
        if x is own and n != m:  # another tile compares with `own` later: keep its bytes
            snapshot = np.array(own) if snapshot is None else snapshot
            x = snapshot
        c0, c1 = member.out_box[-1]
        part = y[start : start + count, c0 - lo : c1 - lo].reshape(box_shape(member.out_box))
        join.parts[n] = (part, x)


def plan_joins(
    program: Program,
    kernels: Sequence[tuple[OpDef, NodeInfo]],
    constant_view: Callable[[int, Box], np.ndarray],
    vtcm_view: Callable[[int, int, Box, Box, str], np.ndarray],
    shared: dict[tuple[int, int], SharedTile],
) -> dict[tuple[int, int], JoinTile]:
    """The tiles that may join, by (core, position in the core's stream): float32
    ungrouped 2-D convs of batch 1 split into two or more thin row bands, and float32
    MatMuls by a constant matrix split into two or more row bands; one tile per core, input
    read whole from one VTCM buffer, constant weight (and bias) in place."""
    tensors = program.tensors
    in_place = in_place_views(program, constant_view, vtcm_view)
    tiles: dict[int, list[tuple[int, int, RunKernel]]] = defaultdict(list)
    for core, stream in enumerate(program.streams):
        for index, instr in enumerate(stream):
            if isinstance(instr, RunKernel) and 0 <= instr.kernel < len(kernels):
                tiles[instr.kernel].append((core, index, instr))
    found: dict[tuple[int, int], JoinTile] = {}
    for kernel, members in tiles.items():
        opdef, info = kernels[kernel]
        desc = program.kernels[kernel]
        matmul = opdef.op_type == "MatMul"
        joinable = _joinable_matmul if matmul else _joinable
        if not joinable(program, opdef, info, desc.inputs, members):
            continue
        w_id = desc.inputs[1]
        weight = constant_view(w_id, tuple((0, d) for d in tensors[w_id].shape))
        rows = weight if matmul else weight.reshape(len(weight), -1)
        bias = None
        if len(info.in_shapes) > 2 and desc.inputs[2] >= 0:
            b_id = desc.inputs[2]
            bias = constant_view(b_id, tuple((0, d) for d in tensors[b_id].shape))
        join = Join(
            info=info,
            compute=opdef.compute,
            weight=rows,
            bias=bias,
            members=[],
            pointwise=not matmul and _pointwise(info, members),
            matmul=matmul,
        )
        for core, index, instr in members:
            act = instr.inputs[0]
            assert act is not None
            read = _reader(core, act, tensors[desc.inputs[0]].dtype, vtcm_view)
            expected = []
            for p in (1, 2)[: len(info.in_shapes) - 1]:
                operand = instr.inputs[p]
                if operand is not None:
                    expected.append(expected_in_place(in_place(core, desc.inputs[p], operand), p))
            (c0, c1) = instr.out_box[-1 if matmul else 1]
            n_base = len(info.in_shapes)
            tile = RunTile(
                out_box=instr.out_box,
                in_boxes=tuple(None if op is None else op.box for op in instr.inputs[:n_base]),
            )
            member = Member(
                core=core,
                out_box=instr.out_box,
                x_box=act.box,
                read=read,
                expected=tuple(expected),
                tile=tile,
                fallback=shared.get((core, index)),
            )
            if uniform_rows(rows[:, c0:c1].T if matmul else rows[c0:c1]):
                continue  # the kernel repeats one row (column): it stays alone
            found[(core, index)] = JoinTile(join, len(join.members))
            join.members.append(member)
    return found


def _joinable(
    program: Program,
    opdef: OpDef,
    info: NodeInfo,
    inputs: tuple[int, ...],
    members: list[tuple[int, int, RunKernel]],
) -> bool:
    tensors = program.tensors
    if opdef.op_type != "Conv" or int(info.attr("group", 1)) != 1 or len(members) < 2:
        return False
    out_shape = info.out_shapes[0]
    if len(out_shape) != 4 or out_shape[0] != 1 or info.out_dtypes[0] != "float32":
        return False
    if any(d != "float32" for d in info.in_dtypes if d is not None):
        return False
    if inputs[0] < 0 or tensors[inputs[0]].kind == KIND_CONSTANT:
        return False
    for p in (1, 2)[: len(info.in_shapes) - 1]:
        if inputs[p] < 0 or tensors[inputs[p]].kind != KIND_CONSTANT:
            return False
    boxes = []
    for _, _, instr in members:
        if not _reads_its_box(opdef, info, instr):
            return False
        w = instr.inputs[1]
        if w is None or w.box[1:] != tuple((0, d) for d in info.in_shapes[1][1:]):  # type: ignore[index]
            return False
        boxes.append(instr.out_box)
    if len({(b[2], b[3]) for b in boxes}) < 2:  # one band: shared products cover it
        return False
    if max(int(np.prod(box_shape(b[2:]), dtype=np.int64)) for b in boxes) > THIN:
        return False
    return _tile_the_output(boxes, out_shape)


def _joinable_matmul(
    program: Program,
    opdef: OpDef,
    info: NodeInfo,
    inputs: tuple[int, ...],
    members: list[tuple[int, int, RunKernel]],
) -> bool:
    """A float32 MatMul of an activation whose leading axes are all 1 by a constant matrix,
    split into two or more row bands, each tile reading whole rows from one VTCM buffer and
    the weight columns of its output."""
    tensors = program.tensors
    a, b = info.in_shapes[0], info.in_shapes[1]
    out_shape = info.out_shapes[0]
    if len(members) < 2 or a is None or b is None or len(b) != 2 or len(a) < 2:
        return False
    if len(out_shape) != len(a) or any(d != 1 for d in out_shape[:-2]):
        return False
    if info.out_dtypes[0] != "float32" or any(d != "float32" for d in info.in_dtypes[:2]):
        return False
    if inputs[0] < 0 or tensors[inputs[0]].kind == KIND_CONSTANT:
        return False
    if inputs[1] < 0 or tensors[inputs[1]].kind != KIND_CONSTANT:
        return False
    boxes = []
    for _, _, instr in members:
        w = instr.inputs[1]
        if w is None or not _reads_its_box(opdef, info, instr):
            return False
        if w.box != ((0, b[0]), instr.out_box[-1]):
            return False
        boxes.append(instr.out_box)
    if len({box[-2] for box in boxes}) < 2:  # one band: shared products cover it
        return False
    return _tile_the_output(boxes, out_shape)


def _reads_its_box(opdef: OpDef, info: NodeInfo, instr: RunKernel) -> bool:
    """A member tile with one output reads the whole activation box its output needs, held
    in one VTCM buffer."""
    act = instr.inputs[0]
    if act is None or not _covered(act) or len(instr.outputs) != 1:
        return False
    return bool(list(opdef.input_boxes(info, instr.out_box))[0] == act.box)


def _tile_the_output(boxes: list[Box], out_shape: tuple[int, ...]) -> bool:
    """The members' output boxes are distinct and together as large as the output."""
    volume = sum(int(np.prod(box_shape(box), dtype=np.int64)) for box in boxes)
    return volume == int(np.prod(out_shape, dtype=np.int64)) and len(set(boxes)) == len(boxes)


def _pointwise(info: NodeInfo, members: list[tuple[int, int, RunKernel]]) -> bool:
    """A 1x1 kernel at stride 1 whose tiles read the positions they write."""
    kernel = info.in_shapes[1][2:]  # type: ignore[index]
    if any(k != 1 for k in kernel) or any(int(v) != 1 for v in info.attr("strides", [])):
        return False
    return all(
        i.inputs[0] is not None and i.inputs[0].box[2:] == i.out_box[2:] for *_, i in members
    )


def _covered(operand: Operand) -> bool:
    """Whether the operand's pieces cover its box exactly (as the kernel's own check)."""
    total = 0
    for piece in operand.pieces:
        common = _intersect(piece.box, operand.box)
        if common is None:
            return False
        total += int(np.prod(box_shape(common), dtype=np.int64))
    return total == int(np.prod(box_shape(operand.box), dtype=np.int64))


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


def _reader(
    core: int,
    operand: Operand,
    dtype: str,
    vtcm_view: Callable[[int, int, Box, Box, str], np.ndarray],
) -> Callable[[np.ndarray | None], np.ndarray]:
    """A copy of the operand's bytes in `core`'s VTCM, joined from its pieces (into `out`
    when given)."""
    box = operand.box
    parts = []
    for piece in operand.pieces:
        common = _intersect(piece.box, box)
        assert common is not None
        where = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(common, box, strict=True))
        parts.append((where, vtcm_view(core, piece.vtcm, piece.box, common, dtype)))
    shape = box_shape(box)

    def read(out: np.ndarray | None) -> np.ndarray:
        if out is None:
            out = np.empty(shape, dtype=np.dtype(dtype))
        for where, src in parts:
            out[where] = src
        return out

    return read
