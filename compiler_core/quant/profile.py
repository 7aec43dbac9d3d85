"""The quantization profile's format: what each tensor of the float model held on the
calibration set (its minimum, maximum and a histogram), read and written.

The profile keeps the raw histograms, so one profile serves every calibration method and
schema (`-quantization-calibration` is a compile option, applied when the profile is loaded).
The quantize pass reads it; `quant/collect.py` fills it by running the float model.

File (JSON, docs/quantization.md):

    {"format": "qpcfarm-quantization-profile", "version": 1, "samples": 16,
     "num_histogram_bins": 512,
     "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 3, 224, 224]}],
     "tensors": {"conv1_out": {"min": -3.1, "max": 7.9, "hist_min": -3.1, "hist_max": 7.9,
                               "counts": [0, 3, ...]}, ...}}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.model_folder import LOCAL, ModelFolder

FORMAT = "qpcfarm-quantization-profile"
VERSION = 1


@dataclass
class TensorStats:
    """One tensor over the calibration set."""

    min: float
    max: float
    hist_min: float = 0.0
    hist_max: float = 0.0
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def edges(self) -> np.ndarray:
        return np.linspace(self.hist_min, self.hist_max, len(self.counts) + 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "min": self.min,
            "max": self.max,
            "hist_min": self.hist_min,
            "hist_max": self.hist_max,
            "counts": [int(c) for c in self.counts],
        }


@dataclass
class Profile:
    samples: int
    bins: int
    inputs: list[dict[str, Any]]
    tensors: dict[str, TensorStats]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "samples": self.samples,
            "num_histogram_bins": self.bins,
            "inputs": self.inputs,
            "tensors": {name: t.to_json() for name, t in sorted(self.tensors.items())},
        }


def write_profile(profile: Profile, path: str | Path) -> None:
    try:
        Path(path).write_text(json.dumps(profile.to_json()), encoding="utf-8")
    except OSError as exc:
        raise CompileError(
            "invalid_option",
            f"-dump-profile: cannot write {path}: {exc.strerror}",
            flag="-dump-profile",
        ) from None


def read_profile(
    path: str | Path, flag: str = "-load-profile", folder: ModelFolder = LOCAL
) -> Profile:
    """A profile file, checked: a clear `invalid_option` naming the flag otherwise (and a
    file outside a confined `folder` is `file_outside_model`)."""

    def bad(reason: str) -> CompileError:
        return CompileError("invalid_option", f"{flag}: {path}: {reason}", flag=flag)

    try:
        doc = json.loads(folder.resolve(path, flag).read_text(encoding="utf-8"))
    except OSError as exc:
        raise bad(f"cannot read it ({exc.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise bad(f"not a JSON profile ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad(f'not a quantization profile (no "format": "{FORMAT}")')
    if doc.get("version") != VERSION:
        raise bad(f"profile version {doc.get('version')!r}; this compiler reads {VERSION}")
    tensors: dict[str, TensorStats] = {}
    raw = doc.get("tensors")
    if not isinstance(raw, dict):
        raise bad('"tensors" must be an object of tensor name -> statistics')
    for name, entry in raw.items():
        try:
            stats = TensorStats(
                min=float(entry["min"]),
                max=float(entry["max"]),
                hist_min=float(entry["hist_min"]),
                hist_max=float(entry["hist_max"]),
                counts=np.asarray(entry["counts"], dtype=np.int64),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(
                f"tensor {name!r}: {exc!r} (needs min, max, hist_min, hist_max, counts)"
            ) from None
        if not all(map(math.isfinite, (stats.min, stats.max))) or stats.min > stats.max:
            raise bad(f"tensor {name!r}: range [{stats.min}, {stats.max}] is not finite/ordered")
        if stats.counts.ndim != 1 or np.any(stats.counts < 0):
            raise bad(f"tensor {name!r}: counts must be a list of non-negative integers")
        tensors[name] = stats
    return Profile(
        samples=int(doc.get("samples", 0)),
        bins=int(doc.get("num_histogram_bins", 0)),
        inputs=list(doc.get("inputs", [])),
        tensors=tensors,
    )
