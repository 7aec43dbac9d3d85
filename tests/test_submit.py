"""`qpcfarm submit`: the farm as a drop-in for the local compile, over real HTTP.

One embedded-mode server (`qpcfarm serve`: SQLite and blobs in a temporary data directory,
in-process worker) runs as a subprocess on a free loopback port for the whole module. Every
remote QPC is compared byte for byte with what `qpcfarm compile` writes locally with the same
flags: the compiler is deterministic, so any difference is a bug of the farm path.
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import onnx
import pytest

from app.console.cli import main
from app.console.client import etag_sha256
from app.console.submit import (
    ProgressDisplay,
    external_data_files,
    parse_args,
    remote_flags,
    upload_source,
)
from compiler_core.options import CompileOptions
from tests.conftest import tiny_model

REPO = Path(__file__).resolve().parents[1]
START_ATTEMPTS = 600  # x 0.1 s: a bounded wait for the server to answer /healthz


@dataclass
class Server:
    url: str
    api_key: str
    data_dir: Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server_env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QPCFARM_")}
    env["QPCFARM_DATA_DIR"] = str(data_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("farm")
    data_dir = root / "data"
    port = _free_port()
    log = open(root / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.console.cli", "serve", "--port", str(port)]
        + ["--log-level", "warning"],
        cwd=root,
        env=_server_env(data_dir),
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(START_ATTEMPTS):
            if proc.poll() is not None:
                pytest.fail(f"qpcfarm serve exited: {(root / 'serve.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            pytest.fail("qpcfarm serve did not answer /healthz")
        key = (data_dir / "api-key").read_text().strip()
        yield Server(url, key, data_dir)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _save(model: onnx.ModelProto, path: Path, **kwargs: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), **kwargs)  # type: ignore[arg-type]
    return path


def _submit(server: Server, *flags: str, api_key: str | None = None) -> int:
    return main(["submit", *flags, "--server", server.url, "--api-key", api_key or server.api_key])


def _model_count(server: Server) -> int:
    headers = {"Authorization": f"Bearer {server.api_key}"}
    body = httpx.get(f"{server.url}/v1/models", headers=headers, timeout=10.0).json()
    return int(body["count"])


def _warning_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("qpcfarm: error:")]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------------------ the path


def test_submit_writes_the_qpc_a_local_compile_writes_and_prints_its_report(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _save(tiny_model(scale=0.25), tmp_path / "m.onnx")
    flags = ["-aic-num-cores=2", "-aic-perf-metrics", "-time-passes"]

    assert main(["compile", f"-m={model}", f"-aic-binary-dir={tmp_path / 'local'}", *flags]) == 0
    local = capsys.readouterr()
    local_out = local.out
    assert _submit(server, f"-m={model}", f"-aic-binary-dir={tmp_path / 'remote'}", *flags) == 0
    remote = capsys.readouterr()
    # The farm's report always holds the perf analysis; without -aic-perf-warnings, submit
    # prints what the local compile prints, and no more.
    assert _warning_lines(remote.err) == _warning_lines(local.err)

    local_qpc = (tmp_path / "local" / "programqpc.bin").read_bytes()
    assert (tmp_path / "remote" / "programqpc.bin").read_bytes() == local_qpc
    # Metrics are estimates of the program, so they match exactly; pass times do not.
    local_metrics = local_out.split("\npass ")[0]
    assert remote.out.startswith(local_metrics)
    assert "\ntotal " in remote.out and "lower" in remote.out
    assert remote.out.rstrip().endswith(str(tmp_path / "remote" / "programqpc.bin"))
    assert "succeeded" in remote.err  # the plain-text progress lines (stderr is not a TTY)
    assert not list((tmp_path / "remote").glob("*.part"))


def test_with_aic_perf_warnings_submit_prints_the_perf_analysis_a_local_compile_prints(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _save(tiny_model(scale=0.26), tmp_path / "m.onnx")
    flags = ["-aic-num-cores=2", "-aic-perf-warnings"]
    assert main(["compile", f"-m={model}", f"-aic-binary-dir={tmp_path / 'local'}", *flags]) == 0
    local = _warning_lines(capsys.readouterr().err)
    assert _submit(server, f"-m={model}", f"-aic-binary-dir={tmp_path / 'remote'}", *flags) == 0
    remote = _warning_lines(capsys.readouterr().err)
    assert remote == local and any("[fp32_compute]" in line for line in local)


def test_a_second_identical_submit_is_a_cache_hit_with_the_same_bytes(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _save(tiny_model(scale=0.5), tmp_path / "m.onnx")
    assert _submit(server, f"-m={model}", f"-aic-binary-dir={tmp_path / 'a'}") == 0
    assert "cache hit" not in capsys.readouterr().err  # the first one compiled
    assert _submit(server, f"-model={model}", f"-aic-binary-dir={tmp_path / 'b'}") == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "cache hit" in line]
    assert len(said) == 1 and "reused" in said[0] and "nothing was compiled" in said[0]
    first = (tmp_path / "a" / "programqpc.bin").read_bytes()
    assert (tmp_path / "b" / "programqpc.bin").read_bytes() == first


def test_a_model_with_external_data_is_uploaded_as_a_zip_and_compiles_the_same(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ext" / "weights").mkdir(parents=True)
    model = _save(
        tiny_model(scale=0.75),
        tmp_path / "ext" / "m.onnx",
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights/m.data",
        size_threshold=0,
    )
    assert external_data_files(model) == ["weights/m.data"]
    with upload_source(model) as (archive, name):
        assert name == "m.zip" and archive.read_bytes()[:4] == b"PK\x03\x04"

    assert main(["compile", f"-m={model}", f"-aic-binary-dir={tmp_path / 'local'}"]) == 0
    assert _submit(server, f"-m={model}", f"-aic-binary-dir={tmp_path / 'remote'}") == 0
    capsys.readouterr()
    local_qpc = (tmp_path / "local" / "programqpc.bin").read_bytes()
    assert (tmp_path / "remote" / "programqpc.bin").read_bytes() == local_qpc


def test_a_model_with_kilobytes_of_inline_weights_compiles_the_same(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    weights = numpy_helper.from_array(
        np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(64, 64), "W"
    )
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "inline",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [weights],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    model = _save(proto, tmp_path / "inline.onnx")

    assert main(["compile", f"-m={model}", f"-aic-binary-dir={tmp_path / 'local'}"]) == 0
    code = _submit(server, f"-m={model}", f"-aic-binary-dir={tmp_path / 'remote'}")
    capsys.readouterr()
    assert code == 0
    local_qpc = (tmp_path / "local" / "programqpc.bin").read_bytes()
    assert (tmp_path / "remote" / "programqpc.bin").read_bytes() == local_qpc


def test_a_model_without_external_data_is_uploaded_as_it_is(tmp_path: Path) -> None:
    model = _save(tiny_model(), tmp_path / "m.onnx")
    assert external_data_files(model) == []
    with upload_source(model) as (path, name):
        assert (path, name) == (model, "m.onnx")


def test_missing_external_data_fails_before_upload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _save(
        tiny_model(),
        tmp_path / "m.onnx",
        save_as_external_data=True,
        location="m.data",
        size_threshold=0,
    )
    (tmp_path / "m.data").unlink()
    code = main(
        ["submit", f"-m={model}", f"-aic-binary-dir={tmp_path}/o", "--server", "http://127.0.0.1:9"]
    )
    assert code == 1
    assert "m.data" in _one_error_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------- failures


def test_a_bad_flag_fails_before_any_upload_with_the_local_compile_error(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _save(tiny_model(), tmp_path / "m.onnx")
    before = _model_count(server)
    args = [f"-m={model}", f"-aic-binary-dir={tmp_path / 'o'}", "-aic-num-cores=99"]

    assert main(["compile", *args]) == 1
    local_error = _one_error_line(capsys.readouterr().err)
    assert _submit(server, *args) == 1
    remote_error = _one_error_line(capsys.readouterr().err)

    assert remote_error == local_error and "-aic-num-cores" in remote_error
    assert _model_count(server) == before
    assert not (tmp_path / "o").exists()


def test_a_wrong_api_key_is_one_line_and_writes_nothing(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _save(tiny_model(), tmp_path / "m.onnx")
    code = _submit(
        server, f"-m={model}", f"-aic-binary-dir={tmp_path / 'o'}", api_key="qpf_not-a-key"
    )
    assert code == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "401" in line and "--api-key" in line
    assert not (tmp_path / "o" / "programqpc.bin").exists()


def test_a_refusal_of_the_farm_is_one_line_with_its_code_message_and_status(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _save(tiny_model(), tmp_path / "m.onnx")
    args = [f"-m={model}", f"-aic-binary-dir={tmp_path / 'o'}", "--compiler", "qaic@9.9.9"]

    assert _submit(server, *args) == 1
    line = _one_error_line(capsys.readouterr().err)

    assert line.startswith("qpcfarm: error: compiler_unavailable: no worker has compiler")
    assert "qaic@9.9.9" in line and line.endswith("(HTTP 409)")
    assert not (tmp_path / "o").exists()


def test_a_compile_that_fails_on_the_farm_reports_the_compilers_error(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _save(tiny_model(batch="N"), tmp_path / "dynamic.onnx")  # a free dim, never bound
    args = [f"-m={model}", f"-aic-binary-dir={tmp_path / 'o'}"]

    assert main(["compile", *args]) == 1
    local_error = _one_error_line(capsys.readouterr().err)
    assert _submit(server, *args) == 1
    remote_error = _one_error_line(capsys.readouterr().err)

    assert remote_error == local_error and "symbolic 'N'" in remote_error
    assert not (tmp_path / "o" / "programqpc.bin").exists()


def test_an_unreachable_server_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _save(tiny_model(), tmp_path / "m.onnx")
    url = f"http://127.0.0.1:{_free_port()}"
    code = main(["submit", f"-m={model}", f"-aic-binary-dir={tmp_path / 'o'}", "--server", url])
    assert code == 1
    line = _one_error_line(capsys.readouterr().err)
    assert f"cannot reach the server at {url}" in line
    assert "`qpcfarm serve`" in line and "--server" in line  # what to do about it


def test_an_option_naming_a_missing_local_file_is_refused_before_upload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _save(tiny_model(), tmp_path / "m.onnx")
    args = [
        f"-m={model}",
        f"-aic-binary-dir={tmp_path}/o",
        f"-custom-IO-list-file={tmp_path}/io.yaml",
    ]
    assert main(["submit", *args, "--server", "http://127.0.0.1:9"]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "-custom-IO-list-file" in line and "no such file" in line


# ------------------------------------------------------------------------------ the parts


def test_client_options_are_split_from_compile_flags() -> None:
    args = parse_args(
        ["-m=a.onnx", "--server", "http://farm:8000", "-aic-num-cores=2", "--timeout=5"],
        env={"QPCFARM_API_KEY": "from-env"},
    )
    assert args.flags == ["-m=a.onnx", "-aic-num-cores=2"]
    assert (args.server, args.timeout, args.api_key) == ("http://farm:8000", 5.0, "from-env")


def test_the_api_key_comes_from_the_flag_then_the_environment_then_the_data_dir(
    tmp_path: Path,
) -> None:
    (tmp_path / "api-key").write_text("from-file\n")
    env = {"QPCFARM_DATA_DIR": str(tmp_path)}
    assert parse_args([], env=env).api_key == "from-file"
    assert parse_args([], env={**env, "QPCFARM_API_KEY": "from-env"}).api_key == "from-env"
    assert parse_args(["--api-key", "given"], env=env).api_key == "given"
    assert parse_args([], env={"QPCFARM_DATA_DIR": str(tmp_path / "none")}).api_key is None


def test_the_server_gets_canonical_flags_without_local_paths() -> None:
    options = CompileOptions.from_flags(
        ["-model=m.onnx", "-aic-binary-dir=out", "-aic-num-cores=4", "-time-passes"]
    )
    flags = remote_flags(options)
    assert not any(f.startswith(("-model", "-m=", "-aic-binary-dir")) for f in flags)
    assert CompileOptions.from_flags(flags) == options.with_(model=None, aic_binary_dir=None)


def test_progress_prints_one_line_per_change_in_words_when_not_a_terminal() -> None:
    stream = io.StringIO()
    display = ProgressDisplay(stream, "0123456789abcdef")
    for status, stage, progress in [
        ("queued", None, 0.0),
        ("running", "import", 0.1),
        ("running", "import", 0.2),
        ("running", "lower", 0.6),
        ("succeeded", "done", 1.0),
    ]:
        display.update({"status": status, "stage": stage, "progress": progress})
    display.close()
    assert stream.getvalue().splitlines() == [
        "qpcfarm: job 01234567 queued",
        "qpcfarm: job 01234567 running importing the model 10%",
        "qpcfarm: job 01234567 running lowering to kernels 60%",
        "qpcfarm: job 01234567 succeeded",
    ]


def test_etags_name_a_sha256_in_any_usual_spelling() -> None:
    digest = "ab" * 32
    assert etag_sha256(f'"{digest}"') == digest
    assert etag_sha256(f'W/"sha256:{digest.upper()}"') == digest
    assert etag_sha256('"v1"') == ""


def test_option_files_are_uploaded_beside_the_model_and_named_there(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    import numpy as np

    from compiler_core import QpcSession
    from tests.decoder_model import generate_reference, generate_with, kv_decoder

    decoder = kv_decoder(seed=11)
    model = _save(decoder, tmp_path / "decoder.onnx")
    specs = tmp_path / "local-specs.json"
    specs.write_text(
        json.dumps(
            {"specializations": [{"batch_size": 1, "seq_len": 4}, {"batch_size": 1, "seq_len": 1}]}
        )
    )
    options = CompileOptions.from_flags([f"-m={model}", f"-network-specialization-config={specs}"])
    assert "-network-specialization-config=network-specialization-config.json" in remote_flags(
        options, {"network_specialization_config": ("network-specialization-config.json", specs)}
    )

    out = tmp_path / "remote"
    code = _submit(
        server,
        f"-m={model}",
        f"-aic-binary-dir={out}",
        f"-network-specialization-config={specs}",
        "-retained-state",
    )
    capsys.readouterr()
    assert code == 0
    prompt = np.array([[5, 1, 44, 2]], np.int64)
    with QpcSession(out / "programqpc.bin") as session:
        assert len(session.specializations) == 2
        tokens = generate_with(session.run, prompt, 3, feed_back=False)
    assert tokens == generate_reference(decoder, prompt, 3)


# ----------------------------------------------------------------------- framework models


def test_submit_takes_a_torch_export_program_and_the_farm_converts_it(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The served farm (its compile child process, the conversion child under it) compiles
    a `.pt2` as the local compile does: the QPC computes what torch computes."""
    import importlib.util
    import warnings

    import numpy as np

    if not all(importlib.util.find_spec(m) for m in ("torch", "onnxscript")):
        pytest.skip("torch and onnxscript not installed: pip install 'qpcfarm[torch]'")
    import torch

    from compiler_core import run_qpc

    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh()).eval()
    x = torch.randn(2, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(net, (x,)), tmp_path / "net.pt2")
    code = _submit(server, f"-m={tmp_path / 'net.pt2'}", f"-aic-binary-dir={tmp_path / 'out'}")
    out, err = capsys.readouterr()
    assert code == 0, err
    (got,) = run_qpc(out.strip(), {"input": x.numpy()}).values()
    np.testing.assert_allclose(got, net(x).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_submit_sends_input_shapes_so_a_torchscript_that_cannot_convert_is_refused_at_upload(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`-input-shapes` goes with the upload: a TorchScript module that loads but does not
    convert with them is refused by the upload (its code, a non-zero exit), before a job."""
    import importlib.util
    import warnings

    if not all(importlib.util.find_spec(m) for m in ("torch", "onnxscript")):
        pytest.skip("torch and onnxscript not installed: pip install 'qpcfarm[torch]'")
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated, and still a format users have
        torch.jit.save(torch.jit.script(torch.nn.Linear(4, 3).eval()), tmp_path / "net.pt")
    code = _submit(
        server,
        f"-m={tmp_path / 'net.pt'}",
        "-input-shapes=input:1x5",  # the Linear takes 4 features
        f"-aic-binary-dir={tmp_path / 'out'}",
    )
    out, err = capsys.readouterr()
    assert code != 0
    assert "torch.onnx.export cannot convert" in err and "(HTTP 422)" in err, err
    assert sys.prefix not in err  # no server path (the converter's installation)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
