"""Early layers of an int8 ResNet at batch 1 are cut by rows and columns on every core
(issue 21): a large map with little weight is computed where its rows already are, each core
reading its own rows plus the halo rows its window needs from its neighbours, instead of
cutting the output channels and sending every core the whole input. The split chooser prices
the cuts that keep every output channel on a core beside the fastest ones by compute alone
(`splits.WHOLE`), and the program it picks runs on the functional runtime with ONNX Runtime's
int8 outputs."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import QuantType

from compiler_core import compile_model
from compiler_core.lowering import splits
from compiler_core.lowering.program import Program, RunKernel
from compiler_core.ops.registry import Box
from compiler_core.runtime import run_qpc
from tests.codegen_models import bench_models
from tests.ort_int8 import ort_int8_saturates
from tests.quant_models import calibration, ort_qdq, output_scales, run_ort

CORES = 16
STEPS = 4


@cache
def _qdq_resnet() -> onnx.ModelProto:
    """ONNX Runtime's quantize_static QDQ form (symmetric int8, per channel) of a two-stage
    bottleneck ResNet on a 112x112 image: 56x56 after the stem, 28x28 after the pool."""
    models, _ = bench_models()
    spec = models.ResNetSpec(blocks=(1, 1), width=32, image=112, classes=10)
    model = models.resnet(spec)
    return ort_qdq(
        model,
        calibration(model, 2),
        per_channel=True,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
    )


def _tiles(program: Program, kernel: int) -> list[tuple[int, Box]]:
    """(core, output box) of each tile the program runs of `kernel`."""
    return [
        (core, i.out_box)
        for core, stream in enumerate(program.streams)
        for i in stream
        if isinstance(i, RunKernel) and i.kernel == kernel
    ]


def test_large_maps_are_cut_by_rows_on_every_core_and_match_ort_int8() -> None:
    qdq = _qdq_resnet()
    result = compile_model(qdq, [f"-aic-num-cores={CORES}"])
    try:
        convs = [k for k in result.program.kernels if k.info.op_type == "QConv"]
        large = [k for k in convs if k.info.out_shapes[0][2] >= 28]
        assert len(large) >= 4, [k.info.out_shapes[0] for k in convs]
        for k in large:
            tiles = _tiles(result.program, k.id)
            channels = k.info.out_shapes[0][1]
            assert all(box[1] == (0, channels) for _, box in tiles), (k.name, tiles)
            assert len({core for core, _ in tiles}) == CORES, (k.name, tiles)
        # integer arithmetic: the cut changes where a value is computed, never its bits
        one = compile_model(qdq, ["-aic-num-cores=1"])
        scales = output_scales(qdq)
        try:
            for feeds in calibration(qdq, 2, seed=9):
                ours = run_qpc(result.qpc_path, feeds)
                alone = run_qpc(one.qpc_path, feeds)
                theirs = run_ort(qdq, feeds, optimize=not ort_int8_saturates())
                for (name, y), ref in zip(ours.items(), theirs, strict=True):
                    np.testing.assert_array_equal(y, alone[name])
                    # ORT rounds some requantizations differently (one step each); over the
                    # network's layers they add up to 3 steps of the output at most (measured)
                    diff = float(np.abs(y - ref).max())
                    assert diff <= STEPS * scales[name] * (1 + 1e-5), (name, diff, scales[name])
        finally:
            one.cleanup()
    finally:
        result.cleanup()


def test_pricing_the_row_cuts_makes_the_program_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the cuts that keep channels whole among those priced in full, the same model
    on the same cores is estimated slower: the row cuts win on transfers, which compute alone
    (the first ranking) cannot see."""
    qdq = _qdq_resnet()
    estimates = []
    for whole in (splits.WHOLE, 0):
        monkeypatch.setattr(splits, "WHOLE", whole)
        result = compile_model(qdq, [f"-aic-num-cores={CORES}"])
        estimates.append(result.metrics["estimated_device_latency_us"])
        result.cleanup()
    with_rows, without = estimates
    assert with_rows < 0.8 * without, estimates


def test_a_stem_reading_int8_input_from_ddr_keeps_its_channels_on_every_core(
    tmp_path: Path,
) -> None:
    """With int8 codes as the graph input (custom IO), the stem conv reads the same bytes
    from DDR and computes as long under a row cut as under a channel cut: the tie goes to the
    row cut, which the pool and the convs after it read in place, and the program is no
    slower than the one with a float input (whose first kernel quantizes it)."""
    models, _ = bench_models()
    model = models.resnet(models.ResNetSpec(blocks=(1,), width=64, image=224, classes=10))
    qdq = ort_qdq(
        model,
        calibration(model, 2),
        per_channel=True,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
    )
    path = tmp_path / "qdq.onnx"
    onnx.save(qdq, path)
    listing = tmp_path / "io.yaml"
    boundary = [qdq.graph.input[0].name, qdq.graph.output[0].name]
    listing.write_text("".join(f"- IOName: {n}\n  Precision: int8\n" for n in boundary))
    estimates = []
    for extra in ([f"-custom-IO-list-file={listing}"], []):
        result = compile_model(path, [f"-aic-num-cores={CORES}", *extra])
        try:
            stem = next(k for k in result.program.kernels if k.info.op_type == "QConv")
            tiles = _tiles(result.program, stem.id)
            channels = stem.info.out_shapes[0][1]
            assert all(box[1] == (0, channels) for _, box in tiles), tiles
            assert len({core for core, _ in tiles}) == CORES, tiles
            estimates.append(result.metrics["estimated_device_latency_us"])
        finally:
            result.cleanup()
    integer_io, float_io = estimates
    assert integer_io <= float_io, estimates
