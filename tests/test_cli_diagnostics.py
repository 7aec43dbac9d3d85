"""What the command line says when it is given the wrong thing: a file of another kind, a
misspelt symbol, another QPC's stats; and what -time-passes and warnings look like."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from compiler_core import CompileOptions, compile_model
from compiler_core.cli import main
from compiler_core.report import pass_time_rows, render_warning
from tests.conftest import tiny_model
from tests.models import transformer_encoder


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qpcfarm: error: "), err
    return lines[0]


@pytest.fixture
def compiled(tmp_path: Path) -> tuple[Path, Path]:
    """(the model, its QPC compiled at stats level 70)."""
    model = tmp_path / "tiny.onnx"
    onnx.save(tiny_model(), model)
    out = tmp_path / "out"
    assert main(["compile", f"-m={model}", f"-aic-binary-dir={out}", "-stats-level=70"]) == 0
    return model, out / "programqpc.bin"


def test_running_an_onnx_model_says_to_compile_it_first(
    compiled: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model, _ = compiled
    capsys.readouterr()
    code, _, err = run(capsys, "run", str(model))
    line = error_line(err)
    assert code == 1 and f"{model} is an ONNX model, not a QPC" in line
    assert "qpcfarm compile -m=" in line and "magic" not in line


def test_inputs_that_are_no_npz_are_named_with_how_to_make_one(
    compiled: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, qpc = compiled
    np.save(tmp_path / "x.npy", np.zeros((2, 4), np.float32))
    capsys.readouterr()
    for given, kind in ((model, "is an ONNX model"), (tmp_path / "x.npy", "single numpy array")):
        code, _, err = run(capsys, "run", str(qpc), "--inputs", str(given))
        line = error_line(err)
        assert code == 1 and kind in line and "numpy.savez(" in line
        assert "pickle" not in line


def test_stats_of_another_qpc_are_said_to_belong_to_it(
    compiled: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, qpc = compiled
    other_model = tmp_path / "other.onnx"
    onnx.save(tiny_model(batch=4), other_model)
    other = tmp_path / "other"
    flags = [f"-m={other_model}", f"-aic-binary-dir={other}", "-stats-level=70"]
    assert main(["compile", *flags, "-aic-num-cores=2"]) == 0
    np.savez(tmp_path / "in.npz", x=np.ones((4, 4), np.float32))
    stats = tmp_path / "stats"
    assert (
        main(
            [
                "run",
                str(other),
                "--inputs",
                str(tmp_path / "in.npz"),
                "--profiling-out-dir",
                str(stats),
            ]
        )
        == 0
    )
    capsys.readouterr()
    code, _, err = run(
        capsys, "opstats", "--qpc", str(qpc), "--input-dir", str(stats), "--output-dir", "r"
    )
    line = error_line(err)
    assert code == 1 and f"the stats in {stats} belong to another QPC" in line
    assert "--profiling-out-dir" in line


def test_a_misspelt_symbol_is_named_beside_the_dimension_it_left_unbound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "sym",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    model = tmp_path / "sym.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    code, _, err = run(
        capsys,
        "compile",
        f"-m={model}",
        f"-aic-binary-dir={tmp_path / 'out'}",
        "-onnx-define-symbol=bacth,2",
    )
    line = error_line(err)
    assert code == 1 and "symbolic 'batch'" in line
    assert "-onnx-define-symbol names 'bacth'" in line and "its symbols: batch" in line


def test_pmu_events_are_echoed_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "tiny.onnx"
    onnx.save(tiny_model(), model)
    out = tmp_path / "out"
    flags = [f"-m={model}", f"-aic-binary-dir={out}", "-stats-level=70", "-aic-pmu-events=0x1"]
    assert main(["compile", *flags]) == 0
    capsys.readouterr()
    assert main(["qpc", "inspect", str(out)]) == 0
    assert "-aic-pmu-events=0x1" in capsys.readouterr().out
    assert "-aic-pmu-events=0x1" in CompileOptions.from_flags(flags).to_flags()


def test_time_passes_counts_each_moment_once(tmp_path: Path) -> None:
    """The stages add up to no more than the compile took; the graph passes are parts of
    their stage, not stages beside it."""
    started = time.perf_counter()
    result = compile_model(transformer_encoder(), ["-aic-num-cores=2"])
    elapsed = time.perf_counter() - started
    times = result.pass_times
    stages = {name: s for name, s in times.items() if "/" not in name}
    passes = {name: s for name, s in times.items() if name.startswith("graph-passes/")}
    assert list(stages)[:2] == ["import", "graph-passes"] and "fold-constants" not in stages
    assert "graph-passes/fold-constants" in passes
    assert sum(passes.values()) <= stages["graph-passes"]
    _, total = pass_time_rows(times)
    assert total == pytest.approx(sum(stages.values())) and total <= elapsed
    result.cleanup()


def test_a_warning_lists_its_nodes_then_its_suggestion_apart() -> None:
    listed = [f"/n{i}" for i in range(8)]
    line = render_warning({"code": "c", "message": "m", "nodes": listed, "suggestion": "do x"})
    assert line == f"warning: [c] m (nodes: {', '.join(listed)}); suggestion: do x"
    assert "in all" not in line  # a list cut at 8 claims no total
    long = render_warning({"code": "c", "message": "m", "nodes": [f"/n{i}" for i in range(11)]})
    assert long.endswith("/n7 and 3 more)")
