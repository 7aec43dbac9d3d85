"""`gather_windows` (compiler_core/ops/conv.py): the windows a conv or pool tile reads, as
numpy's sliding-window view of the tile's input with its padding, strides and dilations."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from compiler_core.ops.conv import Window, _TileWindows, gather_windows


def _reference(x: np.ndarray, win: Window, rank: int, o0: int, o1: int) -> np.ndarray:
    """Pad the whole input, take every window, keep outputs [o0, o1): (N, C, *O, *K)."""
    padded = np.pad(x, [(0, 0), (0, 0)] + [(win.pad_begin, win.pad_end + win.span)] * rank)
    view = sliding_window_view(padded, [win.span] * rank, axis=tuple(range(2, 2 + rank)))
    outputs = slice(o0 * win.stride, (o1 - 1) * win.stride + 1, win.stride)
    return view[(slice(None), slice(None), *[outputs] * rank)]


@pytest.mark.parametrize("kernel", [1, 3])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("pad", [0, 1])
@pytest.mark.parametrize("rank", [1, 2])
def test_every_tile_reads_the_windows_of_the_padded_input(
    kernel: int, stride: int, pad: int, rank: int
) -> None:
    """Every output range [o0, o1) of every axis setting, 1x1 windows included (those are
    the input itself, strided, with unit window axes)."""
    size = 7
    out = (size + 2 * pad - kernel) // stride + 1
    win = Window(kernel, stride, 1, pad, pad, size, out)
    rng = np.random.default_rng(kernel * 8 + stride * 4 + pad * 2 + rank)
    x = rng.standard_normal((1, 3, *(size,) * rank)).astype(np.float32)
    for o0 in range(out):
        for o1 in range(o0 + 1, out + 1):
            lo, hi = win.clipped(o0, o1)
            tile = x[(slice(None), slice(None), *[slice(lo, hi)] * rank)]
            out_box = ((0, 1), (0, 3), *[(o0, o1)] * rank)
            in_box = ((0, 1), (0, 3), *[(lo, hi)] * rank)
            got = gather_windows(tile, [win] * rank, out_box, in_box, 0.0)
            want = _reference(x, win, rank, o0, o1)
            assert got.shape == (1, 3, *(o1 - o0,) * rank, *(kernel,) * rank)
            np.testing.assert_array_equal(got, want)
            assert not got.flags.writeable, "a kernel could write its input through it"


@pytest.mark.parametrize("kernel,pad", [(3, 1), (1, 0), (3, 0)])
def test_a_tiles_kept_windows_read_its_input_as_it_holds_now(kernel: int, pad: int) -> None:
    """A conv tile's windows are laid out once (`_TileWindows`, padding in a private array):
    they still read what the same input array holds at each use, and another array's bytes
    when given another array."""
    size = 7
    out = (size + 2 * pad - kernel) // 1 + 1
    win = Window(kernel, 1, 1, pad, pad, size, out)
    o0, o1 = 0, max(1, out - 2)
    lo, hi = win.clipped(o0, o1)
    out_box = ((0, 1), (0, 3), (o0, o1), (0, out))
    in_box = ((0, 1), (0, 3), (lo, hi), win.clipped(0, out))
    rng = np.random.default_rng(kernel + pad)
    vtcm = rng.standard_normal((1, 3, size, size)).astype(np.float32)
    x = vtcm[:, :, lo:hi, in_box[3][0] : in_box[3][1]]  # a buffer's view, as the runtime's
    kept = _TileWindows(x.shape, x.dtype, [win] * 2, out_box, in_box)
    for _ in range(2):
        want = gather_windows(x, [win] * 2, out_box, in_box, 0.0)
        np.testing.assert_array_equal(kept.of(x), want)
        vtcm[...] = rng.standard_normal(vtcm.shape)  # the buffer is written again
    other = rng.standard_normal(x.shape).astype(np.float32)
    got = kept.of(other)
    np.testing.assert_array_equal(got, gather_windows(other, [win] * 2, out_box, in_box, 0.0))
    assert not got.flags.writeable
