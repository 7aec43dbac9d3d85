"""The importer: ONNX in (path, bytes or proto), a statically shaped onnx_ir model out."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnx.parser
import onnx_ir as ir
import psutil
import pytest

from compiler_core.errors import CompileError
from compiler_core.importer import (
    ImportedModel,
    import_model,
    infer_shapes,
    require_static_shapes,
)
from compiler_core.ops.registry import ALL, FLOATS, OpDef, OpRegistry


def _compute(node, inputs, ctx):  # never called by the importer
    raise AssertionError("the importer must not compute")


def make_registry(*op_types: str, dtypes: frozenset[str] = ALL) -> OpRegistry:
    registry = OpRegistry()
    for op_type in op_types:
        registry.add(OpDef(op_type=op_type, compute=_compute, dtypes=dtypes))
    return registry


OPS = make_registry(
    "Relu", "Add", "Mul", "MatMul", "Conv", "Reshape", "Shape", "Gather", "Concat", "NonZero"
)


def parse(text: str) -> onnx.ModelProto:
    return onnx.parser.parse_model(text)


RELU_ADD = """<ir_version: 8, opset_import: ["" : 17]>
m (float[N, 4] x) => (float[N, 4] y) { a = Relu(x) y = Add(a, a) }"""


def load(source, **kwargs) -> ImportedModel:
    kwargs.setdefault("registry", OPS)
    return import_model(source, **kwargs)


def shape_of(model: ir.Model, name: str) -> tuple[int, ...]:
    for value in [*model.graph.inputs, *model.graph.initializers.values()]:
        if value.name == name:
            return tuple(value.shape)  # type: ignore[arg-type]
    for node in model.graph:
        for value in node.outputs:
            if value.name == name:
                return tuple(value.shape)  # type: ignore[arg-type]
    raise KeyError(name)


def assert_all_static(model: ir.Model) -> None:
    require_static_shapes(model)


def with_external_weight(
    tmp_path: Path, location: str, n: int = 1024, offset: int = 0
) -> onnx.ModelProto:
    """y = Add(x, w) whose float32[n] initializer w lives at `location` (written by hand)."""
    model = parse(
        f"""<ir_version: 8, opset_import: ["" : 17]>
        m (float[{n}] x) => (float[{n}] y) {{ y = Add(x, w) }}"""
    )
    tensor = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=[n])
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(4 * n))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    model.graph.initializer.append(tensor)
    return model


# --- sources ----------------------------------------------------------------------------------


def test_imports_from_path_bytes_and_proto_alike(tmp_path: Path) -> None:
    proto = parse(RELU_ADD)
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    sym = {"N": 2}
    from_path = load(path, define_symbols=sym)
    from_str_path = load(str(path), define_symbols=sym)
    from_bytes = load(proto.SerializeToString(), define_symbols=sym)
    from_proto = load(proto, define_symbols=sym)
    for imported in (from_path, from_str_path, from_bytes, from_proto):
        assert imported.opset == 17
        assert shape_of(imported.model, "y") == (2, 4)
        assert imported.model.graph.outputs[0].dtype == ir.DataType.FLOAT
    assert from_path.source_path == path.resolve()
    assert from_bytes.source_path is None and from_proto.source_path is None


def test_importing_a_proto_leaves_the_callers_proto_unchanged() -> None:
    proto = parse(RELU_ADD)
    before = proto.SerializeToString()
    load(proto, define_symbols={"N": 3})
    assert proto.SerializeToString() == before


def test_default_registry_is_the_compilers_op_registry() -> None:
    from compiler_core.ops import REGISTRY

    if REGISTRY.lookup("Relu", "", 17) is None or REGISTRY.lookup("Add", "", 17) is None:
        pytest.skip("the op registry does not have Relu/Add yet")
    imported = import_model(parse(RELU_ADD), define_symbols={"N": 1})
    assert shape_of(imported.model, "y") == (1, 4)


# --- external data ----------------------------------------------------------------------------


def test_external_data_saved_by_onnx_is_mapped_lazily(tmp_path: Path) -> None:
    proto = parse(
        """<ir_version: 8, opset_import: ["" : 17]>
        m (float[2, 256] x) => (float[2, 128] y) { y = MatMul(x, w) }"""
    )
    # Larger than the 64 KiB below which external tensors are read, not mapped.
    weight = np.arange(256 * 128, dtype=np.float32).reshape(256, 128)
    proto.graph.initializer.append(onh.from_array(weight, "w"))
    onnx.save(proto, tmp_path / "m.onnx", save_as_external_data=True, location="m.data")
    assert (tmp_path / "m.data").stat().st_size == weight.nbytes

    imported = load(tmp_path / "m.onnx")
    tensor = imported.model.graph.initializers["w"].const_value
    assert isinstance(tensor, ir.ExternalTensor)
    assert shape_of(imported.model, "w") == (256, 128)
    assert shape_of(imported.model, "y") == (2, 128)
    np.testing.assert_array_equal(tensor.numpy(), weight)


def test_external_data_in_a_subfolder_is_allowed(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    np.ones(1024, np.float32).tofile(tmp_path / "weights" / "w.bin")
    onnx.save(with_external_weight(tmp_path, "weights/w.bin"), tmp_path / "m.onnx")
    imported = load(tmp_path / "m.onnx")
    assert np.asarray(imported.model.graph.initializers["w"].const_value).sum() == 1024


def test_bytes_with_external_data_use_base_dir_or_fail(tmp_path: Path) -> None:
    np.ones(1024, np.float32).tofile(tmp_path / "w.bin")
    data = with_external_weight(tmp_path, "w.bin").SerializeToString()
    with pytest.raises(CompileError) as err:
        load(data)
    assert err.value.code == "external_data_missing"
    assert "'w'" in err.value.message and "file path" in err.value.message
    assert shape_of(load(data, base_dir=tmp_path).model, "y") == (1024,)


@pytest.mark.parametrize(
    ("location", "reason"),
    [("../outside.bin", "'..'"), ("sub/../../outside.bin", "'..'"), ("/etc/passwd", "absolute")],
)
def test_external_data_outside_the_model_folder_is_rejected(
    tmp_path: Path, location: str, reason: str
) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    np.ones(1024, np.float32).tofile(tmp_path / "outside.bin")
    onnx.save(with_external_weight(tmp_path, location), model_dir / "m.onnx")
    with pytest.raises(CompileError) as err:
        load(model_dir / "m.onnx")
    assert err.value.code == "unsafe_external_data"
    assert "'w'" in err.value.message and location in err.value.message
    assert reason in err.value.message
    assert err.value.details == {"tensor": "w", "location": location}


def test_external_data_symlink_escaping_the_folder_is_rejected(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    np.ones(1024, np.float32).tofile(tmp_path / "secret.bin")
    (model_dir / "w.bin").symlink_to(tmp_path / "secret.bin")
    onnx.save(with_external_weight(tmp_path, "w.bin"), model_dir / "m.onnx")
    with pytest.raises(CompileError) as err:
        load(model_dir / "m.onnx")
    assert err.value.code == "unsafe_external_data"
    assert "symlink" in err.value.message and "w.bin" in err.value.message


def test_missing_external_file_is_a_clear_error(tmp_path: Path) -> None:
    onnx.save(with_external_weight(tmp_path, "gone.bin"), tmp_path / "m.onnx")
    with pytest.raises(CompileError) as err:
        load(tmp_path / "m.onnx")
    assert err.value.code == "external_data_missing"
    assert "gone.bin" in err.value.message and "not found" in err.value.message


def test_external_file_shorter_than_the_tensor_is_a_clear_error(tmp_path: Path) -> None:
    np.ones(1024, np.float32).tofile(tmp_path / "w.bin")
    onnx.save(with_external_weight(tmp_path, "w.bin", offset=8), tmp_path / "m.onnx")
    with pytest.raises(CompileError) as err:
        load(tmp_path / "m.onnx")
    assert err.value.code == "external_data_missing"
    assert "4096 bytes" in err.value.message and "[8, 4104)" in err.value.message


def test_a_small_external_tensor_whose_file_shrank_after_the_check_is_a_clear_error(
    tmp_path: Path,
) -> None:
    """The import checks every file's length first; a file cut short after that check (by
    another process) is still `external_data_missing` naming the file, not numpy's error."""
    from compiler_core.tensors import read_external

    np.ones(16, np.float32).tofile(tmp_path / "w.bin")
    tensor = ir.ExternalTensor(
        location="w.bin",
        offset=0,
        length=64,
        dtype=ir.DataType.FLOAT,
        shape=ir.Shape([16]),
        name="w",
        base_dir=tmp_path,
    )
    assert read_external(tensor).numpy().tolist() == [1.0] * 16
    os.truncate(tmp_path / "w.bin", 60)
    with pytest.raises(CompileError) as err:
        read_external(tensor)
    assert err.value.code == "external_data_missing"
    assert "w.bin" in err.value.message and "'w'" in err.value.message


def test_large_external_data_model_imports_without_loading_its_weights(tmp_path: Path) -> None:
    n = 300 * 2**20 // 4  # 300 MiB of float32
    chunk = np.ones(2**20, np.float32)  # 4 MiB
    with open(tmp_path / "w.bin", "wb") as f:
        for _ in range(n // chunk.size):
            f.write(chunk.data)
    del chunk
    onnx.save(with_external_weight(tmp_path, "w.bin", n=n), tmp_path / "m.onnx")
    gc.collect()
    process = psutil.Process()
    before = process.memory_info().rss

    imported = load(tmp_path / "m.onnx")

    grown = process.memory_info().rss - before
    assert grown < 60 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB for 300 MiB of weights"
    assert shape_of(imported.model, "y") == (n,)
    assert isinstance(imported.model.graph.initializers["w"].const_value, ir.ExternalTensor)


# --- bad files --------------------------------------------------------------------------------


def test_missing_file_is_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(CompileError) as err:
        load(tmp_path / "nope.onnx")
    assert err.value.code == "model_not_found" and "nope.onnx" in err.value.message


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"this is a text file, not a model\n",
        np.random.default_rng(0).bytes(4096),
    ],
    ids=["empty", "text", "random"],
)
def test_files_that_are_not_onnx_are_invalid_model(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(content)
    with pytest.raises(CompileError) as err:
        load(path)
    assert err.value.code == "invalid_model"
    assert "ONNX model" in err.value.message or "empty" in err.value.message


@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.95])
def test_truncated_model_is_invalid_model(tmp_path: Path, fraction: float) -> None:
    proto = parse(RELU_ADD)
    proto.graph.initializer.append(onh.from_array(np.ones(100, np.float32), "unused"))
    data = proto.SerializeToString()
    path = tmp_path / "m.onnx"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(CompileError) as err:
        load(path, define_symbols={"N": 1})
    assert err.value.code == "invalid_model"


def test_checker_errors_are_wrapped_with_their_first_line() -> None:
    proto = parse(RELU_ADD)
    proto.graph.node[0].input[0] = "undefined_tensor"
    with pytest.raises(CompileError) as err:
        load(proto, define_symbols={"N": 1})
    assert err.value.code == "invalid_model"
    assert "checker" in err.value.message and "undefined_tensor" in err.value.message


def test_string_and_sequence_graph_io_are_unsupported_types() -> None:
    proto = parse(RELU_ADD)
    proto.graph.input.append(oh.make_tensor_value_info("s", onnx.TensorProto.STRING, [1]))
    seq = oh.make_tensor_sequence_value_info("q", onnx.TensorProto.FLOAT, None)
    proto.graph.input.append(seq)
    with pytest.raises(CompileError) as err:
        load(proto, define_symbols={"N": 1})
    assert err.value.code == "unsupported_type"
    assert "'s'" in err.value.message and "'q'" in err.value.message


# --- symbols and batch size -------------------------------------------------------------------


TWO_INPUTS = """<ir_version: 8, opset_import: ["" : 17]>
m (float[batch, 3, S] x, float[batch, S] z) => (float[batch, 3, S] y)
{ a = Relu(x) zz = Reshape(z, shp) y = Add(a, zz) }"""


def two_inputs() -> onnx.ModelProto:
    proto = parse(TWO_INPUTS)
    proto.graph.initializer.append(onh.from_array(np.array([0, 1, -1], np.int64), "shp"))
    return proto


def test_define_symbols_bind_every_use_of_a_symbol() -> None:
    imported = load(two_inputs(), define_symbols={"batch": 2, "S": 5})
    assert shape_of(imported.model, "x") == (2, 3, 5)
    assert shape_of(imported.model, "z") == (2, 5)
    assert shape_of(imported.model, "y") == (2, 3, 5)
    assert imported.warnings == []


def test_batchsize_replaces_a_symbolic_first_dim() -> None:
    imported = load(two_inputs(), define_symbols={"S": 7}, batchsize=4)
    assert shape_of(imported.model, "x") == (4, 3, 7)
    assert shape_of(imported.model, "z") == (4, 7)
    assert shape_of(imported.model, "y") == (4, 3, 7)


def test_batchsize_replaces_the_models_fixed_batch_on_inputs_that_share_it() -> None:
    proto = parse(
        """<ir_version: 8, opset_import: ["" : 17]>
        m (float[1, 8] x, float[1, 8] z, float[3, 8] k) => (float[1, 8] y, float[3, 8] kk)
        { y = Add(x, z) kk = Relu(k) }"""
    )
    proto.graph.value_info.append(oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 8]))
    imported = load(proto, batchsize=6)
    assert shape_of(imported.model, "x") == (6, 8)
    assert shape_of(imported.model, "z") == (6, 8)
    assert shape_of(imported.model, "k") == (3, 8)
    assert shape_of(imported.model, "y") == (6, 8)


def test_batchsize_that_contradicts_a_defined_symbol_is_an_option_error() -> None:
    with pytest.raises(CompileError) as err:
        load(two_inputs(), define_symbols={"batch": 2, "S": 5}, batchsize=3)
    assert err.value.code == "invalid_option" and err.value.flag == "-batchsize"


def test_unused_symbol_is_a_warning_not_an_error() -> None:
    imported = load(parse(RELU_ADD), define_symbols={"N": 2, "seq_len": 128})
    assert shape_of(imported.model, "y") == (2, 4)
    assert len(imported.warnings) == 1 and "seq_len" in imported.warnings[0]


@pytest.mark.parametrize("bad", [0, -3])
def test_non_positive_symbol_value_is_an_option_error(bad: int) -> None:
    with pytest.raises(CompileError) as err:
        load(parse(RELU_ADD), define_symbols={"N": bad})
    assert err.value.code == "invalid_option" and err.value.flag == "-onnx-define-symbol"


def test_unbound_symbol_names_input_dim_symbol_and_flag() -> None:
    with pytest.raises(CompileError) as err:
        load(two_inputs(), define_symbols={"batch": 1})
    assert err.value.code == "dynamic_shape"
    message = err.value.message
    assert "input 'x' dim 2 is symbolic 'S': set -onnx-define-symbol=S,<value>" in message
    assert "input 'z' dim 1 is symbolic 'S'" in message
    with pytest.raises(CompileError) as err:
        load(parse(RELU_ADD))
    assert "input 'x' dim 0 is symbolic 'N': set -onnx-define-symbol=N,<value> (or -batchsize)" in (
        err.value.message
    )


def test_unnamed_dynamic_batch_dim_asks_for_batchsize() -> None:
    proto = parse(RELU_ADD)
    proto.graph.input[0].type.tensor_type.shape.dim[0].Clear()
    with pytest.raises(CompileError) as err:
        load(proto)
    assert err.value.code == "dynamic_shape"
    assert "input 'x' dim 0" in err.value.message and "-batchsize" in err.value.message
    assert shape_of(load(proto, batchsize=3).model, "y") == (3, 4)


# --- shape inference --------------------------------------------------------------------------


def test_shape_inference_fills_every_intermediate_shape() -> None:
    proto = parse(
        """<ir_version: 8, opset_import: ["" : 17]>
        m (float[N, 3, 8, 8] x) => (float[N, 16, 8, 8] y)
        { c = Conv<pads = [1, 1, 1, 1]>(x, w) r = Relu(c) s = Shape(r) y = Mul(r, r) }"""
    )
    proto.graph.initializer.append(onh.from_array(np.ones((16, 3, 3, 3), np.float32), "w"))
    imported = load(proto, define_symbols={"N": 2})
    assert shape_of(imported.model, "c") == (2, 16, 8, 8)
    assert shape_of(imported.model, "r") == (2, 16, 8, 8)
    assert shape_of(imported.model, "s") == (4,)
    assert shape_of(imported.model, "w") == (16, 3, 3, 3)
    assert imported.unresolved == []
    assert_all_static(imported.model)
    # The weight went back where it was: inference only borrowed it.
    assert imported.model.graph.initializers["w"].const_value is not None
    assert [v.name for v in imported.model.graph.inputs] == ["x"]


def test_data_propagation_resolves_shapes_computed_from_shapes() -> None:
    proto = parse(
        """<ir_version: 8, opset_import: ["" : 17]>
        m (float[N, 6] x) => (float[M, K] y)
        { s = Shape(x) d = Gather(s, i) n = Concat<axis = 0>(d, m1) y = Reshape(x, n) }"""
    )
    proto.graph.initializer.extend(
        [
            onh.from_array(np.array([1], np.int64), "i"),
            onh.from_array(np.array([-1], np.int64), "m1"),
        ]
    )
    imported = load(proto, define_symbols={"N": 3})
    assert shape_of(imported.model, "y") == (6, 3)


def test_data_dependent_output_is_recorded_not_rejected() -> None:
    proto = parse(
        """<ir_version: 8, opset_import: ["" : 17]>
        m (float[5] x) => (int64[1, K] y) { y = NonZero(x) }"""
    )
    imported = load(proto)
    assert imported.unresolved == ["y"]
    assert any("data-dependent" in w for w in imported.warnings)
    with pytest.raises(CompileError) as err:
        require_static_shapes(imported.model)
    assert err.value.code == "dynamic_shape" and "NonZero" in err.value.message


def test_inconsistent_shapes_are_shape_inference_failed_naming_the_node() -> None:
    proto = parse(
        """<ir_version: 8, opset_import: ["" : 17]>
        m (float[2, 4] x, float[3, 5] z) => (float[2, 4] y) { a = Relu(x) y = Add(a, z) }"""
    )
    with pytest.raises(CompileError) as err:
        load(proto)
    assert err.value.code == "shape_inference_failed"
    assert err.value.node == "Add_1" and "Add_1" in err.value.message


def _annotated_chain() -> onnx.ModelProto:
    """Named nodes, exporter shape annotations (a stale batch), a large weight and a large
    Constant: every part of the copy shape inference receives that import changes."""
    proto = parse(
        """<ir_version: 8, opset_import: ["" : 17]>
        m (float[N, 600] x, float[1, 600] z) => (float[N, 600] y, float[1, 600] zz)
        { a = Add(x, big) b = Mul(a, small) c = Constant<value = float[600] {0}>()
          d = Add(b, c) y = Relu(d) zz = Relu(z) }"""
    )
    for index, node in enumerate(proto.graph.node):
        node.name = f"n{index}"
    constant = proto.graph.node[2].attribute[0].t
    constant.ClearField("float_data")
    constant.raw_data = np.full(600, 0.5, np.float32).tobytes()
    proto.graph.initializer.extend(
        [
            onh.from_array(np.arange(600, dtype=np.float32), "big"),
            onh.from_array(np.array([2.0], np.float32), "small"),
        ]
    )
    for name in ("a", "b"):
        proto.graph.value_info.append(
            oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [1, 600])
        )
    proto.graph.value_info.append(oh.make_tensor_value_info("d", onnx.TensorProto.FLOAT, None))
    return proto


@pytest.mark.parametrize(
    ("model", "options"),
    [
        (RELU_ADD, {"define_symbols": {"N": 3}}),
        (TWO_INPUTS, {"define_symbols": {"S": 7}, "batchsize": 4}),
        ("annotated", {"define_symbols": {"N": 2}}),
        ("annotated", {"batchsize": 5}),
        ("unnamed", {"define_symbols": {"N": 2}}),
    ],
)
def test_shape_inference_sees_the_model_as_it_stands_after_binding(
    model: str, options: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The import serialises the model once, for the checker, and brings that copy up to date
    for shape inference: it must be what serialising the bound model again gives."""
    import compiler_core.importer as importer

    if model == TWO_INPUTS:
        proto = two_inputs()
    elif model in ("annotated", "unnamed"):
        proto = _annotated_chain()
        if model == "unnamed":
            proto.graph.node[1].name = ""
    else:
        proto = parse(model)
    for index, node in enumerate(proto.graph.node):
        node.name = node.name or ("" if model == "unnamed" else f"n{index}")
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)  # the large tensors then stay in the file (onnx_wire)
    real = importer.infer_shapes
    given: list[bool] = []

    def compare(ir_model: ir.Model, lean: onnx.ModelProto | None = None) -> bool:
        given.append(lean is not None)
        if lean is not None:
            fresh = importer._lean_model(ir_model)
            assert lean.SerializeToString(deterministic=True) == fresh.SerializeToString(
                deterministic=True
            )
        return real(ir_model, lean)

    monkeypatch.setattr(importer, "infer_shapes", compare)
    registry = make_registry("Relu", "Add", "Mul", "Reshape", "Constant")
    imported = load(os.fspath(path), registry=registry, **options)
    assert_all_static(imported.model)
    assert given == [model != "unnamed"]  # a renamed node: serialised again


def test_infer_shapes_reruns_in_place_after_a_graph_change() -> None:
    imported = load(parse(RELU_ADD), define_symbols={"N": 2})
    model = imported.model
    x = model.graph.inputs[0]
    x.shape = ir.Shape([7, 4])
    for node in model.graph:
        node.outputs[0].shape = None
    infer_shapes(model)
    assert shape_of(model, "a") == (7, 4) and shape_of(model, "y") == (7, 4)


# --- operators and names ----------------------------------------------------------------------


def test_unsupported_operators_are_reported_together_with_counts() -> None:
    proto = parse(
        """<ir_version: 8, opset_import: ["" : 17, "com.acme" : 1]>
        m (float[2] x) => (float[2] y)
        { a = com.acme.Foo(x) b = com.acme.Foo(a) c = com.acme.Bar(b) y = Relu(c) }"""
    )
    with pytest.raises(CompileError) as err:
        load(proto)
    assert err.value.code == "unsupported_operator"
    message = err.value.message
    assert "com.acme::Foo (opset 1) at 2 nodes: Foo_0, Foo_1" in message
    assert "com.acme::Bar (opset 1) at 1 node: Bar_2" in message
    entries = err.value.details["unsupported"]
    assert isinstance(entries, list)
    assert {(e["op_type"], e["domain"], e["count"]) for e in entries} == {
        ("Foo", "com.acme", 2),
        ("Bar", "com.acme", 1),
    }


def test_long_node_lists_show_the_first_few_and_a_count() -> None:
    body = " ".join(f"v{i + 1} = com.acme.Foo(v{i})" for i in range(8))
    proto = parse(
        f"""<ir_version: 8, opset_import: ["" : 17, "com.acme" : 1]>
        m (float[2] v0) => (float[2] v8) {{ {body} }}"""
    )
    with pytest.raises(CompileError) as err:
        load(proto)
    assert "at 8 nodes: Foo_0, Foo_1, Foo_2, Foo_3, Foo_4 and 3 more" in err.value.message


def test_op_outside_its_registered_opset_range_is_unsupported() -> None:
    registry = OpRegistry()
    registry.add(OpDef(op_type="Relu", compute=_compute, since=6, until=13))
    registry.add(OpDef(op_type="Add", compute=_compute, since=14))
    with pytest.raises(CompileError) as err:
        import_model(parse(RELU_ADD), define_symbols={"N": 1}, registry=registry)
    assert "Relu (opset 17)" in err.value.message and "Add" not in err.value.message


def test_unsupported_element_type_is_reported_with_the_supported_ones() -> None:
    proto = parse(
        """<ir_version: 8, opset_import: ["" : 17]>
        m (double[4] x, int64[4] k) => (double[4] y, int64[4] kk) { y = Relu(x) kk = Relu(k) }"""
    )
    registry = make_registry("Relu", dtypes=FLOATS - {"float64"})
    with pytest.raises(CompileError) as err:
        import_model(proto, registry=registry)
    assert err.value.code == "unsupported_operator"
    assert "element type float64 (supported: float16, float32)" in err.value.message
    assert "element type int64" in err.value.message


def test_model_local_functions_are_inlined() -> None:
    proto = parse(
        """<ir_version: 8, opset_import: ["" : 17, "local" : 1]>
        m (float[2, 3] x) => (float[2, 3] y) { y = local.Double(x) }
        <domain: "local", opset_import: ["" : 17]>
        Double (a) => (b) { r = Relu(a) b = Add(r, r) }"""
    )
    imported = load(proto)
    assert [n.op_type for n in imported.model.graph] == ["Relu", "Add"]
    assert not imported.model.functions
    assert shape_of(imported.model, "y") == (2, 3)


def test_every_node_gets_a_unique_stable_name() -> None:
    proto = parse(
        """<ir_version: 8, opset_import: ["" : 17]>
        m (float[2] x) => (float[2] y) { a = Relu(x) b = Relu(a) c = Relu(b) y = Relu(c) }"""
    )
    proto.graph.node[1].name = "Relu_0"  # clashes with the generated name of node 0
    proto.graph.node[2].name = "Relu_0"  # duplicate
    names = [n.name for n in load(proto).model.graph]
    assert len(set(names)) == 4 and all(names)
    assert names == [n.name for n in load(proto).model.graph]
    assert names[1] == "Relu_0" and names[3] == "Relu_3"


def test_initializers_listed_as_inputs_become_constants() -> None:
    proto = parse(
        """<ir_version: 8, opset_import: ["" : 17]>
        m (float[2] x, float[2] w) => (float[2] y) { y = Add(x, w) }"""
    )
    proto.graph.initializer.append(onh.from_array(np.ones(2, np.float32), "w"))
    imported = load(proto)
    assert [v.name for v in imported.model.graph.inputs] == ["x"]
    assert any("'w'" in w or " w" in w for w in imported.warnings)


def test_initializer_order_and_values_survive_import(tmp_path: Path) -> None:
    proto = parse(
        """<ir_version: 8, opset_import: ["" : 17]>
        m (float[2, 600] x) => (float[2, 600] y) { a = Add(x, big) y = Mul(a, small) }"""
    )
    big = np.arange(600, dtype=np.float32)
    proto.graph.initializer.extend(
        [onh.from_array(big, "big"), onh.from_array(np.array([2.0], np.float32), "small")]
    )
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    imported = load(os.fspath(path))
    inits = imported.model.graph.initializers
    assert list(inits) == ["big", "small"]
    np.testing.assert_array_equal(np.asarray(inits["big"].const_value), big)


def test_model_without_default_domain_ops_reports_its_ops_not_a_bad_file() -> None:
    proto = parse(
        """<ir_version: 8, opset_import: ["ai.onnx.ml" : 3]>
        m (float[2] x) => (float[2] y) { y = ai.onnx.ml.Binarizer(x) }"""
    )
    with pytest.raises(CompileError) as err:
        load(proto)
    assert err.value.code == "unsupported_operator"
    assert "ai.onnx.ml::Binarizer (opset 3)" in err.value.message
