"""The Python API that the service and the checks import, exactly as documented."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from compiler_core import (
    CompileError,
    CompileOptions,
    compile_model,
    load_qpc,
    run_qpc,
    validate_qpc,
)
from tests.models import transformer_encoder


def test_compile_model_without_a_binary_dir_writes_a_temporary_qpc() -> None:
    result = compile_model(transformer_encoder(), CompileOptions.from_flags(["-aic-num-cores=2"]))
    assert result.qpc_path.name == "programqpc.bin" and result.qpc_path.exists()
    assert result.qpc[:4] == (0x00A1CD7C).to_bytes(4, "little")
    assert result.metrics["num_cores"] == 2 and result.metrics["estimated"] is True
    assert "lower" in result.pass_times and "graph-passes/fold-constants" in result.pass_times
    assert isinstance(result.warnings, list)
    result.cleanup()
    assert not result.qpc_path.exists()


def test_options_come_from_flags_json_or_an_object_alike(tmp_path: Path) -> None:
    model = transformer_encoder()
    flags = compile_model(model, ["-aic-num-cores=3", f"-aic-binary-dir={tmp_path / 'a'}"])
    json = compile_model(model, {"aic-num-cores": 3, "aic_binary_dir": str(tmp_path / "b")})
    obj = compile_model(model, CompileOptions.from_json({"aic_num_cores": 3}))
    assert flags.qpc == json.qpc == obj.qpc
    assert CompileOptions.from_flags(["-aic-num-cores=3"]).to_json() == obj.options.to_json()


def test_run_qpc_takes_bytes_or_a_path_and_returns_every_output_by_name() -> None:
    model = transformer_encoder()
    x = np.random.default_rng(0).standard_normal((2, 16, 64)).astype(np.float32)
    result = compile_model(model)
    from_path = run_qpc(result.qpc_path, {"x": x})
    from_bytes = run_qpc(result.qpc, {"x": x})
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    assert list(from_path) == ["y"]
    np.testing.assert_array_equal(from_path["y"], from_bytes["y"])
    np.testing.assert_allclose(from_path["y"], want, rtol=1e-4, atol=1e-5)


def test_load_and_validate_a_compiled_qpc() -> None:
    result = compile_model(transformer_encoder(), ["-aic-num-cores=16"])
    with load_qpc(result.qpc_path) as qpc:
        assert qpc.network is not None and qpc.network.num_cores == 16
    assert validate_qpc(result.qpc_path).ok
    report = validate_qpc(result.qpc_path, device="aic100-standard")
    assert not report.ok
    assert any(c.name == "device-cores" and not c.ok for c in report.checks)


def test_every_failure_is_one_exception_type_with_a_stable_code() -> None:
    with pytest.raises(CompileError) as bad_option:
        compile_model(transformer_encoder(), ["-aic-num-cores=0"])
    assert bad_option.value.code == "invalid_option"
    with pytest.raises(CompileError) as bad_model:
        compile_model(b"not a model at all")
    assert bad_model.value.code == "invalid_model"
    assert bad_model.value.to_dict()["code"] == "invalid_model"
