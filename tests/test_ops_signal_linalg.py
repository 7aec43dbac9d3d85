"""STFT and MelWeightMatrix through the whole path, against ONNX Runtime.

Their output shapes hang on scalar inputs (frame step and length, bin counts); when those are
graph inputs the model declares the output shape, as the compiler's contract requires.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from compiler_core.errors import CompileError
from tests.op_checks import assert_matches, one_node_model, rand, run_compiled

F32 = np.float32
I64 = np.int64


def _stft_model(
    feeds: dict[str, np.ndarray], out: tuple[int, ...], **attrs: Any
) -> onnx.ModelProto:
    names = ["signal", "step", "window", "length"]
    node = oh.make_node("STFT", [n if n in feeds else "" for n in names], ["y"], **attrs)
    return one_node_model(node, feeds, {"y": (F32, out)}, opset=17)


def _hann(n: int) -> np.ndarray:
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)).astype(F32)


@pytest.mark.parametrize("onesided", [0, 1])
def test_stft_of_a_real_signal_with_a_window_matches_onnxruntime(onesided: int) -> None:
    feeds = {"signal": rand(2, 40, 1), "step": np.array(6, dtype=I64), "window": _hann(10)}
    bins = 6 if onesided else 10
    model = _stft_model(feeds, (2, 6, bins, 2), onesided=onesided)
    assert_matches(model, feeds, rtol=1e-4, atol=1e-5)


def test_stft_with_frame_length_and_no_window_matches_onnxruntime() -> None:
    feeds = {"signal": rand(1, 33, 1), "step": np.array(4, dtype=I64)}
    feeds["length"] = np.array(8, dtype=I64)
    assert_matches(_stft_model(feeds, (1, 7, 5, 2)), feeds, rtol=1e-4, atol=1e-5)


def test_stft_of_a_complex_signal_two_sided_matches_onnxruntime() -> None:
    feeds = {"signal": rand(1, 24, 2), "step": np.array(5, dtype=I64), "window": _hann(8)}
    feeds["length"] = np.array(8, dtype=I64)
    model = _stft_model(feeds, (1, 4, 8, 2), onesided=0)
    assert_matches(model, feeds, rtol=1e-4, atol=1e-5)


def test_stft_rejects_a_window_longer_than_frame_length() -> None:
    feeds = {"signal": rand(1, 24, 1), "step": np.array(4, dtype=I64), "window": _hann(8)}
    feeds["length"] = np.array(6, dtype=I64)
    with pytest.raises(CompileError, match="window length 8 differs from frame_length 6"):
        run_compiled(_stft_model(feeds, (1, 5, 4, 2)), feeds)


def _mel_model(feeds: dict[str, np.ndarray], out: tuple[int, int]) -> onnx.ModelProto:
    names = ["mels", "dft", "rate", "low", "high"]
    node = oh.make_node("MelWeightMatrix", names, ["w"])
    return one_node_model(node, feeds, {"w": (F32, out)}, opset=17)


def _mel_feeds(mels: int, dft: int, rate: int, low: float, high: float) -> dict[str, np.ndarray]:
    return {
        "mels": np.array(mels, dtype=I64),
        "dft": np.array(dft, dtype=I64),
        "rate": np.array(rate, dtype=I64),
        "low": np.array(low, dtype=F32),
        "high": np.array(high, dtype=F32),
    }


@pytest.mark.parametrize(
    "params",
    [(8, 64, 16000, 0.0, 8000.0), (20, 512, 22050, 125.0, 7600.0), (6, 16, 8000, 300.0, 3000.0)],
)
def test_melweightmatrix_triangles_match_onnxruntime(
    params: tuple[int, int, int, float, float],
) -> None:
    feeds = _mel_feeds(*params)
    out = (params[1] // 2 + 1, params[0])
    assert_matches(_mel_model(feeds, out), feeds)


def test_melweightmatrix_rejects_an_upper_edge_beyond_the_spectrum() -> None:
    feeds = _mel_feeds(4, 16, 8000, 0.0, 40000.0)
    with pytest.raises(CompileError, match="falls outside the 9 bins"):
        run_compiled(_mel_model(feeds, (9, 4)), feeds)
