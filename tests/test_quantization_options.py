"""The quantization options: the vendor's names and defaults, and one message per rule, naming
the flag, the value and the rule (the style of tests/test_options.py)."""

from __future__ import annotations

import pytest

from compiler_core.options import CompileOptions, options_json_schema, usage
from tests.test_options import assert_names, rejected

PROFILE = "-load-profile=profile.json"


def test_defaults_are_the_vendors() -> None:
    o = CompileOptions()
    assert o.quantization_precision == "Int8"
    assert o.quantization_precision_bias == "Int8"
    assert o.quantization_schema_activations == "symmetric_with_uint8"
    assert o.quantization_schema_constants == "symmetric_with_uint8"
    assert o.quantization_calibration == "None"
    assert o.percentile_calibration_value == 100.0
    assert o.num_histogram_bins == 512
    assert not (o.no_quant or o.enable_channelwise or o.enable_rowwise)
    assert o.execute_nodes_in_fp16 == () and o.keep_original_precision_for_nodes == ()
    assert not o.quantize


def test_every_quantization_flag_parses_with_its_canonical_spelling() -> None:
    o = CompileOptions.from_flags(
        [
            PROFILE,
            "-quantization-precision=int16",
            "-quantization-precision-bias=INT32",
            "-quantization-schema-activations=asymmetric",
            "-quantization-schema-constants=symmetric_with_power2_scale",
            "-quantization-calibration=percentile",
            "-percentile-calibration-value=99.99",
            "-enable-channelwise",
            "-enable-rowwise",
            "-execute-nodes-in-fp16=Softmax,LayerNormalization",
            "-keep-original-precision-for-nodes=Sigmoid",
        ]
    )
    assert o.quantize
    assert (o.quantization_precision, o.quantization_precision_bias) == ("Int16", "Int32")
    assert o.quantization_calibration == "Percentile"
    assert o.execute_nodes_in_fp16 == ("Softmax", "LayerNormalization")
    assert CompileOptions.from_flags(o.to_flags()) == o
    assert CompileOptions.from_json(o.to_json(full=True)) == o
    assert o.to_json()["execute-nodes-in-fp16"] == ["Softmax", "LayerNormalization"]


def test_dump_profile_with_its_calibration_inputs_quantizes_unless_no_quant() -> None:
    o = CompileOptions.from_flags(["-dump-profile=p.json", "-input-list-file=calib.npz"])
    assert o.quantize
    o = o.with_(no_quant=True)
    assert not o.quantize and o.dump_profile == "p.json"
    same = CompileOptions.from_flags(["-dump-profile=p", "-load-profile=p", "-input-list-file=c"])
    assert same.quantize


def test_execute_nodes_in_fp16_acts_without_a_profile_too() -> None:
    assert CompileOptions.from_flags(["-execute-nodes-in-fp16=Softmax"]).execute_nodes_in_fp16


def test_json_takes_lists_or_comma_text() -> None:
    a = CompileOptions.from_json({"load-profile": "p", "execute-nodes-in-fp16": ["Softmax"]})
    b = CompileOptions.from_json({"load_profile": "p", "execute_nodes_in_fp16": "Softmax"})
    assert a == b


@pytest.mark.parametrize(
    ("flags", "flag", "value", "words"),
    [
        (["-quantization-precision=Int4"], "-quantization-precision", "Int4", ["Int8, Int16"]),
        (
            ["-quantization-precision-bias=Int16"],
            "-quantization-precision-bias",
            "Int16",
            ["Int32"],
        ),
        (
            ["-quantization-schema-activations=asym"],
            "-quantization-schema-activations",
            "asym",
            ["symmetric_with_uint8"],
        ),
        (
            ["-quantization-schema-constants=power2"],
            "-quantization-schema-constants",
            "power2",
            ["symmetric_with_power2_scale"],
        ),
        (["-quantization-calibration=KL"], "-quantization-calibration", "KL", ["KLMinimization"]),
        (
            [PROFILE, "-percentile-calibration-value=89.9"],
            "-percentile-calibration-value",
            "89.9",
            ["90 to 100"],
        ),
        (
            [PROFILE, "-percentile-calibration-value=100.5"],
            "-percentile-calibration-value",
            "100.5",
            ["90 to 100"],
        ),
        (["-num-histogram-bins=8"], "-num-histogram-bins", "8", ["16 to 65536"]),
        (["-num-histogram-bins=many"], "-num-histogram-bins", "many", ["integer"]),
        (["-no-quant=maybe"], "-no-quant", "maybe", ["true or false"]),
        (
            ["-execute-nodes-in-fp16=Softmx"],
            "-execute-nodes-in-fp16",
            "Softmx",
            ["not a supported op type", "Softmax"],
        ),
        (
            [PROFILE, "-keep-original-precision-for-nodes=Conv,,Relu"],
            "-keep-original-precision-for-nodes",
            "Conv,,Relu",
            ["not an op type"],
        ),
    ],
)
def test_bad_values_name_the_flag(flags: list[str], flag: str, value: str, words: list[str]):
    assert_names(rejected(flags), flag, value, *words)


@pytest.mark.parametrize(
    "flag",
    [
        "-quantization-precision=Int16",
        "-quantization-precision-bias=Int32",
        "-quantization-schema-activations=symmetric",
        "-quantization-schema-constants=asymmetric",
        "-quantization-calibration=MSE",
        "-enable-channelwise",
        "-enable-rowwise",
        "-keep-original-precision-for-nodes=Softmax",
    ],
)
def test_tuning_without_a_profile_is_refused(flag: str) -> None:
    name = flag.split("=")[0]
    err = rejected([flag])
    assert_names(err, name, "", "acts only on a quantized compile", "no profile is given")
    err = rejected([flag, "-dump-profile=p", "-input-list-file=c.npz", "-no-quant"])
    assert_names(err, name, "", "-no-quant is given")


def test_histogram_bins_shape_a_dumped_profile_only() -> None:
    err = rejected([PROFILE, "-num-histogram-bins=1024"])
    assert_names(err, "-num-histogram-bins", "1024", "-dump-profile")
    dumped = ["-dump-profile=p", "-input-list-file=c.npz", "-no-quant", "-num-histogram-bins=64"]
    assert CompileOptions.from_flags(dumped).num_histogram_bins == 64


def test_percentile_value_needs_percentile_calibration() -> None:
    err = rejected([PROFILE, "-quantization-calibration=MSE", "-percentile-calibration-value=99"])
    assert_names(err, "-percentile-calibration-value", "99", "Percentile", "given: MSE")


def test_dump_profile_needs_calibration_inputs() -> None:
    err = rejected(["-dump-profile=p.json"])
    assert_names(err, "-dump-profile", "p.json", "-input-list-file")


def test_calibration_inputs_need_a_profile_flag() -> None:
    err = rejected(["-input-list-file=calib.txt"])
    assert_names(err, "-input-list-file", "calib.txt", "-dump-profile")


def test_load_and_dump_profile_must_name_the_same_file() -> None:
    err = rejected(["-load-profile=a.json", "-dump-profile=b.json", "-input-list-file=c.npz"])
    assert_names(err, "-load-profile", "a.json", "-dump-profile=b.json")


def test_no_quant_contradicts_load_profile() -> None:
    err = rejected([PROFILE, "-no-quant"])
    assert_names(err, "-no-quant", "true", "-load-profile=profile.json")


def test_an_op_type_is_fp16_or_original_precision_not_both() -> None:
    err = rejected(
        [
            PROFILE,
            "-execute-nodes-in-fp16=Softmax,Gelu",
            "-keep-original-precision-for-nodes=Gelu",
        ]
    )
    assert_names(err, "-keep-original-precision-for-nodes", "Gelu", "-execute-nodes-in-fp16")


def test_schema_and_help_list_the_quantization_flags() -> None:
    props = options_json_schema()["properties"]
    assert props["quantization-precision"]["enum"] == ["Int8", "Int16"]
    assert props["quantization-precision"]["default"] == "Int8"
    assert props["quantization-calibration"]["enum"][0] == "None"
    assert props["percentile-calibration-value"]["minimum"] == 90
    assert props["num-histogram-bins"]["default"] == 512
    text = usage()
    assert "Quantization:" in text and "-dump-profile=<path>" in text
    assert "-percentile-calibration-value=<90..100>" in text
