"""Multicast boxes written once: the targets' bytes in a box stay in one array of the
runtime's until something reads or writes them otherwise.

An all-gather sends every core's slab of an activation to every core: on 14 cores BERT-base
writes 0.73 GB of VTCM per inference that way, 14 equal copies of each slab, and each core's
kernel then reads its whole buffer. So a multicast into a buffer writes the box once, into
the buffer's mirror (an array of the buffer's bytes), and the targets' bytes in that box are
the mirror's from then on. That keeps the runtime exactly as strict as if every target had
been written:

- a kernel operand that is a buffer whose every byte a core holds in its mirror reads the
  mirror (read-only): the bytes the core would hold, since a box of the mirror changes only
  by a multicast that also writes it on every core holding it;
- any other read of mirrored bytes (a NoC source, a store, a joined operand) first copies
  the boxes it meets from the mirror into the core (`settle`);
- a write of a byte range over a core's mirrored boxes drops the boxes it covers and
  marks its bytes in the others as the core's own (a box is then held less those, and a
  read of any of its other bytes first copies it into the core, keeping the core's own
  bytes); a write of only some bytes of a range (a box of another buffer) copies the boxes
  it meets into the core first; boxes it does not meet stay mirrored;
- a multicast into a box of the mirror first copies that box into the cores that hold it
  and are not its targets;
- an inference starts with no mirror (its VTCM is zeroed).

A core's bytes outside its mirrored boxes are its own, as before. Byte counts are the
instructions', as before. Which buffers stay mirrored after a session's first inference is
judged from what that inference spared and copied out (`judge`). What the mirrors do at an
access follows from the order of the accesses alone, so an inference that runs to its end
is recorded and the later ones replay it (see replay.py).
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import EllipsisType

import numpy as np

from compiler_core.ops.registry import Box, box_shape
from compiler_core.runtime.replay import CoreRanges

Key = tuple[int, int, Box, str]
"""A buffer: its VTCM bytes [start, end), the box of the tensor it holds, its dtype."""

SPARED = 256 << 10
"""Bytes a buffer's multicasts must spare on average to be mirrored: the bookkeeping costs
about what writing that many bytes does."""

Spans = dict[Box, tuple[int, int]]
"""Disjoint boxes of a buffer, each with its byte span (from its first to its last byte)."""


def _volume(box: Box) -> int:
    return int(np.prod(box_shape(box), dtype=np.int64))


def _meets(a: Box, b: Box) -> bool:
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b, strict=True))


@dataclass
class Mirror:
    """One buffer's mirrored boxes: `array` holds every box written (`written`: a tiling,
    the boxes disjoint); the cores in `whole` hold all of them as the array's, those in
    `held` only the boxes (or parts of boxes) listed there."""

    key: Key
    array: np.ndarray
    raw: np.ndarray
    """The array's bytes."""
    strides: tuple[int, ...]
    """Bytes per step of each axis of the buffer (C order)."""
    written: Spans = field(default_factory=dict)
    volume: int = 0
    """Elements of the written boxes."""
    whole: set[int] = field(default_factory=set)
    held: dict[int, Spans] = field(default_factory=dict)
    own: dict[int, dict[Box, list[tuple[int, int]]]] = field(default_factory=dict)
    """Per core, byte ranges inside held boxes' spans written since (the core's own bytes,
    sorted and disjoint): a box is held less those."""

    @property
    def start(self) -> int:
        return self.key[0]

    @property
    def end(self) -> int:
        return self.key[1]

    def index(self, box: Box) -> tuple[slice | EllipsisType, ...]:
        """`box` of the buffer's array (a view, 0-d arrays included)."""
        return (
            *(slice(a - o, b - o) for (a, b), (o, _) in zip(box, self.key[2], strict=True)),
            Ellipsis,
        )

    def span(self, box: Box) -> tuple[int, int]:
        """The bytes from `box`'s first element to its last, in the buffer."""
        first = last = self.start
        for (a, b), (o, _), stride in zip(box, self.key[2], self.strides, strict=True):
            first += (a - o) * stride
            last += (b - 1 - o) * stride
        return first, last + self.array.itemsize

    def boxes(self, core: int) -> Spans:
        """The boxes `core` holds as the array's."""
        return self.written if core in self.whole else self.held[core]

    def split(self, core: int) -> Spans:
        """`core`'s boxes, listed for it alone (it is about to hold fewer)."""
        if core in self.whole:
            self.whole.discard(core)
            self.held[core] = dict(self.written)
        return self.held[core]


class Mirrors(CoreRanges[Mirror]):
    """Per core, the mirrors holding some of its bytes: disjoint byte ranges of its VTCM
    (`pending`: their starts, sorted; `replay` False: every inference looks them up; see
    replay.py)."""

    def __init__(self, vtcm: Sequence[np.ndarray], replay: bool = True) -> None:
        super().__init__(len(vtcm), replay)
        self.vtcm = vtcm
        self._spare: dict[Key, list[np.ndarray]] = {}
        """Arrays of the last inference's mirrors, for this one's."""
        self._made: list[Mirror] = []
        self.copied = 0
        """VTCM bytes copied from mirrors into cores (since created)."""
        self.off: set[Key] = set()
        """Buffers whose multicasts write every target (see `judge`; the executor adds those
        whose bytes joined tiles read, which copy each other's inputs from VTCM)."""
        self._saved: dict[Key, int] = {}
        self._taken: dict[Key, int] = {}
        self._count: dict[Key, int] = {}
        self.judged = False

    def judge(self) -> None:
        """After a session's first inference: the buffers whose mirrors had more than a
        16th as many bytes copied out into cores as they spared the multicasts are written
        on every target from now on (a copy out costs far more per byte than a strided
        multicast write: it follows a later write of part of a box, a buffer's place reused
        for another buffer). Which bytes are copied depends on the program's order of
        instructions, not on the values, so every inference would copy the same."""
        self.judged = True
        self.off |= {
            key
            for key, saved in self._saved.items()
            if 16 * self._taken.get(key, 0) > saved or saved < self._count[key] * SPARED
        }

    def clear(self) -> None:
        """The inference VTCM was zeroed: nothing is mirrored (and nothing recorded); the
        mirrors' arrays are kept for the next inference's."""
        super().clear()
        for mirror in self._made:
            self._spare.setdefault(mirror.key, []).append(mirror.array)
        self._made.clear()

    def multicast(
        self,
        targets: Sequence[int],
        aimed: frozenset[int],
        key: Key,
        box: Box,
        span: tuple[int, int],
        covers: bool,
        views: dict[int, np.ndarray],
        data: np.ndarray,
    ) -> None:
        """`data` lands in `box` of the buffer `key` on every target (`aimed`: the same, as
        a set; `views`: each target's view of that box; `span`: its bytes, every one written
        when `covers`)."""
        replay = self.replay
        if replay.replaying is not None:
            self.copied += replay.follow(self.pending, span[0], span[1], data).copied
            return
        self._multicast(targets, aimed, key, box, span, covers, views, data)
        replay.record(self.pending, span[0], span[1])

    def _multicast(
        self,
        targets: Sequence[int],
        aimed: frozenset[int],
        key: Key,
        box: Box,
        span: tuple[int, int],
        covers: bool,
        views: dict[int, np.ndarray],
        data: np.ndarray,
    ) -> None:
        start, end = key[0], key[1]
        found = self._entries[targets[0]].get(start)
        mirror = found if found is not None and found.key == key else None
        if (
            mirror is not None
            and box not in mirror.written
            and any(_meets(box, b) for b in mirror.written)
        ):  # another tiling of the buffer: its cores take their bytes
            self._dissolve(mirror)
            mirror = None
        new = mirror is None or box not in mirror.written
        if mirror is not None:
            for core in mirror.whole - aimed:
                self._release(mirror, core, box)
            for core in [c for c in mirror.held if c not in aimed]:
                self._release(mirror, core, box)
        else:
            mirror = self._new(key)
        if new:
            mirror.written[box] = mirror.span(box)
            mirror.volume += _volume(box)
        self.replay.write_data(mirror.array[mirror.index(box)], data)
        if not self.judged:
            self._saved[key] = self._saved.get(key, 0) + (len(targets) - 1) * data.nbytes
            self._count[key] = self._count.get(key, 0) + 1
        if aimed <= mirror.whole:
            return
        for core in targets:
            if core in mirror.whole:
                continue
            held = mirror.held.get(core)
            if held is None:
                for other in self._overlapping(core, start, end):
                    self._write(other, core, span[0], span[1], whole=covers)
                if self._overlapping(core, start, end):  # another mirror keeps some bytes
                    self.replay.write_data(views[core], data)
                    continue
                self.replay.touch(core, bool(self.pending[core]))
                insort(self.pending[core], start)
                self._entries[core][start] = mirror
                if len(mirror.written) == 1:
                    mirror.whole.add(core)
                    continue
                held = mirror.held[core] = {}
            held[box] = mirror.written[box]
            own = mirror.own.get(core)
            if own:
                own.pop(box, None)

    def source(self, core: int, start: int, end: int) -> np.ndarray | None:
        """The bytes of the buffer that is exactly [start, end) of `core`, as its mirror's
        (read-only uint8; the same array while the mirror stands) when the core holds every
        one of them there, or None (then the mirrored bytes inside it are copied into the
        core, and the buffer itself is read)."""
        replay = self.replay
        if replay.replaying is not None:
            access = replay.follow(self.pending, start, end)
            self.copied += access.copied
            found: np.ndarray | None = access.result
            return found
        mirror = self._entries[core].get(start)
        if mirror is not None and mirror.end == end and mirror.volume == mirror.array.size:
            if core in mirror.whole or (
                not mirror.own.get(core) and _complete(mirror, mirror.held[core])
            ):
                replay.record(self.pending, start, end, mirror.raw)
                return mirror.raw
        self._settle(core, start, end)
        replay.record(self.pending, start, end)
        return None

    def settle(self, core: int, start: int, end: int) -> None:
        """Bytes [start, end) of `core` are about to be read: copy the mirrored boxes they
        meet into the core (they stay mirrored: the bytes are equal), but where the bytes
        read are the core's own."""
        replay = self.replay
        if replay.replaying is not None:
            self.copied += replay.follow(self.pending, start, end).copied
            return
        self._settle(core, start, end)
        replay.record(self.pending, start, end)

    def _settle(self, core: int, start: int, end: int) -> None:
        for mirror in self._overlapping(core, start, end):
            own = mirror.own.get(core, {})
            dst = None
            for box, (first, last) in list(mirror.boxes(core).items()):
                if last <= start or end <= first:
                    continue
                ranges = own.get(box)
                if ranges is None:
                    if dst is None:
                        dst = self._buffer(mirror, core)
                    self._copy(mirror, dst, box)
                    continue
                lo, hi = max(start, first), min(end, last)
                if any(a <= lo and hi <= b for a, b in ranges):
                    continue  # it reads only bytes the core wrote itself
                self._take(mirror, core, box)
            if mirror.held.get(core) == {}:
                self._forget(mirror, core)

    def overwrite(self, core: int, start: int, end: int, *, whole: bool) -> None:
        """Bytes [start, end) of `core` are about to be written (`whole`: every byte of
        it)."""
        replay = self.replay
        if replay.replaying is not None:
            self.copied += replay.follow(self.pending, start, end).copied
            return
        for mirror in self._overlapping(core, start, end):
            self._write(mirror, core, start, end, whole=whole)
        replay.record(self.pending, start, end)

    def overwrite_many(self, cores: Sequence[int], start: int, end: int, *, whole: bool) -> None:
        replay = self.replay
        if replay.replaying is not None:
            self.copied += replay.follow(self.pending, start, end).copied
            return
        for core in cores:
            for mirror in self._overlapping(core, start, end):
                self._write(mirror, core, start, end, whole=whole)
        replay.record(self.pending, start, end)

    def _new(self, key: Key) -> Mirror:
        shape, dtype = box_shape(key[2]), np.dtype(key[3])
        spare = self._spare.get(key)
        array = spare.pop() if spare else np.empty(shape, dtype)
        strides = tuple(
            int(np.prod(shape[a + 1 :], dtype=np.int64)) * dtype.itemsize for a in range(len(shape))
        )
        raw = array.reshape(-1).view(np.uint8)
        raw.flags.writeable = False  # kernels are handed views of it
        mirror = Mirror(key, array, raw, strides)
        self._made.append(mirror)
        return mirror

    def _buffer(self, mirror: Mirror, core: int) -> np.ndarray:
        raw = self.vtcm[core][mirror.start : mirror.end]
        return raw.view(mirror.array.dtype).reshape(mirror.array.shape)

    def _copy(
        self, mirror: Mirror, dst: np.ndarray, box: Box, kept: tuple[np.ndarray, ...] = ()
    ) -> None:
        """Copy `box` from the mirror into `dst` (the core's buffer), but for the `kept`
        bytes."""
        index = mirror.index(box)
        part = dst[index]
        self.replay.write(part, mirror.array[index], kept)
        self.copied += part.nbytes
        self.replay.copied += part.nbytes
        if not self.judged:
            self._taken[mirror.key] = self._taken.get(mirror.key, 0) + part.nbytes

    def _write(self, mirror: Mirror, core: int, start: int, end: int, *, whole: bool) -> None:
        """The core's boxes meeting [start, end) are written: those wholly inside are
        dropped when `whole`, the others keep [start, end) as the core's own bytes (`whole`)
        or are copied into the core first (a write of some of those bytes); boxes outside
        stay held."""
        if whole and start <= mirror.start and mirror.end <= end:
            self._forget(mirror, core)  # every byte it holds is written
            return
        boxes = mirror.boxes(core)
        meeting = [(b, s) for b, s in boxes.items() if s[0] < end and start < s[1]]
        if not meeting:
            return
        held = mirror.split(core)
        for box, (first, last) in meeting:
            if whole and start <= first and last <= end:
                del held[box]
                mirror.own.get(core, {}).pop(box, None)
            elif whole:
                ranges = mirror.own.setdefault(core, {}).setdefault(box, [])
                merged = _merge(ranges, max(start, first), min(end, last))
                if merged[0][0] <= first and last <= merged[0][1]:  # all of it written since
                    del held[box]
                    del mirror.own[core][box]
                else:
                    ranges[:] = merged
            else:
                self._take(mirror, core, box)
        if not held:
            self._forget(mirror, core)

    def _take(self, mirror: Mirror, core: int, box: Box) -> None:
        """The core's `box` becomes its own bytes: the mirror's, but where it wrote since."""
        dst = self._buffer(mirror, core)
        ranges = mirror.own.get(core, {}).pop(box, None)
        raw = self.vtcm[core]
        self._copy(mirror, dst, box, tuple(raw[a:b] for a, b in ranges or ()))
        del mirror.held[core][box]

    def _release(self, mirror: Mirror, core: int, box: Box) -> None:
        """The mirror's `box` is about to change and `core` does not receive it: if it holds
        the box, the box becomes its own bytes."""
        if box not in mirror.written:
            if core in mirror.whole:
                mirror.split(core)
            return
        held = mirror.split(core)
        if box in held:
            self._take(mirror, core, box)
        if not held:
            self._forget(mirror, core)

    def _dissolve(self, mirror: Mirror) -> None:
        """Every core holding some of the mirror takes those bytes as its own."""
        for core in [*mirror.whole, *mirror.held]:
            held = mirror.split(core)
            for box in list(held):
                self._take(mirror, core, box)
            self._forget(mirror, core)

    def _forget(self, mirror: Mirror, core: int) -> None:
        self.replay.touch(core, True)
        mirror.whole.discard(core)
        mirror.held.pop(core, None)
        mirror.own.pop(core, None)
        del self._entries[core][mirror.start]
        self.pending[core].remove(mirror.start)


def _complete(mirror: Mirror, held: Spans) -> bool:
    """Whether boxes a core holds cover the whole buffer."""
    return sum(_volume(b) for b in held) == mirror.array.size


def _merge(ranges: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """Sorted disjoint ranges with [start, end) added (joined with those it meets or
    touches)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted([*ranges, (start, end)]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
