"""The accuracy report of a quantized compile: its outputs against the float model's.

Both programs run on the functional runtime (the float one compiled in fp32 with our
kernels), on the calibration samples and on the held-back ones (with `-dump-profile`, the
last quarter of `-input-list-file` is held back from calibration; with `-load-profile`, every
given sample is held back). Per output: the largest absolute error, that error relative to
the float output's largest magnitude, the cosine similarity of the two outputs over every
sample, and for a classifier-shaped output ([batch, classes]) the share of samples whose
arg-max agrees (top-1 agreement).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

Feeds = Mapping[str, np.ndarray]
T = TypeVar("T")

POOR_COSINE = 0.99
POOR_TOP1 = 0.95


def split(samples: Sequence[T]) -> tuple[list[T], list[T]]:
    """(calibration, held back): the last quarter is held back, at least one sample when
    there are two or more."""
    held = len(samples) // 4 if len(samples) >= 4 else (1 if len(samples) >= 2 else 0)
    cut = len(samples) - held
    return list(samples[:cut]), list(samples[cut:])


def _run(qpc: str | Path, samples: Sequence[Feeds]) -> dict[str, list[np.ndarray]]:
    from compiler_core.runtime.session import QpcSession

    outputs: dict[str, list[np.ndarray]] = {}
    with QpcSession(qpc) as session:
        for feeds in samples:
            for name, value in session.run(feeds).items():
                outputs.setdefault(name, []).append(np.asarray(value, dtype=np.float64))
    return outputs


def compare(reference: Sequence[np.ndarray], got: Sequence[np.ndarray]) -> dict[str, Any]:
    """Error figures of one output over a set of samples."""
    ref = np.stack(reference).astype(np.float64)
    out = np.stack(got).astype(np.float64)
    diff = np.abs(out - ref)
    finite = np.isfinite(diff)
    max_abs = float(diff[finite].max()) if finite.any() else float("inf")
    scale = float(np.abs(ref).max()) or 1.0
    a, b = ref.reshape(-1), out.reshape(-1)
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    cosine = float(a @ b / norm) if norm > 0 else (1.0 if not a.any() and not b.any() else 0.0)
    figures: dict[str, Any] = {
        "max_abs_error": round(max_abs, 6),
        "relative_error": round(max_abs / scale, 6),
        "cosine_similarity": round(cosine, 6),
    }
    if ref.ndim == 3 and ref.shape[-1] > 1:  # samples x [batch, classes]
        agree = np.argmax(ref, axis=-1) == np.argmax(out, axis=-1)
        figures["top1_agreement"] = round(float(agree.mean()), 4)
    return figures


def report(
    float_qpc: str | Path, quant_qpc: str | Path, sets: Mapping[str, Sequence[Feeds]]
) -> dict[str, Any]:
    """{set name: {"samples": n, "outputs": {output: figures}}} for each non-empty set."""
    out: dict[str, Any] = {}
    for name, samples in sets.items():
        if not samples:
            continue
        ref, got = _run(float_qpc, samples), _run(quant_qpc, samples)
        out[name] = {
            "samples": len(samples),
            "outputs": {o: compare(ref[o], got[o]) for o in ref if o in got},
        }
    return out


def poor(accuracy: Mapping[str, Any]) -> list[str]:
    """Outputs whose figures fall below the thresholds, as 'set/output (figure)' strings."""
    found = []
    for set_name, entry in accuracy.items():
        if not isinstance(entry, Mapping) or "outputs" not in entry:
            continue
        for output, figures in entry["outputs"].items():
            if figures["cosine_similarity"] < POOR_COSINE:
                found.append(f"{set_name}/{output} (cosine {figures['cosine_similarity']})")
            elif figures.get("top1_agreement", 1.0) < POOR_TOP1:
                found.append(f"{set_name}/{output} (top-1 {figures['top1_agreement']})")
    return found
