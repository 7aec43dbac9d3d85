"""Scoring a combination from its compile report: the cost model's estimate of one
inference, turned into what the vendor's configurator measures on a device.

Per instance (one QPC loaded on `cores` cores), from the compile's perf metrics:
- `t_dev`: device time of one batch with its inputs already in DDR
  (`estimated_device_latency_us`);
- `t_host`: the batch's inputs and outputs crossing the host link (`host_transfer_us`);
- `ddr`: DDR bytes the batch reads and writes (`memory_traffic.total`).

Each batch also pays the runtime's host overhead `t_over`: the device table's per-submit
overhead (doorbell, descriptor fetch, completion interrupt) plus its per-DMA-descriptor setup
for each host input and output buffer (`host_buffers`).

With `instances` copies running at once they share the SoC's DDR bandwidth and the host link:
- `t_run = max(t_dev, instances * ddr / bandwidth)`: a batch's device time when every
  instance streams at once;
- set size 1: the host waits for each result before sending the next batch, so a batch
  occupies its instance for `t_run + t_host + t_over`; set size s > 1 keeps s batches queued
  per instance, their transfers and submits overlap the run and the period is
  `max(t_run, instances * t_host, t_over)` (the host link is shared; an instance's submits
  follow one another);
- throughput = instances x batch / period; latency = set size x period (Little's law: s
  batches in flight per instance), so a deeper queue buys throughput with latency.

Whole cards: `instances` counts the copies on one SoC. The same placement runs on every SoC
of the card (a QPC partitioned over `socs_per_instance` SoCs: on each group of that many)
and on every one of `cards` cards. Each SoC has its own DDR and its own port to the card's
switch (the terms above); the SoCs of one card share its one host link, `host_link_lanes`
wide against a SoC port's `SOC_PORT_LANES`, so the period is also at least
`copies on the card x instances x t_host x SOC_PORT_LANES / host_link_lanes`; each card has a
host link of its own. Throughput counts every instance of every SoC and card.

An LLM QPC (prefill and decode specializations, the KV cache as retained state: its perf
metrics carry an `llm` section) is also scored in tokens: its full-batch decode
specialization's step scored as above with set size 1 (a step needs the last token) gives
`tokens_per_s` (instances x batch / period: every sequence of every instance),
`decode_tokens_per_s` (1 / period: what one sequence sees) and the time per output token
`tpot_ms`; its prefill specialization's run gives the time to first token `ttft_ms`.

The objectives are `OBJECTIVE_TABLE`: the one list the CLI, the API schema and the web form
read. The LLM ones take optional bounds on the time to first token and per output token
(`LlmBounds`): the combinations within them rank first.

Every figure is an estimate of the cost model, not a measurement, and is labelled so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compiler_core.devices import SOC_PORT_LANES, DeviceProfile, get_device
from compiler_core.errors import CompileError


@dataclass(frozen=True)
class ObjectiveDef:
    """One objective: its name, what it ranks by, and whether it scores tokens (an LLM QPC)."""

    name: str
    summary: str
    llm: bool = False
    needs_latency_bound: bool = False


OBJECTIVE_TABLE: tuple[ObjectiveDef, ...] = (
    ObjectiveDef("max-throughput", "inferences per second of all instances"),
    ObjectiveDef("min-latency", "time from an inference's submission to its result"),
    ObjectiveDef(
        "max-throughput-under-latency",
        "inferences per second among the combinations within latency_bound_us",
        needs_latency_bound=True,
    ),
    ObjectiveDef(
        "max-tokens-per-s",
        "decode tokens per second of every sequence of every instance at the full decode "
        "batch (an LLM QPC; bounds: max_ttft_ms, max_tpot_ms)",
        llm=True,
    ),
    ObjectiveDef(
        "max-decode-tokens-per-s",
        "decode tokens per second one sequence sees at the full decode batch (an LLM QPC; "
        "bounds: max_ttft_ms, max_tpot_ms)",
        llm=True,
    ),
)
"""Every objective the configurator ranks by, in the order the CLI and API list them."""

OBJECTIVES: tuple[str, ...] = tuple(o.name for o in OBJECTIVE_TABLE)
OBJECTIVE_ALIASES = {
    "throughput": "max-throughput",
    "latency": "min-latency",
    "throughput-under-latency": "max-throughput-under-latency",
    "tokens-per-s": "max-tokens-per-s",
    "decode-tokens-per-s": "max-decode-tokens-per-s",
}
_BY_NAME = {o.name: o for o in OBJECTIVE_TABLE}


def is_llm_objective(objective: str) -> bool:
    return objective in _BY_NAME and _BY_NAME[objective].llm


@dataclass(frozen=True)
class LlmBounds:
    """Upper bounds of the LLM objectives (None: unbounded)."""

    max_ttft_ms: float | None = None
    max_tpot_ms: float | None = None

    def overshoot(self, s: Score) -> float:
        """0 within every bound, else how far over (the sum of the relative excesses; a
        bound on a figure the QPC does not give counts as missed)."""
        over = 0.0
        for bound, value in ((self.max_ttft_ms, s.ttft_ms), (self.max_tpot_ms, s.tpot_ms)):
            if bound is None:
                continue
            if value is None:
                over += 1e9
            elif value > bound:
                over += value / bound - 1
        return over


@dataclass(frozen=True)
class Score:
    """The estimated figures of one combination (all `estimated`)."""

    latency_us: float
    """Time from an inference's submission to its result under full load."""
    throughput: float
    """Inferences per second of all instances together."""
    period_us: float
    """Time between two batches leaving one instance."""
    device_latency_us: float
    host_transfer_us: float
    ddr_bound: bool
    """Whether the instances' shared DDR bandwidth, not compute, sets `t_run`."""
    instances_per_soc: int = 1
    socs: int = 1
    """SoCs in use on all cards."""
    cards: int = 1
    card_link_bound: bool = False
    """Whether the card's host link, shared by its SoCs, sets the period."""
    host_overhead_us: float = 0.0
    """The runtime's host overhead of one batch (submit and DMA descriptors)."""
    estimated: bool = True
    tokens_per_s: float | None = None
    """An LLM QPC: decode tokens/s of every sequence of every instance at the full batch."""
    decode_tokens_per_s: float | None = None
    """An LLM QPC: decode tokens/s one sequence sees at the full batch."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "latency_us": round(self.latency_us, 3),
            "throughput": round(self.throughput, 2),
            "period_us": round(self.period_us, 3),
            "device_latency_us": round(self.device_latency_us, 3),
            "host_transfer_us": round(self.host_transfer_us, 3),
            "ddr_bound": self.ddr_bound,
            "host_overhead_us": round(self.host_overhead_us, 3),
            "instances_per_soc": self.instances_per_soc,
            "socs": self.socs,
            "cards": self.cards,
            "card_link_bound": self.card_link_bound,
            "estimated": True,
        }
        for name in ("tokens_per_s", "decode_tokens_per_s", "ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None:
                out[name] = round(value, 3)
        return out


def _ddr_bytes(metrics: Mapping[str, Any]) -> int:
    total = (metrics.get("memory_traffic") or {}).get("total") or {}
    return int(total.get("ddr_read_bytes", 0)) + int(total.get("ddr_write_bytes", 0))


def device_of(metrics: Mapping[str, Any]) -> DeviceProfile:
    return get_device(str(metrics["device"]))


def score(
    metrics: Mapping[str, Any],
    *,
    instances: int,
    batchsize: int,
    set_size: int,
    cards: int = 1,
    socs_per_instance: int = 1,
    device: DeviceProfile | None = None,
) -> Score:
    """The combination's estimate from its compile's perf metrics (see the module doc);
    `device` overrides the profile the metrics name (its table's parameters)."""
    device = device or device_of(metrics)
    place = _Placement.of(device, cards, socs_per_instance)
    base = _score(
        metrics, instances=instances, batchsize=batchsize, set_size=set_size, device=device,
        place=place,
    )  # fmt: skip
    llm = metrics.get("llm")
    if not isinstance(llm, Mapping) or "full_batch" not in llm:
        return base
    each = metrics.get("specializations") or {}
    full = max(
        (d for d in llm["decode"] if d["batch"] == llm["full_batch"]),
        key=lambda d: d["tokens_per_s"],
    )
    step = _score(
        each.get(full["specialization"], metrics),
        instances=instances,
        batchsize=int(full["batch"]),
        set_size=1,
        device=device,
        place=place,
    )
    ttft_ms = None
    prefill = llm.get("prefill_specialization")
    if prefill is not None and prefill in each:
        ttft_ms = _score(
            each[prefill], instances=instances, batchsize=1, set_size=1, device=device, place=place
        ).period_us
        ttft_ms /= 1e3
    return dataclasses.replace(
        base,
        tokens_per_s=step.throughput,
        decode_tokens_per_s=1e6 / step.period_us,
        ttft_ms=ttft_ms,
        tpot_ms=step.period_us / 1e3,
    )


DEFAULT_HOST_BUFFERS = 2
"""Host buffers of a report that does not count them (older reports): one input, one output."""


def host_overhead_us(metrics: Mapping[str, Any], device: DeviceProfile) -> float:
    """The runtime's host overhead of one batch: the submit plus a DMA descriptor per host
    input and output buffer (the device table's figures)."""
    buffers = metrics.get("host_buffers")
    count = DEFAULT_HOST_BUFFERS if buffers is None else int(buffers)
    return (device.inference_submit_s + count * device.dma_descriptor_s) * 1e6


@dataclass(frozen=True)
class _Placement:
    """Where the copies of a QPC run: `copies` groups of SoCs on all cards, `per_card` of
    them behind one card's host link."""

    copies: int
    per_card: int
    socs_per_instance: int
    cards: int

    @classmethod
    def of(cls, device: DeviceProfile, cards: int, socs_per_instance: int) -> _Placement:
        if cards < 1 or socs_per_instance < 1:
            raise CompileError("invalid_search_space", "cards and SoCs must be positive")
        copies = device.socs * cards // socs_per_instance
        if copies < 1:
            raise CompileError(
                "invalid_search_space",
                f"a QPC over {socs_per_instance} SoCs does not fit {cards} "
                f"{device.name} card(s) of {device.socs} SoCs",
            )
        return cls(copies, max(1, device.socs // socs_per_instance), socs_per_instance, cards)


def _score(
    metrics: Mapping[str, Any],
    *,
    instances: int,
    batchsize: int,
    set_size: int,
    device: DeviceProfile,
    place: _Placement,
) -> Score:
    t_dev = float(metrics["estimated_device_latency_us"])
    t_host = float(metrics.get("host_transfer_us") or 0.0)
    t_over = host_overhead_us(metrics, device)
    t_ddr = instances * _ddr_bytes(metrics) / device.ddr_bandwidth_bytes_per_s * 1e6
    t_run = max(t_dev, t_ddr)
    t_card = place.per_card * instances * t_host * SOC_PORT_LANES / device.host_link_lanes
    if set_size <= 1:
        period = max(t_run + t_host + t_over, instances * t_host, t_card)
    else:
        period = max(t_run, instances * t_host, t_over, t_card)
    period = max(period, 1e-6)
    return Score(
        latency_us=set_size * period,
        throughput=place.copies * instances * batchsize * 1e6 / period,
        period_us=period,
        device_latency_us=t_dev,
        host_transfer_us=t_host,
        ddr_bound=t_ddr > t_dev,
        instances_per_soc=instances,
        socs=place.copies * place.socs_per_instance,
        cards=place.cards,
        card_link_bound=t_card >= period * (1 - 1e-9) and t_card > instances * t_host,
        host_overhead_us=t_over,
    )


def parse_objective(name: str, latency_bound_us: float | None = None) -> tuple[str, float | None]:
    """The canonical objective name; `max-throughput-under-latency` needs a positive bound."""
    canonical = OBJECTIVE_ALIASES.get(name, name)
    if canonical not in OBJECTIVES:
        raise CompileError(
            "invalid_objective",
            f"unknown objective {name!r}: one of {', '.join(OBJECTIVES)}",
        )
    if _BY_NAME[canonical].needs_latency_bound:
        if latency_bound_us is None or not latency_bound_us > 0:
            raise CompileError(
                "invalid_objective",
                "max-throughput-under-latency needs a latency bound in microseconds "
                "(latency_bound_us > 0)",
            )
        return canonical, float(latency_bound_us)
    return canonical, None


def parse_llm_bounds(
    objective: str, max_ttft_ms: float | None = None, max_tpot_ms: float | None = None
) -> LlmBounds | None:
    """The bounds of an LLM objective (each positive, or None); bounds given to another
    objective are an error, not ignored."""
    given = {"max_ttft_ms": max_ttft_ms, "max_tpot_ms": max_tpot_ms}
    for key, value in given.items():
        if value is not None and not (value > 0 and value < float("inf")):
            raise CompileError("invalid_objective", f"{key} must be a positive number of ms")
    if not is_llm_objective(objective):
        named = [k for k, v in given.items() if v is not None]
        if named:
            llm = ", ".join(o.name for o in OBJECTIVE_TABLE if o.llm)
            raise CompileError(
                "invalid_objective",
                f"{' and '.join(named)} bound an LLM objective ({llm}), not {objective}",
            )
        return None
    return LlmBounds(max_ttft_ms, max_tpot_ms)


def _tokens(s: Score, objective: str) -> float | None:
    return s.tokens_per_s if objective == "max-tokens-per-s" else s.decode_tokens_per_s


def rank_key(
    s: Score | None,
    objective: str,
    latency_bound_us: float | None,
    tie: Sequence[int] = (),
    llm_bounds: LlmBounds | None = None,
) -> tuple[Any, ...]:
    """Sort key, best first: unscored (failed, or no LLM figures for an LLM objective) last;
    under a latency bound the combinations within it by throughput, then those over it by
    latency; under LLM bounds those within them by tokens/s, then those over them by how far.
    Ties go to fewer cores in use, then to `tie` (the input order)."""
    if s is None:
        return (2, 0.0, *tie)
    if is_llm_objective(objective):
        tokens = _tokens(s, objective)
        if tokens is None:
            return (2, 0.0, *tie)
        over = (llm_bounds or LlmBounds()).overshoot(s)
        if over > 0:
            return (1, over, -tokens, *tie)
        return (0, -tokens, s.tpot_ms or 0.0, *tie)
    if objective == "min-latency":
        return (0, s.latency_us, -s.throughput, *tie)
    if objective == "max-throughput-under-latency":
        assert latency_bound_us is not None
        if s.latency_us <= latency_bound_us:
            return (0, -s.throughput, s.latency_us, *tie)
        return (1, s.latency_us, -s.throughput, *tie)
    return (0, -s.throughput, s.latency_us, *tie)


def meets(
    s: Score | None,
    objective: str,
    latency_bound_us: float | None,
    llm_bounds: LlmBounds | None = None,
) -> bool:
    """Whether a scored combination satisfies the objective's bound (always, without one;
    an LLM objective needs the QPC's token figures)."""
    if s is None:
        return False
    if is_llm_objective(objective):
        return _tokens(s, objective) is not None and (llm_bounds or LlmBounds()).overshoot(s) == 0
    return objective != "max-throughput-under-latency" or s.latency_us <= (latency_bound_us or 0)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the (latency, throughput) pairs no other pair beats on both (lower latency
    and higher throughput), in order of latency."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front: list[int] = []
    best = -1.0
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front
