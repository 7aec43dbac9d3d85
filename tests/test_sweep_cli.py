"""`qpcfarm configure` on this machine: the compiles in parallel processes, the ranked table on
stdout, the best QPC written and running like ONNX Runtime; bad input fails with one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from tests.conftest import tiny_model
from tests.service_helpers import qpcfarm_argv, service_env


def configure(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        qpcfarm_argv("configure", *args),
        env=service_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_local_sweep_ranks_every_valid_combination_and_writes_the_best_qpc(
    tmp_path: Path,
) -> None:
    model = tiny_model(batch="N")
    onnx.save(model, str(tmp_path / "tiny.onnx"))
    (tmp_path / "space.yaml").write_text(
        "parameters:\n  cores: [1, 2]\n  batchsize: [1, 4]\n  instances: [1, 2, 4]\n"
        "constraints: ['cores * instances <= 4']\n"
    )
    done = configure(
        tmp_path, "-m=tiny.onnx", "--search-space", "space.yaml", "--jobs", "2",
        "--objective", "latency", "-aic-binary-dir=best", "--json", "all.json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "invalid combination" in done.stderr and "fails the constraint" in done.stderr
    ranked = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(ranked) == 10  # 12 combinations, 2 over the constraint (2 cores x 4)
    latencies = [float(row[7]) for row in ranked]
    assert latencies == sorted(latencies)  # min-latency: lowest first
    summary = json.loads((tmp_path / "all.json").read_text())
    assert summary["compiles"] == 4 and summary["best"]["latency_us"] == latencies[0]

    from compiler_core.runtime import run_qpc

    batch = summary["best"]["batchsize"]
    x = np.linspace(-1, 1, batch * 4, dtype=np.float32).reshape(batch, 4)
    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    got = run_qpc(str(tmp_path / "best" / "programqpc.bin"), {"x": x})["y"]
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)


def test_configure_refuses_bad_input_with_one_line(tmp_path: Path) -> None:
    onnx.save(tiny_model(batch="N"), str(tmp_path / "tiny.onnx"))
    (tmp_path / "bad.csv").write_text("cores,colour\n1,red\n")
    (tmp_path / "none.csv").write_text("cores,ols\n1,4\n")
    cases = [
        (["-m=tiny.onnx", "--search-space", "bad.csv"], "unknown search-space parameter"),
        (["-m=tiny.onnx", "--search-space", "none.csv"], "no combination"),
        (["-m=tiny.onnx", "--search-space", "missing.csv"], "cannot read the search space"),
        (["-m=gone.onnx", "--search-space", "bad.csv"], "unknown search-space parameter"),
        (["--search-space", "none.csv", "-m=tiny.onnx", "-nope"], "-nope"),
        (["-m=tiny.onnx", "--search-space", "none.csv", "--objective", "throughput-under-latency"],
         "latency bound"),
    ]  # fmt: skip
    for args, words in cases:
        done = configure(tmp_path, *args)
        assert done.returncode == 1, (args, done.stderr)
        assert words in done.stderr and done.stderr.count("\n") <= 2, done.stderr
