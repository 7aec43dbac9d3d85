"""Signal ops: the cosine-sum windows (Hann, Hamming, Blackman) and DFT.

Windows are generated, not computed from data: the size input must be a constant (its value
fixes the output shape). DFT runs whole (its axis couples every element) on the
[..., 1 | 2] real/complex layout ONNX uses, in the input's precision, like the ONNX reference.
"""

from __future__ import annotations

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.registry import FLOATS, NodeInfo, TileCtx, register

Array = np.ndarray

_COEFFS = {
    "HannWindow": (0.5, 0.5, 0.0),
    "HammingWindow": (25.0 / 46.0, 21.0 / 46.0, 0.0),
    "BlackmanWindow": (0.42, 0.5, 0.08),
}
"""a0, a1, a2 of w[n] = a0 - a1 cos(2 pi n / D) + a2 cos(4 pi n / D)."""


def window_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    size = inputs[0]
    assert size is not None
    n = int(size.reshape(-1)[0])
    a0, a1, a2 = _COEFFS[node.op_type]
    denominator = n if int(node.attr("periodic", 1)) else n - 1
    k = np.arange(n, dtype=np.float64)
    phase = 2.0 * np.pi * k / denominator if denominator > 0 else np.zeros(n)
    w = a0 - a1 * np.cos(phase) + a2 * np.cos(2.0 * phase)
    return [w.astype(np.dtype(node.out_dtypes[0]))]


for _op in _COEFFS:
    register(
        _op,
        window_compute,
        since=17,
        dtypes=frozenset({"int32", "int64"}),
        kernel=_op.lower(),
        macs=lambda node: int(node.out_shapes[0][0]) if node.out_shapes[0] else 0,
        doc="Cosine-sum window of a constant size; periodic (default) or symmetric.",
    )


def _dft_axis(node: NodeInfo, inputs: list[Array | None], rank: int) -> int:
    if node.opset >= 20:
        given = inputs[2] if len(inputs) > 2 else None
        axis = -2 if given is None else int(given.reshape(-1)[0])
    else:
        axis = int(node.attr("axis", 1))
    return axis + rank if axis < 0 else axis


def dft_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = inputs[0]
    assert x is not None
    axis = _dft_axis(node, inputs, x.ndim)
    if not 0 < axis < x.ndim - 1:
        raise CompileError("invalid_model", f"DFT axis {axis} out of range", node=node.name)
    work = np.float64 if x.dtype == np.float64 else np.float32
    signal: Array = x[..., 0].astype(work)
    if x.shape[-1] == 2:
        signal = signal + np.multiply(x[..., 1].astype(work), 1j)
    length_in = inputs[1] if len(inputs) > 1 else None
    length = signal.shape[axis] if length_in is None else int(length_in.reshape(-1)[0])
    inverse = bool(int(node.attr("inverse", 0)))
    onesided = bool(int(node.attr("onesided", 0)))
    if inverse and onesided:
        # One-sided spectrum in, real signal out: its length is the static output's.
        real = np.fft.irfft(signal, n=node.out_shapes[0][axis], axis=axis)
        return [real[..., None].astype(np.dtype(node.out_dtypes[0]))]
    transform = np.fft.ifft if inverse else np.fft.fft
    spectrum = transform(signal, n=length, axis=axis)
    if onesided:
        spectrum = np.take(spectrum, np.arange(length // 2 + 1), axis=axis)
    y = np.stack([spectrum.real, spectrum.imag], axis=-1)
    return [y.astype(np.dtype(node.out_dtypes[0]))]


def dft_macs(node: NodeInfo) -> int:
    """n log n per transformed element, as an FFT would."""
    elements = int(np.prod(node.out_shapes[0], dtype=np.int64))
    return elements * max(1, int(np.log2(max(2, elements))))


register(
    "DFT",
    dft_compute,
    since=17,
    dtypes=FLOATS,
    kernel="dft",
    macs=dft_macs,
    doc="Forward or inverse, optional onesided and dft_length; axis attribute (17) or input (20).",
)
