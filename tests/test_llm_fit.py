"""Whether a model fits one SoC's DDR is decided from its header before any compile: weights
(at their stored precision) + the KV cache x sequences + the working set, against DDR. A model
that cannot fit is refused at once, by the compiler, the CLI (non-zero exit) and the API (422
`model_does_not_fit`), with the bytes needed and available and the options that would fit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto

from compiler_core.cli import main
from compiler_core.compile import compile_model
from compiler_core.errors import CompileError
from compiler_core.fit import check_fit
from compiler_core.options import CompileOptions
from tests.api_helpers import LiveServer, Servers, zip_bytes
from tests.models import sparse_matmul_header

GIB = 1 << 30
STANDARD_DDR = 16 * GIB


def _state_model(rows: int, cols: int) -> onnx.ModelProto:
    """A retained state of [rows, cols] fp32 (no weights at all)."""
    graph = oh.make_graph(
        [oh.make_node("Add", ["state", "one"], ["state_RetainedState"])],
        "state",
        [oh.make_tensor_value_info("state", TensorProto.FLOAT, [rows, cols])],
        [oh.make_tensor_value_info("state_RetainedState", TensorProto.FLOAT, [rows, cols])],
        [oh.make_tensor("one", TensorProto.FLOAT, [], [1.0])],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


def test_weights_larger_than_the_ddr_are_refused_from_the_header_with_what_would_fit(
    tmp_path: Path,
) -> None:
    path = sparse_matmul_header(tmp_path, 96 * 1024, 96 * 1024)  # 18.0 GiB of fp16 weights
    with pytest.raises(CompileError) as info:
        compile_model(str(path), ["-aic-device=aic100-standard"])
    error = info.value
    details: dict[str, Any] = dict(error.details)
    assert error.code == "model_does_not_fit"
    assert details["needed_bytes"] > details["available_bytes"] == STANDARD_DDR
    assert details["weights_bytes"] == 96 * 1024 * 96 * 1024 * 2
    assert any(s.startswith("-mxfp6-matmul") for s in details["suggestions"])
    assert "-mxfp6-matmul" in error.message and "GB" in error.message


def test_the_same_weights_as_mxfp6_fit(tmp_path: Path) -> None:
    path = sparse_matmul_header(tmp_path, 96 * 1024, 96 * 1024)
    report = check_fit(path, CompileOptions.from_flags(["-mxfp6-matmul"]))
    assert report.fits
    assert report.weights_bytes == 96 * 1024 * 3 * 1024 * 25  # 25 bytes per 32 weights
    assert report.host_bytes == 96 * 1024 * 96 * 1024 * 2


def test_the_cli_exits_non_zero_naming_the_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = sparse_matmul_header(tmp_path, 96 * 1024, 96 * 1024)
    out = tmp_path / "out"
    status = main(
        ["compile", f"-m={path}", f"-aic-binary-dir={out}", "-aic-device=aic100-standard"]
    )
    assert status != 0
    err = capsys.readouterr().err
    assert "model_does_not_fit" in err or "needs" in err
    assert not (tmp_path / "out" / "programqpc.bin").exists()


def test_the_kv_cache_counts_its_sequences_and_mxint8_or_a_shorter_context_would_fit() -> None:
    model = _state_model(5, GIB // 4)  # 5 sequences of 1 GiB (fp32)
    options = CompileOptions.from_flags(["-retained-state", "-aic-device=aic100-standard"])
    report = check_fit(model.SerializeToString(), options)
    assert report.fits and report.kv_cache_bytes == 5 * GIB and report.sequences == 5
    assert report.kv_bytes_per_sequence == GIB
    big = _state_model(17, GIB // 4)
    report = check_fit(big.SerializeToString(), options)
    assert not report.fits and report.kv_cache_bytes == 17 * GIB
    assert "-mxint8-kv-cache" in report.suggestions
    assert any(s.startswith("a context at most") for s in report.suggestions)


def test_a_fitting_llm_compiles_as_before() -> None:
    from tests.decoder_model import kv_decoder

    result = compile_model(
        kv_decoder().SerializeToString(),
        ["-onnx-define-symbol=batch_size,1", "-onnx-define-symbol=seq_len,1", "-retained-state"],
    )
    result.cleanup()


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    servers = Servers(tmp_path_factory)
    try:
        yield servers.get("sqlite")
    finally:
        servers.close()


def test_the_api_refuses_at_submit_with_422_model_does_not_fit(local: LiveServer) -> None:
    archive = zip_bytes({"state.onnx": _state_model(17, GIB // 4).SerializeToString()})
    with local.client(local.new_key()) as api:
        response = api.post("/v1/models", files={"file": ("state.zip", archive)})
        assert response.status_code == 201, response.text
        model = response.json()
        submitted = api.post(
            "/v1/compile-jobs",
            json={
                "model_id": model["id"],
                "flags": ["-retained-state", "-aic-device=aic100-standard"],
            },
        )
        assert submitted.status_code == 422, submitted.text
        body = submitted.json()
        assert body["code"] == "model_does_not_fit"
        assert body["fit"]["needed_bytes"] > body["fit"]["available_bytes"]
        assert api.get("/v1/compile-jobs").json()["count"] == 0


def test_the_fit_check_reads_option_files_only_inside_the_jobs_model_folder(
    tmp_path: Path,
) -> None:
    """The check runs before the compile, so it obeys the farm's confinement too: a
    specializations file outside the model's folder is refused, not read."""
    from compiler_core.model_folder import ModelFolder

    folder = tmp_path / "job"
    folder.mkdir()
    path = sparse_matmul_header(folder, 64, 64)
    outside = tmp_path / "secret.json"
    outside.write_text('{"specializations": [{"batch": "1"}]}')
    options = CompileOptions.from_flags([f"-network-specialization-config={outside}"])
    with pytest.raises(CompileError) as info:
        check_fit(str(path), options, ModelFolder.at(folder))
    assert info.value.code == "file_outside_model"
    assert str(tmp_path) not in info.value.message.replace(str(outside), "")


def test_the_submit_time_check_reads_no_more_than_a_bounded_header() -> None:
    """The API reads a stored upload's header only when it is small and indexed: a tar (no
    index) or a header past the bound is left to the compile's own check."""
    import io
    import tarfile

    from compiler_core import fit

    model = _state_model(4, 4)
    options = CompileOptions.from_flags(["-retained-state"])
    assert fit.check_upload_fit(io.BytesIO(model.SerializeToString()), options) is not None
    assert (
        fit.check_upload_fit(io.BytesIO(zip_bytes({"m.onnx": model.SerializeToString()})), options)
        is not None
    )
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as archive:
        data = model.SerializeToString()
        info = tarfile.TarInfo("m.onnx")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    tar.seek(0)
    assert fit.check_upload_fit(tar, options) is None

    class Huge(io.BytesIO):
        """A bare upload that claims more bytes than the bound: read no further than it."""

        def read(self, n: int | None = -1) -> bytes:
            assert n is not None and 0 < n <= fit.MAX_SUBMIT_HEADER_BYTES + 4
            return b"\x08" * min(n, fit.MAX_SUBMIT_HEADER_BYTES + 1) if n > 4 else b"\x08" * n

    assert fit.check_upload_fit(Huge(), options) is None
