"""The compile-option schema: parsing flags and JSON, the rules, canonical forms, help, schema."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import pickle

import pytest

from compiler_core.devices import (
    clock_from_tflops,
    default_device_for,
    get_device,
    list_devices,
)
from compiler_core.errors import CompileError
from compiler_core.options import (
    LOCAL_ONLY_OPTIONS,
    MODEL_FILE_OPTIONS,
    OPTIONS,
    CompileOptions,
    options_json_schema,
    spec_for,
    usage,
)


def rejected(flags: list[str]) -> CompileError:
    with pytest.raises(CompileError) as info:
        CompileOptions.from_flags(flags)
    return info.value


def assert_names(err: CompileError, flag: str, value: str, *rule_words: str) -> None:
    """A rejection names the flag, the value given and the rule broken, on one line."""
    assert err.code == "invalid_option"
    assert err.flag == flag
    assert flag in err.message and value in err.message
    for word in rule_words:
        assert word in err.message, err.message
    assert "\n" not in err.message


# -- defaults and basic parsing ---------------------------------------------------------------


def test_no_flags_gives_the_documented_defaults() -> None:
    o = CompileOptions.from_flags([])
    assert o == CompileOptions()
    assert (o.aic_num_cores, o.ols, o.mos, o.stats_level) == (1, 1, None, 40)
    assert o.vtcm_working_set_limit_ratio == 1.0 and o.size_split_granularity == 1024
    assert o.aic_hw_version == "ai100" and o.aic_device is None
    assert o.device == default_device_for("ai100")
    assert o.warnings == ()


def test_model_alias_m_and_model_are_the_same_option() -> None:
    assert CompileOptions.from_flags(["-m=a.onnx"]) == CompileOptions.from_flags(["-model=a.onnx"])
    assert CompileOptions.from_flags(["-m=a.onnx"]).model == "a.onnx"


def test_booleans_are_bare_or_true_false() -> None:
    assert CompileOptions.from_flags(["-convert-to-fp16"]).convert_to_fp16 is True
    assert CompileOptions.from_flags(["-convert-to-fp16=true"]).convert_to_fp16 is True
    assert CompileOptions.from_flags(["-convert-to-fp16=false"]).convert_to_fp16 is False
    assert_names(rejected(["-convert-to-fp16=maybe"]), "-convert-to-fp16", "maybe", "true or false")


def test_double_dash_spelling_is_accepted_like_llvm_tools() -> None:
    assert CompileOptions.from_flags(["--aic-num-cores=4"]).aic_num_cores == 4


def test_value_flags_need_an_equals_value() -> None:
    err = rejected(["-batchsize"])
    assert err.flag == "-batchsize" and "-batchsize=" in err.message


def test_positional_arguments_are_rejected() -> None:
    err = rejected(["model.onnx"])
    assert "model.onnx" in err.message and "-flag=value" in err.message


def test_unknown_flag_uses_the_vendor_message_and_suggests_a_spelling() -> None:
    err = rejected(["-aic-num-core=4"])
    assert err.code == "unknown_option"
    assert err.message.startswith("Invalid option -aic-num-core.")
    assert "Did you mean -aic-num-cores?" in err.message
    assert err.message.endswith("Use -h for the list of options.")


def test_runner_profiling_flag_is_not_a_compile_option() -> None:
    err = rejected(["-aic-profiling-type=stats"])
    assert err.code == "unknown_option" and err.flag == "-aic-profiling-type"
    assert "qaic-runner" in err.message


def test_flag_names_are_case_sensitive_like_qaic_compile() -> None:
    assert CompileOptions.from_flags(["-custom-IO-list-file=io.yaml"]).custom_io_list_file == (
        "io.yaml"
    )
    assert rejected(["-custom-io-list-file=io.yaml"]).code == "unknown_option"


def test_a_non_repeatable_flag_may_appear_once() -> None:
    err = rejected(["-aic-num-cores=2", "-aic-num-cores=4"])
    assert err.flag == "-aic-num-cores" and "only once" in err.message


def test_deprecated_compile_only_is_accepted_with_a_warning() -> None:
    o = CompileOptions.from_flags(["-compile-only"])
    assert o.compile_only is True
    assert o.warnings == ("-compile-only is deprecated and ignored",)
    assert o.to_json() == CompileOptions().to_json()


# -- value rules ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "17", "-1", "2.5", "abc", ""])
def test_aic_num_cores_must_be_an_integer_in_1_to_16(value: str) -> None:
    err = rejected([f"-aic-num-cores={value}"])
    assert_names(err, "-aic-num-cores", f"-aic-num-cores: {value}", "integer", "1", "16")


def test_aic_num_cores_must_fit_the_chosen_device() -> None:
    err = rejected(["-aic-device=aic100-standard", "-aic-num-cores=16"])
    assert_names(err, "-aic-num-cores", "16", "AIC100 Standard", "14")
    assert CompileOptions.from_flags(["-aic-num-cores=16"]).aic_num_cores == 16
    assert rejected(["-aic-device=aic080", "-aic-num-cores=9"]).flag == "-aic-num-cores"


def test_ultra_bounds_cores_per_soc_not_per_card() -> None:
    assert rejected(["-aic-device=aic100-ultra", "-aic-num-cores=17"]).flag == "-aic-num-cores"
    assert CompileOptions.from_flags(["-aic-device=aic100-ultra", "-aic-num-cores=16"]).device == (
        get_device("aic100-ultra")
    )


@pytest.mark.parametrize("ols", ["3", "6"])
def test_ols_must_be_a_power_of_two(ols: str) -> None:
    err = rejected(["-aic-num-cores=8", f"-ols={ols}"])
    assert_names(err, "-ols", ols, "power of two")


def test_ols_must_not_exceed_the_cores() -> None:
    assert_names(rejected(["-aic-num-cores=4", "-ols=8"]), "-ols", "8", "-aic-num-cores (4)")
    assert CompileOptions.from_flags(["-aic-num-cores=4", "-ols=4"]).ols == 4


def test_mos_is_between_1_and_the_cores() -> None:
    assert_names(rejected(["-aic-num-cores=4", "-mos=5"]), "-mos", "5", "-aic-num-cores (4)")
    assert_names(rejected(["-mos=0"]), "-mos", "0", "integer")
    assert CompileOptions.from_flags(["-aic-num-cores=4", "-mos=2"]).mos == 2


@pytest.mark.parametrize("value", ["0", "-1", "0.0"])
def test_batchsize_must_be_at_least_one(value: str) -> None:
    assert_names(rejected([f"-batchsize={value}"]), "-batchsize", value, "from 1 to")


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2", "nan", "inf", "x"])
def test_vtcm_ratio_is_in_the_half_open_unit_interval(value: str) -> None:
    err = rejected([f"-vtcm-working-set-limit-ratio={value}"])
    assert_names(err, "-vtcm-working-set-limit-ratio", value, "greater than 0", "at most 1")


def test_vtcm_ratio_accepts_one_and_small_fractions() -> None:
    assert (
        CompileOptions.from_flags(["-vtcm-working-set-limit-ratio=1"]).vtcm_working_set_limit_ratio
        == 1.0
    )  # noqa: E501
    assert (
        CompileOptions.from_flags(
            ["-vtcm-working-set-limit-ratio=.25"]
        ).vtcm_working_set_limit_ratio
        == 0.25
    )  # noqa: E501


@pytest.mark.parametrize("value", ["511", "2049", "1k"])
def test_size_split_granularity_is_512_to_2048_kib(value: str) -> None:
    err = rejected([f"-size-split-granularity={value}"])
    assert_names(err, "-size-split-granularity", value, "512", "2048")


def test_allocator_dealloc_delay_is_a_non_negative_integer() -> None:
    assert_names(
        rejected(["-allocator-dealloc-delay=-3"]), "-allocator-dealloc-delay", "-3", ">= 0"
    )
    assert CompileOptions.from_flags(["-allocator-dealloc-delay=0"]).allocator_dealloc_delay == 0


def test_compile_threads_is_at_least_one() -> None:
    assert_names(rejected(["-compile-threads=0"]), "-compile-threads", "0", ">= 1")


def test_depth_first_mem_is_8_to_32_and_needs_depth_first() -> None:
    err = rejected(["-aic-depth-first-mem=16"])
    assert_names(err, "-aic-depth-first-mem", "16", "-aic-enable-depth-first")
    err = rejected(["-aic-enable-depth-first", "-aic-depth-first-mem=33"])
    assert_names(err, "-aic-depth-first-mem", "33", "8", "32")
    o = CompileOptions.from_flags(["-aic-enable-depth-first", "-aic-depth-first-mem=16"])
    assert o.aic_depth_first_mem == 16


def test_stats_level_takes_the_documented_levels_only() -> None:
    for level in (40, 50, 70, 100):
        assert CompileOptions.from_flags([f"-stats-level={level}"]).stats_level == level
    assert_names(rejected(["-stats-level=60"]), "-stats-level", "60", "40, 50, 70, 100")


def test_stats_batchsize_is_at_least_one_and_defaults_to_the_batch() -> None:
    assert_names(rejected(["-stats-batchsize=0"]), "-stats-batchsize", "0", "from 1 to")
    assert CompileOptions.from_flags(["-batchsize=4"]).effective_stats_batchsize == 4
    o = CompileOptions.from_flags(["-batchsize=4", "-stats-batchsize=2"])
    assert o.effective_stats_batchsize == 2


def test_pmu_recipe_takes_the_five_recipes() -> None:
    o = CompileOptions.from_flags(["-aic-pmu-recipe=kernelutil"])
    assert o.aic_pmu_recipe == "KernelUtil"
    assert_names(rejected(["-aic-pmu-recipe=Foo"]), "-aic-pmu-recipe", "Foo", "AxiRdWr", "HmxMacs")


def test_pmu_events_are_hex_and_canonicalised() -> None:
    o = CompileOptions.from_flags(["-aic-pmu-events=3f,0x70,200"])
    assert o.aic_pmu_events == ("3F", "70", "200")


@pytest.mark.parametrize("value", ["3G", "0x", "1,,2", "-3"])
def test_pmu_events_must_each_be_hex(value: str) -> None:
    assert_names(rejected([f"-aic-pmu-events={value}"]), "-aic-pmu-events", value, "hex")


def test_at_most_eight_pmu_events() -> None:
    err = rejected(["-aic-pmu-events=1,2,3,4,5,6,7,8,9"])
    assert_names(err, "-aic-pmu-events", "1,2,3,4,5,6,7,8,9", "at most 8")
    assert len(CompileOptions.from_flags(["-aic-pmu-events=1,2,3,4,5,6,7,8"]).aic_pmu_events) == 8


def test_pmu_events_may_not_repeat() -> None:
    assert "twice" in rejected(["-aic-pmu-events=3F,0x3f"]).message


def test_pmu_recipe_and_events_exclude_each_other() -> None:
    err = rejected(["-aic-pmu-recipe=AxiRd", "-aic-pmu-events=3F"])
    assert_names(err, "-aic-pmu-events", "3F", "-aic-pmu-recipe=AxiRd", "one or the other")


def test_ddr_stats_is_accepted_at_the_default_stats_level() -> None:
    assert CompileOptions.from_flags(["-ddr-stats"]).ddr_stats is True


def test_operators_supported_names_the_supported_frameworks() -> None:
    assert CompileOptions.from_flags(["-operators-supported=onnx"]).operators_supported == "onnx"
    err = rejected(["-operators-supported=caffe2"])
    assert_names(err, "-operators-supported", "caffe2", "supported: onnx, tensorflow, pytorch")


def test_define_symbol_is_repeatable_and_collects_a_mapping() -> None:
    o = CompileOptions.from_flags(["-onnx-define-symbol=seq,32", "-onnx-define-symbol=batch,1"])
    assert dict(o.onnx_define_symbol) == {"batch": 1, "seq": 32}
    assert list(o.onnx_define_symbol) == ["batch", "seq"]


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        ("batch", "<name>,<value>"),
        ("batch,0", "from 1 to"),
        ("batch,x", "from 1 to"),
        (",4", "name"),
    ],
)
def test_define_symbol_values_are_name_comma_positive_int(value: str, rule: str) -> None:
    assert_names(rejected([f"-onnx-define-symbol={value}"]), "-onnx-define-symbol", value, rule)


def test_define_symbol_may_not_bind_a_name_twice_differently() -> None:
    err = rejected(["-onnx-define-symbol=b,1", "-onnx-define-symbol=b,2"])
    assert err.flag == "-onnx-define-symbol" and "already bound to 1" in err.message
    same = CompileOptions.from_flags(["-onnx-define-symbol=b,1", "-onnx-define-symbol=b,1"])
    assert dict(same.onnx_define_symbol) == {"b": 1}


def test_hw_version_2_0_is_ai100() -> None:
    assert CompileOptions.from_flags(["-aic-hw-version=2.0"]).aic_hw_version == "ai100"
    assert_names(rejected(["-aic-hw-version=3.0"]), "-aic-hw-version", "3.0", "ai100", "ai200")


def test_device_implies_its_hardware_version_and_must_agree_with_it() -> None:
    o = CompileOptions.from_flags(["-aic-device=AIC200"])
    assert (o.aic_device, o.aic_hw_version) == ("aic200", "ai200")
    err = rejected(["-aic-device=aic200", "-aic-hw-version=2.0"])
    assert_names(err, "-aic-hw-version", "2.0", "ai200")


def test_device_accepts_display_names_and_rejects_unknown_ones() -> None:
    o = CompileOptions.from_flags(["-aic-device=AIC100 Standard"])
    assert o.aic_device == "aic100-standard" and o.device.num_cores == 14
    assert_names(rejected(["-aic-device=h100"]), "-aic-device", "h100", "aic100-pro")


def test_options_are_immutable() -> None:
    o = CompileOptions.from_flags(["-onnx-define-symbol=b,1"])
    with pytest.raises(AttributeError):
        o.aic_num_cores = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        o.onnx_define_symbol["b"] = 2  # type: ignore[index]
    assert pickle.loads(pickle.dumps(o)) == o and copy.deepcopy(o) == o
    assert hash(o) == hash(CompileOptions.from_flags(["-onnx-define-symbol=b,1"]))


def test_with_changes_options_and_validates_again() -> None:
    o = CompileOptions.from_flags(["-aic-num-cores=4"])
    assert o.with_(ols=2).ols == 2
    assert o.with_(aic_num_cores="8").aic_num_cores == 8
    with pytest.raises(CompileError) as info:
        o.with_(ols=8)
    assert info.value.flag == "-ols"
    assert o.with_(mos=None) == o


# -- JSON ---------------------------------------------------------------------------------------


def test_json_accepts_flag_names_snake_case_and_dashed_keys() -> None:
    flags = CompileOptions.from_flags(["-aic-num-cores=4", "-convert-to-fp16", "-m=a.onnx"])
    for data in (
        {"aic-num-cores": 4, "convert-to-fp16": True, "m": "a.onnx"},
        {"aic_num_cores": 4, "convert_to_fp16": True, "model": "a.onnx"},
        {"-aic-num-cores": "4", "-convert-to-fp16": "true", "-model": "a.onnx"},
    ):
        assert CompileOptions.from_json(data) == flags
        assert CompileOptions.from_json(json.dumps(data)) == flags


def test_json_symbols_and_events_take_natural_json_shapes() -> None:
    o = CompileOptions.from_json(
        {"onnx-define-symbol": {"seq": 32, "batch": "1"}, "aic-pmu-events": ["3f", "0x70"]}
    )
    assert dict(o.onnx_define_symbol) == {"batch": 1, "seq": 32}
    assert o.aic_pmu_events == ("3F", "70")
    assert CompileOptions.from_json({"onnx-define-symbol": ["seq,32", "batch,1"]}) == (
        o.with_(aic_pmu_events=())
    )


@pytest.mark.parametrize(
    ("data", "flag"),
    [
        ({"aic-num-cores": True}, "-aic-num-cores"),
        ({"aic-num-cores": 4.5}, "-aic-num-cores"),
        ({"aic-num-cores": -2}, "-aic-num-cores"),
        ({"vtcm-working-set-limit-ratio": "half"}, "-vtcm-working-set-limit-ratio"),
        ({"aic-pmu-events": [63]}, "-aic-pmu-events"),
        ({"convert-to-fp16": "yes please"}, "-convert-to-fp16"),
        ({"aic-num-cores": 4, "aic_num_cores": 4}, "-aic-num-cores"),
    ],
)
def test_json_values_are_checked_by_the_same_rules(data: dict[str, object], flag: str) -> None:
    with pytest.raises(CompileError) as info:
        CompileOptions.from_json(data)
    assert info.value.code == "invalid_option" and info.value.flag == flag
    assert flag in info.value.message


def test_json_unknown_keys_and_non_objects_are_rejected() -> None:
    with pytest.raises(CompileError) as info:
        CompileOptions.from_json({"aic-profiling-type": "stats"})
    assert info.value.code == "unknown_option"
    assert info.value.message.startswith("Invalid option -aic-profiling-type.")
    for bad in ("[1, 2]", "{not json", 3):
        with pytest.raises(CompileError) as info:
            CompileOptions.from_json(bad)  # type: ignore[arg-type]
        assert info.value.code == "invalid_option"


def test_json_null_means_the_default() -> None:
    assert CompileOptions.from_json({"mos": None, "batchsize": None}) == CompileOptions()


# -- canonical forms ----------------------------------------------------------------------------

RICH_FLAGS = [
    "-m=model.onnx",
    "-aic-binary-dir=out",
    "-aic-hw",
    "-aic-device=aic100-standard",
    "-aic-num-cores=8",
    "-ols=2",
    "-mos=4",
    "-batchsize=2",
    "-onnx-define-symbol=seq,128",
    "-onnx-define-symbol=batch,2",
    "-convert-to-fp16",
    "-vtcm-working-set-limit-ratio=0.5",
    "-size-split-granularity=2048",
    "-allocator-dealloc-delay=3",
    "-multicast-weights",
    "-aic-enable-depth-first",
    "-aic-depth-first-mem=16",
    "-time-passes",
    "-stats-level=70",
    "-stats-batchsize=2",
    "-ddr-stats",
    "-aic-pmu-events=3f,70,0x200",
    "-aic-perf-warnings",
    "-aic-perf-metrics",
    "-mxfp6-matmul",
    "-retained-state",
    "-network-specialization-config=spec.json",
    "-custom-IO-list-file=io.yaml",
    "-node-precision-info=prec.yaml",
    "-compile-threads=4",
]


def test_flags_round_trip_through_json_and_back() -> None:
    o = CompileOptions.from_flags(RICH_FLAGS)
    assert CompileOptions.from_flags(o.to_flags()) == o
    via_json = CompileOptions.from_json(json.loads(json.dumps(o.to_json(full=True))))
    assert via_json == o
    assert via_json.to_flags() == o.to_flags()


def test_to_flags_writes_canonical_spellings_and_omits_defaults() -> None:
    o = CompileOptions.from_flags(["-m=a.onnx", "-aic-hw-version=2.0", "-aic-pmu-events=3f"])
    assert o.to_flags() == ["-model=a.onnx", "-aic-pmu-events=0x3F"]  # echoed as written
    assert CompileOptions().to_flags() == []


def test_canonical_json_is_identical_for_equivalent_spellings_and_orders() -> None:
    a = CompileOptions.from_flags(
        [
            "-aic-hw-version=2.0",
            "-aic-num-cores=4",
            "-onnx-define-symbol=a,1",
            "-onnx-define-symbol=b,2",
            "-aic-pmu-events=3f,0x070",
            "-convert-to-fp16=true",
            "-vtcm-working-set-limit-ratio=0.50",
            "-m=one.onnx",
            "-time-passes",
        ]
    )
    b = CompileOptions.from_json(
        {
            "aic_pmu_events": "3F,70",
            "convert_to_fp16": True,
            "onnx-define-symbol": {"b": 2, "a": 1},
            "aic-num-cores": "4",
            "vtcm-working-set-limit-ratio": 0.5,
            "model": "two.onnx",
            "aic-hw-version": "ai100",
        }
    )
    assert a.to_json_str() == b.to_json_str()
    assert hashlib.sha256(a.to_json_str().encode()).hexdigest() == (
        hashlib.sha256(b.to_json_str().encode()).hexdigest()
    )


def test_canonical_json_changes_when_a_compile_affecting_option_changes() -> None:
    base = CompileOptions.from_flags(["-aic-num-cores=4"])
    assert base.to_json_str() != base.with_(aic_num_cores=2).to_json_str()
    assert base.to_json_str() != base.with_(convert_to_fp16=True).to_json_str()
    assert base.to_json_str() != base.with_(stats_level=70).to_json_str()


def test_canonical_json_keeps_only_options_that_change_the_qpc() -> None:
    canonical = CompileOptions.from_flags(RICH_FLAGS).to_json()
    for dropped in (
        "model",
        "aic-binary-dir",
        "time-passes",
        "aic-perf-metrics",
        "aic-perf-warnings",
        "compile-threads",
        "compile-only",
        "operators-supported",
    ):
        assert dropped not in canonical
    assert canonical["aic-num-cores"] == 8 and canonical["aic-pmu-events"] == ["3F", "70", "200"]
    assert list(canonical) == sorted(canonical)
    text = CompileOptions.from_flags(RICH_FLAGS).to_json_str()
    assert " " not in text and json.loads(text) == canonical


def test_canonical_json_is_a_fixed_point() -> None:
    o = CompileOptions.from_flags(RICH_FLAGS)
    again = CompileOptions.from_json(o.to_json())
    assert again.to_json_str() == o.to_json_str()


# -- help and schema ----------------------------------------------------------------------------


def test_help_lists_every_flag_with_its_default() -> None:
    text = usage()
    for spec in OPTIONS:
        assert spec.flag in text, spec.flag
    assert "-m, -model=<path>" in text
    assert "-aic-num-cores=<1..16>" in text and "[default: 1]" in text
    assert "[default: 1024]" in text and "[default: 40]" in text and "[default: 1.0]" in text
    assert text.count("[default:") == len(OPTIONS)
    assert "(deprecated)" in text
    assert "-aic-profiling-type" not in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_json_schema_has_a_property_per_option_keyed_by_flag_name() -> None:
    schema = options_json_schema()
    props = schema["properties"]
    assert set(props) == {spec.name for spec in OPTIONS}
    assert schema.get("additionalProperties") is False
    assert props["aic-num-cores"]["type"] == "integer"
    assert (props["aic-num-cores"]["minimum"], props["aic-num-cores"]["maximum"]) == (1, 16)
    assert props["aic-num-cores"]["default"] == 1
    assert props["stats-level"]["enum"] == [40, 50, 70, 100]
    assert props["aic-pmu-recipe"]["enum"] == ["AxiRd", "AxiWr", "AxiRdWr", "KernelUtil", "HmxMacs"]
    assert props["vtcm-working-set-limit-ratio"]["exclusiveMinimum"] == 0
    assert props["compile-only"].get("deprecated") is True
    assert props["aic-device"]["enum"] == [d.name for d in list_devices()]
    json.dumps(schema)


def test_spec_lookup_accepts_every_spelling() -> None:
    assert spec_for("-m") is spec_for("model") is spec_for("MODEL")
    assert spec_for("custom_io_list_file").name == "custom-IO-list-file"


# -- devices ------------------------------------------------------------------------------------


def test_device_profiles_carry_the_published_figures() -> None:
    std, pro, ultra = (get_device(n) for n in ("aic100-standard", "aic100-pro", "aic100-ultra"))
    assert (std.num_cores, pro.num_cores, ultra.num_cores, ultra.socs) == (14, 16, 64, 4)
    assert (std.ddr_bytes, pro.ddr_bytes, ultra.ddr_bytes) == (16 << 30, 32 << 30, 128 << 30)
    assert std.vtcm_bytes_per_core == 8_323_072 and std.l2_bytes == 1 << 20
    assert (std.hmx_fp16_macs_per_cycle, std.hvx_threads) == (4096, 4)
    assert (std.fp16_tflops, std.int8_tops, pro.fp16_tflops, pro.int8_tops) == (110, 325, 125, 375)
    assert std.noc_bandwidth_bytes_per_s == 186e9 and std.ddr_bandwidth_bytes_per_s == 137e9
    assert std.pci_device_id == 0xA100 and get_device("aic080").pci_device_id == 0xA080


def test_clock_is_derived_from_the_published_fp16_peak() -> None:
    std = get_device("aic100-standard")
    assert std.clock_hz == clock_from_tflops(110.0, 14)
    assert abs(std.peak_fp16_flops_per_core * std.num_cores - 110e12) < 1e6


def test_the_int8_rate_comes_from_the_published_int8_peak_not_twice_fp16() -> None:
    for name, tops in (("aic100-standard", 325e12), ("aic100-pro", 375e12)):
        device = get_device(name)
        peak = device.hmx_int8_macs_per_cycle * 2 * device.clock_hz * device.num_cores
        assert abs(peak - tops) / tops < 1e-3
        assert device.hmx_int8_macs_per_cycle != 2 * device.hmx_fp16_macs_per_cycle


def test_bf16_only_on_ai200_and_aic080_has_fewer_cores() -> None:
    assert all(("bfloat16" in d.dtypes) == (d.hw_version == "ai200") for d in list_devices())
    assert get_device("aic080").num_cores < get_device("aic100-standard").num_cores
    assert get_device("aic080").modelled and get_device("aic200").modelled


def test_get_device_is_case_insensitive_and_names_the_known_devices() -> None:
    assert get_device("AIC100 Pro") is get_device("aic100-pro") is get_device("Aic100_Pro")
    with pytest.raises(CompileError) as info:
        get_device("h100")
    assert info.value.code == "unknown_device"
    assert all(d.name in info.value.message for d in list_devices())


def test_default_device_per_hardware_version() -> None:
    assert default_device_for("2.0") is default_device_for("ai100")
    assert default_device_for("ai100").cores_per_soc == 16
    assert default_device_for("ai200").hw_version == "ai200"


# -- one declaration per option ---------------------------------------------------------------


def test_each_option_is_one_field_of_compile_options_declaring_its_flag() -> None:
    declared = [f.name for f in dataclasses.fields(CompileOptions) if f.name != "warnings"]
    assert [spec.attr for spec in OPTIONS] == declared
    defaults = CompileOptions()
    for spec in OPTIONS:
        if spec.name == "aic-hw-version":  # follows -aic-device: -h and the schema say so
            assert spec.default is None and defaults.aic_hw_version == "ai100"
        else:
            assert getattr(defaults, spec.attr) == spec.default, spec.name


def test_the_option_rule_sets_are_read_from_the_declarations() -> None:
    assert [s.name for s in LOCAL_ONLY_OPTIONS] == [
        "model",
        "aic-binary-dir",
        "operators-supported",
        "mdp-dump-partition-config",
    ]
    assert [s.name for s in MODEL_FILE_OPTIONS] == [
        "mdp-load-partition-config",
        "network-specialization-config",
        "custom-IO-list-file",
        "node-precision-info",
        "load-profile",
        "input-list-file",
    ]
    assert all(s.kind == "path" for s in MODEL_FILE_OPTIONS)
    assert not {s.name for s in LOCAL_ONLY_OPTIONS} & {s.name for s in MODEL_FILE_OPTIONS}
