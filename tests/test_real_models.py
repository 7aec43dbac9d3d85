"""bench/real_models.py on a small subset: models exported by torch from transformers and timm
(random weights from configs) compile in fp32 and fp16 and match ONNX Runtime.

Slow (exports and functional runs): deselected by default, `python -m pytest -m slow` runs it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench():  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import real_models

    return real_models


def test_a_transformers_encoder_and_decoder_match_onnxruntime_in_fp32_and_fp16(
    bench, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    rows = bench.run(bench.select("bert,llama"), ["fp32", "fp16"], 14, tmp_path, progress=False)
    assert [(r.name, r.precision) for r in rows] == [
        ("bert", "fp32"),
        ("bert", "fp16"),
        ("llama", "fp32"),
        ("llama", "fp16"),
    ]
    for row in rows:
        assert row.ok, (row.cells(), row.notes)
        assert row.max_err is not None and row.max_err <= bench.TOLERANCE[row.precision]


def test_timm_cnn_with_revived_batchnorms_matches_onnxruntime(bench, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    zoo = pytest.importorskip("real_model_zoo")
    try:
        zoo.import_timm()
    except (ModuleNotFoundError, RuntimeError) as exc:
        pytest.skip(str(exc))
    rows = bench.run(bench.select("timm-resnet18"), ["fp32"], 14, tmp_path, progress=False)
    assert rows[0].ok, (rows[0].cells(), rows[0].notes)


def test_revive_leaves_no_dead_batchnorm_or_layer_scale() -> None:
    torch = pytest.importorskip("torch")
    from real_model_zoo import revive

    module: Any = torch.nn.Module

    class Block(module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.norm = torch.nn.BatchNorm2d(8)
            self.gamma = torch.nn.Parameter(torch.full((8,), 1e-6))
            torch.nn.init.zeros_(self.norm.weight)  # timm's zero_init_last

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.norm(self.conv(x)) * self.gamma[:, None, None]

    block = Block().eval()
    x = torch.randn(4, 3, 8, 8)
    revive(block, lambda: block(x))
    assert float(block.norm.weight.min()) >= 0.5 and float(block.gamma.min()) >= 0.5
    assert not torch.allclose(block.norm.running_mean, torch.zeros(8))
    with torch.no_grad():
        y = block(x)
    assert 0.1 < float(y.std()) < 10.0  # normalised by the data's own statistics, not dead
