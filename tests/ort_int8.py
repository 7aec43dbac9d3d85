"""Whether ONNX Runtime's int8 kernels compute the ONNX arithmetic on this CPU.

On x86 without VNNI, ORT multiplies uint8 by int8 (and int8 by int8, after shifting one side)
with VPMADDUBSW, which adds each pair of products into an int16 and saturates: two products
past 32,767 together are clipped (ORT's quantization guide says so and suggests 7-bit weights
for such CPUs). There ORT's fused int8 output is not exact int8 arithmetic and cannot be the
oracle for ours, which is; the tests then take the ONNX arithmetic from ORT running the QDQ
graph unfused (float between DequantizeLinear and QuantizeLinear) or from `onnx.reference`
for a QLinear op. With VNNI (VPDPBUSD adds into int32) ORT's fused kernels are the oracle.
"""

from __future__ import annotations

import platform
from functools import cache

from compiler_core.blas_core import CPUINFO, first_cpu

_X86 = {"x86_64", "amd64", "i386", "i686", "x86"}
_VNNI = {"avx512_vnni", "avx_vnni"}


@cache
def ort_int8_saturates() -> bool:
    """True where ORT's x86 int8 GEMMs use the saturating int16 pair sums (no VNNI), and
    where the CPU cannot be read (the unfused oracle is right everywhere, only slower)."""
    if platform.machine().lower() not in _X86:
        return False
    try:
        _, flags = first_cpu(CPUINFO.read_text())
    except OSError:
        return True
    return not flags & _VNNI
