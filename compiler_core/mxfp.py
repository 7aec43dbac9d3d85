"""`-mxfp6-matmul`: constant MatMul/Gemm weights stored as OCP Microscaling MXFP6 (E2M3).

Format (OCP MX v1.0): blocks of 32 consecutive elements along the reduction (K) axis share one
E8M0 scale (an unsigned 8-bit power-of-two exponent, bias 127; 0xFF is NaN); each element is
FP6 E2M3 (sign, 2 exponent bits with bias 1, 3 mantissa bits, subnormals, no inf/NaN, largest
magnitude 7.5). The scale is the spec's suggestion, 2^(floor(log2(amax)) - 2) with amax the
block's largest magnitude (2 = E2M3's largest exponent), clamped to E8M0's range; an all-zero
block takes the smallest scale (log2(0) = -inf). Elements are x / scale rounded to nearest,
ties to even, and saturated to +-7.5. A block holding an infinity or NaN gets the NaN scale
(every element then decodes to NaN), as the spec prescribes.

Storage (ours; the spec leaves it open): the weight is read with its K axis moved last
(`numpy.moveaxis(w, axis, -1)`) in C order; each row of K elements is cut into ceil(K/32)
blocks, the last one zero-padded. A block is 25 bytes: the scale byte, then 32 six-bit codes
packed 4 per 3 bytes (codes c0..c3 form the little-endian 24-bit word c0 | c1<<6 | c2<<12 |
c3<<18). 25 bytes per 32 elements is 6.25 bits per element, scales included.

The functional runtime decodes a weight once when it loads the QPC and rounds the values to
fp16 (the vendor computes MXFP6 matmuls in fp16): a block's values are exactly representable
in fp16 unless the scale puts them outside its range, where they saturate (+-65504) or lose
subnormal bits. The decoded weight keeps the graph's dtype: fp16 with `-convert-to-fp16`,
otherwise fp32 holding fp16-rounded values, so activations stay fp32; `-mxfp6-matmul` changes
how weights are stored, not the precision of the rest of the network.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from compiler_core.lowering.lowered import LoweredGraph, LTensor
from compiler_core.lowering.program import KIND_CONSTANT

if TYPE_CHECKING:
    from compiler_core.qpc.container import ConstantEntry

MXFP6 = "mxfp6"
BLOCK = 32
"""Elements sharing one scale."""
BLOCK_BYTES = 1 + BLOCK * 6 // 8
"""One scale byte plus 32 six-bit codes."""
SCALE_BIAS = 127
SCALE_NAN = 0xFF
ELEM_EMAX = 2
"""Exponent of E2M3's largest binade (4 <= x < 8)."""
ELEM_MAX = 7.5
FP16_MAX = 65504.0

E2M3_MAGNITUDES = np.array(
    [m / 8 for m in range(8)] + [2.0 ** (e - 1) * (1 + m / 8) for e in (1, 2, 3) for m in range(8)]
)
"""Magnitude of codes 0..31 (exponent bits 4-3, mantissa bits 2-0); bit 5 is the sign.
Ascending, so a rounded magnitude's code is its index."""

_ROWS_PER_CHUNK_ELEMENTS = 1 << 20
FLOAT_DTYPES = ("float32", "float16")


# ---------------------------------------------------------------------------------- the codec


def mxfp6_nbytes(shape: Sequence[int], axis: int) -> int:
    """Stored size of a tensor of `shape` blocked along `axis`."""
    k = int(shape[axis])
    rows = int(np.prod(shape, dtype=np.int64)) // k if k else 0
    return rows * -(-k // BLOCK) * BLOCK_BYTES


def block_scales(blocks: np.ndarray) -> np.ndarray:
    """E8M0 scale codes of (..., 32) float64 blocks."""
    amax = np.max(np.abs(blocks), axis=-1)
    finite = np.isfinite(amax)
    _, exp = np.frexp(np.where(finite, amax, 0.0))  # amax = m * 2^exp, 0.5 <= m < 1
    unbiased = np.where(amax > 0, exp - 1 - ELEM_EMAX, -SCALE_BIAS)
    codes = np.clip(unbiased, -SCALE_BIAS, SCALE_BIAS) + SCALE_BIAS
    return np.where(finite, codes, SCALE_NAN).astype(np.uint8)


def quantize_e2m3(values: np.ndarray) -> np.ndarray:
    """Six-bit E2M3 codes of float64 values already divided by their scale: round to nearest,
    ties to even, saturate to +-7.5. Non-finite inputs give code 0 (their block's scale is NaN)."""
    finite = np.isfinite(values)
    mag = np.where(finite, np.abs(values), 0.0)
    _, exp = np.frexp(mag)  # floor(log2(mag)) = exp - 1 for mag > 0
    binade = np.clip(exp - 1, 0, ELEM_EMAX)  # subnormals share binade 0's step of 1/8
    step = np.ldexp(1.0, binade - 3)
    rounded = np.minimum(np.rint(mag / step) * step, ELEM_MAX)  # rint: ties to even
    codes = np.searchsorted(E2M3_MAGNITUDES, rounded).astype(np.uint8)
    return codes | np.where(np.signbit(values) & finite, 0x20, 0).astype(np.uint8)


def encode_rows(rows: np.ndarray) -> np.ndarray:
    """(R, K) values -> (R, ceil(K/32) * 25) bytes."""
    r, k = rows.shape
    n_blocks = -(-k // BLOCK)
    padded = np.zeros((r, n_blocks * BLOCK), dtype=np.float64)
    padded[:, :k] = rows
    blocks = padded.reshape(r, n_blocks, BLOCK)
    scales = block_scales(blocks)
    exponent = scales.astype(np.int64) - SCALE_BIAS
    scaled = np.ldexp(blocks, -np.where(scales == SCALE_NAN, 0, exponent)[..., None])
    codes = quantize_e2m3(scaled).astype(np.uint32).reshape(r, n_blocks, BLOCK // 4, 4)
    words = codes[..., 0] | codes[..., 1] << 6 | codes[..., 2] << 12 | codes[..., 3] << 18
    out = np.empty((r, n_blocks, BLOCK_BYTES), dtype=np.uint8)
    out[..., 0] = scales
    packed = out[..., 1:].reshape(r, n_blocks, BLOCK // 4, 3)
    for byte in range(3):
        packed[..., byte] = (words >> (8 * byte)) & 0xFF
    return out.reshape(r, n_blocks * BLOCK_BYTES)


def iter_encode_mxfp6(array: np.ndarray, axis: int) -> Iterator[memoryview]:
    """The stored bytes of `array` blocked along `axis`, a bounded number of rows at a time."""
    moved = np.moveaxis(np.asarray(array), axis, -1)
    k = moved.shape[-1]
    rows = moved.reshape(-1, k)
    step = max(1, _ROWS_PER_CHUNK_ELEMENTS // max(k, 1))
    for start in range(0, rows.shape[0], step):
        chunk = np.asarray(rows[start : start + step], dtype=np.float64)
        yield encode_rows(chunk).reshape(-1).data


def encode_mxfp6(array: np.ndarray, axis: int) -> bytes:
    return b"".join(bytes(chunk) for chunk in iter_encode_mxfp6(array, axis))


def decode_rows(data: np.ndarray, k: int) -> np.ndarray:
    """(R, n_blocks * 25) bytes -> (R, k) float64 values."""
    r = data.shape[0]
    blocks = data.reshape(r, -1, BLOCK_BYTES)
    scales = blocks[..., 0].astype(np.int64)
    b = blocks[..., 1:].reshape(r, blocks.shape[1], BLOCK // 4, 3).astype(np.uint32)
    words = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16
    codes = np.stack([(words >> (6 * i)) & 0x3F for i in range(4)], axis=-1)
    codes = codes.reshape(r, blocks.shape[1], BLOCK)
    values = E2M3_MAGNITUDES[codes & 0x1F] * np.where(codes & 0x20, -1.0, 1.0)
    values = np.ldexp(values, (scales - SCALE_BIAS)[..., None])
    values = np.where((scales == SCALE_NAN)[..., None], np.nan, values)
    return values.reshape(r, -1)[:, :k]


def decode_mxfp6(
    data: bytes | memoryview | np.ndarray, shape: Sequence[int], axis: int, dtype: str
) -> np.ndarray:
    """The weight as the runtime computes with it: fp16-rounded values in `dtype`."""
    shape = tuple(int(d) for d in shape)
    axis = axis % len(shape)
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if raw.size != mxfp6_nbytes(shape, axis):
        raise ValueError(
            f"MXFP6 data of shape {list(shape)} blocked along axis {axis} needs "
            f"{mxfp6_nbytes(shape, axis)} bytes, not {raw.size}"
        )
    k = shape[axis]
    moved_shape = (*shape[:axis], *shape[axis + 1 :], k)
    rows = int(np.prod(moved_shape[:-1], dtype=np.int64))
    values = decode_rows(raw.reshape(rows, -1), k) if raw.size else np.zeros((rows, k))
    fp16 = np.clip(values, -FP16_MAX, FP16_MAX).astype(np.float16)  # NaN stays NaN
    return np.moveaxis(fp16.reshape(moved_shape), -1, axis).astype(np.dtype(dtype))


# ------------------------------------------------------------------- choosing what is encoded


@dataclass
class Mxfp6Tensor(LTensor):
    """A constant stored as MXFP6: `dtype` and `shape` stay the logical ones the kernels
    see; `nbytes` is its stored size, so memory planning and the program use that."""

    block_axis: int = 0

    @property
    def nbytes(self) -> int:
        return mxfp6_nbytes(self.shape, self.block_axis)

    @property
    def logical_nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def _weight_axis(op_type: str, domain: str, attrs: Mapping[str, object], rank: int) -> int | None:
    """The K axis of a MatMul/Gemm B operand, None for other ops."""
    if domain not in ("", "ai.onnx"):
        return None
    if op_type == "MatMul":
        return 0 if rank == 1 else rank - 2
    if op_type == "Gemm" and rank == 2:
        return 1 if int(attrs.get("transB", 0) or 0) else 0  # type: ignore[call-overload]
    return None


def encode_matmul_weights(graph: LoweredGraph) -> list[str]:
    """Mark every constant read only as the B operand of MatMul/Gemm kernels (one K axis) as
    MXFP6, in place; the names of those marked. Their full-precision copies in the kernels'
    NodeInfo (small constants are inlined there) are dropped: the QPC holds only MXFP6."""
    aliased = {t.alias_of for t in graph.tensors if t.alias_of is not None}
    axes: dict[int, int | None] = {}
    for lk in graph.kernels:
        info = lk.desc.info
        for position, tid in enumerate(lk.desc.inputs):
            if tid < 0:
                continue
            t = graph.tensors[tid]
            axis = None
            if position == 1:
                axis = _weight_axis(info.op_type, info.domain, info.attrs, len(t.shape))
            if tid in axes and axes[tid] != axis:
                axis = None
            axes[tid] = axis
    outputs = set(graph.outputs)
    marked: list[int] = []
    for tid, axis in axes.items():
        t = graph.tensors[tid]
        if (
            axis is None
            or t.kind != KIND_CONSTANT
            or t.dtype not in FLOAT_DTYPES
            or tid in aliased
            or tid in outputs
            or t.alias_of is not None
            or int(np.prod(t.shape, dtype=np.int64)) == 0
        ):
            continue
        fields = {f.name: getattr(t, f.name) for f in dataclasses.fields(t)}
        graph.tensors[tid] = Mxfp6Tensor(**fields, block_axis=axis)
        marked.append(tid)
    _drop_inlined(graph, set(marked))
    return [graph.tensors[t].name for t in sorted(marked)]


def _drop_inlined(graph: LoweredGraph, marked: set[int]) -> None:
    for lk in graph.kernels:
        desc = lk.desc
        drop = {i for i, tid in enumerate(desc.inputs) if tid in marked and i in desc.info.consts}
        if drop:
            consts = {i: v for i, v in desc.info.consts.items() if i not in drop}
            info = dataclasses.replace(desc.info, consts=consts)
            lk.desc = dataclasses.replace(desc, info=info)


# ------------------------------------------------------------------------------ the runtime


def decode_constants(
    entries: Sequence[ConstantEntry], constants: bytes | memoryview
) -> dict[int, np.ndarray]:
    """The encoded constants of a QPC decoded, read-only, by their offset in constants.bin."""
    raw = np.frombuffer(constants, dtype=np.uint8)
    out: dict[int, np.ndarray] = {}
    for entry in entries:
        if entry.encoding is None:
            continue
        if entry.encoding != MXFP6 or entry.block_axis is None:
            raise ValueError(f"constant {entry.name!r} has unknown encoding {entry.encoding!r}")
        data = raw[entry.offset : entry.offset + entry.nbytes]
        if data.size != entry.nbytes:
            raise ValueError(f"constant {entry.name!r} lies beyond constants.bin")
        try:
            array = decode_mxfp6(data, entry.shape, entry.block_axis, entry.dtype)
        except ValueError as exc:
            raise ValueError(f"constant {entry.name!r}: {exc}") from None
        array.setflags(write=False)
        out[entry.offset] = array
    return out
