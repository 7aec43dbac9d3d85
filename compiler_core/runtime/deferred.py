"""Constant loads whose bytes are moved only when something needs them as VTCM bytes.

A DMA load of a whole buffer from a constant tensor is most of the bytes an inference
moves when weights stream (BERT-base: 0.54 GB per inference on 14 cores), and the kernel
that reads the buffer next could read the constant itself. So such a load records "this
buffer holds that constant box" instead of copying, and every later access to the core's
VTCM goes through this record, which keeps the runtime exactly as strict as if it had
copied:

- a kernel operand that is exactly a deferred buffer reads the constant (a read-only view);
- any other read of bytes a deferred buffer covers (a store, a NoC copy, a joined operand,
  a gather's indices) first writes the constant into VTCM (`settle`);
- a write over the whole of a deferred buffer drops the record (the copy would have been
  overwritten); a write over part of it first writes the constant (`overwrite`);
- an inference starts with no record (its VTCM is zeroed).

The source is a constant, which nothing can change, so settling late gives the bytes an
early copy would have: what a core reads, and so every race a missing semaphore wait
exposes, is unchanged. Byte counts are the instruction's, as before.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np


class DeferredLoads:
    """Per core, the deferred buffers: disjoint byte ranges [start, end) of its VTCM, each
    with the VTCM view it stands for and the constant view that fills it."""

    def __init__(self, num_cores: int) -> None:
        self.pending: list[list[int]] = [[] for _ in range(num_cores)]
        """Per core, the starts of its deferred buffers, sorted (empty: nothing deferred)."""
        self._entries: list[dict[int, tuple[int, np.ndarray, np.ndarray]]] = [
            {} for _ in range(num_cores)
        ]
        """Per core, by start: (end, VTCM view, constant view)."""

    def clear(self) -> None:
        """The inference VTCM was zeroed: nothing is deferred."""
        for starts, entries in zip(self.pending, self._entries, strict=True):
            starts.clear()
            entries.clear()

    def defer(self, core: int, start: int, end: int, dst: np.ndarray, src: np.ndarray) -> None:
        """The whole buffer `dst` ([start, end) of `core`'s VTCM) now holds `src`."""
        self.overwrite(core, start, end, whole=True)
        self._add(core, start, end, dst, src)

    def source(self, core: int, start: int, end: int) -> np.ndarray | None:
        """The constant a buffer that is exactly [start, end) stands for, or None (then any
        deferred bytes inside it are settled, and the buffer itself is read)."""
        found = self._entries[core].get(start)
        if found is not None and found[0] == end:
            return found[2]
        if self._meets(core, start, end):
            self._cut(core, start, end, whole=False)
        return None

    def settle(self, core: int, start: int, end: int) -> None:
        """Bytes [start, end) of `core`'s VTCM are about to be read: write the deferred
        bytes there (whole rows of the first axis of each buffer they touch; the buffers'
        other rows stay deferred)."""
        if self._meets(core, start, end):
            self._cut(core, start, end, whole=False)

    def overwrite(self, core: int, start: int, end: int, *, whole: bool) -> None:
        """Bytes [start, end) of `core`'s VTCM are about to be written: every byte of that
        range (`whole`: the deferred bytes there are dropped) or only some of them (a box
        inside a buffer: they are written first, as a read would)."""
        if self._meets(core, start, end):
            self._cut(core, start, end, whole=whole)

    def overwrite_many(self, cores: list[int], start: int, end: int, *, whole: bool) -> None:
        """`overwrite` on each of `cores` (a multicast's targets: one range on each)."""
        for core in cores:
            if self._meets(core, start, end):
                self._cut(core, start, end, whole=whole)

    def _meets(self, core: int, start: int, end: int) -> bool:
        """Whether a deferred buffer of `core` overlaps [start, end): the last one starting
        before `end` is the only candidate, as they are disjoint."""
        starts = self.pending[core]
        if not starts:
            return False
        i = bisect_left(starts, end)
        return i > 0 and self._entries[core][starts[i - 1]][0] > start

    def _cut(self, core: int, start: int, end: int, *, whole: bool) -> None:
        """Take every deferred buffer meeting [start, end) apart by rows of its first axis:
        rows wholly outside stay deferred; rows inside are written, except those `whole`
        says the caller overwrites entirely."""
        for key in self._overlapping(core, start, end):
            found_end, dst, src = self._entries[core].pop(key)
            self.pending[core].remove(key)
            if dst.ndim == 0 or dst.shape[0] == 0 or dst.nbytes == 0:
                if not (whole and start <= key and found_end <= end):
                    dst[...] = src
                continue
            rows = dst.shape[0]
            row = dst.nbytes // rows
            head = max(0, (start - key) // row)  # rows [0, head) end at or before start
            tail = min(rows, -(-(end - key) // row))  # rows [tail, rows) begin at or after end
            if head > 0:
                self._add(core, key, key + head * row, dst[:head], src[:head])
            if tail < rows:
                self._add(core, key + tail * row, found_end, dst[tail:], src[tail:])
            if not whole:
                dst[head:tail] = src[head:tail]
                continue
            first = key + head * row < start  # the first row inside straddles start
            if first:
                dst[head] = src[head]
            if key + tail * row > end and not (first and tail - 1 == head):  # the last, end
                dst[tail - 1] = src[tail - 1]

    def _add(self, core: int, start: int, end: int, dst: np.ndarray, src: np.ndarray) -> None:
        insort(self.pending[core], start)
        self._entries[core][start] = (end, dst, src)

    def _overlapping(self, core: int, start: int, end: int) -> list[int]:
        starts = self.pending[core]
        if not starts:
            return []
        entries = self._entries[core]
        found = []
        i = bisect_left(starts, end) - 1
        while i >= 0 and entries[starts[i]][0] > start:  # disjoint: ends rise with starts
            found.append(starts[i])
            i -= 1
        return found
