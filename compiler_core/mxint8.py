"""MXINT8 storage of retained state (a KV cache kept on the device as MX int8 blocks).

Format (OCP Microscaling v1.0, MXINT8): blocks of 32 consecutive elements share one E8M0 scale
(an unsigned 8-bit power-of-two exponent, bias 127; 0xFF is NaN); each element is an 8-bit
two's-complement integer with an implicit scale of 2^-6, so a block holds
`scale x q / 64` with q in [-127, 127] (the spec allows -128; we never produce it, which keeps
the format symmetric). The scale is 2^floor(log2(amax)) with amax the block's largest
magnitude (the element format's largest power of two is 1 = 2^0), clamped to E8M0's range; an
all-zero block takes the smallest scale. Elements are x / scale x 64 rounded to nearest, ties
to even, and saturated to +-127. A block holding an infinity or NaN gets the NaN scale.

Storage (ours; the spec leaves it open): blocks run along the tensor's last axis (a cache's
head dimension), each row of K elements cut into ceil(K/32) blocks, the last one zero-padded;
a block is 33 bytes: the scale byte, then 32 int8 elements. 33 bytes per 32 elements is
8.25 bits per element, against 16 for fp16.

Writes quantize the rows they write (whole rows along the block axis: a scatter tile never
cuts that axis), reads dequantize to the tensor's declared type (fp16 or fp32).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MXINT8 = "mxint8"
BLOCK = 32
BLOCK_BYTES = 1 + BLOCK
SCALE_BIAS = 127
SCALE_NAN = 0xFF
ELEM_FRACTION_BITS = 6
"""int8 elements carry an implicit 2^-6: q / 64."""
ELEM_MAX = 127


def mxint8_nbytes(shape: Sequence[int]) -> int:
    """Stored size of a tensor of `shape` blocked along its last axis."""
    if not shape:
        return BLOCK_BYTES
    k = int(shape[-1])
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return rows * -(-k // BLOCK) * BLOCK_BYTES


def encode_rows(rows: np.ndarray) -> np.ndarray:
    """(N, K) floats -> (N, ceil(K/32) * 33) uint8 MXINT8 blocks."""
    n, k = rows.shape
    blocks = -(-k // BLOCK)
    padded = np.zeros((n, blocks * BLOCK), np.float64)
    padded[:, :k] = rows
    values = padded.reshape(n, blocks, BLOCK)
    amax = np.max(np.abs(values), axis=-1)
    finite = np.isfinite(amax)
    _, exp = np.frexp(np.where(finite, amax, 0.0))  # amax = m * 2^exp, 0.5 <= m < 1
    unbiased = np.clip(np.where(amax > 0, exp - 1, -SCALE_BIAS), -SCALE_BIAS, SCALE_BIAS)
    scales = np.where(finite, unbiased + SCALE_BIAS, SCALE_NAN).astype(np.uint8)
    step = np.ldexp(1.0, (unbiased - ELEM_FRACTION_BITS).astype(np.int64))[..., None]
    safe = np.where(np.isfinite(values), values, 0.0)
    q = np.clip(np.rint(safe / step), -ELEM_MAX, ELEM_MAX).astype(np.int8)
    out = np.empty((n, blocks, BLOCK_BYTES), np.uint8)
    out[..., 0] = scales
    out[..., 1:] = q.view(np.uint8)
    return out.reshape(n, blocks * BLOCK_BYTES)


def decode_rows(data: np.ndarray, k: int, dtype: np.dtype | str) -> np.ndarray:
    """(N, ceil(K/32) * 33) uint8 blocks -> (N, K) values of `dtype`."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, BLOCK_BYTES)
    scales = blocks[..., 0].astype(np.int64)
    q = blocks[..., 1:].view(np.int8).astype(np.float64)
    step = np.ldexp(1.0, scales - SCALE_BIAS - ELEM_FRACTION_BITS)[..., None]
    values = np.where((scales == SCALE_NAN)[..., None], np.nan, q * step)
    return values.reshape(n, -1)[:, :k].astype(dtype)


def quantize(values: np.ndarray) -> np.ndarray:
    """What storing `values` as MXINT8 (blocks along the last axis) and reading them back
    gives: the round trip, in the values' dtype."""
    rows = values.reshape(-1, values.shape[-1]).astype(np.float64)
    k = values.shape[-1]
    return decode_rows(encode_rows(rows), k, values.dtype).reshape(values.shape)


class Mxint8Store:
    """A tensor's MXINT8 bytes (uint8, `mxint8_nbytes(shape)` long), read and written by
    boxes in the tensor's own coordinates."""

    def __init__(self, storage: np.ndarray, shape: tuple[int, ...], dtype: str) -> None:
        self.shape = shape
        self.dtype = np.dtype(dtype)
        k = shape[-1]
        self.k = k
        self.row_bytes = -(-k // BLOCK) * BLOCK_BYTES
        self.rows = storage.reshape(-1, self.row_bytes)
        self.outer = shape[:-1]

    def read(self, box: tuple[tuple[int, int], ...]) -> np.ndarray:
        """Dequantized values of `box` (reads only the rows it touches)."""
        index = self._row_index(box[:-1])
        decoded = decode_rows(self.rows[index.reshape(-1)], self.k, self.dtype)
        lo, hi = box[-1]
        return decoded[:, lo:hi].reshape(*index.shape, hi - lo)

    def write_rows(self, outer: tuple[np.ndarray, ...], values: np.ndarray) -> None:
        """Quantize whole rows: `outer` indexes the leading axes (numpy advanced indexing,
        broadcast), `values` holds those rows' K elements."""
        flat = np.ravel_multi_index(outer, self.outer)
        self.rows[flat.reshape(-1)] = encode_rows(values.reshape(-1, self.k).astype(np.float64))

    def _row_index(self, box: tuple[tuple[int, int], ...]) -> np.ndarray:
        grids = np.meshgrid(*(np.arange(a, b) for a, b in box), indexing="ij")
        return np.ravel_multi_index(tuple(grids), self.outer) if box else np.zeros((), np.int64)
