"""Mirrored multicasts (compiler_core/runtime/mirrors.py): a multicast writes its box once,
into the buffer's mirror, and every read of any target sees the bytes that writing every
target would have left there."""

from __future__ import annotations

import numpy as np
import pytest

from compiler_core.ops.registry import Box
from compiler_core.runtime.executor import _span
from compiler_core.runtime.mirrors import Key, Mirrors

CORES, SIZE = 3, 256

BUFFERS: list[tuple[int, Box]] = [  # (VTCM offset, the tensor box it holds), overlapping
    (0, ((0, 4), (0, 8))),
    (0, ((0, 2), (0, 4), (0, 4))),
    (16, ((0, 6), (0, 8))),
    (40, ((0, 3), (0, 16))),
    (100, ((0, 8), (0, 8))),
]


def _tilings(buf_box: Box) -> list[list[Box]]:
    """Row slabs (every byte of their span) and column blocks (not) of a buffer."""
    (a0, a1), (b0, b1) = buf_box[0], buf_box[-1]
    mid = buf_box[1:-1]
    rows = [((r, r + 1), *mid, (b0, b1)) for r in range(a0, a1)]
    half = (b0 + b1) // 2
    columns = [((a0, a1), *mid, (b0, half)), ((a0, a1), *mid, (half, b1))]
    return [rows, columns]


def _key(offset: int, buf_box: Box) -> Key:
    size = int(np.prod([b - a for a, b in buf_box]))
    return (offset, offset + size, buf_box, "uint8")


def _view(memory: np.ndarray, core: int, offset: int, buf_box: Box, box: Box) -> np.ndarray:
    shape = tuple(b - a for a, b in buf_box)
    buf = memory[core, offset : offset + int(np.prod(shape))].reshape(shape)
    return buf[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, buf_box, strict=True))]


@pytest.mark.parametrize("seed", range(6))
def test_every_read_sees_what_writing_every_target_leaves(seed: int) -> None:
    """Random multicasts of boxes of overlapping buffers to random core sets, writes of
    byte ranges (every byte, or every other one), reads of byte ranges and whole-buffer
    kernel reads, on an eagerly written memory and a mirrored one: every read agrees, and
    so does the whole memory once settled."""
    rng = np.random.default_rng(seed)
    for _ in range(150):
        eager = np.zeros((CORES, SIZE), np.uint8)
        lazy = np.zeros((CORES, SIZE), np.uint8)
        mirrors = Mirrors(list(lazy))
        for _ in range(40):
            kind = int(rng.integers(5))
            offset, buf_box = BUFFERS[int(rng.integers(len(BUFFERS)))]
            key = _key(offset, buf_box)
            if kind <= 1:  # a multicast of one box of one of the buffer's tilings
                tiling = _tilings(buf_box)[int(rng.integers(2))]
                box = tiling[int(rng.integers(len(tiling)))]
                count = int(rng.integers(2, CORES + 1))
                targets = sorted(int(c) for c in rng.choice(CORES, count, replace=False))
                shape = tuple(b - a for a, b in box)
                data = rng.integers(1, 255, shape, dtype=np.uint8)
                for core in targets:
                    _view(eager, core, offset, buf_box, box)[...] = data
                start, end, covers = _span(offset, buf_box, box, "uint8")
                views = {core: _view(lazy, core, offset, buf_box, box) for core in targets}
                mirrors.multicast(
                    targets, frozenset(targets), key, box, (start, end), covers, views, data
                )
                continue
            core = int(rng.integers(CORES))
            start = int(rng.integers(0, SIZE - 1))
            end = int(rng.integers(start + 1, min(SIZE, start + 48) + 1))
            if kind == 2:  # a write of every byte, or of every other one
                whole = bool(rng.integers(2))
                step = 1 if whole else 2
                value = rng.integers(1, 255, end - start, dtype=np.uint8)[::step]
                eager[core, start:end:step] = value
                mirrors.overwrite(core, start, end, whole=whole)
                lazy[core, start:end:step] = value
            elif kind == 3:
                mirrors.settle(core, start, end)
                np.testing.assert_array_equal(lazy[core, start:end], eager[core, start:end])
            else:  # a kernel reading the whole buffer, as another tensor's shape
                seen = mirrors.source(core, key[0], key[1])
                if seen is None:
                    seen = lazy[core, key[0] : key[1]]
                np.testing.assert_array_equal(seen, eager[core, key[0] : key[1]])
        for core in range(CORES):
            mirrors.settle(core, 0, SIZE)
        np.testing.assert_array_equal(lazy, eager)


def test_a_multicast_writes_one_array_not_its_targets() -> None:
    """An all-gather's slabs land in the mirror only; each target's kernel reads the whole
    buffer from it, and a store of one target's buffer copies the bytes in first."""
    memory = np.zeros((3, 64), np.uint8)
    mirrors = Mirrors(list(memory))
    buf_box: Box = ((0, 4), (0, 8))
    key = _key(16, buf_box)
    for row in range(4):
        box = ((row, row + 1), (0, 8))
        views = {c: _view(memory, c, 16, buf_box, box) for c in range(3)}
        span = _span(16, buf_box, box, "uint8")
        data = np.full((1, 8), row + 1, np.uint8)
        mirrors.multicast([0, 1, 2], frozenset({0, 1, 2}), key, box, span[:2], True, views, data)
    assert not memory.any()
    want = np.repeat(np.arange(1, 5, dtype=np.uint8), 8)
    for core in range(3):
        seen = mirrors.source(core, 16, 48)
        assert seen is not None and not seen.flags.writeable
        np.testing.assert_array_equal(seen, want)
    mirrors.settle(1, 16, 48)
    np.testing.assert_array_equal(memory[1, 16:48], want)
    assert not memory[[0, 2]].any()


def test_buffers_whose_bytes_are_copied_out_are_written_whole_after_the_first_inference() -> None:
    """Two all-gathers of 512 KiB buffers over 3 cores: one then read whole, the other's
    place then written a row at a time through another buffer's boxes (its bytes copied
    out): only the first stays mirrored."""
    memory = np.zeros((3, 2 << 20), np.uint8)
    mirrors = Mirrors(list(memory))
    buf_box: Box = ((0, 4), (0, 128 << 10))
    for offset in (0, 1 << 20):
        key = _key(offset, buf_box)
        for row in range(4):
            box = ((row, row + 1), (0, 128 << 10))
            views = {c: _view(memory, c, offset, buf_box, box) for c in range(3)}
            start, end, covers = _span(offset, buf_box, box, "uint8")
            data = np.full((1, 128 << 10), row, np.uint8)
            mirrors.multicast(
                [0, 1, 2], frozenset(range(3)), key, box, (start, end), covers, views, data
            )
    for core in range(3):
        assert mirrors.source(core, 0, 512 << 10) is not None
        mirrors.overwrite(core, 1 << 20, (1 << 20) + 1000, whole=False)
    mirrors.judge()
    assert mirrors.off == {_key(1 << 20, buf_box)}


def _random_accesses(rng: np.random.Generator) -> list[tuple[int, int, Box, Box, list[int]]]:
    """40 random (kind, offset, buffer box, box, cores) accesses as the test above makes
    them: kinds 0-1 multicast `box` to `cores`, the others take a byte range of `cores[0]`
    (its [start, end) as the box's one axis)."""
    accesses = []
    for _ in range(40):
        kind = int(rng.integers(5))
        offset, buf_box = BUFFERS[int(rng.integers(len(BUFFERS)))]
        if kind <= 1:
            tiling = _tilings(buf_box)[int(rng.integers(2))]
            box = tiling[int(rng.integers(len(tiling)))]
            count = int(rng.integers(2, CORES + 1))
            targets = sorted(int(c) for c in rng.choice(CORES, count, replace=False))
            accesses.append((kind, offset, buf_box, box, targets))
            continue
        start = int(rng.integers(0, SIZE - 1))
        end = int(rng.integers(start + 1, min(SIZE, start + 48) + 1))
        accesses.append((kind, offset, buf_box, ((start, end),), [int(rng.integers(CORES))]))
    return accesses


@pytest.mark.parametrize("seed", range(4))
def test_replayed_inferences_read_what_writing_every_target_leaves(seed: int) -> None:
    """The same random accesses in three inferences, each on a zeroed memory and with new
    data: the first is recorded, the next two replay it (writing their own data), and every
    read, and the whole memory once settled, agree with an eagerly written memory; the
    bytes copied out of mirrors are those the mirrors count when they look records up."""
    rng = np.random.default_rng(seed)
    for _ in range(60):
        accesses = _random_accesses(rng)
        wholes = [bool(rng.integers(2)) for _ in accesses]
        lazy, looked = np.zeros((CORES, SIZE), np.uint8), np.zeros((CORES, SIZE), np.uint8)
        mirrors, lookup = Mirrors(list(lazy)), Mirrors(list(looked), replay=False)
        for inference in range(3):
            eager = np.zeros((CORES, SIZE), np.uint8)
            lazy[:] = looked[:] = 0
            mirrors.start(fresh=inference == 0)
            lookup.start(fresh=True)
            for (kind, offset, buf_box, box, cores), whole in zip(accesses, wholes, strict=True):
                key = _key(offset, buf_box)
                if kind <= 1:
                    shape = tuple(b - a for a, b in box)
                    data = rng.integers(1, 255, shape, dtype=np.uint8)
                    for core in cores:
                        _view(eager, core, offset, buf_box, box)[...] = data
                    start, end, covers = _span(offset, buf_box, box, "uint8")
                    for mirror, memory in ((mirrors, lazy), (lookup, looked)):
                        views = {c: _view(memory, c, offset, buf_box, box) for c in cores}
                        mirror.multicast(
                            cores, frozenset(cores), key, box, (start, end), covers, views, data
                        )
                    continue
                core, ((start, end),) = cores[0], box
                if kind == 2:
                    step = 1 if whole else 2
                    value = rng.integers(1, 255, end - start, dtype=np.uint8)[::step]
                    eager[core, start:end:step] = value
                    for mirror, memory in ((mirrors, lazy), (lookup, looked)):
                        mirror.overwrite(core, start, end, whole=whole)
                        memory[core, start:end:step] = value
                elif kind == 3:
                    mirrors.settle(core, start, end)
                    lookup.settle(core, start, end)
                    np.testing.assert_array_equal(lazy[core, start:end], eager[core, start:end])
                else:
                    seen = mirrors.source(core, key[0], key[1])
                    if seen is None:
                        seen = lazy[core, key[0] : key[1]]
                    np.testing.assert_array_equal(seen, eager[core, key[0] : key[1]])
                    lookup.source(core, key[0], key[1])
                assert mirrors.copied == lookup.copied
            for core in range(CORES):
                mirrors.settle(core, 0, SIZE)
                lookup.settle(core, 0, SIZE)
            mirrors.finish()
            assert mirrors.copied == lookup.copied
            np.testing.assert_array_equal(lazy, eager)
