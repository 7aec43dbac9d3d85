"""Refactoring guard: the benchmark networks compile to the same program bytes as recorded.

`tests/byte_identity_programs.json` holds, per configuration, the sha256 of every QPC segment
that the compiler's code generation decides: the programs, their stats descriptors, the
constants and the constants descriptor. The network descriptor is left out (it records the
compiler version and every option's value, which change when an option is added) and so are
the CRC segments (derived from the segments hashed).

A moving, splitting or renaming change must leave every digest as it is. A change that means
to alter programs (a better schedule, a new kernel) regenerates the file and says so in its
commit message:

    python -m tests.test_byte_identity --write

The models are the benchmark's own builders (bench/models.py, bench/transformer_models.py) at
small sizes, the code generation tests' models (tests/codegen_models.py) and the quantization
tests' (tests/quant_models.py); the full-size benchmark networks run under `-m slow`.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest

from compiler_core import compile_model
from compiler_core.qpc.container import load_qpc
from tests.codegen_models import bench_models, conv_net, mlp

DIGESTS = Path(__file__).with_name("byte_identity_programs.json")
UNHASHED = ("networkdesc.bin",)
"""Segments outside code generation: the options and the compiler version."""

Model = Callable[[Path], tuple[Path, list[str]]]
"""Writes the model into a work folder; returns its path and the flags it needs there."""


@dataclass(frozen=True)
class Case:
    name: str
    model: Model
    flags: tuple[str, ...]
    slow: bool = False


def _saved(name: str, build: Callable[[], onnx.ModelProto]) -> Model:
    def write(work: Path) -> tuple[Path, list[str]]:
        path = work / f"{name}.onnx"
        if not path.exists():
            onnx.save(build(), path)
        return path, []

    return write


def _resnet(spec_name: str) -> Model:
    def write(work: Path) -> tuple[Path, list[str]]:
        models, _ = bench_models()
        return models.write_resnet(getattr(models, spec_name), work), []

    return write


def _encoder(**spec: int) -> Model:
    def write(work: Path) -> tuple[Path, list[str]]:
        _, transformers = bench_models()
        return transformers.write_encoder(transformers.EncoderSpec(**spec), work), []

    return write


def _decoder(**spec: int) -> Model:
    def write(work: Path) -> tuple[Path, list[str]]:
        _, transformers = bench_models()
        return transformers.write_decoder(transformers.DecoderSpec(**spec), work), []

    return write


def _calibrated_cnn(work: Path) -> tuple[Path, list[str]]:
    """The quantization tests' CNN quantized to int8 from a profile of its calibration set.

    The profile is collected once, then its ranges are rounded outward to three significant
    digits before the digested compile loads it: the float model's outputs differ in the last
    bits between machines (BLAS kernels chosen per CPU), and those bits would reach the scales.
    The digest guards the program built from a profile, not the CPU's arithmetic.
    """
    from compiler_core.quant.profile import read_profile, write_profile
    from tests.quant_models import calibration, cnn

    path = work / "quant-cnn.onnx"
    onnx.save(cnn(), path)
    samples = calibration(cnn(), 6)
    np.savez(work / "quant-cnn-calib.npz", x=np.stack([s["x"] for s in samples]))
    calib, profile = work / "quant-cnn-calib.npz", work / "quant-cnn-profile.json"
    collected = compile_model(
        path, [f"-input-list-file={calib}", f"-dump-profile={profile}", "-aic-num-cores=1"]
    )
    collected.cleanup()
    stats = read_profile(profile)
    for t in stats.tensors.values():
        t.min, t.hist_min = _round_out(t.min, math.floor), _round_out(t.hist_min, math.floor)
        t.max, t.hist_max = _round_out(t.max, math.ceil), _round_out(t.hist_max, math.ceil)
    write_profile(stats, profile)
    return path, [f"-load-profile={profile}"]


def _round_out(value: float, direction: Callable[[float], int]) -> float:
    """`value` to three significant digits, rounded in `direction` (floor or ceil)."""
    if value == 0.0:
        return 0.0
    step = 10.0 ** (math.floor(math.log10(abs(value))) - 2)
    return float(direction(value / step) * step)


def _qdq_cnn() -> onnx.ModelProto:
    """The CNN as ONNX Runtime's static quantizer writes it (QDQ pairs for fold_qdq)."""
    from tests.quant_models import calibration, cnn, ort_qdq

    return ort_qdq(cnn(), calibration(cnn(), 4))


SMALL_ENCODER = {"layers": 2, "hidden": 128, "heads": 4, "ffn": 512, "seq": 32}
SMALL_DECODER = {"layers": 2, "hidden": 128, "heads": 4, "ffn": 512, "vocab": 1024, "ctx": 64}
MID_DECODER = {"layers": 4, "hidden": 1024, "heads": 8, "ffn": 4096, "vocab": 8192, "ctx": 512}

CASES = (
    Case("conv-net-1core", _saved("conv-net", conv_net), ("-aic-num-cores=1",)),
    Case(
        "conv-net-fp16-4cores-standard",
        _saved("conv-net", conv_net),
        ("-convert-to-fp16", "-aic-num-cores=4", "-aic-device=aic100-standard"),
    ),
    Case(
        "mlp-batch-4cores-aic080",
        _saved("mlp-batch", lambda: mlp(batch=4)),
        ("-aic-num-cores=4", "-aic-device=aic080"),
    ),
    Case(
        "resnet-quick-fp16-depth-first-4cores",
        _resnet("RESNET_QUICK"),
        ("-convert-to-fp16", "-batchsize=2", "-aic-enable-depth-first", "-aic-num-cores=4"),
    ),
    Case(
        "resnet-quick-fp16-14cores",
        _resnet("RESNET_QUICK"),
        ("-convert-to-fp16", "-batchsize=1", "-aic-num-cores=14", "-aic-device=aic100-standard"),
    ),
    Case(
        "encoder-small-fp16-4cores-aic200",
        _encoder(**SMALL_ENCODER),
        (
            "-convert-to-fp16",
            "-onnx-define-symbol=batch,1",
            "-aic-num-cores=4",
            "-aic-device=aic200",
        ),
    ),
    Case(
        "decoder-small-retained-mxfp6-4cores",
        _decoder(**SMALL_DECODER, seq=1),
        ("-retained-state", "-mxfp6-matmul", "-onnx-define-symbol=batch,1", "-aic-num-cores=4"),
    ),
    Case(
        "decoder-small-prefill-mxint8-kv-2cores",
        _decoder(**SMALL_DECODER, seq=8),
        ("-retained-state", "-mxint8-kv-cache", "-onnx-define-symbol=batch,1", "-aic-num-cores=2"),
    ),
    Case("quant-cnn-calibrated-int8", _calibrated_cnn, ("-aic-num-cores=2",)),
    Case("qdq-cnn-int8", _saved("qdq-cnn", _qdq_cnn), ("-aic-num-cores=1",)),
    Case(
        "resnet50-fp16-1core",
        _resnet("RESNET50"),
        ("-convert-to-fp16", "-batchsize=1", "-aic-num-cores=1", "-aic-device=aic100-standard"),
    ),
    Case(
        "resnet50-fp16-14cores",
        _resnet("RESNET50"),
        ("-convert-to-fp16", "-batchsize=1", "-aic-num-cores=14", "-aic-device=aic100-standard"),
    ),
    Case(
        "resnet50-fp16-depth-first-batch8-14cores",
        _resnet("RESNET50"),
        ("-convert-to-fp16", "-batchsize=8", "-aic-enable-depth-first", "-aic-num-cores=14"),
        slow=True,
    ),
    Case(
        "bert-base-fp16-14cores",
        _encoder(),
        ("-convert-to-fp16", "-onnx-define-symbol=batch,1", "-aic-num-cores=14"),
        slow=True,
    ),
    Case(
        "bert-large-fp16-14cores",
        _encoder(layers=24, hidden=1024, heads=16, ffn=4096, seq=384),
        ("-convert-to-fp16", "-onnx-define-symbol=batch,1", "-aic-num-cores=14"),
        slow=True,
    ),
    Case(
        "decoder-mid-decode-4cores",
        _decoder(**MID_DECODER, seq=1),
        ("-retained-state", "-onnx-define-symbol=batch,1", "-aic-num-cores=4"),
        slow=True,
    ),
    Case(
        "decoder-mid-prefill-16cores",
        _decoder(**MID_DECODER, seq=64),
        ("-retained-state", "-onnx-define-symbol=batch,1", "-aic-num-cores=16"),
        slow=True,
    ),
)


def program_digests(case: Case, work: Path) -> dict[str, str]:
    """sha256 of each code-generated segment of the QPC the case compiles to."""
    path, extra = case.model(work)
    result = compile_model(path, [*extra, *case.flags])
    try:
        with load_qpc(result.qpc_path) as qpc:
            return {
                name: hashlib.sha256(view).hexdigest()
                for name, view in sorted(qpc.segments.items())
                if name not in UNHASHED
                and not name.endswith(".crc")
                and not any(name.startswith(f"{u}.") for u in UNHASHED)
            }
    finally:
        result.cleanup()


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("byte-identity")


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in CASES],
)
def test_program_bytes_are_the_recorded_ones(case: Case, work: Path) -> None:
    recorded = json.loads(DIGESTS.read_text())
    assert case.name in recorded, (
        f"no digests for {case.name}: python -m tests.test_byte_identity --write"
    )
    assert program_digests(case, work) == recorded[case.name]


def test_every_case_is_recorded_and_every_record_is_a_case() -> None:
    assert set(json.loads(DIGESTS.read_text())) == {c.name for c in CASES}


def _write(names: set[str] | None = None) -> None:
    recorded = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            if names is None or case.name in names:
                recorded[case.name] = program_digests(case, Path(tmp))
                print(case.name, flush=True)
    ordered = {c.name: recorded[c.name] for c in CASES if c.name in recorded}
    DIGESTS.write_text(json.dumps(ordered, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--write"]:
        sys.exit("usage: python -m tests.test_byte_identity --write [case ...]")
    _write(set(sys.argv[2:]) or None)
