"""The README works as written: its CLI block runs from model to profile on a model made here,
and every file the README and docs/ point to is in the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]


def readme_cli_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## The compiler CLI", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "no ```bash block under 'The compiler CLI'"
    return block.group(1)


def small_cnn() -> onnx.ModelProto:
    """Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm -> Softmax, a classifier's shape."""
    rng = np.random.default_rng(7)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.2, "w"),
        numpy_helper.from_array(np.zeros(8, np.float32), "b"),
        numpy_helper.from_array(rng.standard_normal((10, 8)).astype(np.float32) * 0.2, "fc"),
        numpy_helper.from_array(np.zeros(10, np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["g"], name="pool"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc", "fc_b"], ["logits"], name="fc", transB=1),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "small_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_the_readme_cli_block_runs_as_written(tmp_path: Path) -> None:
    onnx.save(small_cnn(), tmp_path / "model.onnx")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QPCFARM_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", readme_cli_block()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    out = done.stdout
    assert "Performance metrics (estimated)" in out and "\ntotal " in out
    assert "image: float32 [1x3x16x16]" in out  # inspect showed what in.npz must hold
    assert "probs  1x10  float32" in out
    assert "report/opstats-summary.txt" in out and "report/trace.json" in out
    assert "FAIL" not in out and "PASS container" in out
    assert len(list((tmp_path / "stats").glob("stats-inf-*.bin"))) == 3
    for made in ("in.npz", "out.npz", "report/opstats-summary.csv"):
        assert (tmp_path / made).is_file(), made
    with np.load(tmp_path / "out.npz") as outputs:
        assert np.isclose(outputs["probs"].sum(), 1.0, atol=1e-4)
    assert "warning" not in done.stderr


PATH_IN_TEXT = re.compile(
    r"(?:\]\(|`)((?:[\w.-]+/)*[\w.-]+\.(?:md|py|yml|yaml|toml|ini|png|js))(?=[`)\s:#,])"
)
"""A file named in a link or in backticks (`docs/service.md`, `lowering/emit.py`)."""
MARKDOWN_NAME = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.md)\b")
"""Any other mention of a Markdown file (`see DESIGN.md`)."""


def repository_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return listed.stdout.splitlines()


def test_the_docs_point_only_to_files_in_the_repository() -> None:
    """By path from the repository's root or the doc's folder, or as the tail of a path
    (`lowering/emit.py` in docs/compiler.md is compiler_core/lowering/emit.py)."""
    files = repository_files()
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        names = {m.group(1) for m in PATH_IN_TEXT.finditer(text)}
        names |= {m.group(1) for m in MARKDOWN_NAME.finditer(text)}
        for name in sorted(names):
            if (ROOT / name).exists() or (doc.parent / name).exists():
                continue
            if not any(f == name or f.endswith("/" + name) for f in files):
                missing.append(f"{doc.relative_to(ROOT)}: {name}")
    assert not missing, "\n".join(missing)
