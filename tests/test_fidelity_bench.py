"""bench/fidelity.py's pure helpers: the published rows, the error figures and the search
space (the bench itself compiles full-size models and never runs here)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.fidelity import ROWS, mean_absolute_error_percent, ratio, space_rows, table
from compiler_core.configurator.space import build_space


def test_published_rows_are_mlperf_v31_offline_per_card_on_the_pro_card() -> None:
    published = {r.key: r.per_card for r in ROWS if r.per_card is not None}
    assert published == {"resnet50-int8": 24_876.0, "bert-large-int8": 784.0}
    assert {r.key for r in ROWS if r.per_card is None} == {"resnet50-fp16", "bert-large-fp16"}
    assert {r.device for r in ROWS} == {"aic100-pro"}


def test_mean_absolute_error_skips_rows_without_a_published_figure() -> None:
    pairs = [(1.2, 1.0), (0.9, 1.0), (5.0, None)]
    assert mean_absolute_error_percent(pairs) == pytest.approx(15.0)
    assert mean_absolute_error_percent([(5.0, None)]) is None
    assert ratio(30.0, 20.0) == pytest.approx(1.5)
    assert ratio(30.0, None) is None


def test_quick_space_is_valid_for_the_pro_card_and_keeps_one_socs_cores() -> None:
    rows, constraints = space_rows(quick=True, cores_per_soc=16)
    space = build_space(rows, ["-aic-device=aic100-pro"], constraints)
    assert len(space.groups) == 9  # cores {4, 8, 16} x batch {1, 4, 8}
    assert all(p.cores * p.instances <= 16 for p in space.valid_points)
    assert {p.instances for p in space.valid_points} == {1, 2, 4}


def test_table_flags_a_row_outside_fifteen_percent() -> None:
    config = {"cores": 4, "instances_per_soc": 4, "batch": 8, "set_size": 2}
    results: list[dict[str, Any]] = [
        {"key": "resnet50-int8", "model": "ResNet-50", "precision": "int8",
         "device": "aic100-pro", "published": 100.0, "estimated": 120.0, "ratio": 1.2,
         "config": config, "device_us": 10.0},
        {"key": "resnet50-fp16", "model": "ResNet-50", "precision": "fp16",
         "device": "aic100-pro", "published": None, "estimated": 60.0, "ratio": None,
         "config": config, "device_us": 20.0},
    ]  # fmt: skip
    lines = table(results)
    assert "| 1.20 | no |" in lines[2]
    assert "mean absolute error: 20.0%" in "\n".join(lines)
    assert "resnet50: int8 / fp16 estimated = 2.00x" in lines
