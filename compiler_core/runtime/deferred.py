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

The records follow from the order of the accesses alone, so an inference that runs to its
end is recorded and the later ones replay it (see replay.py).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import NamedTuple

import numpy as np

from compiler_core.runtime.replay import CoreRanges


class Deferred(NamedTuple):
    """A deferred buffer: bytes [start, end) of a core's VTCM, the VTCM view they are and
    the constant view that fills them."""

    start: int
    end: int
    dst: np.ndarray
    src: np.ndarray


class DeferredLoads(CoreRanges[Deferred]):
    """Per core, the deferred buffers: disjoint byte ranges [start, end) of its VTCM
    (`pending`: their starts, sorted; empty: nothing deferred), each with the VTCM view it
    stands for and the constant view that fills it (`replay` False: every inference looks
    them up; see replay.py)."""

    def defer(self, core: int, start: int, end: int, dst: np.ndarray, src: np.ndarray) -> None:
        """The whole buffer `dst` ([start, end) of `core`'s VTCM) now holds `src`."""
        replay = self.replay
        if replay.replaying is not None:
            replay.follow(self.pending, start, end)
            return
        if self._meets(core, start, end):
            self._cut(core, start, end, whole=True)
        self._add(core, start, end, dst, src)
        replay.record(self.pending, start, end)

    def source(self, core: int, start: int, end: int) -> np.ndarray | None:
        """The constant a buffer that is exactly [start, end) stands for, or None (then any
        deferred bytes inside it are settled, and the buffer itself is read)."""
        replay = self.replay
        if replay.replaying is not None:
            found: np.ndarray | None = replay.follow(self.pending, start, end).result
            return found
        entry = self._entries[core].get(start)
        if entry is not None and entry.end == end:
            replay.record(self.pending, start, end, entry.src)
            return entry.src
        if self._meets(core, start, end):
            self._cut(core, start, end, whole=False)
        replay.record(self.pending, start, end)
        return None

    def settle(self, core: int, start: int, end: int) -> None:
        """Bytes [start, end) of `core`'s VTCM are about to be read: write the deferred
        bytes there (whole rows of the first axis of each buffer they touch; the buffers'
        other rows stay deferred)."""
        self.overwrite(core, start, end, whole=False)

    def overwrite(self, core: int, start: int, end: int, *, whole: bool) -> None:
        """Bytes [start, end) of `core`'s VTCM are about to be written: every byte of that
        range (`whole`: the deferred bytes there are dropped) or only some of them (a box
        inside a buffer: they are written first, as a read would)."""
        replay = self.replay
        if replay.replaying is not None:
            replay.follow(self.pending, start, end)
            return
        if self._meets(core, start, end):
            self._cut(core, start, end, whole=whole)
        replay.record(self.pending, start, end)

    def overwrite_many(self, cores: list[int], start: int, end: int, *, whole: bool) -> None:
        """`overwrite` on each of `cores` (a multicast's targets: one range on each)."""
        replay = self.replay
        if replay.replaying is not None:
            replay.follow(self.pending, start, end)
            return
        for core in cores:
            if self._meets(core, start, end):
                self._cut(core, start, end, whole=whole)
        replay.record(self.pending, start, end)

    def _meets(self, core: int, start: int, end: int) -> bool:
        """Whether a deferred buffer of `core` overlaps [start, end): the last one starting
        before `end` is the only candidate, as they are disjoint."""
        starts = self.pending[core]
        if not starts:
            return False
        i = bisect_left(starts, end)
        return i > 0 and self._entries[core][starts[i - 1]].end > start

    def _cut(self, core: int, start: int, end: int, *, whole: bool) -> None:
        """Take every deferred buffer meeting [start, end) apart by rows of its first axis:
        rows wholly outside stay deferred; rows inside are written, except those `whole`
        says the caller overwrites entirely."""
        self.replay.touch(core, True)
        for key, found_end, dst, src in self._overlapping(core, start, end):
            del self._entries[core][key]
            self.pending[core].remove(key)
            if dst.ndim == 0 or dst.shape[0] == 0 or dst.nbytes == 0:
                if not (whole and start <= key and found_end <= end):
                    self.replay.write(dst, src)
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
                self.replay.write(dst[head:tail], src[head:tail])
                continue
            first = key + head * row < start  # the first row inside straddles start
            if first:
                self.replay.write(dst[head : head + 1], src[head : head + 1])
            if key + tail * row > end and not (first and tail - 1 == head):  # the last, end
                self.replay.write(dst[tail - 1 : tail], src[tail - 1 : tail])

    def _add(self, core: int, start: int, end: int, dst: np.ndarray, src: np.ndarray) -> None:
        self.replay.touch(core, bool(self.pending[core]))
        insort(self.pending[core], start)
        self._entries[core][start] = Deferred(start, end, dst, src)
