"""Device profiles: the numbers the compiler, cost model and validator target.

Every figure here is *modelled*: taken from Qualcomm's public product briefs where one exists
(cores, DDR size and bandwidth, peak TFLOPS, VTCM/L2 per core, HMX/HVX rates, PCI ids) and
chosen by us where none does (AIC080's core count and clock, everything about AIC200). The
clock is not published; it is derived from the published fp16 peak as
`TFLOPS / (cores x HMX fp16 MACs per cycle x 2 flops per MAC)`. (The published int8 TOPS imply
a higher int8 rate than 2x fp16 at that clock; we keep the fp16-derived clock and the 8192
int8 MACs per cycle, so int8 peaks are estimates.) Reports label anything derived from these
numbers as "estimated".
"""

from __future__ import annotations

from dataclasses import dataclass

from compiler_core.errors import CompileError

GIB = 1 << 30
MIB = 1 << 20

VTCM_USABLE_BYTES = 8_323_072
"""Of the 8 MiB VTCM per core, what the vendor compiler reports as usable."""

HMX_FP16_MACS = 4096
HMX_INT8_MACS = 8192

AI100_DTYPES = frozenset(
    {"float32", "float16", "int8", "uint8", "int16", "int32", "int64", "bool", "mxfp6", "mxint8"}
)
"""Element types AI100-class hardware handles (fp32 works but runs slowly; mxfp6 is a weight
format for MatMul, mxint8 an I/O format). No bf16 and no fp64."""

AI200_DTYPES = AI100_DTYPES | {"bfloat16"}


def clock_from_tflops(fp16_tflops: float, num_cores: int) -> int:
    """The clock (Hz) at which `num_cores` HMX units reach the given fp16 peak."""
    return round(fp16_tflops * 1e12 / (num_cores * HMX_FP16_MACS * 2))


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator SKU as the compiler sees it (modelled figures; see the module doc).

    `num_cores` counts the usable NSP cores of the whole card; a network is compiled for one
    SoC, so `cores_per_soc` bounds `-aic-num-cores`. DDR size and bandwidth are per card;
    `*_per_soc` gives what one SoC (one network instance) can use.
    """

    name: str
    display_name: str
    hw_version: str
    num_cores: int
    socs: int
    clock_hz: int
    ddr_bytes: int
    ddr_bandwidth_bytes_per_s: float
    """Per SoC (~137 GB/s for LPDDR4x on AIC100)."""
    dtypes: frozenset[str]
    pci_device_id: int | None
    """PCI device id under vendor 0x17cb; None where no id is published."""
    fp16_tflops: float
    """Peak fp16 TFLOPS of the card: published for AIC100 Standard/Pro/Ultra, modelled else."""
    modelled: bool = False
    """True when even the headline figures are our choice, not published ones."""
    vtcm_bytes_per_core: int = VTCM_USABLE_BYTES
    l2_bytes: int = 1 * MIB
    """L2 cache per core."""
    hmx_fp16_macs_per_cycle: int = HMX_FP16_MACS
    hmx_int8_macs_per_cycle: int = HMX_INT8_MACS
    hvx_threads: int = 4
    hvx_int8_macs_per_cycle: int = 512
    hvx_fp16_macs_per_cycle: int = 256
    dma_engines_per_core: int = 1
    pci_vendor_id: int = 0x17CB

    @property
    def cores_per_soc(self) -> int:
        return self.num_cores // self.socs

    @property
    def ddr_bytes_per_soc(self) -> int:
        return self.ddr_bytes // self.socs

    @property
    def total_ddr_bandwidth_bytes_per_s(self) -> float:
        return self.ddr_bandwidth_bytes_per_s * self.socs

    @property
    def peak_fp16_flops_per_core(self) -> float:
        return self.hmx_fp16_macs_per_cycle * 2 * self.clock_hz

    def supports_dtype(self, dtype: str) -> bool:
        return dtype in self.dtypes


def _profile(
    name: str,
    display_name: str,
    *,
    hw_version: str,
    num_cores: int,
    socs: int,
    ddr_gib: int,
    fp16_tflops: float,
    pci_device_id: int | None,
    bandwidth_per_soc: float = 137e9,
    modelled: bool = False,
) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        display_name=display_name,
        hw_version=hw_version,
        num_cores=num_cores,
        socs=socs,
        clock_hz=clock_from_tflops(fp16_tflops, num_cores),
        ddr_bytes=ddr_gib * GIB,
        ddr_bandwidth_bytes_per_s=bandwidth_per_soc,
        dtypes=AI200_DTYPES if hw_version == "ai200" else AI100_DTYPES,
        pci_device_id=pci_device_id,
        fp16_tflops=fp16_tflops,
        modelled=modelled,
    )


_PROFILES: tuple[DeviceProfile, ...] = (
    # Published: 14 usable NSPs, 16 GB LPDDR4x at ~137 GB/s, 110 TFLOPS fp16.
    _profile(
        "aic100-standard",
        "AIC100 Standard",
        hw_version="ai100",
        num_cores=14,
        socs=1,
        ddr_gib=16,
        fp16_tflops=110.0,
        pci_device_id=0xA100,
    ),
    # Published: 16 NSPs, 32 GB, ~137 GB/s, 125 TFLOPS fp16.
    _profile(
        "aic100-pro",
        "AIC100 Pro",
        hw_version="ai100",
        num_cores=16,
        socs=1,
        ddr_gib=32,
        fp16_tflops=125.0,
        pci_device_id=0xA100,
    ),
    # Published: 4 SoCs, 64 NSPs, 128 GB, ~548 GB/s in all, 290 TFLOPS fp16.
    _profile(
        "aic100-ultra",
        "AIC100 Ultra",
        hw_version="ai100",
        num_cores=64,
        socs=4,
        ddr_gib=128,
        fp16_tflops=290.0,
        pci_device_id=0xA100,
    ),
    # Published only as "fewer NSPs, lower clocks": 8 NSPs and ~0.8x the Standard clock
    # (8 x 4096 x 2 x 767 MHz = 50.3 TFLOPS) are our model.
    _profile(
        "aic080",
        "AIC080",
        hw_version="ai100",
        num_cores=8,
        socs=1,
        ddr_gib=16,
        fp16_tflops=50.3,
        pci_device_id=0xA080,
        modelled=True,
    ),
    # The next generation, entirely modelled: an AIC100 Pro-like SoC that adds bf16.
    _profile(
        "aic200",
        "AIC200",
        hw_version="ai200",
        num_cores=16,
        socs=1,
        ddr_gib=128,
        fp16_tflops=125.0,
        pci_device_id=None,
        bandwidth_per_soc=274e9,
        modelled=True,
    ),
)

_DEFAULTS = {"ai100": "aic100-pro", "ai200": "aic200"}
"""Compiling without `-aic-device` targets the full SoC of the hardware version (16 cores on
AI100, the `-aic-num-cores` limit of qaic-compile); a QPC is checked against a smaller SKU
with `qpcfarm qpc validate --device`."""

HW_VERSION_SPELLINGS = {"2.0": "ai100", "ai100": "ai100", "ai200": "ai200"}


def _key(name: str) -> str:
    return "-".join(name.strip().lower().replace("_", " ").split())


_BY_KEY = {_key(key): p for p in _PROFILES for key in (p.name, p.display_name)}


def list_devices() -> list[DeviceProfile]:
    return list(_PROFILES)


def device_names() -> list[str]:
    return [p.name for p in _PROFILES]


def get_device(name: str) -> DeviceProfile:
    """Look a profile up by slug or display name, ignoring case, spaces and underscores."""
    profile = _BY_KEY.get(_key(name))
    if profile is None:
        raise CompileError(
            "unknown_device",
            f"unknown device {name!r}; known devices: {', '.join(device_names())}",
            details={"device": name, "known": device_names()},
        )
    return profile


def canonical_hw_version(version: str) -> str:
    """`2.0` (the older spelling) and `ai100` are the same hardware."""
    canonical = HW_VERSION_SPELLINGS.get(version.strip().lower())
    if canonical is None:
        raise CompileError(
            "unknown_hw_version",
            f"unknown hardware version {version!r}; known: {', '.join(HW_VERSION_SPELLINGS)}",
        )
    return canonical


def default_device_for(hw_version: str) -> DeviceProfile:
    return get_device(_DEFAULTS[canonical_hw_version(hw_version)])
