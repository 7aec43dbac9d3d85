"""Every compiler_core module imports on its own, first, in a fresh interpreter: no import
cycle depends on which module a program happens to load first (the CLI, the worker and the
service each start from a different one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in (ROOT / "compiler_core").rglob("*.py")
    if path.name != "__init__.py"
)


def test_each_compiler_module_imports_first_in_a_fresh_interpreter() -> None:
    # One interpreter per module, run in parallel batches to keep this quick.
    script = "import importlib, sys; importlib.import_module(sys.argv[1])"
    failures = []
    for start in range(0, len(MODULES), 8):
        batch = MODULES[start : start + 8]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script, name],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name in batch
        ]
        for name, proc in zip(batch, procs, strict=True):
            _, err = proc.communicate(timeout=120)
            if proc.returncode:
                failures.append(f"{name}: {err.strip().splitlines()[-1]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", ["app.domain.services.models", "worker.tasks"])
def test_service_entry_modules_import_first(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
