"""Cut a kernel's output into tiles that fit VTCM and spread them over the NSP cores.

A tile is a box of output 0; the op's tiling rule says which box of every input it reads.
Cuts come from two needs: parallelism (`-aic-num-cores` x `-ols` parts, `-mos` capping the
output-channel cut) and fit (the working set of inputs + output must fit the VTCM budget;
the output part of one tile is also kept under `-size-split-granularity`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops._tiling import broadcast_input_box
from compiler_core.ops.registry import Box, NodeInfo, OpDef, full_box

ALIGN = 64


@dataclass(slots=True, unsafe_hash=True)
class TileSpec:
    """One tile of a kernel. Treated as immutable (hashed, shared between kernels and
    builds), but not declared frozen: a frozen dataclass sets each field through
    `object.__setattr__`, 4x the construction time, and the split chooser builds ~8,000 of
    them per ResNet-50 compile."""

    out_box: Box
    in_boxes: tuple[Box | None, ...]
    """Base-op inputs first, then the epilogue operands."""
    working_set: int
    core: int = 0


class CutTile(NamedTuple):
    """A tile of a cut as the split chooser prices it: its boxes and core, without the
    working set a `TileSpec` carries (most cuts priced are never picked)."""

    out_box: Box
    in_boxes: tuple[Box | None, ...]
    core: int


@dataclass(frozen=True)
class TilingRequest:
    info: NodeInfo
    opdef: OpDef
    extra_shapes: tuple[tuple[int, ...], ...]
    extra_dtypes: tuple[str, ...]
    num_cores: int
    ols: int
    mos: int | None
    budget: int
    granularity: int
    rotate: int = 0
    indexed: frozenset[int] = frozenset()
    """Inputs a gather DMA fetches slice by slice (see OpDef.indexed_inputs): a tile holds
    only what it gathers, the size of its output."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@functools.cache
def _itemsize(dtype: str) -> int:
    return int(np.dtype(dtype).itemsize)


def _nbytes(box: Box | None, dtype: str | None) -> int:
    if box is None or dtype is None:
        return 0
    n = 1
    for start, stop in box:
        n *= stop - start
    return _aligned(n * _itemsize(dtype))


def _ranges(size: int, parts: int) -> list[tuple[int, int]]:
    return [(size * i // parts, size * (i + 1) // parts) for i in range(parts)]


def _tile(req: TilingRequest, out_box: Box) -> TileSpec:
    return _tile_reading(req, out_box, tuple(req.opdef.input_boxes(req.info, out_box)))


def _tile_reading(req: TilingRequest, out_box: Box, in_boxes: tuple[Box | None, ...]) -> TileSpec:
    """The tile of `out_box` whose op reads `in_boxes`: the epilogue's operands added, and
    its working set."""
    # the split chooser asks for thousands of tiles: one loop, no generator per sum
    info = req.info
    if req.opdef.ddr_to_ddr:  # DMA between DDR regions: no VTCM working set
        return TileSpec(out_box=out_box, in_boxes=in_boxes, working_set=0)
    if req.extra_shapes:
        out_shape = info.out_shapes[0]
        in_boxes += tuple(broadcast_input_box(s, out_shape, out_box) for s in req.extra_shapes)
    dtypes = (*info.in_dtypes, *req.extra_dtypes)
    if len(in_boxes) != len(dtypes):
        raise ValueError(f"node {info.name!r}: {len(in_boxes)} input boxes, {len(dtypes)} dtypes")
    indexed = req.indexed
    ws = 0
    for i, b in enumerate(in_boxes):
        if indexed and i in indexed:
            b = out_box
        d = dtypes[i]
        if b is None or d is None:
            continue
        n = _itemsize(d)
        if len(b) == 4:  # a feature map's box, unrolled
            (a0, a1), (b0, b1), (c0, c1), (d0, d1) = b
            n *= (a1 - a0) * (b1 - b0) * (c1 - c0) * (d1 - d0)
        else:
            for start, stop in b:
                n *= stop - start
        ws += (n + ALIGN - 1) // ALIGN * ALIGN
    if not req.opdef.output_in_ddr:
        outs = output_boxes(req.opdef, info, out_box)
        for b, d in zip(outs, info.out_dtypes, strict=True):
            ws += _nbytes(b, d)
    return TileSpec(out_box=out_box, in_boxes=in_boxes, working_set=ws)


def _tiles_for(req: TilingRequest, parts: dict[int, int]) -> list[Box]:
    shape = req.info.out_shapes[0]
    per_axis = [_ranges(d, parts.get(a, 1)) for a, d in enumerate(shape)]
    return [tuple(b) for b in itertools.product(*per_axis)]


def _probe(req: TilingRequest, parts: dict[int, int]) -> tuple[int, int]:
    """Working set and output bytes of the largest tile: along every axis the longest range,
    the one nearest the middle (an interior tile reads a full halo; edge tiles read less)."""
    shape = req.info.out_shapes[0]
    box = []
    for a, d in enumerate(shape):
        p = parts.get(a, 1)
        box.append(_middle_longest(d, p))
    tile = _tile(req, tuple(box))
    return tile.working_set, _nbytes(tuple(box), req.info.out_dtypes[0])


def _middle_longest(size: int, parts: int) -> tuple[int, int]:
    """Of `_ranges(size, parts)`, the longest nearest the middle one (`parts // 2`; of two
    as near, the first), found by looking outward from the middle: ranges are `size //
    parts` or one longer, and the longer ones are spread evenly."""
    middle = parts // 2
    longest = -(-size // parts)
    for k in range(parts):
        for i in (middle - k, middle + k) if k else (middle,):
            if 0 <= i < parts:
                lo, hi = size * i // parts, size * (i + 1) // parts
                if hi - lo == longest:
                    return lo, hi
    raise AssertionError("no range has the longest length")


def split_axes(req: TilingRequest) -> list[int]:
    info = req.info
    axes = req.opdef.split_axes(info)  # always asked: ops validate their node there
    tiled = len(info.out_shapes) == 1 or req.opdef.output_boxes is not None
    if not tiled or not info.out_shapes or not info.out_shapes[0]:
        return []
    return [a for a in axes if info.out_shapes[0][a] > 1]


def output_boxes(opdef: OpDef, info: NodeInfo, out_box: Box) -> list[Box]:
    """Every output's box in the tile cut as `out_box` of output 0."""
    if len(info.out_shapes) == 1:
        return [out_box]
    if opdef.output_boxes is not None:
        return opdef.output_boxes(info, out_box)
    return [full_box(s) for s in info.out_shapes]


Probes = dict[tuple[tuple[int, int], ...], tuple[int, int]]
"""Working sets already probed for a request, by cut (see `fit_tiles`)."""


def fit_tiles(
    req: TilingRequest, parts: dict[int, int], probes: Probes | None = None
) -> dict[int, int]:
    """`parts` cut further, along the axis that shrinks the working set most each time,
    until a tile fits half the VTCM budget (so the next tile's operands can load while this
    one computes) and its output part `-size-split-granularity`; the whole budget when no
    finer cut exists (more than that is a `vtcm_overflow`)."""
    axes = split_axes(req)
    shape = req.info.out_shapes[0] if req.info.out_shapes else ()
    parts = {a: parts.get(a, 1) for a in axes}
    target = max(1, req.budget // 2)
    memo: Probes = {} if probes is None else probes

    def probe(cut: dict[int, int]) -> tuple[int, int]:
        key = tuple(sorted(cut.items()))
        found = memo.get(key)
        if found is None:
            found = memo[key] = _probe(req, cut)
        return found

    while axes:
        ws, out_bytes = probe(parts)
        if ws <= target and out_bytes <= req.granularity:
            break
        best: tuple[int, int] | None = None
        for a in axes:
            if parts[a] >= shape[a]:
                continue
            trial = dict(parts)
            trial[a] = min(shape[a], parts[a] * 2)
            trial_ws, _ = probe(trial)
            if best is None or trial_ws < best[0]:
                best = (trial_ws, a)
        if best is None:
            _check_fits(req, ws)
            break
        parts[best[1]] = min(shape[best[1]], parts[best[1]] * 2)
    return {a: p for a, p in parts.items() if p > 1}


def tiles_of(req: TilingRequest, parts: dict[int, int]) -> list[TileSpec]:
    """The tiles of a cut (cores not yet assigned), each checked against the budget."""
    info = req.info
    if not parts:
        tile = _tile(req, full_box(info.out_shapes[0]) if info.out_shapes else ())
        _check_fits(req, tile.working_set)
        return [tile]
    grid = req.opdef.grid_input_boxes
    if grid is None:
        tiles = [_tile(req, b) for b in _tiles_for(req, parts)]
    else:  # the op works its boxes out axis by axis, for the whole grid at once
        shape = info.out_shapes[0]
        per_axis = [_ranges(d, parts.get(a, 1)) for a, d in enumerate(shape)]
        tiles = [
            _tile_reading(req, b, tuple(boxes))
            for b, boxes in zip(itertools.product(*per_axis), grid(info, per_axis), strict=True)
        ]
    budget = req.budget
    for t in tiles:
        if t.working_set > budget:
            _check_fits(req, t.working_set)
    return tiles


def cut_tiles(
    req: TilingRequest, parts: dict[int, int], num_cores: int, rotate: int
) -> list[CutTile]:
    """The boxes and cores `assign_cores(tiles_of(req, parts), num_cores, rotate)` gives each
    tile: what pricing a cut needs, without the working sets (checked when a cut is picked
    and its tiles built)."""
    info = req.info
    opdef = req.opdef
    if not parts:
        boxes = [full_box(info.out_shapes[0]) if info.out_shapes else ()]
        inputs: Iterable[Sequence[Box | None]] = [opdef.input_boxes(info, boxes[0])]
    else:
        per_axis = [_ranges(d, parts.get(a, 1)) for a, d in enumerate(info.out_shapes[0])]
        boxes = list(itertools.product(*per_axis))
        grid = opdef.grid_input_boxes
        inputs = (
            (opdef.input_boxes(info, b) for b in boxes) if grid is None else grid(info, per_axis)
        )
    extra = req.extra_shapes if not opdef.ddr_to_ddr else ()
    out_shape = info.out_shapes[0] if extra else ()
    n = len(boxes)
    tiles = []
    for t, (box, base) in enumerate(zip(boxes, inputs, strict=True)):
        in_boxes = tuple(base)
        if extra:
            in_boxes += tuple(broadcast_input_box(s, out_shape, box) for s in extra)
        core = (t * num_cores // n) if n >= num_cores else (rotate + t) % num_cores
        tiles.append(CutTile(box, in_boxes, core))
    return tiles


def plan_tiles(req: TilingRequest) -> list[TileSpec]:
    """Tiles cut by bytes read alone (what the split chooser starts from without a cost)."""
    if not split_axes(req):
        return assign_cores(tiles_of(req, {}), req.num_cores, req.rotate)
    shape = req.info.out_shapes[0]
    axes = split_axes(req)
    limit = {a: shape[a] for a in axes}
    if req.mos is not None and 1 in limit and req.opdef.unit == "hmx":
        limit[1] = min(limit[1], max(1, req.mos))
    parts = fit_tiles(req, _parallel_split(req, axes, limit))
    return assign_cores(tiles_of(req, parts), req.num_cores, req.rotate)


def _parallel_split(req: TilingRequest, axes: list[int], limit: dict[int, int]) -> dict[int, int]:
    """Cut for `cores x ols` parts along the axes that make the tiles read the least.

    Each candidate starts from a different axis and fills up with the rest in the op's order
    of preference; the estimate is tiles x the working set of a representative tile, so a
    Conv with a large input and small weights is cut by rows (each core reads its rows once)
    rather than by output channels (each core would read the whole input)."""
    want = req.num_cores * max(1, req.ols)
    best: tuple[int, int, dict[int, int]] | None = None
    for rank, first in enumerate(axes):
        parts = {a: 1 for a in axes}
        for a in [first] + [a for a in axes if a != first]:
            have = math.prod(parts.values())
            if have >= want:
                break
            parts[a] = min(limit[a], math.ceil(want / have))
        tiles = math.prod(parts.values())
        traffic = tiles * _probe(req, parts)[0]
        if best is None or (traffic, rank) < (best[0], best[1]):
            best = (traffic, rank, parts)
    assert best is not None
    return best[2]


def assign_cores(tiles: Sequence[TileSpec], num_cores: int, rotate: int) -> list[TileSpec]:
    """Consecutive tiles to the same core, as evenly as the count allows; fewer tiles than
    cores start at `rotate` so small kernels spread over the cores."""
    n = len(tiles)
    out = []
    for i, t in enumerate(tiles):
        core = (i * num_cores // n) if n >= num_cores else (rotate + i) % num_cores
        out.append(TileSpec(t.out_box, t.in_boxes, t.working_set, core))
    return out


def _check_fits(req: TilingRequest, working_set: int) -> None:
    if working_set > req.budget:
        info = req.info
        raise CompileError(
            "vtcm_overflow",
            f"node '{info.name}' ({info.op_type}) needs {working_set:,} bytes of VTCM for its "
            f"smallest tile, {working_set - req.budget:,} bytes more than the "
            f"{req.budget:,}-byte budget per core (-vtcm-working-set-limit-ratio)",
            node=info.name,
            details={"needed": working_set, "budget": req.budget},
        )
