"""Whole models compile to QPCs whose functional-runtime outputs match ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from compiler_core import compile_model, run_qpc
from tests.models import (
    LIGHT_MODELS,
    light_model_input,
    light_model_path,
    transformer_encoder,
)

RTOL, ATOL = 1e-4, 1e-5


def _ort(model: str | bytes, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


@pytest.mark.parametrize("cores", [1, 4])
@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_light_cnn_matches_onnxruntime(name: str, cores: int) -> None:
    path = light_model_path(name)
    result = compile_model(path, [f"-aic-num-cores={cores}"])
    program = result.program
    assert program.num_cores == cores
    feeds = {
        program.tensors[t].name: light_model_input(program.tensors[t].shape) for t in program.inputs
    }
    ours = run_qpc(result.qpc_path, feeds)
    expected = _ort(path, feeds)
    assert set(ours) == set(expected)
    for key, want in expected.items():
        np.testing.assert_allclose(ours[key], want, rtol=RTOL, atol=ATOL, err_msg=key)
    busy = [s for s in program.streams if any(type(i).__name__ == "RunKernel" for i in s)]
    assert len(busy) == cores


@pytest.mark.parametrize("cores", [1, 3, 8])
def test_transformer_encoder_matches_onnxruntime(cores: int) -> None:
    model = transformer_encoder()
    x = np.random.default_rng(1).standard_normal((2, 16, 64)).astype(np.float32)
    result = compile_model(model, [f"-aic-num-cores={cores}"])
    ours = run_qpc(result.qpc_path, {"x": x})
    want = _ort(model.SerializeToString(), {"x": x})
    np.testing.assert_allclose(ours["y"], want["y"], rtol=RTOL, atol=ATOL)


def test_transformer_attention_is_split_across_cores() -> None:
    result = compile_model(transformer_encoder(), ["-aic-num-cores=4"])
    busy = [s for s in result.program.streams if any(type(i).__name__ == "RunKernel" for i in s)]
    assert len(busy) == 4
