"""The op registry names every op without importing a kernel, and imports an op's module when
the op is first looked up. `compiler_core/ops/index.py` (op -> module) is generated from the
registrations; these tests fail when it drifts from them. Each check runs in a fresh
interpreter, since this one has imported op modules already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from compiler_core.ops import REGISTRY
from compiler_core.ops.index import OP_MODULES

ROOT = Path(__file__).resolve().parents[1]
NOT_OPS = {"compiler_core.ops.registry", "compiler_core.ops.index", "compiler_core.ops._tiling"}


def _fresh(code: str) -> object:
    """Run `code` in a fresh interpreter; it leaves its answer in `result` (JSON)."""
    script = f"import json, sys\n{code}\nprint(json.dumps(result))\n"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


OP_MODULES_LOADED = (
    "sorted(m.rpartition('.')[2] for m in sys.modules "
    f"if m.startswith('compiler_core.ops.') and m not in {sorted(NOT_OPS)!r})"
)


def test_the_index_is_what_the_op_modules_register() -> None:
    check = subprocess.run(
        [sys.executable, "-m", "compiler_core.ops.index_builder", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr


def test_listing_every_op_loads_every_module_of_the_index() -> None:
    assert {(d.domain, d.op_type) for d in REGISTRY.all()} == set(OP_MODULES)


def test_importing_the_compiler_imports_no_op_module() -> None:
    loaded = _fresh(
        f"import compiler_core.compile, compiler_core.cli\nresult = {OP_MODULES_LOADED}"
    )
    assert loaded == []


def test_looking_up_an_op_imports_its_module_and_not_the_others() -> None:
    loaded = _fresh(
        "from compiler_core.ops import REGISTRY\n"
        "assert REGISTRY.lookup('Relu', '', 17).op_type == 'Relu'\n"
        f"result = {OP_MODULES_LOADED}"
    )
    assert "activation" in loaded
    assert "control_flow" not in loaded and "conv" not in loaded


def test_op_names_come_from_the_index_without_importing_kernels() -> None:
    names = _fresh(
        "from compiler_core.ops import REGISTRY\n"
        "names = sorted(REGISTRY.op_types())\n"
        f"result = [names, {OP_MODULES_LOADED}]"
    )
    assert isinstance(names, list)
    assert names[0] == sorted({d.op_type for d in REGISTRY.all()})
    assert names[1] == []


def test_unknown_ops_are_not_found_and_import_nothing() -> None:
    result = _fresh(
        "from compiler_core.ops import REGISTRY\n"
        "found = REGISTRY.lookup('NoSuchOp', '', 17), REGISTRY.versions('NoSuchOp', 'x.y')\n"
        f"result = [found[0] is None, found[1], {OP_MODULES_LOADED}]"
    )
    assert result == [True, [], []]


def test_concurrent_first_lookups_all_find_their_ops() -> None:
    # Threads that ask for ops of the same and of dependent modules at once (QConv's module
    # imports Conv's) each get the op's entry, never a half-registered module's miss.
    ops = ["Conv", "QConv", "MaxPool", "MatMul", "QMatMul", "Relu", "Add", "Softmax"] * 4
    found = _fresh(
        "import threading\n"
        "from compiler_core.ops import REGISTRY\n"
        f"ops = {ops!r}\n"
        "barrier = threading.Barrier(len(ops))\n"
        "result = [None] * len(ops)\n"
        "def look(i):\n"
        "    barrier.wait()\n"
        "    domain = 'com.qpcfarm' if ops[i].startswith('Q') else ''\n"
        "    opdef = REGISTRY.lookup(ops[i], domain)\n"
        "    result[i] = None if opdef is None else opdef.op_type\n"
        "threads = [threading.Thread(target=look, args=(i,)) for i in range(len(ops))]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]"
    )
    assert found == ops
