"""Scoring a combination from its compile report: the cost model's estimate of one
inference, turned into what the vendor's configurator measures on a device.

Per instance (one QPC loaded on `cores` cores), from the compile's perf metrics:
- `t_dev`: device time of one batch with its inputs already in DDR
  (`estimated_device_latency_us`);
- `t_host`: the batch's inputs and outputs crossing the host link (`host_transfer_us`);
- `ddr`: DDR bytes the batch reads and writes (`memory_traffic.total`).

With `instances` copies running at once they share the SoC's DDR bandwidth and the host link:
- `t_run = max(t_dev, instances * ddr / bandwidth)`: a batch's device time when every
  instance streams at once;
- set size 1: the host waits for each result before sending the next batch, so a batch
  occupies its instance for `t_run + t_host`; set size s > 1 keeps s batches queued per
  instance, their transfers overlap the run and the period is `max(t_run, instances * t_host)`
  (the host link is shared);
- throughput = instances x batch / period; latency = set size x period (Little's law: s
  batches in flight per instance), so a deeper queue buys throughput with latency.

Every figure is an estimate of the cost model, not a measurement, and is labelled so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from compiler_core.devices import DeviceProfile, get_device
from compiler_core.errors import CompileError

Objective = Literal["max-throughput", "min-latency", "max-throughput-under-latency"]
OBJECTIVES: tuple[str, ...] = ("max-throughput", "min-latency", "max-throughput-under-latency")
OBJECTIVE_ALIASES = {
    "throughput": "max-throughput",
    "latency": "min-latency",
    "throughput-under-latency": "max-throughput-under-latency",
}


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
    estimated: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "latency_us": round(self.latency_us, 3),
            "throughput": round(self.throughput, 2),
            "period_us": round(self.period_us, 3),
            "device_latency_us": round(self.device_latency_us, 3),
            "host_transfer_us": round(self.host_transfer_us, 3),
            "ddr_bound": self.ddr_bound,
            "estimated": True,
        }


def _ddr_bytes(metrics: Mapping[str, Any]) -> int:
    total = (metrics.get("memory_traffic") or {}).get("total") or {}
    return int(total.get("ddr_read_bytes", 0)) + int(total.get("ddr_write_bytes", 0))


def device_of(metrics: Mapping[str, Any]) -> DeviceProfile:
    return get_device(str(metrics["device"]))


def score(metrics: Mapping[str, Any], *, instances: int, batchsize: int, set_size: int) -> Score:
    """The combination's estimate from its compile's perf metrics (see the module doc)."""
    t_dev = float(metrics["estimated_device_latency_us"])
    t_host = float(metrics.get("host_transfer_us") or 0.0)
    bandwidth = device_of(metrics).ddr_bandwidth_bytes_per_s
    t_ddr = instances * _ddr_bytes(metrics) / bandwidth * 1e6
    t_run = max(t_dev, t_ddr)
    if set_size <= 1:
        period = max(t_run + t_host, instances * t_host)
    else:
        period = max(t_run, instances * t_host)
    period = max(period, 1e-6)
    return Score(
        latency_us=set_size * period,
        throughput=instances * batchsize * 1e6 / period,
        period_us=period,
        device_latency_us=t_dev,
        host_transfer_us=t_host,
        ddr_bound=t_ddr > t_dev,
    )


def parse_objective(name: str, latency_bound_us: float | None = None) -> tuple[str, float | None]:
    """The canonical objective name; `max-throughput-under-latency` needs a positive bound."""
    canonical = OBJECTIVE_ALIASES.get(name, name)
    if canonical not in OBJECTIVES:
        raise CompileError(
            "invalid_objective",
            f"unknown objective {name!r}: one of {', '.join(OBJECTIVES)}",
        )
    if canonical == "max-throughput-under-latency":
        if latency_bound_us is None or not latency_bound_us > 0:
            raise CompileError(
                "invalid_objective",
                "max-throughput-under-latency needs a latency bound in microseconds "
                "(latency_bound_us > 0)",
            )
        return canonical, float(latency_bound_us)
    return canonical, None


def rank_key(
    s: Score | None, objective: str, latency_bound_us: float | None, tie: Sequence[int] = ()
) -> tuple[Any, ...]:
    """Sort key, best first: unscored (failed) last; under a latency bound the combinations
    within it by throughput, then those over it by latency. Ties go to fewer cores in use,
    then to `tie` (the input order)."""
    if s is None:
        return (2, 0.0, *tie)
    if objective == "min-latency":
        return (0, s.latency_us, -s.throughput, *tie)
    if objective == "max-throughput-under-latency":
        assert latency_bound_us is not None
        if s.latency_us <= latency_bound_us:
            return (0, -s.throughput, s.latency_us, *tie)
        return (1, s.latency_us, -s.throughput, *tie)
    return (0, -s.throughput, s.latency_us, *tie)


def meets(s: Score | None, objective: str, latency_bound_us: float | None) -> bool:
    """Whether a scored combination satisfies the objective's bound (always, without one)."""
    if s is None:
        return False
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
