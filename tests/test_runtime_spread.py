"""`spread`: a multicast's destination buffers in the machine's one VTCM array, written as one
strided view when the target cores are evenly spaced."""

from __future__ import annotations

import numpy as np

from compiler_core.runtime.executor import spread


def _buffers(memory: np.ndarray, cores: list[int]) -> list[np.ndarray]:
    """Columns 2..5 of a (3, 8) fp32 buffer at byte 64 of each core's row."""
    return [memory[c, 64 : 64 + 96].view(np.float32).reshape(3, 8)[:, 2:5] for c in cores]


def test_evenly_spaced_targets_are_written_by_one_view() -> None:
    memory = np.zeros((6, 256), np.uint8)
    views = _buffers(memory, [1, 3, 5])
    every = spread(views)
    assert every is not None
    data = np.arange(9, dtype=np.float32).reshape(3, 3)
    every[...] = data
    for view in views:
        np.testing.assert_array_equal(view, data)
    assert not memory[[0, 2, 4]].any()  # the other cores
    for core in (1, 3, 5):
        row = memory[core].copy()
        row[64 : 64 + 96].view(np.float32).reshape(3, 8)[:, 2:5] = 0
        assert not row.any()  # nothing outside the box


def test_unevenly_spaced_or_single_targets_have_no_single_view() -> None:
    memory = np.zeros((6, 256), np.uint8)
    assert spread(_buffers(memory, [0, 1, 3])) is None
    assert spread(_buffers(memory, [2])) is None
