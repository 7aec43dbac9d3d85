"""Writes `index.py`, the op registry's map from op type to the modules that register it.

The registry entries stay the one source of truth: the map is read off them, by importing
every op module of this package in a fresh interpreter and noting which module's top-level
code made each registration. Run after adding, removing or moving an op:

    python -m compiler_core.ops.index_builder           # rewrite compiler_core/ops/index.py
    python -m compiler_core.ops.index_builder --check   # exit 1 if it is stale (a test runs this)
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from pathlib import Path
from types import FrameType

from compiler_core.ops import registry

NOT_OP_MODULES = frozenset({"registry", "index", "index_builder"})
INDEX_FILE = Path(__file__).with_name("index.py")

Index = dict[registry.OpKey, tuple[str, ...]]

HEADER = '''"""Which op module registers each op type, so the registry can name every op without
importing a kernel and import a kernel's module when a graph uses the op.

Generated from the registrations by `python -m compiler_core.ops.index_builder`; do not edit.
Keys are (domain, op type); values the modules of `compiler_core.ops` that register versions
of the op, in registration order.
"""

OP_MODULES: dict[tuple[str, str], tuple[str, ...]] = {
'''


def op_modules() -> Index:
    """Import every op module and return which module registered each op. Needs a fresh
    interpreter: the registrations of an op module imported before are not seen again."""
    package = __package__ or "compiler_core.ops"
    names = _module_names()
    already = [n for n in names if f"{package}.{n}" in sys.modules]
    if already:
        raise RuntimeError(f"op modules imported already ({', '.join(already)}): run me alone")
    owners: dict[registry.OpKey, list[str]] = {}
    add = registry.REGISTRY.add

    def recording_add(opdef: registry.OpDef) -> registry.OpDef:
        module = _registering_module(sys._getframe(1))
        if module.rpartition(".")[0] != package:
            raise RuntimeError(f"{opdef.op_type} is registered from {module}, not an op module")
        owners.setdefault((opdef.domain, opdef.op_type), []).append(module.rpartition(".")[2])
        return add(opdef)

    registry.REGISTRY.add = recording_add  # type: ignore[method-assign]
    try:
        for name in names:
            importlib.import_module(f"{package}.{name}")
    finally:
        del registry.REGISTRY.add
    return {key: tuple(dict.fromkeys(modules)) for key, modules in sorted(owners.items())}


def _module_names() -> list[str]:
    return sorted(
        info.name
        for info in pkgutil.iter_modules([str(Path(__file__).parent)])
        if info.name not in NOT_OP_MODULES
    )


def _registering_module(frame: FrameType | None) -> str:
    """The module whose top-level code is running the registration (the nearest module frame:
    a helper such as `register_unary` called from `activation` counts as `activation`)."""
    while frame is not None and frame.f_code.co_name != "<module>":
        frame = frame.f_back
    return "?" if frame is None else str(frame.f_globals.get("__name__", "?"))


def render(index: Index) -> str:
    """The text of index.py (formatted as `ruff format` leaves it)."""
    rows = []
    for (domain, op_type), modules in index.items():
        value = ", ".join(json.dumps(m) for m in modules) + ("," if len(modules) == 1 else "")
        rows.append(f"    ({json.dumps(domain)}, {json.dumps(op_type)}): ({value}),\n")
    return HEADER + "".join(rows) + "}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if index.py is stale")
    args = parser.parse_args(argv)
    text = render(op_modules())
    if args.check:
        current = INDEX_FILE.read_text() if INDEX_FILE.exists() else ""
        if current != text:
            print(
                f"{INDEX_FILE} is stale: run `python -m compiler_core.ops.index_builder`",
                file=sys.stderr,
            )
            return 1
        return 0
    INDEX_FILE.write_text(text)
    print(f"wrote {INDEX_FILE}: {text.count(chr(10)) - HEADER.count(chr(10)) - 1} op types")
    return 0


if __name__ == "__main__":
    sys.exit(main())
