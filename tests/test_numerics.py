"""Non-finite outputs are reported with where they began and the fix, not left to numpy's
RuntimeWarnings: by run_qpc and QpcSession (a NonFiniteWarning and `session.numerics`), by
`qpcfarm run` (a warning line) and in a profile's summary; the compiler names the constants
-convert-to-fp16 clips or flushes to 0, with the nodes that read them."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from compiler_core import compile_model, run_qpc
from compiler_core.cli import main
from compiler_core.runtime import QpcSession
from compiler_core.runtime.numerics import NonFiniteWarning
from tests.models import OVERFLOW_INPUTS as ONES
from tests.models import OVERFLOW_WIDTH as WIDTH
from tests.models import light_model_input, light_model_path, overflowing_model
from tests.op_checks import run_onnxruntime


def test_fp16_overflow_is_traced_to_its_kernel_with_the_fix_that_works(tmp_path: Path) -> None:
    model = overflowing_model()
    result = compile_model(model, ["-convert-to-fp16"])
    with pytest.warns(NonFiniteWarning) as caught:
        out = run_qpc(result.qpc_path, ONES)["y"]
    assert np.isnan(out).all()
    report = caught[0].message.report  # type: ignore[union-attr]
    assert report.outputs["y"].nan == WIDTH
    origin = report.origin
    assert origin.kind == "kernel" and origin.dtype == "float16"
    assert origin.nodes == ("/proj/MatMul", "/proj/Mul")
    assert origin.inputs.bad == 0 and origin.inputs.high == 5000.0
    assert origin.results.posinf == WIDTH
    assert "float16 holds at most" in report.message()
    assert "FP32NodeInstanceNames: [/proj/MatMul, /proj/Mul]" in report.fix

    # The fix as the report words it: those nodes in float32, the rest in float16.
    keep = tmp_path / "keep.yaml"
    keep.write_text("FP32NodeInstanceNames: [/proj/MatMul, /proj/Mul]\n")
    fixed = compile_model(model, ["-convert-to-fp16", f"-node-precision-info={keep}"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteWarning)
        ours = run_qpc(fixed.qpc_path, ONES)["y"]
    (want,) = run_onnxruntime(model, ONES)
    np.testing.assert_allclose(ours, want, rtol=1e-2, atol=1e-3)


def test_infinities_that_never_reach_an_output_are_not_blamed() -> None:
    """The mask branch's -inf come first in the program; the NaN come from the overflow."""
    result = compile_model(overflowing_model(with_mask_branch=True), ["-convert-to-fp16"])
    kernels = {n: k.id for k in result.program.kernels for n in k.nodes}
    assert kernels["/mask/MatMul"] < kernels["/proj/MatMul"]
    with QpcSession(result.qpc_path) as session, pytest.warns(NonFiniteWarning):
        session.run(ONES)
        session.run(ONES)  # traced once per session
    assert session.numerics is not None and session.numerics.origin is not None
    assert session.numerics.origin.nodes == ("/proj/MatMul", "/proj/Mul")


def test_finite_runs_warn_nothing_and_fp32_runs_name_no_precision_fix() -> None:
    result = compile_model(overflowing_model(with_mask_branch=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = run_qpc(result.qpc_path, ONES)["y"]  # float32: 80,000 is fine
    assert np.isfinite(out).all()

    nan_in = {"x": np.full((1, WIDTH), np.nan, np.float32)}
    with QpcSession(result.qpc_path) as session, pytest.warns(NonFiniteWarning):
        session.run(nan_in)
    assert session.numerics is not None and session.numerics.origin is not None
    assert (session.numerics.origin.kind, session.numerics.origin.name) == ("input", "x")
    assert "node-precision-info" not in session.numerics.fix


def test_qpcfarm_run_prints_the_report_as_one_warning_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "overflow.onnx"
    onnx.save(overflowing_model(), model)
    np.savez(tmp_path / "in.npz", x=ONES["x"])
    out_dir = tmp_path / "out"
    assert main(["compile", f"-m={model}", f"-aic-binary-dir={out_dir}", "-convert-to-fp16"]) == 0
    capsys.readouterr()
    assert main(["run", str(out_dir), "--inputs", str(tmp_path / "in.npz")]) == 0
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()  # no numpy RuntimeWarning, no internal path
    assert line.startswith("warning: [non_finite] output 'y' holds 16 NaN of 16 values.")
    assert "(nodes: /proj/MatMul, /proj/Mul); suggestion: keep these nodes in float32" in line


def test_a_light_cnn_that_overflows_float16_is_traced_to_the_first_node_past_its_range() -> None:
    """light_squeezenet's synthetic weights drive activations far past 65,504: the first
    kernel blamed holds the first node whose float32 output (ONNX Runtime) leaves float16's
    range."""
    path = light_model_path("light_squeezenet")
    result = compile_model(path, ["-convert-to-fp16"])
    program = result.program
    feeds = {
        program.tensors[t].name: light_model_input(program.tensors[t].shape) for t in program.inputs
    }
    with QpcSession(result.qpc_path) as session, pytest.warns(NonFiniteWarning):
        session.run(feeds)
    assert session.numerics is not None and session.numerics.origin is not None
    blamed = set(session.numerics.origin.nodes)

    proto = onnx.load(path)
    produced = [
        (node.name or f"{node.op_type}_{i}", out)
        for i, node in enumerate(proto.graph.node)
        for out in node.output
    ]
    del proto.graph.output[:]
    proto.graph.output.extend(helper.make_empty_tensor_value_info(o) for _, o in produced)
    values = run_onnxruntime(proto, feeds)
    first = next(
        name
        for (name, _), value in zip(produced, values, strict=True)
        if np.abs(value).max() > 65504
    )
    assert first in blamed, (first, blamed)
