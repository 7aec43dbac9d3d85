"""Hostile compiler inputs: every file a farm compile reads stays inside the job's model
folder; models and options that declare what no device holds are refused before anything is
allocated or expanded; refusals carry a stable code and name no server path."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core import CompileError, CompileOptions
from compiler_core.compile import compile_model
from compiler_core.importer import import_model
from compiler_core.metrics import _histogram
from compiler_core.model_bounds import MAX_EXPANDED_NODES, MAX_TENSOR_BYTES
from compiler_core.model_folder import ModelFolder
from compiler_core.options import options_json_schema
from tests import test_api
from tests.api_helpers import zip_bytes
from tests.conftest import tiny_model
from tests.test_api import play_worker, submit, upload

servers, local, local_api = test_api.servers, test_api.local, test_api.local_api

SECRET = b"SECRET-API-KEY!!"  # 16 bytes: exactly one float[1, 4] input, so it would be read
SECRET_FLOATS = np.frombuffer(SECRET, np.float32)


def _model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "job" / "model"
    folder.mkdir(parents=True)
    onnx.save(tiny_model(batch=1), folder / "model.onnx")
    return folder


def _outside_secret(tmp_path: Path) -> Path:
    secret = tmp_path / "outside" / "api-key"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_bytes(SECRET)
    return secret


def _refused(
    err: pytest.ExceptionInfo[CompileError], code: str, *server_paths: Path, given: str = ""
) -> None:
    """The error has `code` and names none of `server_paths` (apart from echoing the text
    `given`, the name the job itself wrote)."""
    assert err.value.code == code, err.value
    text = str(err.value.to_dict())
    if given:
        text = text.replace(given, "<given>")
    for path in server_paths:
        assert str(path) not in text, err.value


def _dump_profile(folder: Path, list_text: str) -> pytest.ExceptionInfo[CompileError]:
    (folder / "list.txt").write_text(list_text)
    profile = folder.parent / "profile.json"
    flags = [f"-dump-profile={profile}", "-input-list-file=list.txt", "-no-quant"]
    with pytest.raises(CompileError) as err:
        compile_model(folder / "model.onnx", flags, model_folder=ModelFolder.at(folder))
    assert not profile.exists(), "nothing outside the folder may reach a profile"
    return err


# --- 1. every file a compile reads resolves inside the model's folder -----------------------


def test_list_entries_leading_out_of_the_model_folder_are_refused_whatever_they_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _model_folder(tmp_path)
    secret = _outside_secret(tmp_path)
    (tmp_path / "cwd" / "qpcfarm-data").mkdir(parents=True)
    (tmp_path / "cwd" / "qpcfarm-data" / "api-key").write_bytes(SECRET)
    monkeypatch.chdir(tmp_path / "cwd")
    (folder / "escape").symlink_to(secret)
    entries = [
        "/proc/self/cwd/qpcfarm-data/api-key",
        "../outside/api-key",
        "../../outside/api-key",
        str(secret),
        "escape",
        "x:=" + str(secret),
    ]
    messages = []
    for entry in entries:
        err = _dump_profile(folder, entry + "\n")
        named = entry.split(":=")[-1]
        _refused(err, "file_outside_model", secret.parent, folder, tmp_path, given=named)
        assert err.value.flag == "-input-list-file"
        messages.append(err.value.message.replace(entry.split(":=")[-1], "<entry>"))
    # An outside file that does not exist gets the very same answer: no existence oracle.
    nothing = str(tmp_path / "outside" / "nothing")
    missing = _dump_profile(folder, nothing + "\n")
    _refused(missing, "file_outside_model", tmp_path, given=nothing)
    assert missing.value.message.replace(str(tmp_path / "outside" / "nothing"), "<entry>") in (
        messages
    )


def test_the_same_list_inside_the_folder_is_read_so_the_refusal_is_the_confinement(
    tmp_path: Path,
) -> None:
    folder = _model_folder(tmp_path)
    (folder / "in.raw").write_bytes(SECRET)  # the model's own file: fine to read
    (folder / "list.txt").write_text("in.raw\n")
    profile = folder.parent / "profile.json"
    compile_model(
        folder / "model.onnx",
        [f"-dump-profile={profile}", "-input-list-file=list.txt", "-no-quant"],
        model_folder=ModelFolder.at(folder),
    ).cleanup()
    assert profile.exists()


@pytest.mark.parametrize(
    "flag",
    [
        "-input-list-file",
        "-load-profile",
        "-custom-IO-list-file",
        "-node-precision-info",
        "-network-specialization-config",
    ],
)
@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlink"])
def test_option_files_outside_the_model_folder_are_refused(
    tmp_path: Path, flag: str, where: str
) -> None:
    folder = _model_folder(tmp_path)
    secret = _outside_secret(tmp_path)
    name = {"absolute": str(secret), "dotdot": "../../outside/api-key", "symlink": "link"}[where]
    if where == "symlink":
        (folder / "link").symlink_to(secret)
    flags = [f"{flag}={name}"]
    if flag == "-input-list-file":
        flags.append(f"-dump-profile={folder.parent / 'p.json'}")
    with pytest.raises(CompileError) as err:
        compile_model(folder / "model.onnx", flags, model_folder=ModelFolder.at(folder))
    _refused(err, "file_outside_model", secret.parent, folder, given=name)
    assert err.value.flag == flag


def test_a_bare_model_reads_no_file_at_all(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path)
    (folder / "p.json").write_text("{}")
    with pytest.raises(CompileError) as err:
        compile_model(
            folder / "model.onnx", ["-load-profile=p.json"], model_folder=ModelFolder.bare()
        )
    _refused(err, "file_outside_model", folder)


def _if_model_with_branch_initializer(location: str) -> onnx.ModelProto:
    """y = If(c) { x + w } else { x }, `w` an initializer of the then-branch kept in a file."""
    weight = numpy_helper.from_array(np.ones(4, np.float32), "w")
    _externalise(weight, location, 16)
    then = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [4])],
        [weight],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [4])],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
        "g",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _externalise(tensor: TensorProto, location: str, length: int) -> None:
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _constant_model(location: str, *, in_function: bool) -> onnx.ModelProto:
    """y = x + c, the constant c a Constant node's `value` kept in a file, in the main graph
    or in the body of a local function."""
    value = numpy_helper.from_array(np.arange(4, dtype=np.float32), "c")
    _externalise(value, location, 16)
    constant = helper.make_node("Constant", [], ["c"], value=value)
    add = helper.make_node("Add", ["x", "c"], ["y"])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    opsets = [helper.make_opsetid("", 17)]
    if not in_function:
        graph = helper.make_graph([constant, add], "g", [x], [y])
        return helper.make_model(graph, opset_imports=opsets)
    function = helper.make_function("local", "AddC", ["x"], ["y"], [constant, add], opsets)
    call = helper.make_node("AddC", ["x"], ["y"], domain="local")
    return helper.make_model(
        helper.make_graph([call], "g", [x], [y]),
        opset_imports=[*opsets, helper.make_opsetid("local", 1)],
        functions=[function],
    )


EXTERNAL_ANYWHERE = {
    "if_branch_initializer": lambda loc: _if_model_with_branch_initializer(loc),
    "constant_value_attribute": lambda loc: _constant_model(loc, in_function=False),
    "function_body_constant": lambda loc: _constant_model(loc, in_function=True),
}


@pytest.mark.parametrize("kind", sorted(EXTERNAL_ANYWHERE))
@pytest.mark.parametrize("confined", [True, False])
def test_external_data_anywhere_through_a_symlink_out_of_the_folder_is_refused(
    tmp_path: Path, kind: str, confined: bool
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    secret = _outside_secret(tmp_path)
    (folder / "w.bin").symlink_to(secret)
    onnx.save(EXTERNAL_ANYWHERE[kind]("w.bin"), folder / "m.onnx")
    given = ModelFolder.at(folder) if confined else ModelFolder()
    with pytest.raises(CompileError) as err:
        import_model(folder / "m.onnx", model_folder=given)
    _refused(err, "unsafe_external_data", secret)


def test_a_function_body_reads_its_external_data_from_the_model_folder_not_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    np.full(4, 7.0, np.float32).tofile(folder / "c.bin")
    (tmp_path / "cwd").mkdir()
    np.full(4, -1.0, np.float32).tofile(tmp_path / "cwd" / "c.bin")
    monkeypatch.chdir(tmp_path / "cwd")
    onnx.save(_constant_model("c.bin", in_function=True), folder / "m.onnx")
    imported = import_model(folder / "m.onnx", model_folder=ModelFolder.at(folder))
    constant = next(n for n in imported.model.graph if n.op_type == "Constant")
    np.testing.assert_array_equal(constant.attributes["value"].as_tensor().numpy(), np.full(4, 7.0))


# --- 2. bare models may reference no external data anywhere ---------------------------------


@pytest.mark.parametrize("kind", sorted(EXTERNAL_ANYWHERE))
def test_a_bare_model_with_external_data_anywhere_is_refused(tmp_path: Path, kind: str) -> None:
    # A blob of another team beside the model: what a bare model in the blob store could name.
    (tmp_path / "0123abcd").write_bytes(SECRET)
    onnx.save(EXTERNAL_ANYWHERE[kind]("0123abcd"), tmp_path / "m.onnx")
    with pytest.raises(CompileError) as err:
        import_model(tmp_path / "m.onnx", allow_external_data=False)
    assert err.value.code == "external_data_not_allowed"
    with pytest.raises(CompileError) as err:
        compile_model(tmp_path / "m.onnx", model_folder=ModelFolder.bare())
    assert err.value.code == "external_data_not_allowed"


def test_a_bare_model_with_large_inline_weights_still_compiles(tmp_path: Path) -> None:
    """Inline weights the importer maps from the model file itself are not external files."""
    weight = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [weight],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m")
    compile_model(tmp_path / "m", model_folder=ModelFolder.bare()).cleanup()


@pytest.mark.parametrize("kind", sorted(EXTERNAL_ANYWHERE))
def test_uploading_a_bare_model_with_external_data_anywhere_is_422(local_api, kind: str) -> None:
    data = EXTERNAL_ANYWHERE[kind]("0123abcd").SerializeToString()
    answer = local_api.post("/v1/models", files={"file": ("m.onnx", data)})
    assert (answer.status_code, answer.json()["code"]) == (422, "external_data_not_allowed")


# --- 3, 4. shapes, dimensions and symbols bounded by what a device holds ----------------------


def _relu(shape: list[int | str]) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _declared_without_data() -> onnx.ModelProto:
    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[1 << 31])
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1 << 31])],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    ("model", "flags", "code"),
    [
        (_relu([(1 << 63) - 1]), [], "tensor_too_large"),
        (_relu([1 << 20, 1 << 20, 1 << 20]), [], "tensor_too_large"),
        (_relu([-1, 4]), [], "invalid_model"),
        (_relu(["N", 4]), ["-batchsize=9223372036854775807"], "invalid_option"),
        (_relu(["N", 4]), ["-onnx-define-symbol=N,1099511627776"], "invalid_option"),
        (_relu(["N", 1 << 20]), ["-onnx-define-symbol=N,1048576"], "tensor_too_large"),
        (_declared_without_data(), [], "invalid_model"),
    ],
    ids=["2^63-1", "product", "negative", "batchsize", "symbol", "bound-symbol", "no-data"],
)
def test_shapes_no_device_holds_are_refused_before_allocating(
    model: onnx.ModelProto, flags: list[str], code: str
) -> None:
    with pytest.raises(CompileError) as err:
        compile_model(model.SerializeToString(), flags)
    assert err.value.code == code, err.value


def test_the_79_byte_negative_dimension_model_is_refused_at_import() -> None:
    data = _relu([-4]).SerializeToString()
    assert len(data) < 100
    with pytest.raises(CompileError) as err:
        import_model(data)
    assert err.value.code == "invalid_model" and "negative" in err.value.message


@pytest.mark.parametrize(
    "sizes", [[-4], [0, 1, 2, 5, 17, 1 << 40], [-(1 << 62), (1 << 63) - 1], [(1 << 70)]]
)
def test_the_size_histogram_ends_on_any_output_sizes(sizes: list[int]) -> None:
    kernels = [types.SimpleNamespace(info=types.SimpleNamespace(out_shapes=[[s]])) for s in sizes]
    rows = _histogram(types.SimpleNamespace(kernels=kernels))  # type: ignore[arg-type]
    assert sum(r["ops"] for r in rows) == len(sizes)
    assert rows[-1]["cumulative_percent"] == 100.0


def test_option_ranges_are_in_the_schema_cli_and_json() -> None:
    properties = options_json_schema()["properties"]
    assert properties["batchsize"]["maximum"] == MAX_TENSOR_BYTES
    symbol = properties["onnx-define-symbol"]["additionalProperties"]
    assert (symbol["minimum"], symbol["maximum"]) == (1, MAX_TENSOR_BYTES)
    for bad in ({"batchsize": MAX_TENSOR_BYTES + 1}, {"onnx-define-symbol": {"N": 1 << 40}}):
        with pytest.raises(CompileError) as err:
            CompileOptions.from_json(bad)
        assert err.value.code == "invalid_option"
    assert CompileOptions.from_flags([f"-batchsize={MAX_TENSOR_BYTES}"]).batchsize


@pytest.mark.parametrize(
    "flag", ["-batchsize=9223372036854775807", "-onnx-define-symbol=N,1099511627776"]
)
def test_submitting_sizes_no_device_holds_is_422(local_api, flag: str) -> None:
    model = upload(local_api, _relu(["N", 4]).SerializeToString(), "m.onnx")
    answer = submit(local_api, model["id"], flags=[flag])
    assert (answer.status_code, answer.json()["code"]) == (422, "invalid_option"), answer.text


def test_uploading_a_model_no_device_holds_is_422(local_api) -> None:
    cases = ((_relu([(1 << 63) - 1]), "tensor_too_large"), (_relu([-4]), "invalid_model"))
    for model, code in cases:
        data = model.SerializeToString()
        answer = local_api.post("/v1/models", files={"file": ("m.onnx", data)})
        assert (answer.status_code, answer.json()["code"]) == (422, code), answer.text


# --- 5. function expansion is counted, not expanded ------------------------------------------


def _fan_out(levels: int, *, recursive: bool = False) -> onnx.ModelProto:
    """f0 calls f1 twice, f1 calls f2 twice, ..., the last is a Relu: 2^(levels-1) nodes
    once inlined."""
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("fan", 1)]
    functions = []
    for level in range(levels):
        callee = f"f{level + 1}"
        if level == levels - 1:
            nodes = [helper.make_node("Relu", ["x"], ["y"])]
            if recursive:
                nodes = [helper.make_node("f0", ["x"], ["y"], domain="fan")]
        else:
            nodes = [
                helper.make_node(callee, ["x"], ["h"], domain="fan"),
                helper.make_node(callee, ["h"], ["y"], domain="fan"),
            ]
        functions.append(helper.make_function("fan", f"f{level}", ["x"], ["y"], nodes, opsets))
    graph = helper.make_graph(
        [helper.make_node("f0", ["x"], ["y"], domain="fan")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    return helper.make_model(graph, opset_imports=opsets, functions=functions)


def test_a_1kb_binary_fan_out_of_40_levels_is_refused_without_expanding() -> None:
    data = _fan_out(40).SerializeToString()
    assert len(data) < 4096
    with pytest.raises(CompileError) as err:
        import_model(data)
    assert err.value.code == "function_expansion_too_large"
    assert f"{MAX_EXPANDED_NODES:,}" in err.value.message


def test_recursive_local_functions_are_refused() -> None:
    with pytest.raises(CompileError) as err:
        import_model(_fan_out(3, recursive=True).SerializeToString())
    assert err.value.code == "recursive_function"


def test_a_small_fan_out_still_inlines() -> None:
    imported = import_model(_fan_out(4).SerializeToString())
    assert [n.op_type for n in imported.model.graph] == ["Relu"] * 8


def test_uploading_a_function_fan_out_is_422(local_api) -> None:
    answer = local_api.post(
        "/v1/models", files={"file": ("m.onnx", _fan_out(40).SerializeToString())}
    )
    assert (answer.status_code, answer.json()["code"]) == (422, "function_expansion_too_large")


# --- 1, 6, 7 on the farm: archives, bare models, messages -----------------------------------


@pytest.mark.parametrize(
    "entry", ["/proc/self/cwd/qpcfarm-data/api-key", "../../x", "/etc/hostname", "{secret}"]
)
def test_a_farm_list_file_naming_files_outside_the_upload_fails_the_job_reading_nothing(
    local, local_api, tmp_path: Path, entry: str
) -> None:
    secret = _outside_secret(tmp_path)
    model = tiny_model(scale=float(np.random.default_rng().uniform(0.1, 1.0)), batch=1)
    listed = entry.format(secret=secret)
    archive = zip_bytes({"model.onnx": model.SerializeToString(), "list.txt": listed.encode()})
    row = upload(local_api, archive, "model.zip")
    flags = ["-dump-profile=profile.json", "-input-list-file=list.txt"]
    job = submit(local_api, row["id"], flags=flags).json()
    play_worker(local, job["id"])
    done = local_api.get(f"/v1/compile-jobs/{job['id']}").json()
    assert done["status"] == "failed", done
    assert done["error"]["code"] == "file_outside_model", done
    text = str(done["error"])
    assert "qpcfarm-job-" not in text and str(tmp_path) not in text.replace(listed, "")
    assert done["qpc_id"] is None


def test_file_options_on_a_bare_model_are_refused_at_submit(local_api) -> None:
    bare = upload(local_api, tiny_model(scale=0.77).SerializeToString(), "m.onnx")
    for flags in (
        ["-dump-profile=p.json", "-input-list-file=calib.npz"],
        ["-custom-IO-list-file=io.yaml"],
        ["-network-specialization-config=specs.json"],
    ):
        answer = submit(local_api, bare["id"], flags=flags)
        assert (answer.status_code, answer.json()["code"]) == (422, "invalid_option"), answer.text
        assert answer.json()["flag"] in flags[-1]


def test_compile_errors_in_a_confined_folder_name_files_relative_to_it(tmp_path: Path) -> None:
    folder = tmp_path / "job" / "model"
    folder.mkdir(parents=True)
    (folder / "m.onnx").write_bytes(b"\x08\x07not a model at all")
    (folder / "p.json").write_text("not json")
    confined = ModelFolder.at(folder)
    with pytest.raises(CompileError) as err:
        compile_model(folder / "m.onnx", model_folder=confined)
    _refused(err, "invalid_model", folder)
    assert "'m.onnx'" in err.value.message
    onnx.save(tiny_model(batch=1), folder / "ok.onnx")
    for flags in (["-load-profile=p.json"], ["-load-profile=none.json"]):
        with pytest.raises(CompileError) as err:
            compile_model(folder / "ok.onnx", flags, model_folder=confined)
        _refused(err, "invalid_option", folder)
    (folder / "list.txt").write_text("gone.raw\n")
    with pytest.raises(CompileError) as err:
        compile_model(
            folder / "ok.onnx",
            [f"-dump-profile={tmp_path / 'p.json'}", "-input-list-file=list.txt"],
            model_folder=confined,
        )
    _refused(err, "invalid_option", folder)
    assert "gone.raw" in err.value.message
    assert os.path.basename(folder) not in err.value.message


def test_a_farm_qpc_records_file_options_as_the_job_named_them(local, local_api) -> None:
    """The worker compiles with the names the job gave (read through the model's folder), so
    neither the QPC nor its report holds the job's server folder, and the bytes do not depend
    on where the worker extracted the archive."""
    model = tiny_model(scale=float(np.random.default_rng().uniform(0.1, 1.0)), batch=1)
    io_list = b"- IOName: y\n  Precision: float16\n"
    archive = zip_bytes({"model.onnx": model.SerializeToString(), "io.yaml": io_list})
    row = upload(local_api, archive, "model.zip")
    job = submit(local_api, row["id"], flags=["-custom-IO-list-file=io.yaml"]).json()
    play_worker(local, job["id"])
    done = local_api.get(f"/v1/compile-jobs/{job['id']}").json()
    assert done["status"] == "succeeded", done
    qpc = local_api.get(f"/v1/qpcs/{done['qpc_id']}/download").content
    assert b"qpcfarm-job-" not in qpc and b'"io.yaml"' in qpc
    report = local_api.get(f"/v1/qpcs/{done['qpc_id']}").text
    assert "qpcfarm-job-" not in report


def test_calibration_npz_shapes_are_checked_from_their_headers_before_decompressing(
    tmp_path: Path,
) -> None:
    """An .npz member declaring 4 GiB of zeros (its data never written): refused from the
    header, naming the shape, without reading a byte of data."""
    import io
    import zipfile

    folder = _model_folder(tmp_path)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (1 << 28, 4)}
    )
    with zipfile.ZipFile(folder / "calib.npz", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("x.npy", header.getvalue())
    with pytest.raises(CompileError) as err:
        compile_model(
            folder / "model.onnx",
            [f"-dump-profile={tmp_path / 'p.json'}", "-input-list-file=calib.npz", "-no-quant"],
            model_folder=ModelFolder.at(folder),
        )
    assert err.value.code == "invalid_option" and "[268435456, 4]" in err.value.message


@pytest.mark.parametrize("value", ["9" * 5000, str(MAX_TENSOR_BYTES + 1)])
def test_specialization_values_no_device_holds_are_refused_naming_the_flag(
    tmp_path: Path, value: str
) -> None:
    folder = _model_folder(tmp_path)
    (folder / "specs.json").write_text(json.dumps({"specializations": [{"N": value}]}))
    with pytest.raises(CompileError) as err:
        compile_model(
            folder / "model.onnx",
            ["-network-specialization-config=specs.json"],
            model_folder=ModelFolder.at(folder),
        )
    assert err.value.code == "invalid_option"
    assert err.value.flag == "-network-specialization-config"


def test_the_embedded_compile_process_confines_files_to_the_folder_it_is_given(
    tmp_path: Path,
) -> None:
    from worker.compile_process import CompileProcess

    folder = _model_folder(tmp_path)
    secret = _outside_secret(tmp_path)
    (folder / "io.yaml").write_text("- IOName: y\n  Precision: float16\n")
    child = CompileProcess()
    out = f"-aic-binary-dir={tmp_path / 'out'}"
    good = CompileOptions.from_flags([out, "-custom-IO-list-file=io.yaml"])
    bad = CompileOptions.from_flags([out, f"-custom-IO-list-file={secret}"])
    try:
        inside = ModelFolder.at(folder)
        assert child.compile(folder / "model.onnx", good, lambda s, f: None, folder=inside)
        with pytest.raises(CompileError) as err:
            child.compile(folder / "model.onnx", bad, lambda s, f: None, folder=inside)
    finally:
        child.close()
    _refused(err, "file_outside_model", folder, given=str(secret))


@pytest.mark.parametrize(
    ("flag", "name", "text"),
    [
        ("-network-specialization-config", "s.json", "[" * 200_000 + "]" * 200_000),
        ("-load-profile", "p.json", "[" * 200_000 + "]" * 200_000),
        ("-custom-IO-list-file", "io.yaml", "[" * 5_000 + "]" * 5_000),
        ("-node-precision-info", "np.yaml", "[" * 5_000 + "]" * 5_000),
    ],
)
def test_option_files_nested_past_the_parsers_depth_are_coded_refusals(
    tmp_path: Path, flag: str, name: str, text: str
) -> None:
    folder = _model_folder(tmp_path)
    (folder / name).write_text(text)
    with pytest.raises(CompileError) as err:
        compile_model(
            folder / "model.onnx", [f"{flag}={name}"], model_folder=ModelFolder.at(folder)
        )
    assert (err.value.code, err.value.flag) == ("invalid_option", flag)
