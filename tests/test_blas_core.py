"""The entry point gives numpy's OpenBLAS its AVX-512 (SkylakeX) kernels on AMD CPUs with
AVX-512, which that OpenBLAS takes for a Haswell; other CPUs and a user's own setting are left
alone. Detection is checked on sample /proc/cpuinfo text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compiler_core.blas_core import SKYLAKEX, choose, core_for, first_cpu

ROOT = Path(__file__).resolve().parents[1]

COMMON = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
    "sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl "
    "pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand "
    "hypervisor lahf_lm abm sse4a bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt "
    "clwb sha_ni xsaveopt xsavec xgetbv1 xsaves"
)
AVX512 = (
    "avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi "
    "avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq"
)
ZEN5 = ("AuthenticAMD", "AMD EPYC 9555 64-Core Processor", f"{COMMON} {AVX512} vaes")
ZEN3 = ("AuthenticAMD", "AMD EPYC 7763 64-Core Processor", f"{COMMON} vaes vpclmulqdq")
SAPPHIRE_RAPIDS = ("GenuineIntel", "Intel(R) Xeon(R) Platinum 8480+", f"{COMMON} {AVX512}")


def cpuinfo(vendor: str, model: str, flags: str, processors: int = 2) -> str:
    block = (
        "processor\t: {n}\n"
        f"vendor_id\t: {vendor}\n"
        "cpu family\t: 26\n"
        f"model name\t: {model}\n"
        f"flags\t\t: {flags}\n"
        "bogomips\t: 6000.00\n"
    )
    return "\n".join(block.format(n=n) for n in range(processors))


def test_an_amd_cpu_with_avx512_gets_the_skylakex_kernels() -> None:
    assert core_for(*first_cpu(cpuinfo(*ZEN5))) == SKYLAKEX


def test_an_amd_cpu_without_avx512_keeps_openblas_choice() -> None:
    assert core_for(*first_cpu(cpuinfo(*ZEN3))) is None


def test_an_intel_cpu_with_avx512_keeps_openblas_choice() -> None:
    assert core_for(*first_cpu(cpuinfo(*SAPPHIRE_RAPIDS))) is None


@pytest.mark.parametrize("missing", ["avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"])
def test_every_one_of_the_five_avx512_subsets_is_required(missing: str) -> None:
    vendor, _, flags = ZEN5
    assert core_for(vendor, set(flags.split()) - {missing}) is None


def test_the_first_processor_block_is_read() -> None:
    vendor, flags = first_cpu(cpuinfo(*ZEN5, processors=3))
    assert vendor == "AuthenticAMD"
    assert {"avx512f", "avx2", "vaes"} <= flags


def test_choose_sets_the_variable_only_when_unset() -> None:
    environ: dict[str, str] = {}
    assert choose(environ, cpuinfo(*ZEN5)) == SKYLAKEX
    assert environ == {"OPENBLAS_CORETYPE": SKYLAKEX}
    mine = {"OPENBLAS_CORETYPE": "Haswell"}
    assert choose(mine, cpuinfo(*ZEN5)) is None
    assert mine == {"OPENBLAS_CORETYPE": "Haswell"}
    nothing: dict[str, str] = {}
    assert choose(nothing, cpuinfo(*ZEN3)) is None
    assert nothing == {}


def test_the_qpcfarm_entry_point_decides_before_numpy_loads() -> None:
    # In a fresh interpreter, without the variable: after the console script's `main` the
    # variable is what this machine's /proc/cpuinfo calls for, and numpy is loaded after it.
    script = (
        "import contextlib, io, json, os, sys\n"
        "from app.console.cli import main\n"
        "numpy_before = 'numpy' in sys.modules\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--help'])\n"
        "print(json.dumps([numpy_before, os.environ.get('OPENBLAS_CORETYPE')]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    numpy_before, value = json.loads(out.stdout.strip().splitlines()[-1])
    try:
        expected = core_for(*first_cpu(Path("/proc/cpuinfo").read_text()))
    except OSError:
        expected = None
    assert numpy_before is False
    assert value == expected
