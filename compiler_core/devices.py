"""Device profiles: the numbers the compiler, cost model and validator target.

Every figure here is *modelled*, taken from Qualcomm's public product pages where one exists
and chosen by us where none does (docs/compiler.md, "Device model", gives each number with
its source):

- cores, DDR size and bandwidth, on-chip SRAM, peak fp16 TFLOPS and int8 TOPS: the Cloud AI
  100 SKU table (Standard 14 NSPs, 16 GB, 137 GB/s, 110 TFLOPS, 325 TOPS; Pro 16 NSPs, 32 GB,
  137 GB/s, 125 TFLOPS, 375 TOPS; Ultra 4 SoCs);
- 8 MiB VTCM and 1 MiB L2 per core (126 MB of SRAM on 14 cores), HMX 4096 fp16 MACs per clock;
- the NoC: 186 GB/s, with multicast and core synchronization.

No clock is published. It is derived from the fp16 peak,
`TFLOPS / (cores x 4096 fp16 MACs per cycle x 2 flops per MAC)`, and the int8 rate then from the
int8 peak at that clock, `TOPS / (cores x clock x 2)`: about 12,100 int8 MACs per cycle on the
Standard card, not 2 x 4096 (the published int8 figure is 2.95x the fp16 one). Reports label
anything derived from these numbers as "estimated".
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
"""The int8 array's native width; the rate a SKU reaches comes from its published TOPS."""
NOC_BYTES_PER_S = 186e9
"""Published NoC data bandwidth of one SoC (with multicast and core synchronization)."""
DMA_ENGINE_BYTES_PER_CYCLE = 64
"""The most one core's DMA engine moves per cycle, however idle the rest of the SoC is
(modelled: no figure is published)."""

INFERENCE_SUBMIT_S = 9e-6
"""Host overhead of one inference submit (one batch of one instance), an assumption built
from its steps: the runtime's enqueue call on the host (~2 us of CPU), the descriptor ring
entry and the doorbell's posted MMIO write landing on the device (~1 us), the device's fetch
of the descriptors from host memory (a PCIe read round trip, ~1 us), and the completion's
MSI interrupt waking the waiting host thread (~5 us on Linux). No figure is published."""
DMA_DESCRIPTOR_S = 0.25e-6
"""Host setup of one DMA descriptor (one per input or output buffer of an inference):
writing its 32-byte entry and the device's DMA engine reading it behind the others of the
submit, pipelined (an assumption: a quarter of a PCIe read round trip)."""
HOST_LINK_LANES = 8
"""PCIe Gen4 lanes of a single-SoC card's host link (the Standard and Pro cards are x8)."""
CARD_HOST_LANES = 16
"""An Ultra card's host link: Gen4 x16 from its PCIe switch, shared by its 4 SoCs."""

AI100_DTYPES = frozenset(
    {"float32", "float16", "int8", "uint8", "int16", "int32", "int64", "bool", "mxfp6", "mxint8"}
)
"""Element types AI100-class hardware handles (fp32 works but runs slowly; mxfp6 is a weight
format for MatMul, mxint8 an I/O format). No bf16 and no fp64."""

AI200_DTYPES = AI100_DTYPES | {"bfloat16"}


def clock_from_tflops(fp16_tflops: float, num_cores: int) -> int:
    """The clock (Hz) at which `num_cores` HMX units reach the given fp16 peak."""
    return round(fp16_tflops * 1e12 / (num_cores * HMX_FP16_MACS * 2))


def int8_rate_from_tops(int8_tops: float, num_cores: int, clock_hz: int) -> int:
    """int8 MACs per cycle per core that reach the given int8 peak at `clock_hz`."""
    return round(int8_tops * 1e12 / (num_cores * clock_hz * 2))


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
    int8_tops: float = 0.0
    """Peak int8 TOPS of the card: published for AIC100 Standard/Pro/Ultra, modelled else."""
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
    dma_bytes_per_cycle: int = DMA_ENGINE_BYTES_PER_CYCLE
    noc_bandwidth_bytes_per_s: float = NOC_BYTES_PER_S
    """Per SoC: core-to-core VTCM transfers and multicast fan-out share it."""
    pci_vendor_id: int = 0x17CB
    host_link_lanes: int = HOST_LINK_LANES
    """Lanes of the card's one host link, shared by all its SoCs (an Ultra card's switch: x16)."""
    inference_submit_s: float = INFERENCE_SUBMIT_S
    """Host overhead of one inference submit (doorbell, descriptor fetch, completion)."""
    dma_descriptor_s: float = DMA_DESCRIPTOR_S
    """Host setup of one DMA descriptor (one per host input or output buffer)."""

    @property
    def host_link_bytes_per_s(self) -> float:
        """Payload rate of the card's host link, one direction (shared by its SoCs)."""
        return pcie_bytes_per_s(self.host_link_lanes)

    @property
    def soc_link_bytes_per_s(self) -> float:
        """Payload rate one SoC's inputs and outputs cross to or from the host at, one direction:
        its own PCIe port (Gen4 x8), at most the card's host link. The one host-link rate of
        the cost model (a program's input doorbells, `host_transfer_us`); the scoring shares
        the card's link between its SoCs on top."""
        return pcie_bytes_per_s(min(SOC_PORT_LANES, self.host_link_lanes))

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

    def hmx_macs_per_cycle(self, dtype: str) -> int:
        """HMX rate for a kernel computing in `dtype` (fp32 has no HMX path: see cost_rates)."""
        return (
            self.hmx_int8_macs_per_cycle
            if dtype in ("int8", "uint8")
            else (self.hmx_fp16_macs_per_cycle)
        )

    def supports_dtype(self, dtype: str) -> bool:
        return dtype in self.dtypes

    def card_of(self, soc: int) -> int:
        """The card a SoC (a partition config's deviceId) sits on."""
        return soc // self.socs

    @property
    def max_socs_per_host(self) -> int:
        return self.socs * MAX_CARDS_PER_HOST


def _profile(
    name: str,
    display_name: str,
    *,
    hw_version: str,
    num_cores: int,
    socs: int,
    ddr_gib: int,
    fp16_tflops: float,
    int8_tops: float,
    pci_device_id: int | None,
    bandwidth_per_soc: float = 137e9,
    host_link_lanes: int = HOST_LINK_LANES,
    modelled: bool = False,
) -> DeviceProfile:
    clock = clock_from_tflops(fp16_tflops, num_cores)
    return DeviceProfile(
        name=name,
        display_name=display_name,
        hw_version=hw_version,
        num_cores=num_cores,
        socs=socs,
        clock_hz=clock,
        ddr_bytes=ddr_gib * GIB,
        ddr_bandwidth_bytes_per_s=bandwidth_per_soc,
        dtypes=AI200_DTYPES if hw_version == "ai200" else AI100_DTYPES,
        pci_device_id=pci_device_id,
        fp16_tflops=fp16_tflops,
        int8_tops=int8_tops,
        hmx_int8_macs_per_cycle=int8_rate_from_tops(int8_tops, num_cores, clock),
        host_link_lanes=host_link_lanes,
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
        int8_tops=325.0,
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
        int8_tops=375.0,
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
        int8_tops=870.0,
        pci_device_id=0xA100,
        host_link_lanes=CARD_HOST_LANES,
    ),
    # Published only as "fewer NSPs, lower clocks": 8 NSPs and ~0.8x the Standard clock
    # (8 x 4096 x 2 x 767 MHz = 50.3 TFLOPS) are our model; int8 at the Pro's 3x fp16 ratio.
    _profile(
        "aic080",
        "AIC080",
        hw_version="ai100",
        num_cores=8,
        socs=1,
        ddr_gib=16,
        fp16_tflops=50.3,
        int8_tops=150.9,
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
        int8_tops=375.0,
        pci_device_id=None,
        bandwidth_per_soc=274e9,
        modelled=True,
    ),
)

PCIE_GEN4_LANE_BYTES_PER_S = 16e9 * 128 / 130 / 8
"""One PCIe Gen4 lane: 16 GT/s with 128b/130b encoding (PCI-SIG), 1.97 GB/s each way."""
PCIE_PAYLOAD_EFFICIENCY = 0.86
"""Share of the lane rate that carries data: 256-byte payloads behind ~24 bytes of TLP header,
sequence number and CRC plus DLLP flow-control traffic (the usual Gen4 figure, ~0.86)."""
SOC_PORT_LANES = 8
"""Each SoC's PCIe port (the Standard and Pro cards are Gen4 x8; an Ultra card's SoCs are
modelled with the same x8 port each, to the card's switch)."""
P2P_LATENCY_S = 2e-6
"""One peer-to-peer DMA between two SoCs behind one switch, issue to landing (an assumption:
DMA descriptor fetch, two switch hops and the doorbell write, a few round trips of ~0.5 us)."""
HOST_RELAY_LATENCY_S = 10e-6
"""A transfer between devices with no p2p connection: written to host memory by the sender's
DMA, noticed by the host and sent down to the receiver (an assumption: two DMAs plus a host
interrupt and doorbell, ~10 us)."""


@dataclass(frozen=True)
class Link:
    """How bytes move between two devices of a partition (modelled; docs/compiler.md)."""

    kind: str
    """"p2p" (through the card's PCIe switch) or "host" (relayed through host memory)."""
    bytes_per_s: float
    """What one SoC can send to its peers at once: its port's payload rate."""
    latency_s: float

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


def pcie_bytes_per_s(lanes: int) -> float:
    """Payload bandwidth of a Gen4 link of `lanes` lanes, one direction."""
    return lanes * PCIE_GEN4_LANE_BYTES_PER_S * PCIE_PAYLOAD_EFFICIENCY


def link_between(kind: str, same_card: bool) -> Link:
    """A p2p link between SoCs of one card goes through its switch at a SoC port's rate; across
    cards, or without a p2p connection, it goes through the host, at most a card's host link
    shared by the SoCs behind it, with the relay's latency."""
    port = pcie_bytes_per_s(SOC_PORT_LANES)
    if kind == "p2p" and same_card:
        return Link("p2p", port, P2P_LATENCY_S)
    if kind == "p2p":
        return Link("p2p", min(port, pcie_bytes_per_s(CARD_HOST_LANES)), 2 * P2P_LATENCY_S)
    return Link("host", min(port, pcie_bytes_per_s(CARD_HOST_LANES) / 2), HOST_RELAY_LATENCY_S)


MAX_CARDS_PER_HOST = 8
"""Cards one host takes (its PCIe slots): device ids of a partition config are SoCs numbered
card after card (an Ultra card's SoCs 0-3, the next card's 4-7, ...)."""


MAX_SOC_DDR_BYTES = max(p.ddr_bytes_per_soc for p in _PROFILES)
"""The DDR of the largest single SoC of any profile (128 GiB, AIC200): no tensor of a QPC,
and no dimension of one (`-batchsize`, a symbol's value), can be larger."""

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
