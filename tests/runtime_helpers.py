"""What the runtime's tests share: a model compiled and its program and constants read back
from the QPC, as a session would load them."""

from __future__ import annotations

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
