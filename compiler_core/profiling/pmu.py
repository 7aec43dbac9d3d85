"""The PMU events our modelled NSP counts, and the vendor's recipes as event sets.

Ids are ours (the vendor's event numbering is not public); each event is computed from the
cost model's timeline of one inference, per core and thread, and is therefore an estimate.
`-aic-pmu-events` may name any hex id: one outside this catalogue is accepted and counts zero.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PmuEvent:
    id: int
    name: str
    meaning: str
    threads: str
    """Which threads count it: "all", "hvx", "hmx" or "dma"."""


CATALOGUE: tuple[PmuEvent, ...] = (
    PmuEvent(0x01, "PCYCLES", "processor cycles from the inference start to the core's end", "all"),
    PmuEvent(0x02, "THREAD_ACTIVE_CYCLES", "cycles the thread was busy (its ucycles)", "all"),
    PmuEvent(
        0x03, "SEM_STALL_CYCLES", "cycles the core waited on semaphores of other cores", "all"
    ),
    PmuEvent(0x04, "DOORBELL_STALL_CYCLES", "cycles the core waited for input doorbells", "all"),
    PmuEvent(
        0x05,
        "COMPUTE_DMA_STALL_CYCLES",
        "cycles in kernels during which neither HMX nor HVX computed (waiting on DMA)",
        "all",
    ),
    PmuEvent(0x10, "HMX_ACTIVE_CYCLES", "cycles the HMX tensor unit computed", "hmx"),
    PmuEvent(0x11, "HMX_MACS", "multiply-accumulates done on HMX", "hmx"),
    PmuEvent(0x12, "HMX_TILES", "kernel tiles run on HMX", "hmx"),
    PmuEvent(0x20, "HVX_ACTIVE_CYCLES", "cycles this HVX thread computed", "hvx"),
    PmuEvent(
        0x21, "HVX_ELEMENT_OPS", "element operations this HVX thread did (its quarter)", "hvx"
    ),
    PmuEvent(0x22, "HVX_TILES", "kernel tiles (or epilogues) run on HVX", "hvx"),
    PmuEvent(0x30, "AXI_RD_BYTES", "bytes read from DDR over AXI by the DMA engine", "dma"),
    PmuEvent(0x31, "AXI_WR_BYTES", "bytes written to DDR over AXI by the DMA engine", "dma"),
    PmuEvent(0x32, "AXI_RD_BURSTS", "64-byte AXI read bursts", "dma"),
    PmuEvent(0x33, "AXI_WR_BURSTS", "64-byte AXI write bursts", "dma"),
    PmuEvent(0x34, "AXI_RD_CONST_BYTES", "bytes of constants (weights) read from DDR", "dma"),
    PmuEvent(
        0x40, "DMA_ACTIVE_CYCLES", "cycles the DMA issue thread had a transfer in flight", "dma"
    ),
    PmuEvent(0x41, "KERNELS_RUN", "kernels (operators) the core ran a part of", "all"),
)
BY_ID: dict[int, PmuEvent] = {e.id: e for e in CATALOGUE}
BY_NAME: dict[str, PmuEvent] = {e.name: e for e in CATALOGUE}

RECIPES: dict[str, tuple[int, ...]] = {
    "AxiRd": (0x30, 0x32, 0x34, 0x01),
    "AxiWr": (0x31, 0x33, 0x01),
    "AxiRdWr": (0x30, 0x31, 0x32, 0x33, 0x01),
    "KernelUtil": (0x01, 0x02, 0x10, 0x20, 0x40, 0x03, 0x05, 0x41),
    "HmxMacs": (0x11, 0x10, 0x12, 0x01),
}
"""`-aic-pmu-recipe` -> event ids (at most 8 each, as the hardware has 8 counters)."""

EXTENDED_DEFAULT = RECIPES["KernelUtil"]
"""Events recorded per operator at -stats-level=100 when no recipe or events are given."""


def parse_event(text: str) -> int:
    return int(text, 16)


def configured_events(recipe: str | None, events: tuple[str, ...] | list[str]) -> tuple[int, ...]:
    """The event ids a QPC counts: the recipe's set, or the given hex ids, in order."""
    if recipe is not None:
        return RECIPES[recipe]
    return tuple(parse_event(e) for e in events)


def unknown_events(events: tuple[str, ...] | list[str]) -> list[str]:
    """Given hex ids that the catalogue does not know (normalised to upper case, no 0x)."""
    return [f"{parse_event(e):X}" for e in events if parse_event(e) not in BY_ID]


def event_name(event: int) -> str:
    known = BY_ID.get(event)
    return known.name if known is not None else f"UNMODELLED_0x{event:X}"
