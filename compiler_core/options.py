"""Compile options: one declarative schema of every `qaic-compile` flag qpcfarm accepts.

Each option is declared once, as a field of `CompileOptions` whose `option(...)` metadata is
its flag's spec; `OPTIONS` collects those specs, and the rule sets (`LOCAL_ONLY_OPTIONS`,
`MODEL_FILE_OPTIONS`) are read from flags on them. The specs drive flag parsing (`-flag=value`,
bare booleans, `=true/false`, repeatable flags, comma lists), JSON parsing (keys are flag names
without the dash, e.g. `"aic-num-cores"`, or their snake_case form), `-h` text, canonical JSON
(the farm's cache key) and the JSON schema the HTTP API publishes. Cross-field rules live in
one function, `_check_rules`. Every rejection is a `CompileError` whose message names the flag,
the value and the rule, in one line.
"""

from __future__ import annotations

import difflib
import json
import math
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from compiler_core.devices import (
    HW_VERSION_SPELLINGS,
    MAX_SOC_DDR_BYTES,
    DeviceProfile,
    default_device_for,
    device_names,
    get_device,
)
from compiler_core.errors import CompileError

Kind = Literal[
    "bool", "int", "float", "str", "path", "enum", "device", "hex_list", "symbol_map", "name_list"
]

MAX_PMU_EVENTS = 8
MAX_CORES = 16
MAX_DIMENSION = MAX_SOC_DDR_BYTES
"""The largest batch size or symbol value: one-byte elements that many fill the largest SoC's
DDR (compiler_core/model_bounds.py bounds whole tensors the same way)."""
STATS_LEVELS = (40, 50, 70, 100)
PMU_RECIPES = ("AxiRd", "AxiWr", "AxiRdWr", "KernelUtil", "HmxMacs")
QUANT_PRECISIONS = ("Int8", "Int16")
BIAS_PRECISIONS = ("Int8", "Int32")
QUANT_SCHEMAS = ("asymmetric", "symmetric", "symmetric_with_uint8", "symmetric_with_power2_scale")
CALIBRATIONS = ("None", "KLMinimization", "KLMinimizationV2", "Percentile", "MSE", "SQNR")
"""`None` is MinMax (the vendor's spelling of the default)."""
HELP_FLAGS = frozenset({"-h", "-help", "--help", "-usage", "--usage"})
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


@dataclass(frozen=True)
class OptionSpec:
    """One flag: how it is spelled, typed, bounded, documented and whether it shapes the QPC."""

    name: str
    """Canonical flag name without the dash (`aic-num-cores`); also the canonical JSON key."""
    kind: Kind
    help: str
    default: Any = None
    aliases: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    min_exclusive: bool = False
    choices: tuple[Any, ...] = ()
    max_items: int | None = None
    repeatable: bool = False
    deprecated: bool = False
    affects_qpc: bool = True
    """Part of canonical JSON (and so of the farm's cache key): the option changes QPC bytes."""
    group: str = "Compilation"
    default_text: str = ""
    """How `-h` describes a default of None (`heuristic`, `the model's`)."""
    metavar: str = ""
    local_only: bool = False
    """Names a place on the machine that compiles, or acts there (`-m`, `-aic-binary-dir`,
    `-operators-supported`): the farm refuses it over the network and a sweep's base flags
    cannot hold it (the configurator sets the model and the output itself)."""
    model_file: bool = False
    """Names a file read with the model: `qpcfarm submit` uploads it in the model's archive
    and the farm reads it from there (never from its own disk)."""
    vendor: bool = True
    """The vendor's `qaic-compile` takes this flag too: a job for the farm's `qaic` backend
    passes it through (`vendor_flags`). False: only qpcfarm's compiler knows it, and a job
    for the vendor backend that sets it is refused."""

    @property
    def attr(self) -> str:
        return self.name.replace("-", "_").lower()

    @property
    def flag(self) -> str:
        return "-" + self.name

    def spellings(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


IO = "Input and output"
TARGET = "Target and partitioning"
MEMORY = "Memory"
PRECISION = "Precision and model shape"
PROFILING = "Profiling and diagnostics"
QUANT = "Quantization"

_OPTION = "qpcfarm.option"
"""The `CompileOptions` field metadata key of an option's declaration."""


@dataclass(frozen=True)
class _Declared:
    """An option as its field declares it; `spec` adds the name the field gives it."""

    settings: dict[str, Any]
    name: str

    def spec(self, attr: str) -> OptionSpec:
        return OptionSpec(name=self.name or attr.replace("_", "-"), **self.settings)


def option(
    kind: Kind,
    help: str,
    *,
    default: Any = None,
    name: str = "",
    schema_default: Any = ...,
    **settings: Any,
) -> Any:
    """Declare a `CompileOptions` field and its flag at once: the field's default is
    `default`; the rest (bounds, choices, group, `local_only`, `model_file`...) are the
    `OptionSpec` that parsing, `-h`, the JSON schema and the farm's rules read. `name` is the
    flag when it is not the field's name with dashes (`custom-IO-list-file`);
    `schema_default` is what `-h` and the schema call the default when the field's is
    implied by another option (`-aic-hw-version` follows `-aic-device`)."""
    shown = default if schema_default is ... else schema_default
    declared = _Declared(dict(kind=kind, help=help, default=shown, **settings), name)
    metadata = {_OPTION: declared}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class CompileOptions:
    """A validated, immutable set of compile options (defaults filled in, spellings canonical).

    Build it with `from_flags`, `from_json` or `CompileOptions()` for all defaults; derive
    variants with `with_`, which validates again.
    """

    model: str | None = option(
        "path",
        "Input ONNX model (required to compile).",
        aliases=("m",),
        affects_qpc=False,
        group=IO,
        default_text="none",
        local_only=True,
    )
    aic_binary_dir: str | None = option(
        "path",
        "Output directory; the QPC is <dir>/programqpc.bin.",
        affects_qpc=False,
        group=IO,
        default_text="none",
        local_only=True,
    )
    operators_supported: str | None = option(
        "enum",
        "Print the supported operators of a framework and exit (tensorflow and pytorch: "
        "each framework operator with the ONNX operators its converter makes of it).",
        choices=("onnx", "tensorflow", "pytorch"),
        affects_qpc=False,
        group=IO,
        default_text="none",
        local_only=True,
    )
    aic_hw: bool = option(
        "bool",
        "Compile for real hardware (always implied here).",
        default=False,
        group=TARGET,
    )
    aic_hw_version: str = option(
        "enum",
        "Hardware generation: 2.0 (older spelling of ai100), ai100 or ai200 (adds bf16).",
        choices=tuple(HW_VERSION_SPELLINGS),
        group=TARGET,
        default_text="the device's, else ai100",
        default="ai100",
        schema_default=None,
    )
    aic_device: str | None = option(
        "device",
        "Device profile to compile for (qpcfarm addition): " + ", ".join(device_names()) + ".",
        group=TARGET,
        default_text="the full SoC of the hardware version",
        vendor=False,
    )
    aic_num_cores: int = option(
        "int",
        "NSP cores to compile for; at most the device's cores per SoC.",
        default=1,
        minimum=1,
        maximum=MAX_CORES,
        group=TARGET,
    )
    mdp_load_partition_config: str | None = option(
        "path",
        "JSON partition config: the devices (SoCs) one partition spans, their cores, and which "
        "devices are connected peer to peer; the network is sliced across them.",
        group=TARGET,
        default_text="none (one SoC)",
        model_file=True,
    )
    mdp_dump_partition_config: str | None = option(
        "path",
        "Write the partition the compile used (JSON, the -mdp-load-partition-config format).",
        affects_qpc=False,
        group=TARGET,
        default_text="none",
        local_only=True,
    )
    mdp_devices: int | None = option(
        "int",
        "Slice the network over this many SoCs (qpcfarm addition): one partition over SoCs "
        "0..N-1 connected peer to peer, -aic-num-cores each, as a -mdp-load-partition-config "
        "listing them would (what the configurator's devices dimension sets).",
        minimum=1,
        maximum=64,
        group=TARGET,
        default_text="1",
        vendor=False,
    )
    ols: int = option(
        "int",
        "Overlap split factor: a power of two, at most -aic-num-cores.",
        default=1,
        minimum=1,
        maximum=MAX_CORES,
        group=TARGET,
    )
    mos: int | None = option(
        "int",
        "Maximum output-channel split, at most -aic-num-cores.",
        minimum=1,
        maximum=MAX_CORES,
        group=TARGET,
        default_text="heuristic",
    )
    multicast_weights: bool = option(
        "bool",
        "Multicast shared weights to all cores (always done here).",
        default=False,
        group=TARGET,
    )
    compile_threads: int | None = option(
        "int",
        "Threads the compiler may use; never changes the QPC.",
        minimum=1,
        affects_qpc=False,
        group=TARGET,
        default_text="all CPUs",
    )
    vtcm_working_set_limit_ratio: float = option(
        "float",
        "Fraction of VTCM a kernel's working set may use.",
        default=1.0,
        minimum=0.0,
        maximum=1.0,
        min_exclusive=True,
        group=MEMORY,
    )
    size_split_granularity: int = option(
        "int",
        "Tile size granularity for splitting, in KiB.",
        default=1024,
        minimum=512,
        maximum=2048,
        group=MEMORY,
    )
    allocator_dealloc_delay: int = option(
        "int",
        "Delay (in ops) before a DDR buffer is reused.",
        default=0,
        minimum=0,
        group=MEMORY,
    )
    aic_enable_depth_first: bool = option(
        "bool",
        "Schedule depth first to keep activations on chip.",
        default=False,
        group=MEMORY,
    )
    aic_depth_first_mem: int | None = option(
        "int",
        "On-chip memory budget for depth-first scheduling, MiB.",
        minimum=8,
        maximum=32,
        group=MEMORY,
        default_text="heuristic",
    )
    retained_state: bool = option(
        "bool",
        "Outputs named *_RetainedState stay in DDR and feed inputs.",
        default=False,
        group=MEMORY,
    )
    batchsize: int | None = option(
        "int",
        "Recompile the model for this batch size.",
        minimum=1,
        maximum=MAX_DIMENSION,
        group=PRECISION,
        default_text="the model's",
    )
    onnx_define_symbol: Mapping[str, int] = option(
        "symbol_map",
        "Bind a symbolic dimension: <name>,<value> (repeat once per symbol).",
        default={},
        minimum=1,
        maximum=MAX_DIMENSION,
        repeatable=True,
        group=PRECISION,
        metavar="<name>,<value>",
        default_text="none",
    )
    input_shapes: str | None = option(
        "str",
        "Input shapes of a TorchScript (or TensorFlow) model, whose file leaves them open: "
        "<name>:<d0>x<d1>...[,<name>:...] (qpcfarm addition).",
        group=PRECISION,
        metavar="<name>:<d0>x<d1>...",
        default_text="the model's",
    )
    network_specialization_config: str | None = option(
        "path",
        "JSON file of shape specializations sharing weights in one QPC.",
        group=PRECISION,
        default_text="none",
        model_file=True,
    )
    full_batch_size: int | None = option(
        "int",
        "Continuous batching: the KV cache's slots. Sets full_batch_size in every "
        "specialization, and batch_size in each decode (seq_len 1) that leaves it unset.",
        minimum=1,
        maximum=MAX_DIMENSION,
        group=PRECISION,
        default_text="the specializations'",
        vendor=False,
    )
    convert_to_fp16: bool = option(
        "bool",
        "Compute in fp16 (constants out of range are clipped).",
        default=False,
        group=PRECISION,
    )
    mxfp6_matmul: bool = option(
        "bool",
        "Store MatMul/Gemm weights as MXFP6 (decoded to fp16 values on the device).",
        default=False,
        group=PRECISION,
    )
    mxint8_kv_cache: bool = option(
        "bool",
        "Store every retained-state tensor (the KV cache) as MXINT8 blocks on the device, as "
        "if each were listed with Precision mxint8 in the custom-IO list.",
        default=False,
        group=PRECISION,
        vendor=False,
    )
    custom_io_list_file: str | None = option(
        "path",
        "YAML list of IOName/Precision pairs.",
        name="custom-IO-list-file",
        group=PRECISION,
        default_text="none",
        model_file=True,
    )
    node_precision_info: str | None = option(
        "path",
        "YAML with FP32NodeInstanceNames / FP16NodeInstanceNames.",
        group=PRECISION,
        default_text="none",
        model_file=True,
    )
    dump_profile: str | None = option(
        "path",
        "Run the float model on the calibration inputs (-input-list-file) and write the "
        "quantization profile (per-tensor ranges and histograms, JSON) to this file; the compile "
        "then uses it unless -no-quant.",
        group=QUANT,
        default_text="none",
    )
    load_profile: str | None = option(
        "path",
        "Quantize the model to int8 (or int16) from this profile (written by -dump-profile).",
        group=QUANT,
        default_text="none",
        model_file=True,
    )
    input_list_file: str | None = option(
        "path",
        "Calibration inputs: a text file, one inference per line (input files, .raw or .npy, "
        "in input order or as name:=path), or an .npz of arrays named by input with the samples "
        "stacked on a leading axis.",
        group=QUANT,
        default_text="none",
        model_file=True,
    )
    no_quant: bool = option(
        "bool",
        "Do not quantize: with -dump-profile, only write the profile and compile in float.",
        default=False,
        group=QUANT,
    )
    quantization_precision: str = option(
        "enum",
        "Integer type of quantized weights and activations.",
        default="Int8",
        choices=QUANT_PRECISIONS,
        group=QUANT,
    )
    quantization_precision_bias: str = option(
        "enum",
        "Integer type of quantized biases (Int8 is rescaled into the int32 accumulator).",
        default="Int8",
        choices=BIAS_PRECISIONS,
        group=QUANT,
    )
    quantization_schema_activations: str = option(
        "enum",
        "How activations map to integers: symmetric (zero point 0), symmetric_with_uint8 "
        "(unsigned for tensors that are never negative), symmetric_with_power2_scale "
        "(scales rounded up to powers of two) or asymmetric (unsigned with a zero point).",
        default="symmetric_with_uint8",
        choices=QUANT_SCHEMAS,
        group=QUANT,
        metavar="<schema>",
    )
    quantization_schema_constants: str = option(
        "enum",
        "How weights map to integers (same schemas as -quantization-schema-activations).",
        default="symmetric_with_uint8",
        choices=QUANT_SCHEMAS,
        group=QUANT,
        metavar="<schema>",
    )
    quantization_calibration: str = option(
        "enum",
        "How an activation's range is chosen from its histogram: None (MinMax), "
        "KLMinimization, KLMinimizationV2, Percentile, MSE or SQNR.",
        default="None",
        choices=CALIBRATIONS,
        group=QUANT,
    )
    percentile_calibration_value: float = option(
        "float",
        "Percentile of |values| kept by -quantization-calibration=Percentile.",
        default=100.0,
        minimum=90.0,
        maximum=100.0,
        group=QUANT,
    )
    num_histogram_bins: int = option(
        "int",
        "Bins of each tensor's histogram in the profile.",
        default=512,
        minimum=16,
        maximum=65536,
        group=QUANT,
    )
    enable_channelwise: bool = option(
        "bool",
        "Quantize Conv weights per output channel (else per tensor).",
        default=False,
        group=QUANT,
    )
    enable_rowwise: bool = option(
        "bool",
        "Quantize MatMul/Gemm weights per output column (else per tensor).",
        default=False,
        group=QUANT,
    )
    execute_nodes_in_fp16: tuple[str, ...] = option(
        "name_list",
        "Op types that stay float and compute in fp16 (comma separated, e.g. Softmax,Gelu).",
        default=(),
        group=QUANT,
        metavar="<op>[,<op>...]",
        default_text="none",
    )
    keep_original_precision_for_nodes: tuple[str, ...] = option(
        "name_list",
        "Op types that are not quantized and keep the model's float precision.",
        default=(),
        group=QUANT,
        metavar="<op>[,<op>...]",
        default_text="none",
    )
    stats_level: int = option(
        "int",
        "Stats instrumentation level (additive): 40, 50, 70 or 100.",
        default=40,
        choices=STATS_LEVELS,
        group=PROFILING,
    )
    stats_batchsize: int | None = option(
        "int",
        "Batch size that stats are normalised by.",
        minimum=1,
        maximum=MAX_DIMENSION,
        group=PROFILING,
        default_text="the batch size",
    )
    ddr_stats: bool = option(
        "bool",
        "Collect per-core DDR traffic (needs -stats-level >= 40).",
        default=False,
        group=PROFILING,
    )
    aic_pmu_recipe: str | None = option(
        "enum",
        "Predefined PMU event set (excludes -aic-pmu-events).",
        choices=PMU_RECIPES,
        group=PROFILING,
        default_text="none",
    )
    aic_pmu_events: tuple[str, ...] = option(
        "hex_list",
        f"Up to {MAX_PMU_EVENTS} PMU event ids in hex, comma separated (excludes -aic-pmu-recipe).",
        default=(),
        max_items=MAX_PMU_EVENTS,
        group=PROFILING,
        metavar="<hex>[,<hex>...]",
        default_text="none",
    )
    aic_perf_warnings: bool = option(
        "bool",
        "Print performance warnings.",
        default=False,
        affects_qpc=False,
        group=PROFILING,
    )
    aic_perf_metrics: bool = option(
        "bool",
        "Print compiler performance metrics.",
        default=False,
        affects_qpc=False,
        group=PROFILING,
    )
    time_passes: bool = option(
        "bool",
        "Print the time each compiler stage took.",
        default=False,
        affects_qpc=False,
        group=PROFILING,
    )
    compile_only: bool = option(
        "bool",
        "Accepted for compatibility and ignored.",
        default=False,
        deprecated=True,
        affects_qpc=False,
        group=PROFILING,
    )
    warnings: tuple[str, ...] = ()
    """Messages about accepted-but-deprecated flags, for the caller to print or store."""

    def __post_init__(self) -> None:
        # A read-only, key-sorted copy: the object stays hashable-in-spirit and canonical.
        symbols = dict(sorted(dict(self.onnx_define_symbol).items()))
        object.__setattr__(self, "onnx_define_symbol", _FrozenDict(symbols))

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_flags(cls, argv: Sequence[str]) -> CompileOptions:
        """Parse qaic-compile style flags: `-flag=value`, bare booleans, repeatable flags."""
        given: dict[str, Any] = {}
        for arg in argv:
            if not arg.startswith("-") or arg in ("-", "--"):
                raise CompileError(
                    "invalid_option",
                    f"Unexpected argument {_shown(arg)}: options are written -flag=value",
                    flag=arg,
                )
            name, has_value, text = arg.lstrip("-").partition("=")
            spec = _FLAGS.get(name)
            if spec is None:
                raise _unknown(arg)
            if not has_value and spec.kind != "bool":
                raise CompileError(
                    "invalid_option",
                    f"Missing value for -{name} (write -{name}={spec.metavar or _metavar(spec)})",
                    flag=spec.flag,
                )
            value = coerce(spec, text if has_value else True)
            _merge(given, spec, value, shown=f"-{name}={text}" if has_value else f"-{name}")
        return _build(given)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str) -> CompileOptions:
        """Parse a JSON object (or its text): keys `aic-num-cores`, `aic_num_cores` or `-m`."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as exc:
                raise CompileError("invalid_option", f"options are not valid JSON: {exc}") from None
        if not isinstance(data, Mapping):
            raise CompileError("invalid_option", "options must be a JSON object of flag: value")
        given: dict[str, Any] = {}
        for key, raw in data.items():
            if not isinstance(key, str):
                raise CompileError("unknown_option", f"Invalid option {key!r}.")
            spec = _JSON_KEYS.get(_json_key(key))
            if spec is None:
                raise _unknown(key if key.startswith("-") else "-" + key)
            if raw is None:
                continue
            if spec.attr in given:
                raise _invalid(spec, raw, "given more than once under different spellings")
            given[spec.attr] = coerce(spec, raw)
        return _build(given)

    def with_(self, **changes: Any) -> CompileOptions:
        """A copy with some options changed (snake_case names), validated like any other."""
        values = self._given()
        for key, value in changes.items():
            spec = _BY_ATTR.get(key)
            if spec is None:
                raise _unknown("-" + key.replace("_", "-"))
            if value is None:
                values.pop(key, None)
            else:
                values[key] = coerce(spec, value)
        return _build(values)

    def _given(self) -> dict[str, Any]:
        """The non-default values, as `_build` takes them back."""
        out: dict[str, Any] = {}
        for spec in OPTIONS:
            value = getattr(self, spec.attr)
            if spec.attr == "aic_hw_version":
                implied = get_device(self.aic_device).hw_version if self.aic_device else "ai100"
                if value != implied:
                    out[spec.attr] = value
            elif _is_set(spec, value):
                out[spec.attr] = value
        return out

    # -- output ---------------------------------------------------------------------------

    def to_json(self, *, full: bool = False) -> dict[str, Any]:
        """Canonical JSON: flag-name keys, canonical spellings, every option that changes the
        QPC bytes (defaults included). `full=True` adds the rest (model path, output dir,
        printing flags) so that `from_json(o.to_json(full=True)) == o`."""
        out: dict[str, Any] = {}
        for spec in OPTIONS:
            if not (spec.affects_qpc or full):
                continue
            value = getattr(self, spec.attr)
            if spec.kind in ("hex_list", "name_list"):
                value = list(value)
            elif spec.kind == "symbol_map":
                value = dict(value)
            out[spec.name] = value
        return dict(sorted(out.items()))

    def to_json_str(self) -> str:
        """Compact, key-sorted canonical JSON; the farm keys its QPC cache on its sha256."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    def to_flags(self) -> list[str]:
        """Canonical flags that `from_flags` turns back into an equal object."""
        flags: list[str] = []
        given = self._given()
        for spec in OPTIONS:
            if spec.attr not in given:
                continue
            value = getattr(self, spec.attr)
            if spec.kind == "bool":
                flags.append(spec.flag if value else f"{spec.flag}=false")
            elif spec.kind == "symbol_map":
                flags.extend(f"{spec.flag}={k},{v}" for k, v in value.items())
            elif spec.kind == "hex_list":  # as the user writes them: 0x1, not 1
                flags.append(f"{spec.flag}={','.join('0x' + v for v in value)}")
            elif spec.kind == "name_list":
                flags.append(f"{spec.flag}={','.join(value)}")
            else:
                flags.append(f"{spec.flag}={_flag_text(value)}")
        return flags

    @property
    def device(self) -> DeviceProfile:
        """The chosen device profile, or the default one of the hardware version."""
        if self.aic_device is not None:
            return get_device(self.aic_device)
        return default_device_for(self.aic_hw_version)

    @property
    def quantize(self) -> bool:
        """Float operators are quantized from a profile (loaded, or dumped by this compile)."""
        return bool(self.load_profile or self.dump_profile) and not self.no_quant

    @property
    def effective_stats_batchsize(self) -> int:
        return self.stats_batchsize or self.batchsize or 1


OPTIONS: tuple[OptionSpec, ...] = tuple(
    f.metadata[_OPTION].spec(f.name) for f in fields(CompileOptions) if _OPTION in f.metadata
)
"""Every option's spec, in declaration order: built from the fields of `CompileOptions`."""
LOCAL_ONLY_OPTIONS: tuple[OptionSpec, ...] = tuple(s for s in OPTIONS if s.local_only)
"""Options for the compiling machine only: refused over the network, never sweep base flags."""
MODEL_FILE_OPTIONS: tuple[OptionSpec, ...] = tuple(s for s in OPTIONS if s.model_file)
"""Options naming a file read with the model: it travels in the model's archive."""

_FLAGS = {spelling: s for s in OPTIONS for spelling in s.spellings()}
"""Flag names are matched exactly, as qaic-compile does (`-custom-IO-list-file`)."""
_BY_ATTR = {s.attr: s for s in OPTIONS}


def _json_key(key: str) -> str:
    return key.lstrip("-").replace("_", "-").lower()


_JSON_KEYS = {_json_key(spelling): s for spelling, s in _FLAGS.items()}
"""JSON keys are lenient: `aic-num-cores`, `aic_num_cores`, `-aic-num-cores`, any case."""


def spec_for(name: str) -> OptionSpec:
    """The spec for a flag (`-aic-num-cores`), JSON key or snake_case attribute."""
    spec = _JSON_KEYS.get(_json_key(name))
    if spec is None:
        raise _unknown(name if name.startswith("-") else "-" + name)
    return spec


# ---------------------------------------------------------------------------------------------
# Errors


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return value if value and not any(c.isspace() for c in value) else repr(value)
    return json.dumps(value) if isinstance(value, (bool, int, float, list, dict)) else repr(value)


def _invalid(spec: OptionSpec, value: Any, rule: str) -> CompileError:
    return CompileError(
        "invalid_option",
        f"Invalid value for {spec.flag}: {_shown(value)} ({rule})",
        flag=spec.flag,
        details={"value": value if isinstance(value, (str, int, float, bool)) else str(value)},
    )


_RUNNER_FLAGS = frozenset(
    {
        "aic-profiling-type",
        "aic-profiling-out-dir",
        "aic-profiling-start-iter",
        "aic-profiling-num-samples",
    }
)
"""qaic-runner's profiling flags: people pass them to the compiler by mistake."""


def _unknown(arg: str) -> CompileError:
    flag = arg.split("=", 1)[0]
    if flag.lstrip("-") in _RUNNER_FLAGS:
        hint = " It is a run-time option (qaic-runner), not a compile option."
    else:
        close = difflib.get_close_matches(flag, ["-" + s for s in _FLAGS], n=1)
        hint = f" Did you mean {close[0]}?" if close else ""
    return CompileError(
        "unknown_option",
        f"Invalid option {flag}.{hint} Use -h for the list of options.",
        flag=flag,
    )


# ---------------------------------------------------------------------------------------------
# Values: one coercion per kind, shared by flags (text) and JSON (typed values)


def _range_rule(spec: OptionSpec, noun: str) -> str:
    lo, hi = spec.minimum, spec.maximum
    if lo is not None and hi is not None:
        lo_text = f"greater than {_num(lo)}" if spec.min_exclusive else f"from {_num(lo)}"
        joiner = " and at most " if spec.min_exclusive else " to "
        return f"must be {noun} {lo_text}{joiner}{_num(hi)}"
    if lo is not None:
        return f"must be {noun} {'>' if spec.min_exclusive else '>='} {_num(lo)}"
    if hi is not None:
        return f"must be {noun} <= {_num(hi)}"
    return f"must be {noun}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _in_range(spec: OptionSpec, x: float) -> bool:
    if spec.minimum is not None:
        if x < spec.minimum or (spec.min_exclusive and x == spec.minimum):
            return False
    return spec.maximum is None or x <= spec.maximum


def _coerce_bool(spec: OptionSpec, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _invalid(spec, value, "must be true or false")


def _integer_text(text: str) -> bool:
    """Decimal integer text short enough to be a 64-bit number (longer is out of every range,
    and Python refuses to parse more than 4,300 digits)."""
    text = text.strip()
    return len(text) <= 24 and text.isascii() and text.lstrip("+-").isdigit()


def _coerce_int(spec: OptionSpec, value: Any) -> int:
    rule = (
        "must be one of " + ", ".join(str(c) for c in spec.choices)
        if spec.choices
        else _range_rule(spec, "an integer")
    )
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        text = value.strip()
        if _integer_text(text):
            number = int(text)
    if number is None:
        raise _invalid(spec, value, rule)
    if spec.choices and number not in spec.choices:
        raise _invalid(spec, value, rule)
    if not _in_range(spec, number):
        raise _invalid(spec, value, rule)
    return number


def _coerce_float(spec: OptionSpec, value: Any) -> float:
    rule = _range_rule(spec, "a number")
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number) or not _in_range(spec, number):
        raise _invalid(spec, value, rule)
    return number


def _coerce_text(spec: OptionSpec, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _invalid(
            spec,
            value,
            "must be a non-empty path" if spec.kind == "path" else "must be a non-empty string",
        )
    return value


def _coerce_enum(spec: OptionSpec, value: Any) -> str:
    if isinstance(value, str):
        for choice in spec.choices:
            if value.strip().lower() == str(choice).lower():
                return str(choice)
    raise _invalid(spec, value, "supported: " + ", ".join(str(c) for c in spec.choices))


def _coerce_device(spec: OptionSpec, value: Any) -> str:
    if isinstance(value, str):
        try:
            return get_device(value).name
        except CompileError:
            pass
    raise _invalid(spec, value, "known devices: " + ", ".join(device_names()))


def _coerce_hex_list(spec: OptionSpec, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        items: list[Any] = [part.strip() for part in value.split(",")] if value.strip() else []
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise _invalid(spec, value, "must be a comma-separated list of hex event ids")
    events: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise _invalid(spec, value, f"event id {_shown(item)} must be a hex string like 3F")
        digits = item.strip()
        digits = digits[2:] if digits.lower().startswith("0x") else digits
        try:
            number = int(digits, 16) if digits and digits.isalnum() else -1
        except ValueError:
            number = -1
        if not 0 <= number <= 0xFFFFFFFF:
            raise _invalid(spec, value, f"event id {_shown(item)} is not a hex number like 3F")
        canonical = f"{number:X}"
        if canonical in events:
            raise _invalid(spec, value, f"event {canonical} is listed twice")
        events.append(canonical)
    if spec.max_items is not None and len(events) > spec.max_items:
        raise _invalid(spec, value, f"at most {spec.max_items} events, got {len(events)}")
    return tuple(events)


def _coerce_name_list(spec: OptionSpec, value: Any) -> tuple[str, ...]:
    """Op type names: one comma-separated string or a list; each a registered op type."""
    from compiler_core.ops import REGISTRY

    if isinstance(value, str):
        items: list[Any] = [part.strip() for part in value.split(",")] if value.strip() else []
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise _invalid(spec, value, "must be a comma-separated list of op types")
    known = REGISTRY.op_types()  # from the op index: no kernel is imported to check names
    names: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise _invalid(spec, value, f"{_shown(item)} is not an op type name")
        name = item.strip()
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise _invalid(spec, value, f"{name} is not a supported op type{hint}")
        if name not in names:
            names.append(name)
    return tuple(names)


def _symbol(spec: OptionSpec, name: Any, raw: Any, shown: Any) -> tuple[str, int]:
    if not isinstance(name, str) or not name.strip():
        raise _invalid(spec, shown, "expected <name>,<value> with a non-empty symbol name")
    value: int | None = None
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif isinstance(raw, str) and _integer_text(raw):
        value = int(raw.strip())
    if value is None or not _in_range(spec, value):
        raise _invalid(
            spec,
            shown,
            f"the value of symbol {name.strip()} {_range_rule(spec, 'an integer')}",
        )
    return name.strip(), value


def _coerce_symbols(spec: OptionSpec, value: Any) -> dict[str, int]:
    """`name,value` text (one per flag), a list of those, or a JSON object name -> value."""
    pairs: list[tuple[str, int]] = []
    if isinstance(value, Mapping):
        pairs = [_symbol(spec, k, v, f"{k},{v}") for k, v in value.items()]
    elif isinstance(value, str):
        if value.count(",") != 1:
            raise _invalid(spec, value, "expected <name>,<value>")
        name, raw = value.split(",")
        pairs = [_symbol(spec, name, raw, value)]
    elif isinstance(value, (list, tuple)):
        for item in value:
            pairs.extend(_coerce_symbols(spec, item).items())
    else:
        raise _invalid(spec, value, "expected <name>,<value>")
    out: dict[str, int] = {}
    for name, number in pairs:
        if out.get(name, number) != number:
            raise _invalid(
                spec, f"{name},{number}", f"symbol {name} is already bound to {out[name]}"
            )
        out[name] = number
    return out


def coerce(spec: OptionSpec, value: Any) -> Any:
    """Check one value (flag text or JSON value) against its spec; return the canonical value."""
    if spec.kind == "bool":
        return _coerce_bool(spec, value)
    if spec.kind == "int":
        return _coerce_int(spec, value)
    if spec.kind == "float":
        return _coerce_float(spec, value)
    if spec.kind in ("str", "path"):
        return _coerce_text(spec, value)
    if spec.kind == "enum":
        return _coerce_enum(spec, value)
    if spec.kind == "device":
        return _coerce_device(spec, value)
    if spec.kind == "hex_list":
        return _coerce_hex_list(spec, value)
    if spec.kind == "name_list":
        return _coerce_name_list(spec, value)
    return _coerce_symbols(spec, value)


# ---------------------------------------------------------------------------------------------
# The options object


class _FrozenDict(dict[str, int]):
    """A dict that refuses mutation, so a frozen CompileOptions really is immutable."""

    def _readonly(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("CompileOptions.onnx_define_symbol is read-only")

    __setitem__ = _readonly  # type: ignore[assignment]
    __delitem__ = _readonly  # type: ignore[assignment]
    update = _readonly  # type: ignore[assignment]
    pop = _readonly  # type: ignore[assignment]
    clear = _readonly  # type: ignore[assignment]
    setdefault = _readonly  # type: ignore[assignment]
    popitem = _readonly  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_FrozenDict, (dict(self),))


def _flag_text(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _metavar(spec: OptionSpec) -> str:
    if spec.metavar:
        return spec.metavar
    if spec.choices:
        return "<" + "|".join(str(c) for c in spec.choices) + ">"
    if spec.kind == "device":
        return "<device>"
    if spec.kind in ("int", "float") and spec.minimum is not None and spec.maximum is not None:
        return f"<{_num(spec.minimum)}..{_num(spec.maximum)}>"
    return {"int": "<int>", "float": "<number>", "path": "<path>"}.get(spec.kind, "<value>")


def _is_set(spec: OptionSpec, value: Any) -> bool:
    default = spec.default
    if spec.kind == "symbol_map":
        return bool(value)
    if spec.kind in ("hex_list", "name_list"):
        return bool(value)
    return bool(value != default)


def _merge(given: dict[str, Any], spec: OptionSpec, value: Any, *, shown: str) -> None:
    """Record one flag occurrence; only repeatable flags may appear more than once."""
    if spec.attr not in given:
        given[spec.attr] = value
        return
    if not spec.repeatable:
        raise CompileError(
            "invalid_option",
            f"Invalid option {shown}: {spec.flag} may appear only once and was already given",
            flag=spec.flag,
        )
    merged = dict(given[spec.attr])
    for name, number in value.items():
        if merged.get(name, number) != number:
            raise _invalid(
                spec, f"{name},{number}", f"symbol {name} is already bound to {merged[name]}"
            )
        merged[name] = number
    given[spec.attr] = merged


def _build(given: Mapping[str, Any]) -> CompileOptions:
    """Fill defaults, resolve the device and hardware version, and run the cross-field rules."""
    values = dict(given)
    device_name = values.get("aic_device")
    hw_given = values.get("aic_hw_version")
    hw = HW_VERSION_SPELLINGS[hw_given] if hw_given is not None else None
    if device_name is not None:
        device = get_device(device_name)
        if hw is not None and hw != device.hw_version:
            raise _invalid(
                _BY_ATTR["aic_hw_version"],
                hw_given,
                f"-aic-device={device.name} is {device.hw_version} hardware",
            )
        values["aic_hw_version"] = device.hw_version
    else:
        values["aic_hw_version"] = hw or "ai100"
        device = default_device_for(values["aic_hw_version"])
    warnings = [
        f"{spec.flag} is deprecated and ignored"
        for spec in OPTIONS
        if spec.deprecated and values.get(spec.attr)
    ]
    options = CompileOptions(**values, warnings=tuple(warnings))
    _check_rules(options, device)
    return options


def _check_rules(o: CompileOptions, device: DeviceProfile) -> None:
    """Every rule that involves more than one option, in one place."""
    spec = _BY_ATTR
    if o.mdp_devices is not None and o.mdp_load_partition_config:
        raise _invalid(
            spec["mdp_devices"],
            o.mdp_devices,
            "give the devices either as a number or in -mdp-load-partition-config, not both",
        )
    if o.mdp_devices is not None and o.mdp_devices > device.max_socs_per_host:
        raise _invalid(
            spec["mdp_devices"],
            o.mdp_devices,
            f"a host holds at most {device.max_socs_per_host} {device.display_name} SoCs",
        )
    if o.aic_num_cores > device.cores_per_soc:
        raise _invalid(
            spec["aic_num_cores"],
            o.aic_num_cores,
            f"{device.display_name} has {device.cores_per_soc} NSP cores per SoC",
        )
    if o.ols & (o.ols - 1) or o.ols > o.aic_num_cores:
        raise _invalid(
            spec["ols"],
            o.ols,
            f"must be a power of two no larger than -aic-num-cores ({o.aic_num_cores})",
        )
    if o.mos is not None and o.mos > o.aic_num_cores:
        raise _invalid(spec["mos"], o.mos, f"must be at most -aic-num-cores ({o.aic_num_cores})")
    if o.aic_depth_first_mem is not None and not o.aic_enable_depth_first:
        raise _invalid(
            spec["aic_depth_first_mem"], o.aic_depth_first_mem, "needs -aic-enable-depth-first"
        )
    if o.ddr_stats and o.stats_level < 40:
        raise _invalid(spec["ddr_stats"], True, "needs -stats-level >= 40")
    if o.aic_pmu_recipe is not None and o.aic_pmu_events:
        raise _invalid(
            spec["aic_pmu_events"],
            ",".join(o.aic_pmu_events),
            f"-aic-pmu-recipe={o.aic_pmu_recipe} is also given; use one or the other",
        )
    _check_quantization_rules(o)


QUANT_TUNING = (
    "quantization_precision",
    "quantization_precision_bias",
    "quantization_schema_activations",
    "quantization_schema_constants",
    "quantization_calibration",
    "percentile_calibration_value",
    "enable_channelwise",
    "enable_rowwise",
    "keep_original_precision_for_nodes",
)
"""Options that only shape a quantized compile: set without a profile, they would do nothing."""


def _check_quantization_rules(o: CompileOptions) -> None:
    """The quantization options' rules: a profile to quantize from, calibration inputs to
    build one, and tuning options only where they act."""
    spec = _BY_ATTR
    if o.dump_profile and o.load_profile and o.dump_profile != o.load_profile:
        raise _invalid(
            spec["load_profile"],
            o.load_profile,
            f"-dump-profile={o.dump_profile} writes the profile this compile uses; give one of "
            "them, or both naming the same file",
        )
    if o.dump_profile and not o.input_list_file:
        raise _invalid(
            spec["dump_profile"],
            o.dump_profile,
            "needs calibration inputs: -input-list-file=<list file or .npz>",
        )
    if o.input_list_file and not (o.dump_profile or o.load_profile):
        raise _invalid(
            spec["input_list_file"],
            o.input_list_file,
            "calibration inputs need -dump-profile (or -load-profile, to report accuracy on them)",
        )
    if o.no_quant and o.load_profile and not o.dump_profile:
        raise _invalid(spec["no_quant"], True, f"-load-profile={o.load_profile} asks to quantize")
    if not o.quantize:
        for attr in QUANT_TUNING:
            value = getattr(o, attr)
            if _is_set(spec[attr], value):
                why = "-no-quant is given" if o.no_quant else "no profile is given"
                raise _invalid(
                    spec[attr],
                    ",".join(value) if isinstance(value, tuple) else value,
                    f"acts only on a quantized compile (-load-profile or -dump-profile); {why}",
                )
    if o.num_histogram_bins != 512 and not o.dump_profile:
        raise _invalid(
            spec["num_histogram_bins"],
            o.num_histogram_bins,
            "shapes the profile -dump-profile writes; no -dump-profile is given",
        )
    if o.percentile_calibration_value != 100.0 and o.quantization_calibration != "Percentile":
        raise _invalid(
            spec["percentile_calibration_value"],
            o.percentile_calibration_value,
            f"needs -quantization-calibration=Percentile (given: {o.quantization_calibration})",
        )
    both = sorted(set(o.execute_nodes_in_fp16) & set(o.keep_original_precision_for_nodes))
    if both:
        raise _invalid(
            spec["keep_original_precision_for_nodes"],
            ",".join(o.keep_original_precision_for_nodes),
            f"{', '.join(both)} is also listed in -execute-nodes-in-fp16",
        )


# ---------------------------------------------------------------------------------------------
# Help text and JSON schema


def wants_help(argv: Iterable[str]) -> bool:
    return any(arg in HELP_FLAGS for arg in argv)


def _default_text(spec: OptionSpec) -> str:
    if spec.default_text:
        return spec.default_text
    if isinstance(spec.default, bool):
        return "true" if spec.default else "false"
    return _flag_text(spec.default)


_HELP_COLUMN = 40
_HELP_WIDTH = 100


def _help_entry(left: str, text: str) -> list[str]:
    """`  -flag=<v>   help...`, help wrapped at 100 columns under its own column."""
    glued = text.replace("[default: ", "[default:\xa0")
    body = [
        line.replace("\xa0", " ")
        for line in textwrap.wrap(glued, _HELP_WIDTH - _HELP_COLUMN - 1, break_on_hyphens=False)
    ]
    lines = [f"  {left}"] if len(left) > _HELP_COLUMN - 3 else []
    first = body.pop(0) if not lines else None
    if first is not None:
        lines.append(f"  {left:<{_HELP_COLUMN - 3}} {first}")
    lines.extend(" " * _HELP_COLUMN + line for line in body)
    return lines


def usage(prog: str = "qpcfarm compile") -> str:
    """The `-h` text: every option, grouped, with its value form and default."""
    lines = [
        f"USAGE: {prog} -m=<model.onnx> -aic-binary-dir=<dir> [options]",
        "",
        "Options are qaic-compile's: -flag=value, booleans bare or =true/=false.",
    ]
    groups: dict[str, list[OptionSpec]] = {}
    for spec in OPTIONS:
        groups.setdefault(spec.group, []).append(spec)
    for group, specs in groups.items():
        lines += ["", f"{group}:"]
        for spec in specs:
            names = ", ".join("-" + s for s in (*spec.aliases, spec.name))
            left = names if spec.kind == "bool" else f"{names}={_metavar(spec)}"
            text = f"{spec.help} [default: {_default_text(spec)}]"
            if spec.deprecated:
                text = "(deprecated) " + text
            lines.extend(_help_entry(left, text))
    lines += ["", *_help_entry("-h, --usage", "Print this help and exit.")]
    return "\n".join(lines) + "\n"


def _json_type(spec: OptionSpec) -> dict[str, Any]:
    if spec.kind == "bool":
        return {"type": "boolean"}
    if spec.kind == "int":
        schema: dict[str, Any] = {"type": "integer"}
        if spec.choices:
            schema["enum"] = list(spec.choices)
    elif spec.kind == "float":
        schema = {"type": "number"}
    elif spec.kind == "enum":
        return {"type": "string", "enum": list(spec.choices)}
    elif spec.kind == "device":
        return {"type": "string", "enum": device_names()}
    elif spec.kind == "hex_list":
        return {
            "anyOf": [
                {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^(0[xX])?[0-9A-Fa-f]+$"},
                    "maxItems": spec.max_items,
                },
                {"type": "string"},
            ]
        }
    elif spec.kind == "symbol_map":
        value = {"type": "integer", "minimum": spec.minimum, "maximum": spec.maximum}
        return {"type": "object", "additionalProperties": value}
    elif spec.kind == "name_list":
        return {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}]}
    else:
        return {"type": "string"}
    if spec.minimum is not None:
        schema["exclusiveMinimum" if spec.min_exclusive else "minimum"] = spec.minimum
    if spec.maximum is not None:
        schema["maximum"] = spec.maximum
    return schema


def options_model() -> type[Any]:
    """A pydantic model of the options object, generated from `OPTIONS`, for OpenAPI.

    Keys are flag names (`aic-num-cores`); snake_case is accepted too. It documents the shape
    only: validate with `CompileOptions.from_json`, which applies the cross-field rules and
    raises `CompileError` with stable codes.
    """
    from pydantic import ConfigDict, Field, create_model

    fields: dict[str, Any] = {}
    for spec in OPTIONS:
        extra = _json_type(spec)
        default = spec.default
        if isinstance(default, tuple):
            default = list(default)
        fields[spec.attr] = (
            Any,
            Field(
                default=default,
                alias=spec.name,
                description=spec.help
                + (f" Default: {spec.default_text}." if spec.default_text else ""),
                deprecated=spec.deprecated or None,
                json_schema_extra=extra,
            ),
        )
    model: type[Any] = create_model(  # type: ignore[call-overload]
        "CompileOptionsJSON",
        __config__=ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True),
        **fields,
    )
    return model


def options_json_schema() -> dict[str, Any]:
    """The JSON schema of the options object (properties keyed by flag name)."""
    schema: dict[str, Any] = options_model().model_json_schema(by_alias=True)
    return schema


__all__ = [
    "LOCAL_ONLY_OPTIONS",
    "MODEL_FILE_OPTIONS",
    "OPTIONS",
    "CompileOptions",
    "OptionSpec",
    "coerce",
    "options_json_schema",
    "option",
    "options_model",
    "spec_for",
    "usage",
    "wants_help",
]


FOR_BACKEND_CODE = "option_not_for_backend"


def vendor_flags(options: CompileOptions) -> list[str]:
    """The flags a job's options give the vendor's `qaic-compile` (the farm's `qaic` backend):
    every option set, spelled as the vendor spells it, places on the compiling machine left
    out (the worker passes the model and output folder itself). An option only qpcfarm's
    compiler knows (`OptionSpec.vendor` False) that is set is a CompileError
    `option_not_for_backend` naming them all."""
    given = options._given()
    alien = [spec.flag for spec in OPTIONS if not spec.vendor and spec.attr in given]
    if alien:
        raise CompileError(
            FOR_BACKEND_CODE,
            f"{', '.join(alien)}: qpcfarm's own option(s), which the vendor's qaic-compile "
            "does not take; remove them to compile with the qaic backend",
            flag=alien[0],
            details={"flags": alien},
        )
    local = {spec.flag for spec in OPTIONS if spec.local_only}
    return [f for f in options.to_flags() if f.partition("=")[0] not in local]
