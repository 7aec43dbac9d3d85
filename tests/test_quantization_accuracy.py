"""The accuracy report of a quantized compile: per output, against the float model run with
our kernels, on the calibration samples and the held-back ones (figures recomputed here from
ONNX Runtime's float outputs), in the metrics; a warning names the nodes that lose most."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from compiler_core.compile import compile_model
from compiler_core.quant.accuracy import compare, split
from compiler_core.runtime import run_qpc
from tests.quant_models import calibration, cnn, run_ort

MODEL = cnn()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("acc")
    onnx.save(MODEL, root / "model.onnx")
    samples = calibration(MODEL, 8)
    np.savez(root / "calib.npz", x=np.stack([s["x"] for s in samples]))
    return root, samples


def test_split_holds_back_the_last_quarter():
    assert [len(p) for p in split(list(range(8)))] == [6, 2]
    assert [len(p) for p in split(list(range(3)))] == [2, 1]
    assert [len(p) for p in split(list(range(1)))] == [1, 0]


def test_compare_figures():
    ref = [np.array([[1.0, 2.0, 3.0]]), np.array([[3.0, 1.0, 0.0]])]
    got = [np.array([[1.0, 2.5, 3.0]]), np.array([[1.0, 2.0, 0.0]])]
    figures = compare(ref, got)
    assert figures["max_abs_error"] == 2.0
    assert figures["relative_error"] == pytest.approx(2.0 / 3.0, abs=1e-6)
    a, b = np.concatenate(ref, axis=None), np.concatenate(got, axis=None)
    cosine = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
    assert figures["cosine_similarity"] == pytest.approx(cosine, abs=1e-6)
    assert figures["top1_agreement"] == 0.5


def test_dumped_compile_reports_both_sets_in_the_metrics(files):
    root, samples = files
    result = compile_model(
        root / "model.onnx",
        [f"-dump-profile={root / 'p.json'}", f"-input-list-file={root / 'calib.npz'}"],
    )
    report = result.metrics["quantization_accuracy"]
    assert report["calibration"]["samples"] == 6 and report["held_back"]["samples"] == 2
    held = report["held_back"]["outputs"]["y"]
    # recompute against ONNX Runtime's float model: our fp32 kernels agree with it closely,
    # so the figures must agree with ORT-based ones to a small tolerance
    ours = [run_qpc(result.qpc_path, s)["y"] for s in samples[6:]]
    ref = [run_ort(MODEL, s)[0] for s in samples[6:]]
    again = compare(ref, ours)
    assert held["max_abs_error"] == pytest.approx(again["max_abs_error"], abs=1e-4)
    assert held["cosine_similarity"] == pytest.approx(again["cosine_similarity"], abs=1e-5)
    assert held["top1_agreement"] == again["top1_agreement"]
    loss = next(w for w in result.warnings if w["code"] == "quantization_loss")
    assert loss["kind"] == "precision" and loss["nodes"]


def test_load_profile_with_inputs_reports_them_as_held_back(files):
    root, _ = files
    compile_model(
        root / "model.onnx",
        [
            f"-dump-profile={root / 'p2.json'}",
            f"-input-list-file={root / 'calib.npz'}",
            "-no-quant",
        ],
    )
    result = compile_model(
        root / "model.onnx",
        [f"-load-profile={root / 'p2.json'}", f"-input-list-file={root / 'calib.npz'}"],
    )
    assert list(result.accuracy) == ["held_back"]
    assert result.accuracy["held_back"]["samples"] == 8
    plain = compile_model(root / "model.onnx", [f"-load-profile={root / 'p2.json'}"])
    assert plain.accuracy is None and "quantization_accuracy" not in plain.metrics


def test_poor_accuracy_warns_naming_the_nodes_that_lose_most(files):
    root, _ = files
    result = compile_model(
        root / "model.onnx",
        [
            f"-dump-profile={root / 'p3.json'}",
            f"-input-list-file={root / 'calib.npz'}",
            "-quantization-calibration=KLMinimizationV2",
        ],
    )
    warning = next(w for w in result.warnings if w["code"] == "quantization_accuracy")
    assert warning["nodes"] and all(n in warning["message"] for n in warning["nodes"])
    assert "-node-precision-info" in warning["suggestion"]
