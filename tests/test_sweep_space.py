"""The configurator's search spaces, scoring and search modes, without a farm: parsing the
vendor's CSV and the compact JSON/YAML form, reporting invalid combinations, the scoring
formulas on hand-made metrics, and what brute and optimize compile."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from compiler_core.configurator.samples import SAMPLES, sample_csv, sample_space
from compiler_core.configurator.scoring import pareto_front, parse_objective, score
from compiler_core.configurator.search import (
    best,
    neighbours,
    next_groups,
    results,
    start_group,
)
from compiler_core.configurator.space import (
    SearchSpace,
    SpaceError,
    build_space,
    load_space,
    parse_csv,
    parse_mapping,
    parse_text,
)
from compiler_core.errors import CompileError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configurator"
GB = 1e9


# ------------------------------------------------------------------------------ spaces


def test_the_vendor_sample_spaces_have_their_documented_sizes_and_match_the_docs_files() -> None:
    sizes = {name: len(sample_space(name).points) for name in SAMPLES}
    assert sizes["config_8cores_only_smallset.csv"] == 36
    assert sizes["config_8cores_only.csv"] == 104
    for name in SAMPLES:
        assert (DOCS / name).read_text() == sample_csv(name), f"regenerate docs/configurator/{name}"
        space = load_space(DOCS / name, ["-aic-device=aic100-standard"])
        assert not space.invalid_points  # only valid rows, as the vendor's files
        assert all(p.cores * p.instances == (14 if "14" in name else 8) for p in space.points)


def test_csv_columns_are_matched_leniently_and_blank_cells_leave_a_flag_unset() -> None:
    space = parse_csv(
        "# a comment\n-aic-num-cores,Num-Instances,batch-size,mos,ols,set-size,convert_to_fp16\n"
        "4,2,8,,2,2,true\n2,1,1,2,1,1,false\n"
    )
    first, second = space.points
    assert first.valid and second.valid
    assert (first.cores, first.instances, first.batchsize, first.set_size) == (4, 2, 8, 2)
    assert first.options is not None and first.options.mos is None
    assert first.options.convert_to_fp16 and first.options.ols == 2
    assert second.options is not None and second.options.mos == 2
    assert "-convert-to-fp16" in first.flags() and "instances=2" in first.flags()


def test_invalid_combinations_are_reported_with_their_reason_and_not_grouped() -> None:
    space = parse_csv(
        "cores,instances,ols,mos,set_size\n"
        "2,1,4,1,1\n"  # ols larger than cores
        "4,1,3,1,1\n"  # ols not a power of two
        "2,1,1,4,1\n"  # mos larger than cores
        "8,3,1,1,1\n"  # 24 cores on a 16-core SoC
        "2,1,1,1,0\n"  # set size 0
        "2,2,1,1,1\n"  # valid
    )
    reasons = [p.reason for p in space.points]
    assert "-ols" in reasons[0] and "-ols" in reasons[1]
    assert "-mos" in reasons[2]
    assert "cores x instances = 24" in reasons[3] and "16 cores" in reasons[3]
    assert "set size" in reasons[4]
    assert space.points[5].valid and len(space.groups) == 1
    assert [p.index for p in space.invalid_points] == [0, 1, 2, 3, 4]


def test_the_compact_form_expands_lists_applies_constraints_and_base_flags() -> None:
    data = {
        "parameters": {"cores": [1, 2, 4], "instances": [1, 2, 4], "batchsize": [1, 4]},
        "constraints": ["cores * instances <= 4", "not (cores == 1 and batchsize == 4)"],
        "base_flags": ["-convert-to-fp16", "-aic-device=aic100-standard"],
    }
    space = parse_mapping(data)
    assert len(space.points) == 18
    valid = {(p.cores, p.instances, p.batchsize) for p in space.valid_points}
    assert (4, 2, 1) not in valid and (1, 4, 4) not in valid and (1, 4, 1) in valid
    assert all(p.options is not None and p.options.convert_to_fp16 for p in space.valid_points)
    # instances need no compile: (cores, batch) pairs are the groups
    assert len(space.groups) == len({(p.cores, p.batchsize) for p in space.valid_points})
    refused = [p for p in space.invalid_points if "constraint" in p.reason]
    assert refused and all(p.reason.startswith("fails the constraint") for p in refused)


def test_yaml_and_json_spaces_read_the_same_and_the_docs_example_is_valid(tmp_path: Path) -> None:
    data = {"parameters": {"cores": [2, 4], "ols": [1, 2]}, "base_flags": {"convert-to-fp16": True}}
    as_json = tmp_path / "s.json"
    as_json.write_text(json.dumps(data))
    import yaml

    as_yaml = tmp_path / "s.yaml"
    as_yaml.write_text(yaml.safe_dump(data))
    a, b = load_space(as_json), load_space(as_yaml)
    assert [p.flags() for p in a.points] == [p.flags() for p in b.points]
    example = load_space(DOCS / "space_14cores.yaml")
    assert example.valid_points and example.invalid_points
    assert all(p.cores * p.instances <= 14 for p in example.valid_points)


@pytest.mark.parametrize(
    ("text", "fmt", "words"),
    [
        ("cores,colour\n1,red\n", "csv", "unknown search-space parameter 'colour'"),
        ("", "csv", "empty"),
        ("cores,instances\n", "csv", "no combinations"),
        ("cores\n1,2\n", "csv", "more cells"),
        ('{"parameters": {"cores": []}}', "json", "empty list"),
        ('{"parameters": {"cores": [1]}, "extra": 1}', "json", "unknown search-space keys"),
        ('{"parameters": {"cores": [1]}, "constraints": ["__import__(1)"]}', "json", "not allowed"),
        ('{"parameters": {"cores": [1]}, "constraints": ["cores <"]}', "json", "not an expression"),
        (
            '{"parameters": {"cores": [1]}, "constraints": ["9 ** 9 ** 9 > cores"]}',
            "json",
            "not allowed",
        ),
        ('{"parameters": {"cores": [1]}, "base_flags": ["-aic-num-cores=x"]}', "json", "base"),
        ('{"parameters": {"m": ["x.onnx"]}}', "json", "cannot set -model"),
        (
            '{"parameters": {"cores": [1]}, "base_flags": ["-operators-supported=onnx"]}',
            "json",
            "cannot set -operators-supported",
        ),
        (
            '{"parameters": {"cores": [1]}, "base_flags": {"aic-binary-dir": "out"}}',
            "json",
            "cannot set -aic-binary-dir",
        ),
        ("[1, 2]", "json", "must be a mapping"),
        ("{", "json", "not valid JSON"),
        ("a: [", "yaml", "not valid YAML"),
    ],
)
def test_bad_spaces_fail_with_a_message_naming_the_problem(text: str, fmt: str, words: str) -> None:
    with pytest.raises(SpaceError) as caught:
        parse_text(text, fmt)
    assert words in caught.value.message
    assert caught.value.code == "invalid_search_space"


def test_a_stored_space_rebuilds_to_the_same_points() -> None:
    space = sample_space("config_8cores_only_smallset.csv")
    again = SearchSpace.from_json(json.loads(json.dumps(space.to_json())))
    assert [p.flags() for p in again.points] == [p.flags() for p in space.points]
    assert [g.points for g in again.groups] == [g.points for g in space.groups]


# ------------------------------------------------------------------------------ scoring


def metrics(device_us: float, host_us: float, ddr_bytes: int, device: str = "aic100-standard"):
    return {
        "device": device,
        "estimated_device_latency_us": device_us,
        "host_transfer_us": host_us,
        "memory_traffic": {"total": {"ddr_read_bytes": ddr_bytes, "ddr_write_bytes": 0}},
    }


def test_throughput_is_instances_times_batch_over_the_period() -> None:
    m = metrics(100.0, 10.0, 0)
    one = score(m, instances=1, batchsize=4, set_size=1)
    busy = 110.0 + one.host_overhead_us  # transfers and the submit not hidden with set size 1
    assert one.host_overhead_us > 0
    assert one.period_us == pytest.approx(busy)
    assert one.throughput == pytest.approx(4 / (busy * 1e-6))
    assert one.latency_us == pytest.approx(busy)
    four = score(m, instances=4, batchsize=4, set_size=1)
    assert four.throughput == pytest.approx(4 * one.throughput)
    assert four.estimated


def test_a_set_size_above_one_hides_host_transfers_at_the_cost_of_latency() -> None:
    m = metrics(100.0, 10.0, 0)
    queued = score(m, instances=1, batchsize=1, set_size=2)
    assert queued.period_us == pytest.approx(100.0)  # the transfer overlaps the run
    assert queued.latency_us == pytest.approx(200.0)  # two batches in flight (Little's law)
    # the shared host link bounds many instances
    many = score(metrics(100.0, 30.0, 0), instances=7, batchsize=1, set_size=2)
    assert many.period_us == pytest.approx(7 * 30.0)


def test_instances_share_the_socs_ddr_bandwidth() -> None:
    bandwidth = 137 * GB  # the Standard SoC's LPDDR4x, per the device profile
    from compiler_core.devices import get_device

    assert get_device("aic100-standard").ddr_bandwidth_bytes_per_s == pytest.approx(bandwidth, 0.01)
    moves = int(get_device("aic100-standard").ddr_bandwidth_bytes_per_s * 100e-6)  # 100 us worth
    m = metrics(150.0, 0.0, moves)
    alone = score(m, instances=1, batchsize=1, set_size=2)
    assert not alone.ddr_bound and alone.period_us == pytest.approx(150.0)
    crowded = score(m, instances=4, batchsize=1, set_size=2)
    assert crowded.ddr_bound and crowded.period_us == pytest.approx(400.0, rel=1e-6)
    assert crowded.throughput == pytest.approx(4 / 400e-6, rel=1e-6)


def test_objectives_and_their_bounds() -> None:
    assert parse_objective("throughput") == ("max-throughput", None)
    assert parse_objective("latency") == ("min-latency", None)
    assert parse_objective("max-throughput-under-latency", 50) == (
        "max-throughput-under-latency",
        50.0,
    )
    for name, bound in (("max-throughput-under-latency", None), ("fastest", None)):
        with pytest.raises(CompileError):
            parse_objective(name, bound)


def test_the_pareto_front_keeps_only_undominated_points() -> None:
    points = [(10.0, 100.0), (20.0, 300.0), (15.0, 90.0), (30.0, 300.0), (5.0, 10.0)]
    assert pareto_front(points) == [4, 0, 1]


# ------------------------------------------------------------------------------ modes


def synthetic(space: SearchSpace, best_cores: int, best_batch: int) -> dict[int, Any]:
    """Metrics per group of a unimodal landscape: device time grows away from
    (best_cores, best_batch) on a log scale."""
    import math

    out = {}
    for g in space.groups:
        cores, batch = g.options.aic_num_cores, g.options.batchsize or 1
        distance = abs(math.log2(cores / best_cores)) + abs(math.log2(batch / best_batch))
        out[g.index] = metrics(batch * 50.0 * (1 + distance) / cores**0.5, 1.0, 0)
    return out


def run_search(space: SearchSpace, mode: str, landscape: dict[int, Any], objective: str,
               bound: float | None = None) -> dict[int, Any]:  # fmt: skip
    """Drive `next_groups` to the end, compiling each round's groups at once."""
    done: dict[int, Any] = {}
    while wanted := next_groups(space, mode, done, set(), objective, bound):
        for g in wanted:
            assert g not in done, "a group was proposed twice"
            done[g] = landscape[g]
    return done


def test_brute_compiles_every_group_once_and_optimize_far_fewer_finding_the_same_best() -> None:
    space = sample_space("config_8cores_only.csv")
    landscape = synthetic(space, best_cores=4, best_batch=2)
    brute = run_search(space, "brute", landscape, "max-throughput")
    assert sorted(brute) == [g.index for g in space.groups]
    optimize = run_search(space, "optimize", landscape, "max-throughput")
    assert len(optimize) < len(brute) / 2
    top_brute = best(results(space, brute), "max-throughput", None)
    top_opt = best(results(space, optimize), "max-throughput", None)
    assert top_brute is not None and top_opt is not None
    assert top_opt.score == top_brute.score


def test_optimize_starts_mid_space_and_steps_one_value_along_one_axis() -> None:
    space = sample_space("config_8cores_only.csv")
    start = space.groups[start_group(space)]
    assert start.options.aic_num_cores in (2, 4) and (start.options.batchsize or 1) in (2, 4)
    for n in neighbours(space, start.index):
        other = space.groups[n]
        changed = [
            k for k in start.compile_params if start.compile_params[k] != other.compile_params[k]
        ]
        assert changed, "a neighbour differs"
    # nothing is proposed while a round is pending
    assert next_groups(space, "optimize", {}, {start.index}, "max-throughput") == []


def test_optimize_survives_failed_compiles_and_a_bound_no_one_meets() -> None:
    space = sample_space("config_8cores_only_smallset.csv")
    landscape: dict[int, Any] = dict.fromkeys(range(len(space.groups)))  # every compile fails
    done = run_search(space, "optimize", landscape, "max-throughput")
    assert len(done) == len(space.groups)  # it widened until nothing was left
    assert best(results(space, done, {0: "boom"}), "max-throughput", None) is None
    ok = synthetic(space, 8, 4)
    bounded = run_search(space, "brute", ok, "max-throughput-under-latency", 1e-3)
    assert best(results(space, bounded), "max-throughput-under-latency", 1e-3) is None


def test_a_latency_bound_picks_the_fastest_combination_within_it() -> None:
    space = build_space(
        [{"cores": 4, "instances": i, "batchsize": b} for i in (1, 2, 4) for b in (1, 8)],
        ["-aic-device=aic100-standard"],
    )
    landscape = {g.index: metrics(20.0 * (g.options.batchsize or 1), 2.0, 0) for g in space.groups}
    done = run_search(space, "brute", landscape, "max-throughput")
    items = results(space, done)
    unbounded = best(items, "max-throughput", None)
    bounded = best(items, "max-throughput-under-latency", 50.0)
    latency = best(items, "min-latency", None)
    assert unbounded is not None and bounded is not None and latency is not None
    assert unbounded.score and bounded.score and latency.score
    assert unbounded.point.batchsize == 8 and unbounded.score.latency_us > 50.0
    assert bounded.score.latency_us <= 50.0 and bounded.point.batchsize == 1
    assert latency.score.latency_us == min(r.score.latency_us for r in items if r.score)
