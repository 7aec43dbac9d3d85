"""The vendor's three sample search spaces, rebuilt from their description (the files
themselves are the vendor's): written as CSV into docs/ by `write_samples` and kept in step
by a test.

- `config_8cores_only_smallset.csv`: cores x instances = 8, batch size 1 or 4, mos 1/4/8,
  ols 1/2/4, only the valid rows (mos and ols no larger than the cores): 36 combinations;
- `config_8cores_only.csv`: the same with batch 1/2/4/8 and mos 1/2/4/8: 104;
- `config_14cores_ref.csv`: every valid combination filling a 14-core SoC (cores x
  instances = 14), batch 1/2/4/8, mos up to the cores, ols powers of two up to the cores.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from compiler_core.configurator.space import SearchSpace, build_space

COLUMNS = ("cores", "instances", "batchsize", "mos", "ols", "set_size")


def _rows(
    total_cores: int, batches: tuple[int, ...], mos: tuple[int, ...], ols: tuple[int, ...]
) -> list[dict[str, int]]:
    rows = []
    for cores in range(1, total_cores + 1):
        if total_cores % cores:
            continue
        for batch in batches:
            for m in mos:
                for o in ols:
                    if m <= cores and o <= cores:
                        row = {"cores": cores, "instances": total_cores // cores}
                        row.update(batchsize=batch, mos=m, ols=o, set_size=1)
                        rows.append(row)
    return rows


SAMPLES: dict[str, list[dict[str, int]]] = {
    "config_8cores_only_smallset.csv": _rows(8, (1, 4), (1, 4, 8), (1, 2, 4)),
    "config_8cores_only.csv": _rows(8, (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4)),
    "config_14cores_ref.csv": _rows(14, (1, 2, 4, 8), (1, 2, 4, 7, 8, 14), (1, 2, 4, 8)),
}


def sample_csv(name: str) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(SAMPLES[name])
    return out.getvalue()


def sample_space(
    name: str, base: tuple[str, ...] = ("-aic-device=aic100-standard",)
) -> SearchSpace:
    """A sample space checked against a 14-core Standard card by default."""
    return build_space(SAMPLES[name], base)


def write_samples(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in SAMPLES:
        path = directory / name
        path.write_text(sample_csv(name))
        written.append(path)
    return written
