"""VTCM buffers and their placement: one offset per buffer, the same on every core.

A buffer lives over an interval of the schedule (in steps: kernel k prefetches in step 2k and
computes in step 2k+1). Buffers whose intervals overlap never share bytes; the others may.
Offsets are symmetric across cores (each buffer is sized for the core that needs the most),
so a multicast can write the same offset on every core it feeds. Resident buffers (constants
kept across inferences) sit at the bottom, [0, resident), for the whole program.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ALIGN = 128
"""VTCM buffers start on HVX vector boundaries."""

FOREVER = 1 << 40


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Buffer:
    id: int
    size: int
    """Bytes per core (the most any core puts in it)."""
    first: int
    last: int
    resident: bool = False
    what: str = ""
    """What it holds, for messages: 'weights of conv1', 'output of relu3'..."""
    root: int = -1
    """The on-chip activation it holds, when it is a producer's output buffer."""
    offset: int = -1


def step_of(kernel: int, compute: bool) -> int:
    return 2 * kernel + (1 if compute else 0)


@dataclass(frozen=True)
class Allocation:
    resident: int
    """Bytes of the resident region [0, resident)."""
    peak: int
    """The highest byte any buffer reaches."""


def allocate(buffers: list[Buffer]) -> Allocation:
    """Give every buffer an offset: resident ones first, packed from 0; then the others,
    largest first, each at the lowest offset free of every buffer live at the same time."""
    cursor = 0
    for buf in sorted((b for b in buffers if b.resident), key=lambda b: b.id):
        buf.offset = cursor
        cursor = align(cursor + buf.size)
    resident = cursor
    order = sorted((b for b in buffers if not b.resident), key=lambda b: (-b.size, b.first, b.id))
    # the buffers placed so far, as arrays: one comparison finds those live with the next
    firsts = np.array([b.first for b in order], dtype=np.int64)
    lasts = np.array([b.last for b in order], dtype=np.int64)
    sizes = np.array([align(max(b.size, 1)) for b in order], dtype=np.int64)
    offsets = np.zeros(len(order), dtype=np.int64)
    peak = resident
    for n, buf in enumerate(order):
        size = int(sizes[n])
        live = (lasts[:n] >= buf.first) & (firsts[:n] <= buf.last)
        offset = _lowest_gap(offsets[:n][live], sizes[:n][live], size, resident)
        buf.offset = offset
        offsets[n] = offset
        peak = max(peak, offset + size)
    return Allocation(resident=resident, peak=peak)


def _lowest_gap(offsets: np.ndarray, sizes: np.ndarray, size: int, floor: int) -> int:
    """The lowest offset >= `floor` where `size` bytes fit between the placed buffers
    [offset, offset + size): walking them by offset, the first gap before one of them that
    is large enough, else the end of the highest."""
    if not len(offsets):
        return floor
    order = np.lexsort((sizes, offsets))
    starts = offsets[order]
    reach = np.maximum(np.maximum.accumulate(starts + sizes[order]), floor)
    before = np.empty_like(reach)
    before[0] = floor
    before[1:] = reach[:-1]
    fits = np.flatnonzero(before + size <= starts)
    return int(before[fits[0]]) if len(fits) else int(reach[-1])


def peak_demand(buffers: list[Buffer]) -> tuple[int, int]:
    """The most bytes live at one step (a lower bound of any allocation) and that step."""
    events: dict[int, int] = {}
    for b in buffers:
        if b.resident:
            continue
        events[b.first] = events.get(b.first, 0) + align(b.size)
        events[b.last + 1] = events.get(b.last + 1, 0) - align(b.size)
    live = best = 0
    at = 0
    for step in sorted(events):
        live += events[step]
        if live > best:
            best, at = live, step
    return best, at
