"""Calibration: the range each tensor is quantized over, chosen from its profile histogram.

Every method works on the histogram of |x| (for a signed symmetric tensor) or of one side of
zero (each side of an asymmetric one), and returns the clipping threshold:

- `None` (MinMax): the largest |x| seen;
- `Percentile`: the smallest threshold keeping `-percentile-calibration-value` percent of the
  values inside;
- `KLMinimization`: the threshold whose quantized distribution is closest (Kullback-Leibler)
  to the original, the values beyond the threshold counted in the last bin (clipping costs);
  `KLMinimizationV2`: the same search with the clipped values left out of the reference
  distribution (only the shape inside the range counts), which clips more aggressively;
- `MSE`: the threshold with the least expected squared error, rounding noise (step**2 / 12)
  inside the range plus the clipping error beyond it;
- `SQNR`: the threshold with the best signal-to-noise ratio per value (each bin's error
  relative to its own power), which protects small values more than `MSE` does.
"""

from __future__ import annotations

import numpy as np

from compiler_core.quant.profile import TensorStats

SPARSE = 4
"""KL needs a populated histogram: a tensor with fewer than SPARSE values per bin over the
calibration set (a classifier's logits) keeps its MinMax range."""

METHODS = ("None", "KLMinimization", "KLMinimizationV2", "Percentile", "MSE", "SQNR")


def side_histogram(stats: TensorStats, positive: bool) -> tuple[np.ndarray, np.ndarray]:
    """Counts and bin edges of |x| over one side of zero (both sides: see abs_histogram)."""
    edges = stats.edges
    centres = (edges[:-1] + edges[1:]) / 2
    keep = centres > 0 if positive else centres < 0
    return _rebin(np.abs(centres[keep]), stats.counts[keep], stats)


def abs_histogram(stats: TensorStats) -> tuple[np.ndarray, np.ndarray]:
    edges = stats.edges
    centres = (edges[:-1] + edges[1:]) / 2
    return _rebin(np.abs(centres), stats.counts, stats)


def _rebin(
    values: np.ndarray, counts: np.ndarray, stats: TensorStats
) -> tuple[np.ndarray, np.ndarray]:
    top = max(abs(stats.hist_min), abs(stats.hist_max), 1e-30)
    bins = max(len(stats.counts), 16)
    hist, edges = np.histogram(values, bins=bins, range=(0.0, top), weights=counts)
    return hist.astype(np.float64), edges


def threshold(
    counts: np.ndarray, edges: np.ndarray, method: str, levels: int, percentile: float = 100.0
) -> float:
    """The clipping threshold of |x| by `method`; `levels`: quantization steps over it."""
    total = counts.sum()
    if total <= 0:
        return float(edges[-1])
    nonzero = np.nonzero(counts)[0]
    top = float(edges[nonzero[-1] + 1])
    if method == "None":
        return top
    if method == "Percentile":
        cumulative = np.cumsum(counts) / total
        index = int(np.searchsorted(cumulative, percentile / 100.0 - 1e-12))
        return float(edges[min(index + 1, len(edges) - 1)])
    if method in ("KLMinimization", "KLMinimizationV2"):
        if total < SPARSE * len(counts):
            return top  # too few values for a distribution to compare: MinMax
        return _kl(counts, edges, levels, fold=method == "KLMinimization")
    return _least_error(counts, edges, levels, relative=method == "SQNR")


def _kl(counts: np.ndarray, edges: np.ndarray, levels: int, fold: bool) -> float:
    bins = len(counts)
    levels = min(levels, bins)
    best, best_i = np.inf, bins
    last = int(np.nonzero(counts)[0][-1]) + 1
    for i in range(levels, max(levels, last) + 1):
        p = counts[:i].copy()
        if fold:
            p[-1] += counts[i:].sum()
        if p.sum() <= 0:
            continue
        inside = counts[:i]
        q = np.zeros(i)
        chunks = np.array_split(np.arange(i), levels)
        for chunk in chunks:
            mass = inside[chunk].sum()
            used = chunk[inside[chunk] > 0]
            if len(used):
                q[used] = mass / len(used)
        pn, qn = p / p.sum(), q / max(q.sum(), 1e-300)
        mask = pn > 0
        eps = 1e-10
        kl = float(np.sum(pn[mask] * np.log(pn[mask] / np.maximum(qn[mask], eps))))
        if kl < best:
            best, best_i = kl, i
    return float(edges[best_i])


def _least_error(counts: np.ndarray, edges: np.ndarray, levels: int, relative: bool) -> float:
    centres = (edges[:-1] + edges[1:]) / 2
    width = float(edges[1] - edges[0])
    candidates = edges[1:][counts.cumsum() > 0]
    if len(candidates) > 256:
        candidates = candidates[np.linspace(0, len(candidates) - 1, 256).astype(int)]
    weight = counts / np.maximum(centres**2, width**2) if relative else counts
    best, best_t = np.inf, float(edges[-1])
    for t in candidates:
        step = t / levels
        err = np.where(centres > t, (centres - t) ** 2, step**2 / 12.0)
        total = float(np.sum(weight * err))
        if total < best:
            best, best_t = total, float(t)
    return best_t
