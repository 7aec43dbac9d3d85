"""`qpcfarm run --profiling-out-dir` and `qpcfarm opstats`: summaries and traces from raw stats."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core.cli import main
from compiler_core.cost_rates import THREADS
from compiler_core.profiling.opstats import load_layout
from compiler_core.profiling.stats_layout import CORE_THREAD_FIELDS, decode_stats

NODES = {
    "conv1": "Conv",
    "relu1": "Relu",
    "pool": "MaxPool",
    "conv2": "Conv",
    "add": "Add",
    "relu2": "Relu",
    "gap": "ReduceMean",
    "fc": "Gemm",
    "softmax": "Softmax",
}
"""The model's nodes: none is folded away or aliased, so each must appear in opstats."""


def small_cnn() -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def weight(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)

    n = helper.make_node
    nodes = [
        n("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        n("Relu", ["c1"], ["r1"], name="relu1"),
        n("MaxPool", ["r1"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
        n("Conv", ["p", "w2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        n("Add", ["c2", "b"], ["s"], name="add"),
        n("Relu", ["s"], ["r2"], name="relu2"),
        n("ReduceMean", ["r2"], ["g"], axes=[2, 3], keepdims=0, name="gap"),
        n("Gemm", ["g", "w3"], ["f"], transB=1, name="fc"),
        n("Softmax", ["f"], ["y"], axis=1, name="softmax"),
    ]
    graph = helper.make_graph(
        nodes,
        "small_cnn",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 16, 16]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 16, 8, 8]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 10])],
        [weight("w1", (16, 8, 3, 3)), weight("w2", (16, 16, 3, 3)), weight("w3", (10, 16))],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def profiled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Path]:
    """small_cnn compiled at level 70 on 4 cores, run 2 times with stats, opstats written."""
    model_path = tmp_path / "cnn.onnx"
    onnx.save(small_cnn(), model_path)
    rng = np.random.default_rng(1)
    np.savez(
        tmp_path / "in.npz",
        x=rng.standard_normal((2, 8, 16, 16)).astype(np.float32),
        b=rng.standard_normal((2, 16, 8, 8)).astype(np.float32),
    )
    qpc_dir = tmp_path / "qpc"
    code, _, err = run_cli(
        capsys,
        "compile",
        f"-m={model_path}",
        f"-aic-binary-dir={qpc_dir}",
        "-aic-num-cores=4",
        "-stats-level=70",
    )
    assert code == 0, err
    code, out, err = run_cli(
        capsys,
        "run",
        str(qpc_dir),
        "--inputs",
        str(tmp_path / "in.npz"),
        "--outputs",
        str(tmp_path / "out.npz"),
        "--profiling-out-dir",
        str(tmp_path / "raw"),
        "-n",
        "2",
    )
    assert code == 0, err
    code, out, err = run_cli(
        capsys,
        "opstats",
        "--qpc",
        str(qpc_dir / "programqpc.bin"),
        "--input-dir",
        str(tmp_path / "raw"),
        "--output-dir",
        str(tmp_path / "report"),
        "--summary",
        "--trace",
    )
    assert code == 0, err
    return {
        "model": model_path,
        "qpc": qpc_dir / "programqpc.bin",
        "raw": tmp_path / "raw",
        "report": tmp_path / "report",
        "in": tmp_path / "in.npz",
        "out": tmp_path / "out.npz",
    }


def csv_rows(report: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO((report / "opstats-summary.csv").read_text())))


def test_run_with_stats_writes_one_raw_buffer_per_inference_and_correct_outputs(
    profiled: dict[str, Path],
) -> None:
    files = sorted(p.name for p in profiled["raw"].iterdir())
    assert files == ["stats-inf-00000.bin", "stats-inf-00001.bin"]
    layout, _ = load_layout(profiled["qpc"])
    assert all((profiled["raw"] / f).stat().st_size == layout.size for f in files)
    with np.load(profiled["in"]) as archive:
        inputs = {name: archive[name] for name in archive.files}
    expected = ort.InferenceSession(str(profiled["model"])).run(None, inputs)[0]
    np.testing.assert_allclose(np.load(profiled["out"])["y"], expected, rtol=1e-4, atol=1e-5)


def test_every_onnx_node_and_every_kernel_appears_in_the_summary(profiled: dict[str, Path]) -> None:
    rows = csv_rows(profiled["report"])
    named = {node for row in rows for node in row["onnx_nodes"].split(";")}
    assert named == set(NODES)
    types = {t for row in rows for t in row["op_types"].split("+")}
    assert types == set(NODES.values())
    layout, _ = load_layout(profiled["qpc"])
    assert {row["op"] for row in rows} == {k.name for k in layout.kernels}
    assert len(rows) == len(layout.op_rows)  # one row per operator and core
    text = (profiled["report"] / "opstats-summary.txt").read_text()
    assert "estimated" in text.splitlines()[1]
    for node in NODES:
        assert node in text


def test_a_fused_kernel_names_all_its_nodes_and_types(profiled: dict[str, Path]) -> None:
    rows = csv_rows(profiled["report"])
    fused = {(row["onnx_nodes"], row["op_types"]) for row in rows}
    assert ("conv1;relu1", "Conv+Relu") in fused
    assert ("conv2;add;relu2", "Conv+Add+Relu") in fused


def test_per_core_operator_cycles_and_waits_add_up_to_the_inference_duration(
    profiled: dict[str, Path],
) -> None:
    layout, _ = load_layout(profiled["qpc"])
    raw = decode_stats(layout, (profiled["raw"] / "stats-inf-00000.bin").read_bytes())
    pcycles = raw["core_thread"].reshape(4, len(THREADS), len(CORE_THREAD_FIELDS))[
        :, 0, CORE_THREAD_FIELDS.index("inference_pcycles")
    ]
    rows = csv_rows(profiled["report"])
    for core in range(4):
        mine = [r for r in rows if r["core"] == f"c{core:02d}"]
        total = sum(float(r["cycles"]) + float(r["wait_before_cycles"]) for r in mine)
        assert total == pytest.approx(float(pcycles[core]))
        assert sum(float(r["share_of_core_percent"]) for r in mine) <= 100.0 + 1e-6


def test_trace_has_a_process_per_core_with_an_ops_lane_and_six_thread_lanes(
    profiled: dict[str, Path],
) -> None:
    trace = json.loads((profiled["report"] / "trace.json").read_text())
    events = trace["traceEvents"]
    assert trace["otherData"]["estimated"] is True
    names = {
        (e["pid"], e["args"]["name"])
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert {(c, f"NSP core c{c:02d}") for c in range(4)} <= names
    for core in range(4):
        lanes = {
            e["args"]["name"]
            for e in events
            if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == core
        }
        assert lanes == {"ops", *THREADS}
    spans = [e for e in events if e["ph"] == "X" and e["cat"] != "setup"]
    assert spans
    for span in spans:
        assert span["args"]["onnx_nodes"] and span["args"]["op_types"]
        assert set(span["args"]["onnx_nodes"]) <= set(NODES)
    by_lane: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for span in spans:
        by_lane.setdefault((span["pid"], span["tid"]), []).append(
            (span["ts"], span["ts"] + span["dur"])
        )
    for lane in by_lane.values():
        lane.sort()
        for (_, end), (start, _) in zip(lane, lane[1:], strict=False):
            assert start >= end - 1e-3  # spans of one lane never overlap
    ops = [e for e in spans if e["cat"] == "op"]
    first = max(e["ts"] + e["dur"] for e in ops if e["args"]["inference"] == 0)
    assert min(e["ts"] for e in ops if e["args"]["inference"] == 1) >= first


def test_opstats_on_a_level_40_qpc_says_per_operator_data_needs_level_70(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_path = tmp_path / "cnn.onnx"
    onnx.save(small_cnn(), model_path)
    qpc = tmp_path / "qpc"
    assert (
        run_cli(capsys, "compile", f"-m={model_path}", f"-aic-binary-dir={qpc}", "-ddr-stats")[0]
        == 0
    )
    np.savez(
        tmp_path / "in.npz",
        x=np.zeros((2, 8, 16, 16), np.float32),
        b=np.zeros((2, 16, 8, 8), np.float32),
    )
    assert (
        run_cli(
            capsys,
            "run",
            str(qpc),
            "--inputs",
            str(tmp_path / "in.npz"),
            "--profiling-out-dir",
            str(tmp_path / "raw"),
        )[0]
        == 0
    )
    code, _, err = run_cli(
        capsys,
        "opstats",
        "--qpc",
        str(qpc),
        "--input-dir",
        str(tmp_path / "raw"),
        "--output-dir",
        str(tmp_path / "out"),
        "--summary",
    )
    assert code == 1
    assert "-stats-level=40" in err and "-stats-level=70" in err
    assert "per-operator" in err and "DDR traffic" in err
    assert not (tmp_path / "out").exists()


def test_opstats_without_raw_stats_says_how_to_produce_them(
    profiled: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(
        capsys,
        "opstats",
        "--qpc",
        str(profiled["qpc"]),
        "--input-dir",
        str(empty),
        "--output-dir",
        str(tmp_path / "o"),
    )
    assert code == 1 and "--profiling-out-dir" in err


def test_raw_stats_of_another_qpc_are_rejected(
    profiled: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "stats-inf-00000.bin").write_bytes(b"\0" * 128)
    code, _, err = run_cli(
        capsys,
        "opstats",
        "--qpc",
        str(profiled["qpc"]),
        "--input-dir",
        str(bad),
        "--output-dir",
        str(tmp_path / "o"),
    )
    assert code == 1 and "layout" in err
