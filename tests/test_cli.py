"""`qpcfarm` on the command line: compile like qaic-compile, run, validate, inspect, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.parser
import pytest

from compiler_core import cli
from compiler_core.cli import main
from compiler_core.options import OPTIONS
from compiler_core.report import render_metrics, render_pass_times, render_warning

MODEL_TEXT = """
<ir_version: 8, opset_import: ["" : 17]>
net (float[2, 8] x, float[2, 8] w) => (float[2, 8] y) {
    s = Add(x, w)
    y = Relu(s)
}
"""


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("qpcfarm: error: ")
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    path = tmp_path / "net.onnx"
    onnx.save(onnx.parser.parse_model(MODEL_TEXT), path)
    return path


# -- compile: help, operator list, option errors ----------------------------------------------


def test_compile_help_prints_every_option_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "compile", "-h")
    assert code == 0 and err == ""
    assert out.startswith("USAGE: qpcfarm compile")
    for spec in OPTIONS:
        assert spec.flag in out
    assert run_cli(capsys, "compile", "--usage")[1] == out


def test_operators_supported_prints_the_registry_one_op_per_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from compiler_core.ops import REGISTRY

    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "compile", "-operators-supported=onnx")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == len(REGISTRY.all())
    for line, opdef in zip(lines, REGISTRY.all(), strict=True):
        op, domain, opsets, dtypes = line.split()
        assert op == opdef.op_type
        assert domain == (opdef.domain or "ai.onnx")
        assert opsets.startswith(f"{opdef.since}")
        assert set(dtypes.split(",")) == set(opdef.dtypes)
    if REGISTRY.lookup("Relu") is not None:
        assert sum(1 for line in lines if line.split()[0] == "Relu") == len(
            REGISTRY.versions("Relu")
        )
    assert list(tmp_path.iterdir()) == []  # writes nothing else


def test_operators_supported_for_another_framework_is_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_cli(capsys, "compile", "-operators-supported=caffe2")
    assert code == 1
    assert "supported: onnx, tensorflow, pytorch" in assert_one_error_line(err)


def test_unknown_flag_exits_1_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "compile", "-m=x.onnx", "-aic-profiling-type=stats")
    assert code == 1 and out == ""
    line = assert_one_error_line(err)
    assert "Invalid option -aic-profiling-type." in line
    assert "Use -h for the list of options." in line


def test_bad_value_names_flag_value_and_rule(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "compile", "-m=x.onnx", "-aic-num-cores=32")
    assert code == 1
    line = assert_one_error_line(err)
    assert "-aic-num-cores" in line and "32" in line and "1 to 16" in line


def test_compile_without_arguments_explains_what_to_pass(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_cli(capsys, "compile")
    assert code == 1 and "-m=<model.onnx>" in assert_one_error_line(err)


def test_missing_model_file_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "nope.onnx"
    code, _, err = run_cli(capsys, "compile", f"-m={missing}", f"-aic-binary-dir={tmp_path}/o")
    assert code == 1
    line = assert_one_error_line(err)
    assert "model file not found" in line and str(missing) in line
    assert not (tmp_path / "o").exists()


def test_model_flag_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "compile", "-aic-num-cores=2")
    assert code == 1 and "-m=<model.onnx>" in assert_one_error_line(err)


def test_output_directory_is_required(capsys: pytest.CaptureFixture[str], model_path: Path) -> None:
    code, _, err = run_cli(capsys, "compile", f"-m={model_path}")
    assert code == 1 and "-aic-binary-dir=<dir>" in assert_one_error_line(err)


# -- compile, run, validate, inspect end to end -------------------------------------------------


def test_compile_then_run_matches_onnxruntime(
    capsys: pytest.CaptureFixture[str], model_path: Path, tmp_path: Path
) -> None:
    import onnxruntime as ort

    out_dir = tmp_path / "out"
    code, out, err = run_cli(
        capsys,
        "compile",
        f"-m={model_path}",
        f"-aic-binary-dir={out_dir}",
        "-aic-num-cores=2",
        "-aic-perf-metrics",
        "-time-passes",
        "-compile-only",
    )
    assert code == 0, err
    qpc = out_dir / "programqpc.bin"
    assert out.strip().splitlines()[-1] == str(qpc) and qpc.is_file()
    assert "Performance metrics (estimated)" in out
    assert "time (ms)" in out and "total" in out
    assert err.count("-compile-only is deprecated") == 1

    rng = np.random.default_rng(0)
    feeds: dict[str, Any] = {n: rng.standard_normal((2, 8)).astype(np.float32) for n in ("x", "w")}
    np.savez(tmp_path / "in.npz", **feeds)
    code, out, err = run_cli(
        capsys,
        "run",
        str(out_dir),
        "--inputs",
        str(tmp_path / "in.npz"),
        "--outputs",
        str(tmp_path / "out.npz"),
    )
    assert code == 0, err
    assert out.split() == ["y", "2x8", "float32"]
    (expected,) = ort.InferenceSession(str(model_path)).run(None, feeds)
    with np.load(tmp_path / "out.npz") as got:
        np.testing.assert_allclose(got["y"], expected, rtol=1e-6, atol=1e-6)


def test_validate_prints_a_line_per_check_and_fails_on_a_too_small_device(
    capsys: pytest.CaptureFixture[str], model_path: Path, tmp_path: Path
) -> None:
    out_dir = tmp_path / "out"
    flags = [f"-m={model_path}", f"-aic-binary-dir={out_dir}", "-aic-num-cores=16"]
    assert run_cli(capsys, "compile", *flags)[0] == 0

    code, out, _ = run_cli(capsys, "qpc", "validate", str(out_dir / "programqpc.bin"))
    assert code == 0
    lines = out.splitlines()
    assert lines and all(line.startswith("PASS ") for line in lines)

    code, out, _ = run_cli(capsys, "qpc", "validate", str(out_dir), "--device", "aic100-standard")
    assert code == 1
    assert any(line.startswith("FAIL ") for line in out.splitlines())
    assert all(line.split()[0] in ("PASS", "FAIL") and ":" in line for line in out.splitlines())


def test_validate_rejects_a_file_that_is_not_a_qpc(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a qpc at all" * 4)
    code, out, _ = run_cli(capsys, "qpc", "validate", str(junk))
    assert code == 1 and out.startswith("FAIL ")


def test_validate_with_an_unknown_device_names_the_known_ones(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    junk = tmp_path / "programqpc.bin"
    junk.write_bytes(b"x")
    code, _, err = run_cli(capsys, "qpc", "validate", str(junk), "--device", "h100")
    assert code == 1 and "aic100-standard" in assert_one_error_line(err)


def test_inspect_prints_text_or_json(
    capsys: pytest.CaptureFixture[str], model_path: Path, tmp_path: Path
) -> None:
    out_dir = tmp_path / "out"
    assert run_cli(capsys, "compile", f"-m={model_path}", f"-aic-binary-dir={out_dir}")[0] == 0
    code, text, _ = run_cli(capsys, "qpc", "inspect", str(out_dir))
    assert code == 0 and "networkdesc.bin" in text
    code, out, _ = run_cli(capsys, "qpc", "inspect", str(out_dir), "--json")
    assert code == 0 and isinstance(json.loads(out), dict)


def test_missing_qpc_file_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run_cli(capsys, "qpc", "inspect", str(tmp_path / "none.bin"))
    assert code == 1 and "QPC file not found" in assert_one_error_line(err)


# -- dispatcher ---------------------------------------------------------------------------------


def test_unknown_command_and_missing_arguments_are_one_line_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_cli(capsys, "bogus")
    assert code == 1 and "bogus" in assert_one_error_line(err)
    code, _, err = run_cli(capsys, "qpc", "validate")
    assert code == 1 and "FILE" in assert_one_error_line(err)


def test_top_level_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "-h")
    assert code == 0
    for name in ("compile", "run", "qpc"):
        assert name in out
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.startswith("qpcfarm ")


def test_unexpected_exceptions_exit_2_with_one_line_unless_debugging(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(argv: object) -> int:
        raise RuntimeError("kaput")

    monkeypatch.setitem(cli.RAW_COMMANDS, "compile", ("", boom))
    code, _, err = run_cli(capsys, "compile", "-m=x")
    assert code == 2 and "RuntimeError: kaput" in assert_one_error_line(err)
    monkeypatch.setenv("QPCFARM_DEBUG", "1")
    code, _, err = run_cli(capsys, "compile", "-m=x")
    assert code == 2 and "Traceback" in err


# -- report rendering ---------------------------------------------------------------------------


def test_render_metrics_aligns_keys_and_groups_thousands() -> None:
    text = render_metrics(
        {
            "original_mac_estimate": 1234567,
            "vtcm": {"c00": 8323072, "c01": 12},
            "histogram": [{"elements": 16, "ops": 3}, {"elements": 4096, "ops": 1}],
            "device": "aic100-pro",
            "latency_us": 0.5,
        }
    )
    lines = text.splitlines()
    assert lines[0] == "Performance metrics (estimated)"
    assert "1,234,567" in text and "8,323,072" in text
    c00, c01 = (line for line in lines if line.strip().startswith(("c00", "c01")))
    assert len(c00) == len(c01)  # numbers right-aligned in one column
    assert any(line.split() == ["elements", "ops"] for line in lines)
    assert any(line.split() == ["4,096", "1"] for line in lines)


def test_render_pass_times_shows_milliseconds_and_percent() -> None:
    text = render_pass_times({"import": 0.75, "lower": 0.25})
    rows = [line.split() for line in text.splitlines()]
    assert rows[1] == ["import", "750.000", "75.0"]
    assert rows[2] == ["lower", "250.000", "25.0"]
    assert rows[-1] == ["total", "1,000.000", "100.0"]


def test_render_pass_times_nests_passes_under_their_stage_and_counts_them_once() -> None:
    text = render_pass_times(
        {
            "import": 0.25,
            "graph-passes": 0.5,
            "graph-passes/fold-constants": 0.375,
            "graph-passes/fold-constants#2": 0.125,
            "lower": 0.25,
        }
    )
    lines = text.splitlines()
    assert lines[2].split() == ["graph-passes", "500.000", "50.0"]
    assert lines[3].startswith("  fold-constants ") and lines[4].startswith("  fold-constants#2")
    assert lines[3].split()[1:] == ["375.000", "37.5"]
    assert lines[-1].split() == ["total", "1,000.000", "100.0"]  # the stages alone


def test_render_warning_is_one_line_with_code_nodes_and_suggestion() -> None:
    line = render_warning(
        {
            "code": "fp16_clip",
            "message": "constants clipped",
            "nodes": ["/a", "/b"],
            "suggestion": "check the ranges",
        }
    )
    assert line == (
        "warning: [fp16_clip] constants clipped (nodes: /a, /b); suggestion: check the ranges"
    )
