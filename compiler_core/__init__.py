"""qpcfarm's compiler: ONNX in, QPC out, and a functional runtime that runs what it emits."""

from typing import TYPE_CHECKING

from compiler_core.lazy_imports import defer_heavy_imports

defer_heavy_imports()  # before anything imports onnx_ir

from compiler_core.errors import CompileError  # noqa: E402
from compiler_core.options import CompileOptions  # noqa: E402

if TYPE_CHECKING:  # what the lazy attributes below are, for type checkers
    from compiler_core.compile import compile_model
    from compiler_core.qpc.container import load_qpc
    from compiler_core.qpc.validate import validate_qpc
    from compiler_core.runtime import QpcSession, run_qpc

__all__ = [
    "CompileError",
    "CompileOptions",
    "QpcSession",
    "compile_model",
    "load_qpc",
    "run_qpc",
    "validate_qpc",
]


def __getattr__(name: str) -> object:
    # Heavy modules load on first use, so `import compiler_core` (the CLI's start) stays fast.
    if name == "compile_model":
        from compiler_core.compile import compile_model

        return compile_model
    if name == "run_qpc":
        from compiler_core.runtime import run_qpc

        return run_qpc
    if name == "QpcSession":
        from compiler_core.runtime import QpcSession

        return QpcSession
    if name == "load_qpc":
        from compiler_core.qpc.container import load_qpc

        return load_qpc
    if name == "validate_qpc":
        from compiler_core.qpc.validate import validate_qpc

        return validate_qpc
    raise AttributeError(name)
