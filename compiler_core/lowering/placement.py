"""Decide where data lives, within each core's VTCM budget, and build the schedule.

Two decisions, made in this order:

1. Activations stay on chip. Every intermediate tensor starts in the VTCM of the cores that
   produce it (its consumers read it there, over the NoC when they run elsewhere). When the
   buffers live at the same time do not fit the budget, the largest tensors live at the
   fullest step are spilled to DDR until they do.
2. Weights stay resident. With what room is left, the weights that would cost the most DDR
   traffic per inference for the VTCM they take are kept resident across inferences (loaded
   once when the program is activated); the rest stream from DDR every inference.

`CodegenPolicy` switches each optimisation off (tests prove each one right by comparing).
"""

from __future__ import annotations

from dataclasses import dataclass

from compiler_core.errors import CompileError
from compiler_core.lowering.emit import (
    BuildMemo,
    Placement,
    Schedule,
    build_schedule,
    consumers_of,
)
from compiler_core.lowering.lowered import LoweredGraph
from compiler_core.lowering.program import (
    KIND_ACTIVATION,
    KIND_CONSTANT,
    KIND_OUTPUT,
    LINK_KERNEL,
    box_nbytes,
)
from compiler_core.lowering.splits import bounding_box
from compiler_core.lowering.vtcm import Allocation, Buffer, align, allocate
from compiler_core.ops.registry import Box

WEIGHTS_AHEAD = 1
"""Streamed weights load up to this many kernels ahead of the one that reads them (fewer
when VTCM is short): DDR keeps streaming while the kernels in between compute."""
MIN_SAVING = 16
"""A weight stays resident only if an inference would stream at least 1/16 of its size (a
lookup table read a few rows at a time is left in DDR for the gather DMA)."""


@dataclass(frozen=True)
class CodegenPolicy:
    """What the code generator may do; everything is on by default."""

    residency: bool = True
    on_chip: bool = True
    multicast: bool = True
    double_buffer: bool = True
    k_splits: bool = True
    """Reduction-axis splits of MatMul/Gemm where faster (lowering/ksplit.py)."""


@dataclass(frozen=True)
class Planned:
    schedule: Schedule
    allocation: Allocation
    spilled: dict[int, int]
    """Activations that did not fit on chip: root -> bytes per core they would have taken."""
    streamed: dict[tuple[int, int], int]
    """Weights not kept resident: (layer, slot) -> resident bytes they would have taken."""


def _eligible(graph: LoweredGraph) -> set[int]:
    consumers = consumers_of(graph)
    produced = {t for lk in graph.kernels for t in lk.desc.outputs if t >= 0}
    linked = {  # read and written by link transfers, which move DDR to DDR
        graph.root(t)
        for lk in graph.kernels
        if lk.desc.kernel == LINK_KERNEL
        for t in (*lk.desc.inputs, *lk.desc.outputs)
        if t >= 0
    }
    return {
        t.id
        for t in graph.tensors
        if t.kind in (KIND_ACTIVATION, KIND_OUTPUT)
        and t.alias_of is None
        and t.id in produced
        and t.nbytes > 0
        and consumers.get(t.id)
        and t.id not in linked
    }


def _weights(graph: LoweredGraph) -> dict[tuple[int, int], tuple[int, int]]:
    """Weight operands: (layer, slot) -> (VTCM bytes if resident, DDR bytes per inference if
    streamed, counting each box a core needs once). A layer's image-group clones (see
    `depth_first`) share one resident copy and would each stream it."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for k, lk in enumerate(graph.kernels):
        for i, tid in enumerate(lk.desc.inputs):
            if tid < 0 or graph.tensors[graph.root(tid)].kind != KIND_CONSTANT:
                continue
            dtype = graph.tensors[tid].dtype
            per_core: dict[int, list] = {}
            gathered = lk.request is not None and i in lk.request.indexed
            for tile in lk.tiles:
                box = tile.out_box if gathered else tile.in_boxes[i]
                if box is not None:
                    per_core.setdefault(tile.core, []).append(box)
            if not per_core:
                continue
            cost = 0
            traffic = 0
            sizes: dict[Box, int] = {}
            for boxes in per_core.values():
                previous = None
                loads = 0
                for b in boxes:
                    if b != previous:
                        n = sizes.get(b)
                        if n is None:
                            n = sizes[b] = box_nbytes(b, dtype)
                        traffic += n
                        loads += 1
                    previous = b
                # a core that loads one box (its tiles' output channels) keeps just that box
                held = sizes[boxes[0]] if loads == 1 else box_nbytes(bounding_box(boxes), dtype)
                cost = held if held > cost else cost
            if gathered:  # a lookup table streams only the rows it is asked for
                cost = max(
                    box_nbytes(b, dtype) for tile in lk.tiles if (b := tile.in_boxes[i]) is not None
                )
            key = (graph.layer(k), i)
            if key in out:  # another clone of the layer: same tiles, streamed again
                cost = max(cost, out[key][0])
                traffic += out[key][1]
            out[key] = (align(cost), traffic)
    return out


def plan_schedule(graph: LoweredGraph, budget: int, policy: CodegenPolicy) -> Planned:
    """The schedule that keeps the most on chip within `budget` bytes of VTCM per core."""
    chip = set(_eligible(graph)) if policy.on_chip else set()
    spilled: dict[int, int] = {}

    prefetch = True
    ahead = WEIGHTS_AHEAD
    memo = BuildMemo()

    def build(
        resident: frozenset[tuple[int, int]], double: bool, buffers_only: bool = False
    ) -> tuple[Schedule, Allocation]:
        placement = Placement(
            chip=frozenset(chip),
            resident=resident,
            double_buffer=double,
            multicast=policy.multicast,
            prefetch=prefetch,
            weights_ahead=ahead,
        )
        schedule = build_schedule(graph, placement, buffers_only, memo)
        return schedule, allocate(schedule.buffers)

    # what fits is decided on the buffers alone; ops are written once the placement is known
    double = policy.double_buffer
    schedule, allocation = build(frozenset(), double, True)
    while allocation.peak > budget and chip:
        victims = _spill_victims(schedule.buffers, schedule.chip_bytes, budget)
        if not victims:
            break
        for root in victims:
            spilled[root] = schedule.chip_bytes.get(root, 0)
            chip.discard(root)
        schedule, allocation = build(frozenset(), double, True)
    while allocation.peak > budget and ahead > 1:
        ahead -= 1
        schedule, allocation = build(frozenset(), double, True)
    if allocation.peak > budget and double:
        double = False
        schedule, allocation = build(frozenset(), double, True)
    if allocation.peak > budget:
        prefetch = False
        schedule, allocation = build(frozenset(), double, True)
    if allocation.peak > budget:
        raise _overflow(schedule.buffers, allocation, budget)

    weights = _weights(graph) if policy.residency else {}
    resident: set[tuple[int, int]] = set()
    room = budget - allocation.peak
    # Most DDR traffic saved per byte of VTCM first. Ties are spread over the program (every
    # other layer, then every fourth...), so streamed weights fall between resident ones and
    # load while those compute instead of all at the end.
    order = {key: _spread(i) for i, key in enumerate(sorted(weights))}
    for key, (cost, traffic) in sorted(
        weights.items(),
        key=lambda kv: (-round(kv[1][1] / max(1, kv[1][0]), 2), order[kv[0]]),
    ):
        if cost <= room and traffic * MIN_SAVING >= cost:
            resident.add(key)
            room -= cost
    while resident:
        trial, trial_alloc = build(frozenset(resident), double)
        if trial_alloc.peak <= budget:
            schedule, allocation = trial, trial_alloc
            break
        # packing lost some room: give up the least valuable resident weights
        worst = min(resident, key=lambda key: (weights[key][1] / max(1, weights[key][0]), key))
        resident.discard(worst)
    else:
        schedule, allocation = build(frozenset(), double)
    streamed = {key: weights[key][0] for key in weights if key not in resident}
    return Planned(schedule, allocation, spilled, streamed)


def _spread(i: int) -> float:
    """The van der Corput sequence: 0, 1/2, 1/4, 3/4, 1/8...: position i of an order that
    keeps every prefix spread evenly."""
    out, base = 0.0, 0.5
    while i:
        if i & 1:
            out += base
        i >>= 1
        base /= 2
    return out


def _spill_victims(buffers: list[Buffer], chip_bytes: dict[int, int], budget: int) -> list[int]:
    """On-chip activations to move to DDR: the largest live where the allocation overflows."""
    over = [b for b in buffers if b.offset + align(max(b.size, 1)) > budget]
    if not over:
        return []
    lo = min(b.first for b in over)
    hi = max(b.last for b in over)
    live = sorted(
        (
            b
            for b in buffers
            if not b.resident and b.root in chip_bytes and b.first <= hi and lo <= b.last
        ),
        key=lambda b: (-b.size, b.id),
    )
    excess = max(b.offset + align(max(b.size, 1)) for b in over) - budget
    victims: list[int] = []
    for b in live:
        victims.append(b.root)
        excess -= align(b.size)
        if excess <= 0:
            break
    return victims


def _overflow(buffers: list[Buffer], allocation: Allocation, budget: int) -> CompileError:
    from compiler_core.lowering.vtcm import peak_demand

    demand, step = peak_demand(buffers)
    live = sorted(
        (b for b in buffers if not b.resident and b.first <= step <= b.last),
        key=lambda b: -b.size,
    )
    kernel = step // 2
    names = ", ".join(f"{b.what} ({b.size:,} B)" for b in live[:4])
    return CompileError(
        "vtcm_overflow",
        f"kernel {kernel} needs {allocation.peak:,} bytes of VTCM per core at once "
        f"({allocation.peak - budget:,} bytes more than the {budget:,}-byte budget): {names}",
        details={"needed": allocation.peak, "budget": budget},
    )
