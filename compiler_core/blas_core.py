"""Give numpy's OpenBLAS its AVX-512 kernels on AMD CPUs that have AVX-512.

numpy's wheels bundle an OpenBLAS (0.3.31 with numpy 2.4.6) that takes AMD Zen 4 and Zen 5
for a Haswell and runs its AVX2 kernels: on a Zen 5, sgemm at about half the speed of its
AVX-512 (SkylakeX) kernels, and the runtime's convolutions and matrix products are sgemm
(ResNet-50 runs 1.2x faster, a BERT-base encoder 1.4x, bench/README.md). OpenBLAS reads
OPENBLAS_CORETYPE once, when numpy loads it, so the `qpcfarm` entry point decides before
anything imports numpy. Intel CPUs are left to OpenBLAS, which identifies them; a value the
user set is kept, whatever it is. Only the standard library is imported here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, MutableMapping
from pathlib import Path

VARIABLE = "OPENBLAS_CORETYPE"
SKYLAKEX = "SkylakeX"
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"})
"""What OpenBLAS's SkylakeX kernels execute (and what it checks itself for that family)."""
CPUINFO = Path("/proc/cpuinfo")


def core_for(vendor: str, flags: Iterable[str]) -> str | None:
    """The OpenBLAS kernel family to force on this CPU, or None to keep OpenBLAS's choice."""
    if vendor == "AuthenticAMD" and AVX512_FLAGS <= set(flags):
        return SKYLAKEX
    return None


def first_cpu(cpuinfo: str) -> tuple[str, frozenset[str]]:
    """The vendor and flags of the first processor listed in /proc/cpuinfo's text."""
    vendor, flags = "", frozenset[str]()
    for line in cpuinfo.splitlines():
        if not line.strip():
            if vendor or flags:
                break  # the end of the first processor's block
            continue
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "vendor_id":
            vendor = value.strip()
        elif key == "flags":
            flags = frozenset(value.split())
    return vendor, flags


def choose(environ: MutableMapping[str, str], cpuinfo: str) -> str | None:
    """Set OPENBLAS_CORETYPE in `environ` if it is unset and the CPU calls for it; returns
    the value set (None: `environ` is unchanged)."""
    if VARIABLE in environ:
        return None
    core = core_for(*first_cpu(cpuinfo))
    if core is not None:
        environ[VARIABLE] = core
    return core


def set_openblas_core() -> str | None:
    """The entry point's call: `choose` for this process (and the processes it starts), as
    long as numpy is not loaded yet (after that the variable would change nothing here)."""
    if "numpy" in sys.modules or VARIABLE in os.environ:
        return None
    try:
        with CPUINFO.open() as f:
            head = f.read(16384)  # the first processor's block, not every core's
    except OSError:
        return None
    return choose(os.environ, head)
