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
from dataclasses import dataclass, field

import numpy as np

from compiler_core.costmodel import tile_cost
from compiler_core.devices import DeviceProfile
from compiler_core.errors import CompileError
from compiler_core.lowering.tiling import (
    Probes,
    TileSpec,
    TilingRequest,
    assign_cores,
    fit_tiles,
    output_boxes,
    split_axes,
    tiles_of,
)
from compiler_core.lowering.tiling import _tile as _tile_spec
from compiler_core.ops.registry import Box, box_shape

DESCRIPTOR = 24
LAUNCH = 16
KEEP = 5
"""Candidates priced in full per kernel (the fastest by compute alone)."""


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


def _bounding(boxes: list[Box]) -> Box:
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


@dataclass
class _Candidate:
    parts: dict[int, int]
    tiles: list[TileSpec]
    compute: dict[int, float]
    resident: int
    """Weight bytes every core gives this kernel if its weights stay resident."""
    stream: float
    """Cycles per inference its weights take if they stream from DDR instead."""
    by_core: dict[int, list[TileSpec]] = field(default_factory=dict)
    moves: dict[tuple[int, ...], float] = field(default_factory=dict)
    held: dict[tuple[int, int], Box | None] = field(default_factory=dict)
    held_all: dict[tuple[int, int], list[Box]] = field(default_factory=dict)


def _factorizations(n: int, axes: list[int], limit: dict[int, int]) -> list[dict[int, int]]:
    out: list[dict[int, int]] = []
    for r in range(1, min(3, len(axes)) + 1):
        for chosen in itertools.combinations(axes, r):
            for split in _products(n, r):
                if all(p <= limit[a] for a, p in zip(chosen, split, strict=True)):
                    out.append({a: p for a, p in zip(chosen, split, strict=True) if p > 1})
    return out


def _products(n: int, r: int) -> list[tuple[int, ...]]:
    if r == 1:
        return [(n,)]
    out: list[tuple[int, ...]] = []
    for d in range(1, n + 1):
        if n % d == 0:
            out.extend((d, *rest) for rest in _products(n // d, r - 1))
    return out


class SplitChooser:
    def __init__(
        self,
        kernels: list[KernelSplit],
        device: DeviceProfile,
        room: int,
        active: int | None = None,
    ) -> None:
        """`active`: use only the first `active` cores (the rest idle)."""
        self.kernels = kernels
        self.active = active
        self.device = device
        self.room = room
        self.engine = float(device.dma_bytes_per_cycle)
        self.noc = device.noc_bandwidth_bytes_per_s / device.clock_hz
        self.ddr = device.ddr_bandwidth_bytes_per_s / device.clock_hz
        self.candidates = [self._candidates(k) for k in kernels]

    def cores(self, req: TilingRequest) -> int:
        return min(self.active or req.num_cores, req.num_cores)

    # ----------------------------------------------------------------------- candidates

    def _candidates(self, ks: KernelSplit) -> list[_Candidate]:
        req = ks.request
        axes = split_axes(req)
        if not axes:
            return [self._candidate(ks, {})]
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
            for parts in _factorizations(n, axes, limit):
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
            return [self._candidate(ks, {})]
        # price in full the fastest few, and the one that spreads weights most
        quick.sort(key=lambda q: (q[0], q[1]))
        kept = quick[:KEEP]
        widest = min(quick, key=lambda q: (q[1], q[0]))
        if widest not in kept:
            kept.append(widest)
        return [self._candidate(ks, parts) for _, _, parts in kept]

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
        tile = _tile_spec(req, tuple(box))
        cost = tile_cost(
            req.info,
            ks.unit,
            ks.macs,
            ks.epilogue,
            tile.out_box,
            tile.in_boxes,
            req.opdef,
            self.device,
        )
        return per_core * (cost.cycles + LAUNCH)

    def _candidate(self, ks: KernelSplit, parts: dict[int, int]) -> _Candidate:
        req = ks.request
        tiles = assign_cores(tiles_of(req, parts), self.cores(req), req.rotate)
        opdef = req.opdef
        compute: dict[int, float] = {}
        by_core: dict[int, list[TileSpec]] = {}
        resident: dict[int, dict[int, list[Box]]] = {}
        dtypes = (*req.info.in_dtypes, *req.extra_dtypes)
        costs: dict[tuple[int, ...], float] = {}
        for t in tiles:
            by_core.setdefault(t.core, []).append(t)
            key = tuple(b - a for a, b in t.out_box)
            cycles = costs.get(key)
            if cycles is None:
                cycles = (
                    tile_cost(
                        req.info,
                        ks.unit,
                        ks.macs,
                        ks.epilogue,
                        t.out_box,
                        t.in_boxes,
                        opdef,
                        self.device,
                    ).cycles
                    + LAUNCH
                )
                costs[key] = cycles
            compute[t.core] = compute.get(t.core, 0.0) + cycles
            for i, box in enumerate(t.in_boxes):
                if box is not None and ks.kinds[i] == "constant" and i not in req.indexed:
                    resident.setdefault(i, {}).setdefault(t.core, []).append(box)
        weight_bytes = 0
        distinct: set[tuple[int, Box]] = set()
        engine = 0
        for i, per_core in resident.items():
            worst = 0
            for boxes in per_core.values():
                worst = max(worst, _bytes(_bounding(boxes), dtypes[i]))
                engine = max(engine, sum(_bytes(b, dtypes[i]) for b in set(boxes)))
                distinct.update((i, b) for b in boxes)
            weight_bytes += worst
        streamed = sum(_bytes(b, dtypes[i]) for i, b in distinct)
        stream = max(streamed / self.ddr, engine / self.engine)
        held: dict[tuple[int, int], Box | None] = {}
        return _Candidate(parts, tiles, compute, weight_bytes, stream, by_core, held=held)

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
            bound = _bounding(boxes) if boxes else None
            if bound is not None and sum(_volume(b) for b in boxes) == _volume(bound):
                cand.held[key] = bound
            else:
                cand.held[key] = None
                cand.held_all[key] = boxes
        found = cand.held[key]
        return [found] if found is not None else cand.held_all.get(key, [])

    # -------------------------------------------------------------------------- pricing

    def _move(self, k: int, cand: _Candidate, chosen: list[_Candidate | None]) -> float:
        """Cycles to bring the operands the cores do not hold: every distinct byte once
        over the NoC (from other cores) or DDR (graph inputs), a multicast feeding every core
        that needs it, the senders' DMA engines sharing the work."""
        ks = self.kernels[k]
        key = tuple(id(chosen[p]) if p >= 0 and chosen[p] is not None else -1 for p in ks.producers)
        if key in cand.moves:
            return cand.moves[key]
        dtypes = (*ks.request.info.in_dtypes, *ks.request.extra_dtypes)
        cores = max(1, len(cand.by_core))
        total = 0.0
        for i, tid in enumerate(ks.inputs):
            kind = ks.kinds[i]
            if tid < 0 or kind in ("constant", "none"):
                continue
            dtype = dtypes[i]
            producer = chosen[ks.producers[i]] if ks.producers[i] >= 0 else None
            remote = 0
            pieces = 0
            for core, tiles in cand.by_core.items():
                seen: set[Box] = set()
                for t in tiles:
                    box = t.in_boxes[i]
                    if box is None or box in seen:
                        continue
                    seen.add(box)
                    need = _bytes(box, dtype)
                    if kind == "chip" and producer is not None and not ks.reshaped[i]:
                        source = self.kernels[ks.producers[i]]
                        held = sum(
                            _overlap(box, p)
                            for p in self._held(producer, source, core, ks.slots[i])
                        )
                        need -= held * _itemsize(dtype) if dtype else 0
                    if need > 0:
                        remote += need
                        pieces += 1
            if not remote:
                continue
            distinct = min(remote, ks.nbytes[i])
            rate = self.ddr if kind == "ddr" else self.noc
            total += max(distinct / rate, distinct / (cores * self.engine))
            total += DESCRIPTOR * pieces / cores
        cand.moves[key] = total
        return total

    def _time(self, k: int, cand: _Candidate, chosen: list[_Candidate | None]) -> float:
        move = self._move(k, cand, chosen)
        return max((c for c in cand.compute.values()), default=0.0) + move

    def _pick(self, price: float) -> tuple[list[_Candidate], int]:
        """Each kernel's cheapest cut when a resident byte costs `price` cycles (its weights
        stream instead where that is cheaper); the resident bytes per core it adds up to."""
        chosen: list[_Candidate | None] = [None] * len(self.kernels)
        total = 0
        for k, cands in enumerate(self.candidates):
            best = min(
                cands,
                key=lambda c: (
                    self._time(k, c, chosen) + min(price * c.resident, c.stream),
                    c.resident,
                ),
            )
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
        return [c.tiles for c in picked]


def shape_of(box: Box) -> tuple[int, ...]:
    return box_shape(box)
