"""Models exported by torch compile from any working directory and run like ONNX Runtime.

Each torch test exports its model into one folder and compiles it from another: a compile must
not depend on where it runs. Without torch these tests skip; the external-data case of a
subgraph is built with onnx.helper and always runs.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core import CompileOptions, compile_model, run_qpc


def _torch() -> Any:
    """torch, or a skip: the tests that export need it, the others do not."""
    return pytest.importorskip("torch")


def _export(module: Any, args: tuple[Any, ...], path: Path, outputs: list[str]) -> Path:
    """Export with torch's TorchScript exporter (the dynamo one needs onnxscript)."""
    torch = _torch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation notice
        torch.onnx.export(
            module, args, str(path), input_names=["x"], output_names=outputs, dynamo=False
        )
    return path


def _compile_and_compare(model: Path, x: np.ndarray, out_dir: Path) -> dict[str, np.ndarray]:
    result = compile_model(
        model, CompileOptions.from_flags([f"-aic-binary-dir={out_dir}", "-aic-num-cores=2"])
    )
    ours = run_qpc(result.qpc_path, {"x": x})
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    for name, theirs in zip(names, session.run(None, {"x": x}), strict=True):
        assert ours[name].shape == theirs.shape, name
        np.testing.assert_allclose(ours[name], theirs, rtol=1e-6, atol=1e-6, err_msg=name)
    return ours


def _large_constant_module() -> Any:
    torch = _torch()
    module: Any = torch.nn.Module

    class AddTable(module):
        """A plain tensor attribute: traced as a 256 KiB Constant node, not an initializer."""

        def __init__(self) -> None:
            super().__init__()
            self.table = torch.randn(256, 256)

        def forward(self, x: Any) -> Any:
            return x + self.table

    return AddTable()


def test_large_constant_node_compiles_from_another_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = _torch()
    (tmp_path / "model").mkdir()
    (tmp_path / "elsewhere").mkdir()
    model = _export(
        _large_constant_module(), (torch.zeros(256, 256),), tmp_path / "model" / "m.onnx", ["y"]
    )
    constants = [n for n in onnx.load(model).graph.node if n.op_type == "Constant"]
    assert constants and constants[0].attribute[0].t.dims == [256, 256]
    monkeypatch.chdir(tmp_path / "elsewhere")

    x = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    _compile_and_compare(model, x, Path("out"))


def test_large_constant_that_is_a_graph_output_compiles_from_another_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = _torch()
    module: Any = torch.nn.Module

    class TableToo(module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.randn(256, 256)

        def forward(self, x: Any) -> tuple[Any, Any]:
            return x * 2.0, self.table * 1.0  # folded by the exporter into the Constant

    (tmp_path / "model").mkdir()
    model = _export(TableToo(), (torch.zeros(4),), tmp_path / "model" / "m.onnx", ["y", "table"])
    node = onnx.load(model).graph.node[-1]
    assert node.op_type == "Constant" and node.output[0] == "table"
    monkeypatch.chdir(tmp_path)

    ours = _compile_and_compare(model, np.arange(4, dtype=np.float32), Path("out"))
    assert ours["table"].shape == (256, 256)


def test_0d_constant_that_is_a_graph_output_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = _torch()
    module: Any = torch.nn.Module

    class WithScale(module):
        def forward(self, x: Any) -> tuple[Any, Any]:
            return torch.relu(x), torch.tensor(2.5)

    (tmp_path / "model").mkdir()
    model = _export(WithScale(), (torch.zeros(4),), tmp_path / "model" / "m.onnx", ["y", "scale"])
    node = onnx.load(model).graph.node[-1]
    assert node.op_type == "Constant" and list(node.attribute[0].t.dims) == []
    monkeypatch.chdir(tmp_path)

    ours = _compile_and_compare(model, np.linspace(-1, 1, 4, dtype=np.float32), Path("out"))
    assert ours["scale"].shape == () and float(ours["scale"]) == 2.5


def _if_with_file_constant(folder: Path) -> Path:
    """An If whose branches return 16 KiB Constants; one branch's tensor is in 'branch.bin'."""

    def branch(name: str, fill: float) -> onnx.GraphProto:
        value = numpy_helper.from_array(np.full((64, 64), fill, np.float32), f"{name}_t")
        node = helper.make_node("Constant", [], [f"{name}_out"], value=value)
        out = helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [64, 64])
        return helper.make_graph([node], name, [], [out])

    then_branch = branch("then", 1.0)
    tensor = then_branch.node[0].attribute[0].t
    (folder / "branch.bin").write_bytes(tensor.raw_data)
    onnx.external_data_helper.set_external_data(tensor, "branch.bin", 0, len(tensor.raw_data))
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["positive"]),
        helper.make_node(
            "If", ["positive"], ["r"], then_branch=then_branch, else_branch=branch("else", 2.0)
        ),
        helper.make_node("Add", ["x", "r"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "if_file_constant",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])],
        initializer=[numpy_helper.from_array(np.array(0.0, np.float32), "zero")],
    )
    path = folder / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_subgraph_tensor_in_a_data_file_is_read_at_import_so_the_qpc_runs_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "model").mkdir()
    model = _if_with_file_constant(tmp_path / "model")
    monkeypatch.chdir(tmp_path)

    x = np.abs(np.random.default_rng(1).standard_normal((64, 64))).astype(np.float32)
    _compile_and_compare(model, x, Path("out"))  # the then-branch reads the file's tensor
    _compile_and_compare(model, -x, Path("out"))
