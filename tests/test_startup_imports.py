"""What the CLI's start-up imports: `qpcfarm --help` and `compile -h` load neither numpy, onnx,
onnx_ir, sympy nor ml_dtypes nor the service's web stack, and a compile loads sympy only if it
is used (the op modules a compile loads are in test_op_index.py).
Behavioural checks on sys.modules in a fresh interpreter, not timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ["sympy", "ml_dtypes", "onnx_ir", "onnx", "numpy", "fastapi", "sqlalchemy", "celery"]


def _loaded_after(code: str) -> dict[str, bool]:
    """Run `code` in a fresh interpreter; which HEAVY modules are then really imported."""
    script = (
        "import json, sys, contextlib, io\n"
        "quiet = io.StringIO()\n"
        "with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):\n"
        f"    {code}\n"
        "from compiler_core.lazy_imports import loaded\n"
        f"print(json.dumps({{name: loaded(name) for name in {HEAVY!r}}}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["compile", "-h"]])
def test_cli_help_imports_no_heavy_module(argv: list[str]) -> None:
    code = (
        f"import app.console.cli\n    try: app.console.cli.main({argv!r})\n"
        "    except SystemExit: pass"
    )
    loaded = _loaded_after(code)
    assert not any(loaded.values()), {name for name, yes in loaded.items() if yes}


def test_compiler_import_defers_sympy_until_a_symbolic_dim_needs_it() -> None:
    loaded = _loaded_after("import compiler_core.compile")
    assert loaded["onnx_ir"] and not loaded["sympy"]
    used = _loaded_after(
        "import compiler_core.compile, onnx_ir as ir\n"
        "    assert str(ir.SymbolicDim('N') * 2) == '2*N'"
    )
    assert used["sympy"]
