"""Collect a quantization profile: run the float model on the functional runtime.

`-dump-profile` compiles the float model (no epilogue fusion, so every node's output is a
kernel output), runs it over the calibration inputs, and records per tensor the minimum,
maximum and a histogram. Two passes: the first finds each tensor's range, the second counts
values into `num-histogram-bins` equal bins over [min(lo, 0), max(hi, 0)]. The result is a
`quant.profile.Profile`; this module is apart from the format so the graph passes that read a
profile do not stand on the runtime.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from compiler_core.quant.profile import Profile, TensorStats
from compiler_core.runtime.session import QpcSession


class RangeProbe:
    """Sees every kernel's result tiles (the executor's probe hook) and accumulates, per
    float output tensor, its range (first pass) or its histogram (second pass)."""

    def __init__(self, program: Any, bins: int) -> None:
        self.program = program
        self.bins = bins
        self.stats: dict[str, TensorStats] = {}
        self.histograms = False

    def observe(self, name: str, array: np.ndarray) -> None:
        if array.dtype.kind != "f" or array.size == 0:
            return
        values = array.astype(np.float64, copy=False)
        finite = values[np.isfinite(values)]
        if finite.size == 0:
            return
        stats = self.stats.get(name)
        if not self.histograms:
            lo, hi = float(finite.min()), float(finite.max())
            if stats is None:
                self.stats[name] = TensorStats(lo, hi)
            else:
                stats.min, stats.max = min(stats.min, lo), max(stats.max, hi)
            return
        if stats is None:
            return
        if stats.counts.size == 0:
            stats.hist_min, stats.hist_max = min(stats.min, 0.0), max(stats.max, 0.0)
            stats.counts = np.zeros(self.bins, np.int64)
        if stats.hist_max > stats.hist_min:
            counts, _ = np.histogram(finite, self.bins, (stats.hist_min, stats.hist_max))
            stats.counts += counts
        else:
            stats.counts[self.bins // 2] += finite.size

    def kernel(self, kernel: int, operands: Sequence[Any], results: Sequence[Any]) -> None:
        desc = self.program.kernels[kernel]
        for tid, result in zip(desc.outputs, results, strict=False):
            if tid >= 0 and result is not None:
                self.observe(self.program.tensors[tid].name, np.asarray(result))


def collect(
    qpc_path: str | Path, samples: Sequence[Mapping[str, np.ndarray]], bins: int
) -> Profile:
    """Run the float QPC over `samples` twice (ranges, then histograms) and profile it."""
    with QpcSession(qpc_path) as session:
        executor = session.executor(samples[0])
        probe = RangeProbe(executor.program, bins)
        executor.probe = probe  # type: ignore[assignment]
        try:
            for histograms in (False, True):
                probe.histograms = histograms
                for feeds in samples:
                    for name, value in feeds.items():
                        probe.observe(name, np.asarray(value))
                    with np.errstate(all="ignore"):
                        executor.run(feeds)
        finally:
            executor.probe = None
        inputs = [
            {"name": io.name, "dtype": io.dtype, "shape": list(io.dims)}
            for io in session.network.inputs
        ]
    for stats in probe.stats.values():
        if stats.counts.size == 0:
            stats.hist_min, stats.hist_max = min(stats.min, 0.0), max(stats.max, 0.0)
            stats.counts = np.zeros(bins, np.int64)
    return Profile(len(samples), bins, inputs, probe.stats)
