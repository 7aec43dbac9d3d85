"""The oracle switch of tests/ort_int8.py: read from the CPU's flags, and true to what ONNX
Runtime computes here (its fused uint8 x int8 product clips pair sums at int16 exactly when
the switch says so)."""

from __future__ import annotations

import numpy as np
import onnx.helper as oh

from compiler_core.blas_core import first_cpu
from tests.op_checks import one_node_model, run_onnxruntime, run_reference
from tests.ort_int8 import ort_int8_saturates


def test_the_switch_reads_the_first_processors_flags():
    text = "processor\t: 0\nflags\t\t: fpu avx2 avx512_vnni\n\nprocessor\t: 1\nflags\t: fpu\n"
    assert first_cpu(text)[1] == {"fpu", "avx2", "avx512_vnni"}
    assert first_cpu("processor\t: 0\n")[1] == set()


def test_ort_clips_pair_sums_exactly_where_the_switch_says():
    # Two channels' products of 255 x 127 add to 64,770: past int16 (ORT pairs adjacent
    # channels), so a saturating kernel gives less.
    x = np.full((1, 2, 1, 1), 255, np.uint8)
    w = np.full((1, 2, 1, 1), 127, np.int8)
    feeds = {
        "x": x,
        "x_scale": np.array(1.0, np.float32),
        "x_zp": np.array(0, np.uint8),
        "w": w,
        "w_scale": np.array(1.0, np.float32),
        "w_zp": np.array(0, np.int8),
        "y_scale": np.array(256.0, np.float32),
        "y_zp": np.array(0, np.uint8),
    }
    node = oh.make_node("QLinearConv", list(feeds), ["y"])
    model = one_node_model(node, feeds, {"y": (np.uint8, (1, 1, 1, 1))}, opset=10)
    (exact,) = run_reference(model, feeds)
    (ort,) = run_onnxruntime(model, feeds)
    assert int(exact.item()) == round(64770 / 256)
    assert (int(ort.item()) < int(exact.item())) == ort_int8_saturates()
