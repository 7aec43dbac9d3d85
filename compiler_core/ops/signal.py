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


# --- STFT -----------------------------------------------------------------------------------


def _stft_fail(node: NodeInfo, problem: str) -> CompileError:
    return CompileError("invalid_model", f"STFT: {problem}", node=node.name)


def _stft_frame_length(node: NodeInfo, inputs: list[Array | None]) -> int:
    window = inputs[2] if len(inputs) > 2 else None
    given = inputs[3] if len(inputs) > 3 else None
    if given is not None:
        length = int(given.reshape(-1)[0])
        if window is not None and window.shape[0] != length:
            raise _stft_fail(
                node, f"window length {window.shape[0]} differs from frame_length {length}"
            )
        return length
    if window is None:
        raise _stft_fail(node, "needs a window or a frame_length")
    return int(window.shape[0])


def stft_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Frames of `frame_length` samples every `frame_step`, windowed, then a DFT each.

    Computed in float64 and rounded once: each frame is a short independent transform, so the
    extra precision is cheap and the result does not depend on the FFT's summation order."""
    signal, step_in = inputs[0], inputs[1]
    assert signal is not None and step_in is not None
    if signal.ndim != 3 or signal.shape[2] not in (1, 2):
        raise _stft_fail(node, f"signal shape {signal.shape} is not [batch, length, 1 or 2]")
    onesided = bool(int(node.attr("onesided", 1)))
    if onesided and signal.shape[2] == 2:
        raise _stft_fail(node, "onesided output needs a real signal")
    step = int(step_in.reshape(-1)[0])
    length = _stft_frame_length(node, inputs)
    if step <= 0 or not 0 < length <= signal.shape[1]:
        raise _stft_fail(
            node, f"frame_step {step} / frame_length {length} do not fit {signal.shape[1]} samples"
        )
    frames = 1 + (signal.shape[1] - length) // step
    x = signal[..., 0].astype(np.float64)
    if signal.shape[2] == 2:
        x = x + np.multiply(signal[..., 1].astype(np.float64), 1j)
    positions = np.arange(frames)[:, None] * step + np.arange(length)[None, :]
    windowed = x[:, positions]  # [batch, frames, length]
    window = inputs[2] if len(inputs) > 2 else None
    if window is not None:
        windowed = windowed * window.astype(np.float64)
    spectrum = np.fft.rfft(windowed, axis=-1) if onesided else np.fft.fft(windowed, axis=-1)
    y = np.stack([spectrum.real, spectrum.imag], axis=-1)
    if y.shape != tuple(node.out_shapes[0]):
        raise CompileError(
            "runtime_fault",
            f"STFT produced shape {y.shape} but the output is declared {node.out_shapes[0]}",
            node=node.name,
        )
    return [y.astype(np.dtype(node.out_dtypes[0]))]


def stft_macs(node: NodeInfo) -> int:
    """n log n per output bin, one FFT per frame."""
    shape = node.out_shapes[0]
    elements = int(np.prod(shape, dtype=np.int64))
    bins = int(shape[-2]) if len(shape) >= 2 else 1
    return max(1, elements * max(1, int(np.log2(max(2, bins)))))


register(
    "STFT",
    stft_compute,
    since=17,
    dtypes=FLOATS,
    kernel="stft",
    macs=stft_macs,
    doc="Whole-tensor short-time Fourier transform of real or complex signals, optional window, "
    "onesided (default) or full spectrum.",
)


# --- MelWeightMatrix --------------------------------------------------------------------------


def _mel_edges(count: int, dft_length: int, rate: int, low_hz: float, high_hz: float) -> Array:
    """`count` + 2 triangle edges as spectrogram bin indices, evenly spaced on the mel scale.

    The mel range is cut into count + 2 steps (not count + 1), as ONNX specifies it, so the
    top edge stays a step below upper_edge_hertz."""
    low_mel = 2595.0 * np.log10(1.0 + low_hz / 700.0)
    high_mel = 2595.0 * np.log10(1.0 + high_hz / 700.0)
    mels = low_mel + np.arange(count + 2) * ((high_mel - low_mel) / (count + 2))
    hertz = 700.0 * (np.power(10.0, mels / 2595.0) - 1.0)
    return np.floor((dft_length + 1) * hertz / rate).astype(np.int64)


def _triangles(edges: Array, bins: int) -> Array:
    """[bins, len(edges) - 2] triangles rising from edges[i] to 1 at edges[i + 1], falling to
    0 at edges[i + 2]; a zero-width rise is a single 1 at the peak."""
    j = np.arange(bins, dtype=np.float64)[:, None]
    left, center, right = edges[None, :-2], edges[None, 1:-1], edges[None, 2:]
    rise_width = (center - left).astype(np.float64)
    fall_width = (right - center).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rise = np.where(rise_width > 0, (j - left) / rise_width, 1.0)
        fall = np.where(fall_width > 0, (right - j) / fall_width, 0.0)
    on_rise = (j >= left) & (j <= center)
    on_fall = (j >= center) & (j < right)
    out: Array = np.where(on_fall, fall, np.where(on_rise, rise, 0.0))
    return out


def mel_weight_matrix_compute(
    node: NodeInfo, inputs: list[Array | None], tile: TileCtx
) -> list[Array]:
    values = [v for v in inputs if v is not None]
    if len(values) != 5:
        raise CompileError("invalid_model", "MelWeightMatrix needs 5 inputs", node=node.name)
    count, dft_length, rate = (int(v.reshape(-1)[0]) for v in values[:3])
    low_hz, high_hz = (float(v.reshape(-1)[0]) for v in values[3:])
    bins = dft_length // 2 + 1
    if count <= 0 or dft_length <= 0 or rate <= 0:
        raise CompileError(
            "invalid_model",
            f"MelWeightMatrix: num_mel_bins {count}, dft_length {dft_length} and sample_rate "
            f"{rate} must be positive",
            node=node.name,
        )
    edges = _mel_edges(count, dft_length, rate, low_hz, high_hz)
    if edges.min() < 0 or edges[1:-1].max() >= bins or edges.max() > bins:
        raise CompileError(
            "invalid_model",
            f"MelWeightMatrix: [{low_hz}, {high_hz}] Hz falls outside the {bins} bins of a "
            f"{dft_length}-point DFT at {rate} Hz",
            node=node.name,
        )
    return [_triangles(edges, bins).astype(np.dtype(node.out_dtypes[0]))]


register(
    "MelWeightMatrix",
    mel_weight_matrix_compute,
    since=17,
    dtypes=frozenset({"int32", "int64"}),
    kernel="mel_weight_matrix",
    macs=lambda node: int(np.prod(node.out_shapes[0], dtype=np.int64)),
    doc="Triangular mel filterbank [dft_length // 2 + 1, num_mel_bins] from runtime or constant "
    "scalars.",
)
