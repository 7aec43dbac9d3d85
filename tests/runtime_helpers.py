"""What the runtime's tests share: a model compiled and its program and constants read back
from the QPC, as a session would load them."""

from __future__ import annotations

import numpy as np
import onnx

from compiler_core import compile_model
from compiler_core.lowering.placement import CodegenPolicy
from compiler_core.lowering.program import Program
from compiler_core.qpc.container import load_qpc


def compiled_program(
    model: onnx.ModelProto, *flags: str, policy: CodegenPolicy | None = None
) -> tuple[Program, bytes]:
    """The program and constants of `model` compiled with `flags` (and `policy`; the QPC
    is removed)."""
    result = compile_model(model, list(flags), policy=policy)
    try:
        with load_qpc(result.qpc_path) as qpc:
            return qpc.program(), bytes(qpc.segments["constants.bin"])
    finally:
        result.cleanup()


def blas_splits_exactly(rows: int, inner: int, cols: int, *, bands: int, by_rows: bool) -> bool:
    """Whether this process's BLAS gives each of `bands` row bands (or column blocks) of a
    float32 product `rows x inner @ inner x cols` the bits of the whole product's part. The
    runtime's shared and joined products are taken only when it does (each is checked bit
    for bit once): OpenBLAS's SkylakeX kernels do, its Haswell kernels do not."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((rows, inner)).astype(np.float32)
    b = rng.standard_normal((inner, cols)).astype(np.float32)
    whole = a @ b
    size = rows if by_rows else cols
    step = -(-size // bands)
    for lo in range(0, size, step):
        hi = min(lo + step, size)
        part = a[lo:hi] @ b if by_rows else a @ b[:, lo:hi]
        want = whole[lo:hi] if by_rows else whole[:, lo:hi]
        if not np.array_equal(part.view(np.uint32), np.ascontiguousarray(want).view(np.uint32)):
            return False
    return True
