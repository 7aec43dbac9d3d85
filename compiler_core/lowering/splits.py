"""Choose how every kernel is cut across the cores, by modelled time.

For each kernel the candidates are the ways to cut its output over the cores along the axes
its op allows (batch, rows, output channels, ... and two- or three-way mixes of them, on all
the cores or on fewer), each refined into tiles that fit VTCM. A candidate is priced as the
slowest core's compute (HMX blocks padded as the cost model pads them) plus the data it must
receive from other cores or from DDR, given how the kernels before it were cut. Weights are
kept resident, so a cut that gives every core all of a layer's weights (rows, batch) costs
VTCM on every core: the chooser adds `price x resident bytes per core` and raises the price
until the network's weights fit the room left for them.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from compiler_core.cost_rates import tile_cost
from compiler_core.devices import DeviceProfile
from compiler_core.errors import CompileError
from compiler_core.lowering import ksplit
from compiler_core.lowering.tiling import (
    Probes,
    TileSpec,
    TilingRequest,
    _ranges,
    assign_cores,
    cut_tiles,
    fit_tiles,
    output_boxes,
    split_axes,
    tiles_of,
)
from compiler_core.lowering.tiling import _tile as _tile_spec
from compiler_core.ops.registry import Box, box_shape, full_box

DESCRIPTOR = 24
LAUNCH = 16
KEEP = 5
"""Candidates priced in full per kernel (the fastest by compute alone)."""
WHOLE = 6
"""Also priced in full: the fastest few cuts that leave axis 1 (a conv's output channels, a
product's columns) whole. Under a producer cut the same way they read their input where it
already is (plus halo rows), which compute alone cannot see: int8 ResNet-50 on 16 cores at
batch 1 cuts its 56x56 and 28x28 layers by rows instead of channels, 153 -> 81 us."""


def _bytes(box: Box, dtype: str | None) -> int:
    if dtype is None:
        return 0
    n = 1
    for a, b in box:
        n *= b - a
    return n * (1 if dtype == "bool" else _itemsize(dtype))


@functools.cache
def _itemsize(dtype: str) -> int:
    return 1 if dtype == "bool" else int(np.dtype(dtype).itemsize)


def _volume(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def bounding_box(boxes: list[Box]) -> Box:
    """The smallest box holding every box of `boxes` (not empty)."""
    if len(boxes) == 1:  # the usual case: a core's one box of a weight
        return tuple(boxes[0])
    lo = [a for a, _ in boxes[0]]
    hi = [b for _, b in boxes[0]]
    for box in boxes[1:]:
        for axis, (a, b) in enumerate(box):
            if a < lo[axis]:
                lo[axis] = a
            if b > hi[axis]:
                hi[axis] = b
    return tuple(zip(lo, hi, strict=True))


def _overlap(a: Box, b: Box) -> int:
    n = 1
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        d = min(a1, b1) - max(a0, b0)
        if d <= 0:
            return 0
        n *= d
    return n


@dataclass
class KernelSplit:
    """What the chooser needs of one kernel."""

    request: TilingRequest
    unit: str
    macs: int
    epilogue: tuple[str, ...]
    inputs: tuple[int, ...]
    """Tensor ids of the operands (-1: none)."""
    kinds: tuple[str, ...]
    """Per operand: 'constant', 'ddr' (graph input) or 'chip' (another kernel's output)."""
    producers: tuple[int, ...]
    """Per operand: the producing kernel (-1 for constants and graph inputs)."""
    slots: tuple[int, ...]
    """Per operand: which output of its producer it is."""
    reshaped: tuple[bool, ...]
    """Per operand: read through a reshape of the producer's output (needs all of it)."""
    nbytes: tuple[int, ...]
    """Per operand: the whole tensor's bytes."""
    epilogue_ops: tuple[int, ...] = ()
    """Per epilogue step: its HVX instructions per 128 codes (`cost_timeline.epilogue_ops`;
    empty when no step is an integer one)."""


class _Tiled(Protocol):
    """What pricing reads of a tile: a `TileSpec` or a `tiling.CutTile`."""

    @property
    def out_box(self) -> Box: ...
    @property
    def in_boxes(self) -> tuple[Box | None, ...]: ...
    @property
    def core(self) -> int: ...


@dataclass
class _Candidate:
    parts: dict[int, int]
    tiles: list[TileSpec] | None
    """The kernel's tiles: None until the cut is picked (`SplitChooser.choose`)."""
    compute: dict[int, float]
    resident: int
    """Weight bytes every core gives this kernel if its weights stay resident."""
    stream: float
    """Cycles per inference its weights take if they stream from DDR instead."""
    by_core: dict[int, list[_Tiled]] = field(default_factory=dict)
    built: bool = False
    """`by_core`, `resident` and `stream` known (`SplitChooser._ready`)."""
    moves: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    """Transfer cycles per (operand, id of its producer's chosen cut)."""
    held: dict[tuple[int, int], Box | None] = field(default_factory=dict)
    held_all: dict[tuple[int, int], list[Box]] = field(default_factory=dict)
    held_by_core: dict[int, dict[int, list[Box]]] = field(default_factory=dict)
    """Per output slot, `_held`'s boxes of every core with tiles."""
    key: Hashable = None
    busiest: float = 0.0
    """The busiest core's compute cycles."""
    """(kernel signature, cut, first core): equal keys, equal tiles on equal cores."""
    kchoice: ksplit.KChoice | None = None
    """A K split (partial products and their reduction) instead of an output cut."""
    reads: dict[int, list[tuple[list[tuple[Box, int]], int, int]]] = field(default_factory=dict)
    """Per operand: each core's distinct input boxes with their elements, their total and
    how many are not empty; shared by the kernels that share the cut (its tiles), priced
    against every producer's cut."""


def _factorizations(n: int, axes: list[int], limit: dict[int, int]) -> list[dict[int, int]]:
    out: list[dict[int, int]] = []
    for r in range(1, min(3, len(axes)) + 1):
        for chosen in itertools.combinations(axes, r):
            for split in _products(n, r):
                if all(p <= limit[a] for a, p in zip(chosen, split, strict=True)):
                    out.append({a: p for a, p in zip(chosen, split, strict=True) if p > 1})
    return out


@functools.cache
def _products(n: int, r: int) -> tuple[tuple[int, ...], ...]:
    """Every way to write `n` as an ordered product of `r` factors (read-only: shared)."""
    if r == 1:
        return ((n,),)
    out: list[tuple[int, ...]] = []
    for d in range(1, n + 1):
        if n % d == 0:
            out.extend((d, *rest) for rest in _products(n // d, r - 1))
    return tuple(out)


class SplitChooser:
    def __init__(
        self,
        kernels: list[KernelSplit],
        device: DeviceProfile,
        room: int,
        active: int | None = None,
        k_splits: bool = True,
    ) -> None:
        """`active`: use only the first `active` cores (the rest idle); `k_splits`: also
        price reduction-axis splits where they apply (see `ksplit`)."""
        self.k_splits = k_splits
        self.kernels = kernels
        self.active = active
        self.device = device
        self.room = room
        self.engine = float(device.dma_bytes_per_cycle)
        self.noc = device.noc_bandwidth_bytes_per_s / device.clock_hz
        self.ddr = device.ddr_bandwidth_bytes_per_s / device.clock_hz
        self._cuts: dict[Hashable, list[dict[int, int]]] = {}
        self._shaped: dict[Hashable, list[float]] = {}
        self._unbuilt: dict[Hashable, tuple[KernelSplit, Hashable, Hashable, int]] = {}
        """Shared candidates not built yet: the kernel to build from (any of the signature's:
        alike), its signature, cut and first core."""
        self._priced: dict[Hashable, _Candidate] = {}
        self._moves: dict[Hashable, tuple[float, float]] = {}
        self._kshared: dict[Hashable, list[_Candidate]] = {}
        self._factored: dict[Hashable, list[dict[int, int]]] = {}
        self._signatures: dict[Hashable, int] = {}
        self._moved = [
            [
                (i, ks.producers[i])
                for i, tid in enumerate(ks.inputs)
                if tid >= 0 and ks.kinds[i] not in ("constant", "none")
            ]
            for ks in kernels
        ]
        """Per kernel: the operands that may have to move, and their producers."""
        self.candidates = [self._candidates(k) for k in kernels]
        self._stem = [
            "ddr" in ks.kinds and "constant" in ks.kinds and len(ks.request.info.out_shapes[0]) == 4
            for ks in kernels
        ]
        """Per kernel: a network's stem (a conv reading the graph input from DDR into a
        4-D map); its ties go to the cut that keeps axis 1 whole (see `_pick`)."""
        self._times: list[dict[tuple[int, ...], list[float | None]]] = [{} for _ in kernels]
        """Per kernel: its candidates' times by the ids of its operands' producers' cuts (None:
        not priced, its bound already above the cheapest; see `_pick`)."""

    def cores(self, req: TilingRequest) -> int:
        active = self.active or req.num_cores
        return active if active < req.num_cores else req.num_cores

    # ----------------------------------------------------------------------- candidates

    def _candidates(self, ks: KernelSplit) -> list[_Candidate]:
        """The cuts worth pricing in full; a kernel identical to an earlier one but for its
        name (ResNet's repeated blocks, a transformer's layers) reuses that one's cuts."""
        # alike kernels by a small number: the signature is a deep tuple, and every key of
        # the chooser's caches (cuts, tiles, prices, transfers) starts with it
        sig = self._signatures.setdefault(_signature(ks), len(self._signatures))
        cuts = self._cuts.get(sig)
        if cuts is None:
            cuts = self._cuts[sig] = self._cuts_of(ks)
        found = [self._candidate(ks, parts, sig) for parts in cuts]
        return found + self._k_candidates(ks, sig)

    def _cuts_of(self, ks: KernelSplit) -> list[dict[int, int]]:
        req = ks.request
        axes = split_axes(req)
        if not axes:
            return [{}]
        shape = req.info.out_shapes[0]
        limit = {a: shape[a] for a in axes}
        if req.mos is not None and 1 in limit and req.opdef.unit == "hmx":
            limit[1] = min(limit[1], max(1, req.mos))
        cores = self.cores(req)
        want = cores * max(1, req.ols)
        counts = {want, cores, *(d for d in range(1, cores) if cores % d == 0)}
        if 0 in axes and shape[0] % cores:
            # a batch that does not divide by the cores: several tiles per core, so that
            # e.g. 16 images x 7 row bands spread evenly over 14 cores
            counts.update(want * m for m in (2, 4, 8))
        seen: set[tuple[tuple[int, int], ...]] = set()
        tried: set[tuple[tuple[int, int], ...]] = set()
        probes: Probes = {}
        quick: list[tuple[float, int, dict[int, int]]] = []
        failure: CompileError | None = None
        for n in sorted(counts):
            # alike layers (same axes and limits) share the list: read-only
            fkey = (n, tuple(axes), tuple(limit[a] for a in axes))
            factored = self._factored.get(fkey)
            if factored is None:
                factored = self._factored[fkey] = _factorizations(n, axes, limit)
            for parts in factored:
                asked = tuple(sorted(parts.items()))
                if asked in tried:
                    continue
                tried.add(asked)
                try:
                    refined = fit_tiles(req, parts, probes)
                except CompileError as exc:  # this cut cannot fit VTCM; others may
                    if exc.code != "vtcm_overflow":
                        raise
                    failure = exc
                    continue
                key = tuple(sorted(refined.items()))
                if key in seen:
                    continue
                seen.add(key)
                quick.append((self._quick(ks, refined), -refined.get(1, 1), refined))
        if not quick:
            if failure is not None:
                raise failure
            return [{}]
        # price in full the fastest few, and the one that spreads weights most
        quick.sort(key=lambda q: (q[0], q[1]))
        kept = quick[:KEEP]
        widest = min(quick, key=lambda q: (q[1], q[0]))
        if widest not in kept:
            kept.append(widest)
        # and those that keep axis 1 whole (see WHOLE)
        for q in [q for q in quick if q[1] == -1][:WHOLE]:
            if q not in kept:
                kept.append(q)
        return [parts for _, _, parts in kept]

    def _quick(self, ks: KernelSplit, parts: dict[int, int]) -> float:
        """Compute cycles of the busiest core, from one tile of the largest size."""
        req = ks.request
        shape = req.info.out_shapes[0]
        tiles = 1
        box = []
        for a, d in enumerate(shape):
            p = parts.get(a, 1)
            tiles *= p
            box.append((0, -(-d // p)))
        per_core = -(-tiles // self.cores(req))
        out_box = tuple(box)
        # an HMX tile's cycles depend on its output box alone: its input boxes are not needed
        in_boxes = () if ks.unit == "hmx" else _tile_spec(req, out_box).in_boxes
        cost = tile_cost(
            req.info,
            ks.unit,
            ks.macs,
            ks.epilogue,
            out_box,
            in_boxes,
            req.opdef,
            self.device,
            ks.epilogue_ops,
        )
        return per_core * (cost.cycles + LAUNCH)

    def _cycles(
        self, ks: KernelSplit, parts: dict[int, int], cut: Hashable, sig: Hashable
    ) -> list[float]:
        """Each tile's compute cycles, in tile order, without building the tiles: a tile's
        cycles are its shape's (priced on the first tile of that shape, the only one built),
        and a cut's tiles have few shapes (a uniform cut's differ only at its edges). Shared
        by kernels with the same signature."""
        key = (sig, cut)
        found = self._shaped.get(key)
        if found is not None:
            return found
        req = ks.request
        info = req.info
        if parts:
            per_axis = [_ranges(d, parts.get(a, 1)) for a, d in enumerate(info.out_shapes[0])]
            lengths = [[hi - lo for lo, hi in ranges] for ranges in per_axis]
            shapes: Iterable[tuple[int, ...]] = itertools.product(*lengths)
            boxes: Iterable[Box] = itertools.product(*per_axis)
        else:  # one tile, the whole output (as `tiles_of` cuts it)
            whole = full_box(info.out_shapes[0]) if info.out_shapes else ()
            shapes, boxes = [tuple(b - a for a, b in whole)], [whole]
        costs: dict[tuple[int, ...], float] = {}
        cycles: list[float] = []
        for shape, box in zip(shapes, boxes, strict=True):
            c = costs.get(shape)
            if c is None:
                c = costs[shape] = (
                    tile_cost(
                        req.info,
                        ks.unit,
                        ks.macs,
                        ks.epilogue,
                        box,
                        () if ks.unit == "hmx" else _tile_spec(req, box).in_boxes,  # as `_quick`
                        req.opdef,
                        self.device,
                        ks.epilogue_ops,
                    ).cycles
                    + LAUNCH
                )
            cycles.append(c)
        self._shaped[key] = cycles
        return cycles

    def _candidate(self, ks: KernelSplit, parts: dict[int, int], sig: Hashable) -> _Candidate:
        """A cut priced: per-core compute now; its tiles, and the weight bytes it keeps or
        streams, when the price search first needs them (`_ready`: most cuts of a kernel
        lose on compute alone and are never built). Kernels of one signature share it
        (fewer tiles than cores: the same first core too); only the transfer prices, which
        depend on the producers, are the kernel's own."""
        req = ks.request
        cut = tuple(sorted(parts.items()))
        cycles = self._cycles(ks, parts, cut, sig)
        cores = self.cores(req)
        n = len(cycles)
        first = req.rotate % cores if n < cores else 0
        key = (sig, cut, first)
        shared = self._priced.get(key)
        if shared is None:
            # each core's compute as `assign_cores` deals the tiles and `_price_assigned`
            # adds them up (the same order: the same sums)
            compute: dict[int, float] = {}
            for i, c in enumerate(cycles):
                core = (i * cores // n) if n >= cores else (first + i) % cores
                if core in compute:
                    compute[core] += c
                else:
                    compute[core] = 0.0 + c
            shared = self._priced[key] = _Candidate(
                parts, None, compute, 0, 0.0, busiest=max(compute.values(), default=0.0)
            )
            shared.key = key
            self._unbuilt[key] = (ks, sig, cut, first)
        return _fresh(shared)

    def _ready(self, cand: _Candidate) -> None:
        """Cut `cand`'s boxes over the cores and price its resident weights if no kernel
        sharing its cut has (see `_candidate`), and give them to this kernel's copy."""
        shared = self._priced[cand.key]
        if not shared.built:
            ks, sig, cut, first = self._unbuilt[cand.key]
            req = ks.request
            tiles = cut_tiles(req, shared.parts, self.cores(req), first)
            built = self._price_assigned(ks, shared.parts, tiles, self._shaped[(sig, cut)])
            assert built.compute == shared.compute
            shared.by_core, shared.built = built.by_core, True
            shared.resident, shared.stream = built.resident, built.stream
        cand.by_core, cand.built = shared.by_core, True
        cand.resident, cand.stream = shared.resident, shared.stream

    def _tiles(self, cand: _Candidate) -> list[TileSpec]:
        """The tiles of a picked cut, each checked against VTCM; built once per shared cut."""
        if cand.tiles is not None:
            return cand.tiles
        shared = self._priced[cand.key]
        if shared.tiles is None:
            ks, _, _, first = self._unbuilt.pop(cand.key)
            req = ks.request
            shared.tiles = assign_cores(tiles_of(req, shared.parts), self.cores(req), first)
        cand.tiles = shared.tiles
        return cand.tiles

    # ------------------------------------------------------------------------- K splits

    def _k_candidates(self, ks: KernelSplit, sig: Hashable) -> list[_Candidate]:
        """The kernel's K splits (see `ksplit`), one per slice count, each with its fastest
        cut of the partial products and of the reduction; alike kernels share them."""
        if not self.k_splits:
            return []
        req = ks.request
        cores = self.cores(req)
        counts = ksplit.slice_counts(req, cores)
        if not counts:
            return []
        shared = self._kshared.get(sig)
        if shared is None:
            shared = self._kshared[sig] = []
            for slices in counts:
                try:
                    shared.append(self._k_candidate(ks, sig, slices, cores))
                except CompileError as exc:  # its partials do not fit VTCM: no K split
                    if exc.code != "vtcm_overflow":
                        raise
        return [_fresh(c) for c in shared]

    def _k_candidate(self, ks: KernelSplit, sig: Hashable, slices: int, cores: int) -> _Candidate:
        """A K split into `slices` priced: the slowest core's partial product, then the NoC
        copies of the partials each reducing core does not hold, then the slowest core's
        reduction (with the fused epilogue); weights and operands as for any cut."""
        req = ks.request
        p_req, r_req = ksplit.requests(req, slices)
        out_elems = math.prod(req.info.out_shapes[0])
        n_steps = len(ks.epilogue) + (len(r_req.extra_shapes) > len(req.extra_shapes))
        p_macs = out_elems * ksplit.reduction_depth(req.info)
        r_macs = slices * out_elems + out_elems * n_steps
        r_epilogue = (req.info.out_dtypes[0],) * n_steps
        size = _itemsize(req.info.out_dtypes[0])
        partial, p_cycles = self._k_tiles(
            p_req, {0: slices}, cores // slices, "hmx", p_macs, (), lambda tiles: 0.0
        )

        def reduction(tiles: list[TileSpec]) -> float:
            moved, pieces = ksplit.reduction_bytes(partial, tiles, size)
            used = max(1, len({t.core for t in tiles}))
            return max(moved / self.noc, moved / (used * self.engine)) + (
                DESCRIPTOR * pieces / used
            )

        reduce, r_cycles = self._k_tiles(r_req, {}, cores, "hvx", r_macs, r_epilogue, reduction)
        tiles = ksplit.as_kernel_operands(req.info, len(ks.inputs), partial, reduce)
        cand = self._price_assigned(ks, {}, tiles, [*p_cycles, *r_cycles])
        cand.tiles = tiles
        cand.busiest = ksplit.HOP + ksplit.MARGIN * (
            _busiest(partial, p_cycles) + reduction(reduce) + _busiest(reduce, r_cycles)
        )
        cand.key = (sig, ("k", slices), 0)
        cand.kchoice = ksplit.KChoice(slices, partial, reduce)
        for core in range(req.num_cores):
            boxes = [t.out_box for t in reduce if t.core == core]
            bound = bounding_box(boxes) if boxes else None
            if bound is not None and sum(_volume(b) for b in boxes) == _volume(bound):
                cand.held[(core, 0)] = bound
            else:
                cand.held[(core, 0)] = None
                cand.held_all[(core, 0)] = boxes
        return cand

    def _k_tiles(
        self,
        req: TilingRequest,
        fixed: dict[int, int],
        spread: int,
        unit: str,
        macs: int,
        epilogue: tuple[str, ...],
        extra: Callable[[list[TileSpec]], float],
    ) -> tuple[list[TileSpec], list[float]]:
        """The fastest cut of one of a K split's kernels: `fixed` parts times every way to
        cut the other axes into `spread` parts (or fewer, dividing it), refined to fit VTCM;
        the tiles (cores assigned) and each one's compute cycles. `extra` prices what else
        depends on the cut (the reduction's transfers)."""
        cores = self.cores(req)
        axes = [a for a in split_axes(req) if a not in fixed]
        shape = req.info.out_shapes[0]
        limit = {a: shape[a] for a in axes}
        options: list[dict[int, int]] = [{}]
        for n in sorted({d for d in range(2, spread + 1) if spread % d == 0}):
            options.extend(_factorizations(n, axes, limit) if axes else [])
        best: tuple[float, list[TileSpec], list[float]] | None = None
        tried: set[tuple[tuple[int, int], ...]] = set()
        probes: Probes = {}
        failure: CompileError | None = None
        for option in options:
            try:
                parts = fit_tiles(req, {**fixed, **option}, probes)
            except CompileError as exc:
                if exc.code != "vtcm_overflow":
                    raise
                failure = exc
                continue
            key = tuple(sorted(parts.items()))
            if key in tried:
                continue
            tried.add(key)
            tiles = assign_cores(tiles_of(req, parts), cores, 0)
            costs: dict[tuple[int, ...], float] = {}
            cycles = []
            for t in tiles:
                tile_shape = tuple(b - a for a, b in t.out_box)
                c = costs.get(tile_shape)
                if c is None:
                    c = costs[tile_shape] = (
                        tile_cost(
                            req.info,
                            unit,
                            macs,
                            epilogue,
                            t.out_box,
                            t.in_boxes,
                            req.opdef,
                            self.device,
                        ).cycles
                        + LAUNCH
                    )
                cycles.append(c)
            time = _busiest(tiles, cycles) + extra(tiles)
            if best is None or time < best[0]:
                best = (time, tiles, cycles)
        if best is None:
            assert failure is not None
            raise failure
        return best[1], best[2]

    def _price_assigned(
        self, ks: KernelSplit, parts: dict[int, int], tiles: Sequence[_Tiled], cycles: list[float]
    ) -> _Candidate:
        req = ks.request
        compute: dict[int, float] = {}
        by_core: dict[int, list[_Tiled]] = {}
        dtypes = (*req.info.in_dtypes, *req.extra_dtypes)
        kinds = ks.kinds
        weights = [i for i, kind in enumerate(kinds) if kind == "constant" and i not in req.indexed]
        for t, c in zip(tiles, cycles, strict=True):
            core = t.core
            found = by_core.get(core)
            if found is None:
                by_core[core] = [t]
                compute[core] = 0.0 + c
            else:
                found.append(t)
                compute[core] += c
        weight_bytes = 0
        streamed = 0
        engine = 0
        for i in weights:
            worst = 0
            dtype = dtypes[i]
            distinct: set[Box] = set()
            for ts in by_core.values():
                # a core's tiles mostly read one box of a weight (their output channels)
                unique: set[Box] = set()
                for t in ts:  # a loop: a comprehension is a function call of its own
                    if i < len(t.in_boxes) and (box := t.in_boxes[i]) is not None:
                        unique.add(box)
                if len(unique) == 1:
                    (only,) = unique
                    nbytes = _bytes(only, dtype)
                    worst = worst if worst > nbytes else nbytes
                    engine = engine if engine > nbytes else nbytes
                elif unique:
                    nbytes = _bytes(bounding_box(list(unique)), dtype)
                    worst = worst if worst > nbytes else nbytes
                    nbytes = sum(_bytes(b, dtype) for b in unique)
                    engine = engine if engine > nbytes else nbytes
                distinct |= unique
            weight_bytes += worst
            streamed += sum(_bytes(b, dtype) for b in distinct)
        stream = max(streamed / self.ddr, engine / self.engine)
        held: dict[tuple[int, int], Box | None] = {}
        busiest = max(compute.values(), default=0.0)
        return _Candidate(
            parts, None, compute, weight_bytes, stream, by_core, True, held=held, busiest=busiest
        )

    def _held(self, cand: _Candidate, ks: KernelSplit, core: int, slot: int) -> list[Box]:
        """The boxes of output `slot` that `cand` leaves on `core`: one bounding box when the
        core's tiles tile it exactly (the usual case), else each tile's."""
        key = (core, slot)
        if key not in cand.held:
            req = ks.request
            boxes = [
                output_boxes(req.opdef, req.info, t.out_box)[slot]
                for t in cand.by_core.get(core, [])
            ]
            bound = bounding_box(boxes) if boxes else None
            total = 0
            for b in boxes:  # a loop, not a generator
                total += _volume(b)
            if bound is not None and total == _volume(bound):
                cand.held[key] = bound
            else:
                cand.held[key] = None
                cand.held_all[key] = boxes
        found = cand.held[key]
        return [found] if found is not None else cand.held_all.get(key, [])

    def _held_by_core(self, cand: _Candidate, ks: KernelSplit, slot: int) -> dict[int, list[Box]]:
        """`_held` of every core with tiles (the others hold nothing), once per slot."""
        found = cand.held_by_core.get(slot)
        if found is None:
            found = cand.held_by_core[slot] = {
                core: self._held(cand, ks, core, slot) for core in cand.by_core
            }
        return found

    # -------------------------------------------------------------------------- pricing

    def _move(self, k: int, cand: _Candidate, chosen: list[_Candidate | None]) -> float:
        """Cycles to bring the operands the cores do not hold: every distinct byte once
        over the NoC (from other cores) or DDR (graph inputs), a multicast feeding every core
        that needs it, the senders' DMA engines sharing the work. Each operand's price
        depends only on its own producer's cut, and is kept per (operand, that cut)."""
        ks = self.kernels[k]
        total = 0.0
        for i, source in self._moved[k]:
            producer = chosen[source] if source >= 0 else None
            key = (i, id(producer))
            found = cand.moves.get(key)
            if found is None:
                alike = (
                    cand.key,
                    i,
                    None if producer is None else producer.key,
                    ks.reshaped[i],
                    ks.slots[i],
                    ks.nbytes[i],
                )
                found = self._moves.get(alike)
                if found is None:
                    found = self._moves[alike] = self._operand_move(ks, cand, i, producer)
                cand.moves[key] = found
            total += found[0]
            total += found[1]
        return total

    def _operand_move(
        self, ks: KernelSplit, cand: _Candidate, i: int, producer: _Candidate | None
    ) -> tuple[float, float]:
        """(transfer cycles, descriptor cycles) of operand `i`."""
        kind = ks.kinds[i]
        dtype = (*ks.request.info.in_dtypes, *ks.request.extra_dtypes)[i]
        if dtype is None:
            return 0.0, 0.0
        size = _itemsize(dtype)
        cores = len(cand.by_core) or 1
        # what the producer's cut leaves on each core is read in place
        local = producer if kind == "chip" and not ks.reshaped[i] else None
        remote = 0
        pieces = 0
        reads = cand.reads.get(i)
        if reads is None:
            reads = cand.reads[i] = _reads(cand.by_core, i)
        if local is None:  # nothing is read in place: every distinct box moves
            for _, total, count in reads:
                remote += total * size
                pieces += count
        else:
            held_by_core = self._held_by_core(local, self.kernels[ks.producers[i]], ks.slots[i])
            for core, (boxes, _, _) in zip(cand.by_core, reads, strict=True):
                held = held_by_core.get(core, ())
                for box, need in boxes:
                    for p in held:
                        # the overlap of `box` with what the core holds (inlined `_overlap`;
                        # a 4-d box, a feature map's, unrolled: ~6,000 overlaps per compile)
                        if len(box) == 4:
                            (a0, a1), (b0, b1), (c0, c1), (d0, d1) = box
                            (e0, e1), (f0, f1), (g0, g1), (h0, h1) = p
                            n = (a1 if a1 < e1 else e1) - (a0 if a0 > e0 else e0)
                            if n > 0:
                                d = (b1 if b1 < f1 else f1) - (b0 if b0 > f0 else f0)
                                n = n * d if d > 0 else 0
                            if n > 0:
                                d = (c1 if c1 < g1 else g1) - (c0 if c0 > g0 else g0)
                                n = n * d if d > 0 else 0
                            if n > 0:
                                d = (d1 if d1 < h1 else h1) - (d0 if d0 > h0 else h0)
                                n = n * d if d > 0 else 0
                            if n > 0:
                                need -= n
                            continue
                        n = 1
                        for (a0, a1), (b0, b1) in zip(box, p, strict=True):
                            d = (a1 if a1 < b1 else b1) - (a0 if a0 > b0 else b0)
                            if d <= 0:
                                n = 0
                                break
                            n *= d
                        need -= n
                    if need > 0:
                        remote += need * size
                        pieces += 1
        if not remote:
            return 0.0, 0.0
        distinct = remote if remote < ks.nbytes[i] else ks.nbytes[i]
        rate = self.ddr if kind == "ddr" else self.noc
        a, b = distinct / rate, distinct / (cores * self.engine)
        return (b if b > a else a), DESCRIPTOR * pieces / cores

    def _time(self, k: int, cand: _Candidate, chosen: list[_Candidate | None]) -> float:
        move = self._move(k, cand, chosen)
        return cand.busiest + move

    def _pick(self, price: float) -> tuple[list[_Candidate], int]:
        """Each kernel's cheapest cut when a resident byte costs `price` cycles (its weights
        stream instead where that is cheaper); the resident bytes per core it adds up to.

        A candidate's transfers are priced only if it can still win: its compute plus its
        weights' price is a lower bound on its total (transfers add a non-negative time, and
        rounded float additions are monotone), so candidates are visited by that bound and
        the visit stops at the first whose bound exceeds the cheapest total found; the
        choice is the one a full pass would make (ties to the first in list order)."""
        chosen: list[_Candidate | None] = [None] * len(self.kernels)
        total = 0
        for k, cands in enumerate(self.candidates):
            best = cands[0]
            if len(cands) > 1:
                # a kernel's times depend only on its producers' cuts, mostly the same from
                # one price to the next: kept per choice of producers, each when first needed
                ids: list[int] = []
                for _, s in self._moved[k]:  # a loop, not a generator (a frame of its own)
                    ids.append(id(chosen[s]) if s >= 0 else 0)
                producers = tuple(ids)
                times = self._times[k].get(producers)
                if times is None:
                    times = self._times[k][producers] = [None] * len(cands)
                # a cut not built yet has no weight price: its compute alone bounds it
                # (a negative price, which only tests ask for, bounds nothing)
                unbuilt = 0.0 if price >= 0 else -math.inf
                bounds = [
                    c.busiest + (c.stream if c.stream < price * c.resident else price * c.resident)
                    if c.built
                    else c.busiest + unbuilt
                    for c in cands
                ]
                lowest: tuple[float, bool, int, int] | None = None
                # a stem's tie goes to the cut that keeps its channels whole: its consumers
                # (a pool, convs cut by rows) read that in place, a channel cut they gather
                stem = self._stem[k]
                for j in sorted(range(len(cands)), key=bounds.__getitem__):
                    if lowest is not None and bounds[j] > lowest[0]:
                        break
                    c = cands[j]
                    if not c.built:
                        self._ready(c)
                    t = times[j]
                    if t is None:
                        t = times[j] = self._time(k, c, chosen)
                    weight = price * c.resident
                    key = (
                        t + (c.stream if c.stream < weight else weight),
                        stem and 1 in c.parts,
                        c.resident,
                        j,
                    )
                    if lowest is None or key < lowest:
                        best, lowest = c, key
            if not best.built:
                self._ready(best)
            chosen[k] = best
            if price * best.resident <= best.stream:
                total += best.resident
        return [c for c in chosen if c is not None], total

    def choose(self) -> list[list[TileSpec]]:
        picked, total = self._pick(0.0)
        if total > self.room:
            low, high = 0.0, 1.0
            while True:
                trial, used = self._pick(high)
                if used <= self.room or high > 1e6:
                    break
                low, high = high, high * 8
            best = trial
            for _ in range(8):
                mid = math.sqrt(low * high) if low > 0 else high / 8
                trial, used = self._pick(mid)
                if used <= self.room:
                    best, high = trial, mid
                else:
                    low = mid
            picked = best
        self.picked = picked
        return [list(self._tiles(c)) for c in picked]


def _fresh(shared: _Candidate) -> _Candidate:
    """A kernel's own copy of a shared candidate: everything shared but its transfer prices."""
    cand = _Candidate.__new__(_Candidate)
    cand.__dict__.update(shared.__dict__)  # copy.copy's result, without its __reduce_ex__
    cand.moves = {}
    return cand


def _reads(
    by_core: dict[int, list[_Tiled]], i: int
) -> list[tuple[list[tuple[Box, int]], int, int]]:
    """Per core (in `by_core`'s order), the distinct boxes its tiles read of operand `i`,
    each with its elements; their total elements and how many are not empty."""
    out: list[tuple[list[tuple[Box, int]], int, int]] = []
    for tiles in by_core.values():
        seen: set[Box] = set()
        boxes: list[tuple[Box, int]] = []
        total = count = 0
        for t in tiles:
            box = t.in_boxes[i]
            if box is None or box in seen:
                continue
            seen.add(box)
            if len(box) == 4:  # a feature map's box, unrolled
                (a0, a1), (b0, b1), (c0, c1), (d0, d1) = box
                n = (a1 - a0) * (b1 - b0) * (c1 - c0) * (d1 - d0)
            else:
                n = 1
                for a, b in box:
                    n *= b - a
            boxes.append((box, n))
            if n > 0:
                total += n
                count += 1
        out.append((boxes, total, count))
    return out


def _busiest(tiles: list[TileSpec], cycles: list[float]) -> float:
    per_core: dict[int, float] = {}
    for t, c in zip(tiles, cycles, strict=True):
        per_core[t.core] = per_core.get(t.core, 0.0) + c
    return max(per_core.values(), default=0.0)


def _signature(ks: KernelSplit) -> Hashable:
    """Everything a kernel's cuts and tile costs depend on, without its name, its place in
    the program (`rotate` only picks the first core) or its operands' tensor ids."""
    req = ks.request
    info = req.info
    sig = (
        info.op_type,
        info.domain,
        info.opset,
        _frozen(info.attrs),
        info.in_shapes,
        info.in_dtypes,
        info.out_shapes,
        info.out_dtypes,
        tuple(sorted((i, _const_key(v)) for i, v in info.consts.items())),
        id(req.opdef),
        req.extra_shapes,
        req.extra_dtypes,
        req.num_cores,
        req.ols,
        req.mos,
        req.budget,
        req.granularity,
        req.indexed,
        ks.unit,
        ks.macs,
        ks.epilogue,
        ks.epilogue_ops,
        ks.kinds,
    )
    try:
        hash(sig)
    except TypeError:  # an attribute we cannot freeze: this kernel shares with no other
        return ("unshared", id(ks))
    return sig


VALUE_CONSTS = 32
"""Constant inputs up to this many elements enter a kernel's signature by value (tiling rules
read axes, pads, slice bounds and scales: at most 2 x rank numbers); larger ones (a conv's
bias) by dtype and shape only, so identical layers with different biases share their cuts."""


def _const_key(value: np.ndarray) -> Hashable:
    if value.size <= VALUE_CONSTS:
        return _frozen(value)
    return ("large", value.dtype.str, value.shape)


def _frozen(value: object) -> Hashable:
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, np.generic):
        return value.item()
    return value  # type: ignore[return-value]


def shape_of(box: Box) -> tuple[int, ...]:
    return box_shape(box)
