"""Search spaces of the model configurator: which combinations of compile and runtime
parameters to try, read from the vendor's CSV form (one row per combination) or a compact
mapping (JSON/YAML: a list of values per parameter, constraints, fixed base flags).

A combination is a `Point`: compile parameters (`cores`, `batchsize`, `mos`, `ols`, the
number of SoCs `devices` the network is sliced over (`-mdp-devices`), an LLM's
`kv_precision` (fp16 | mxint8) and `weight_precision` (fp16 | mxfp6), and any other compile
flag, e.g. `full-batch-size`) plus runtime ones (`instances` per SoC, `set_size`, `cards`)
that need no compile. Points sharing their compile parameters share one compile (a
`Group`). Every point is checked before anything runs: the compile options through the
option schema (`-ols` a power of two no larger than the cores, ...), the instances against
the cores of one SoC, the cards against a host, and the space's constraints; an invalid
point is reported with its reason, never compiled.
"""

from __future__ import annotations

import ast
import csv
import io
import itertools
import json
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler_core.devices import MAX_CARDS_PER_HOST
from compiler_core.errors import CompileError
from compiler_core.options import CompileOptions, spec_for

RUNTIME_PARAMS = ("instances", "set_size", "cards")
"""Parameters of the run, not of the compile: free to vary once a group is compiled
(`instances` per SoC; the scoring fills every SoC of every card)."""

ALIASES: dict[str, str] = {
    "cores": "cores",
    "aic-num-cores": "cores",
    "num-cores": "cores",
    "nsp": "cores",
    "nsps": "cores",
    "instances": "instances",
    "num-instances": "instances",
    "instance": "instances",
    "activations": "instances",
    "batchsize": "batchsize",
    "batch-size": "batchsize",
    "batch": "batchsize",
    "bs": "batchsize",
    "set-size": "set_size",
    "setsize": "set_size",
    "set_size": "set_size",
    "mos": "mos",
    "ols": "ols",
    "kv-precision": "kv_precision",
    "kv_precision": "kv_precision",
    "weight-precision": "weight_precision",
    "weight_precision": "weight_precision",
    "cards": "cards",
    "num-cards": "cards",
    "devices": "devices",
    "socs": "devices",
    "mdp-devices": "devices",
}
"""Column and key spellings (after lower-casing, stripping dashes, `_` -> `-`)."""

PRECISION_PARAMS: dict[str, tuple[str, dict[str, bool]]] = {
    "kv_precision": ("mxint8-kv-cache", {"fp16": False, "mxint8": True}),
    "weight_precision": ("mxfp6-matmul", {"fp16": False, "mxfp6": True}),
}
"""An LLM's precisions as a sweep names them, and the compile flag each value sets: the KV
cache (retained state) as fp16 or MXINT8 blocks, MatMul weights as fp16 or MXFP6."""

COMPILE_FLAG_OF = {
    "cores": "aic-num-cores",
    "batchsize": "batchsize",
    "mos": "mos",
    "ols": "ols",
    "devices": "mdp-devices",
}
"""The compile flag behind each short compile parameter name."""

MAX_POINTS = 4096
"""A space larger than this is refused: it is a typo, not a sweep (the 14-core reference
space of every valid combination has well under this)."""


class SpaceError(CompileError):
    """A search space that cannot be read (bad file, unknown parameter, bad constraint)."""

    def __init__(self, message: str) -> None:
        super().__init__("invalid_search_space", message)


def canonical_param(name: str) -> str:
    """`aic-num-cores` -> `cores`, `-batchsize` -> `batchsize`, `set-size` -> `set_size`;
    another compile flag keeps its flag name (`convert-to-fp16`). Unknown names raise."""
    key = name.strip().lstrip("-").lower().replace("_", "-")
    if key in ALIASES:
        return ALIASES[key]
    if key.replace("-", "_") in ALIASES:
        return ALIASES[key.replace("-", "_")]
    try:
        spec = spec_for(key)
    except CompileError:
        raise SpaceError(
            f"unknown search-space parameter {name!r}: use cores, instances, batchsize, "
            "mos, ols, set_size, cards, devices, kv_precision, weight_precision or a compile "
            "flag name"
        ) from None
    if spec.local_only:  # the model, the output directory, -operators-supported
        raise SpaceError(
            f"the search space cannot set -{spec.name}: it is for the compiling machine "
            "(the configurator sets the model and the output directory itself)"
        )
    return ALIASES.get(spec.name, spec.name)


# ------------------------------------------------------------------------------ constraints

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}


@dataclass(frozen=True)
class Constraint:
    """An arithmetic condition over parameters (`cores * instances <= 14`), parsed once;
    only numbers, parameter names, + - * / // %, comparisons, and/or/not (no
    powers: a constraint must not be able to make the server compute for ever)."""

    text: str
    tree: ast.Expression = field(compare=False, repr=False)
    names: frozenset[str] = field(compare=False, repr=False)

    @classmethod
    def parse(cls, text: str) -> Constraint:
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError:
            raise SpaceError(f"constraint {text!r} is not an expression") from None
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                names.add(canonical_param(node.id).replace("-", "_"))
            elif not isinstance(
                node,
                ast.Expression
                | ast.BinOp
                | ast.UnaryOp
                | ast.BoolOp
                | ast.Compare
                | ast.Constant
                | ast.Load
                | ast.operator
                | ast.unaryop
                | ast.boolop
                | ast.cmpop,
            ):
                raise SpaceError(f"constraint {text!r}: {type(node).__name__} is not allowed")
            elif isinstance(node, ast.operator) and type(node) not in _BINARY:
                raise SpaceError(f"constraint {text!r}: {type(node).__name__} is not allowed")
            elif isinstance(node, ast.Constant) and not isinstance(node.value, int | float):
                raise SpaceError(f"constraint {text!r}: only numbers are allowed")
        return cls(text.strip(), tree, frozenset(names))

    def holds(self, values: Mapping[str, Any]) -> bool:
        return bool(self._eval(self.tree.body, values))

    def _eval(self, node: ast.AST, values: Mapping[str, Any]) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            name = canonical_param(node.id)
            value = values.get(name)
            return 0 if value is None or value is False else (1 if value is True else value)
        if isinstance(node, ast.BinOp):
            op = _BINARY.get(type(node.op))
            if op is None:
                raise SpaceError(f"constraint {self.text!r}: operator not allowed")
            return op(self._eval(node.left, values), self._eval(node.right, values))
        if isinstance(node, ast.UnaryOp):
            operand = self._eval(node.operand, values)
            if isinstance(node.op, ast.Not):
                return not operand
            if isinstance(node.op, ast.USub):
                return -operand
            return operand
        if isinstance(node, ast.BoolOp):
            results = (self._eval(v, values) for v in node.values)
            return all(results) if isinstance(node.op, ast.And) else any(results)
        if isinstance(node, ast.Compare):
            left = self._eval(node.left, values)
            for op_node, right_node in zip(node.ops, node.comparators, strict=True):
                right = self._eval(right_node, values)
                compare = _COMPARE.get(type(op_node))
                if compare is None or not compare(left, right):
                    return False
                left = right
            return True
        raise SpaceError(f"constraint {self.text!r}: {type(node).__name__} is not allowed")


# ------------------------------------------------------------------------------ points


@dataclass(frozen=True)
class Point:
    """One combination: its parameters (canonical names), and for a valid one the compile
    options and the index of its compile group."""

    index: int
    params: Mapping[str, Any]
    options: CompileOptions | None = None
    group: int = -1
    reason: str = ""

    @property
    def valid(self) -> bool:
        return self.options is not None

    @property
    def instances(self) -> int:
        return int(self.params.get("instances") or 1)

    @property
    def set_size(self) -> int:
        return int(self.params.get("set_size") or 1)

    @property
    def cards(self) -> int:
        return int(self.params.get("cards") or 1)

    @property
    def socs_per_instance(self) -> int:
        """SoCs one copy of the QPC spans (`-mdp-devices`; 1 unpartitioned)."""
        return int(self.options.mdp_devices or 1) if self.options else 1

    @property
    def batchsize(self) -> int:
        return int(self.options.batchsize or 1) if self.options else 1

    @property
    def cores(self) -> int:
        return self.options.aic_num_cores if self.options else int(self.params.get("cores") or 1)

    def flags(self) -> list[str]:
        """The compile flags (canonical, base flags included) and the runtime parameters."""
        if self.options is None:
            return [f"{k}={v}" for k, v in self.params.items()]
        runtime = [f"instances={self.instances}", f"set-size={self.set_size}"]
        if "cards" in self.params:
            runtime.append(f"cards={self.cards}")
        return [*self.options.to_flags(), *runtime]

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "params": dict(self.params), "flags": self.flags(),
                "valid": self.valid, "reason": self.reason or None}  # fmt: skip


@dataclass(frozen=True)
class Group:
    """Points sharing one compile: `options` is what the compile job runs with."""

    index: int
    options: CompileOptions
    compile_params: Mapping[str, Any]
    points: tuple[int, ...]


@dataclass(frozen=True)
class SearchSpace:
    """A parsed, checked space: every point (valid or not) in input order, the compile
    groups of the valid ones, the base flags and the constraints."""

    points: tuple[Point, ...]
    groups: tuple[Group, ...]
    base: Mapping[str, Any]
    constraints: tuple[Constraint, ...] = ()

    @property
    def valid_points(self) -> list[Point]:
        return [p for p in self.points if p.valid]

    @property
    def invalid_points(self) -> list[Point]:
        return [p for p in self.points if not p.valid]

    def to_json(self) -> dict[str, Any]:
        """What a farm sweep stores: enough to rebuild the space (`from_rows`)."""
        return {
            "base": dict(self.base),
            "constraints": [c.text for c in self.constraints],
            "rows": [dict(p.params) for p in self.points],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SearchSpace:
        return build_space(data["rows"], data.get("base") or {}, data.get("constraints") or ())


def _value(raw: Any) -> Any:
    """A CSV cell or mapping value as int, float, bool, or text; blank -> None."""
    if isinstance(raw, bool | int | float) or raw is None:
        return raw
    text = str(raw).strip()
    if text == "":
        return None
    lowered = text.lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _check_runtime(name: str, value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{name.replace('_', ' ')} must be a positive integer, not {value!r}"
    return ""


def _normalise_base(base: Mapping[str, Any] | Sequence[str]) -> dict[str, Any]:
    """Base flags as a mapping of flag name -> value: from a mapping or from flag strings."""
    if isinstance(base, Mapping):
        items = dict(base)
    else:
        items = {}
        for flag in base:
            name, has_value, text = str(flag).partition("=")
            items[name.lstrip("-")] = text if has_value else True
    out: dict[str, Any] = {}
    for key, value in items.items():
        name = canonical_param(key)
        if name in RUNTIME_PARAMS:
            raise SpaceError(f"{key} is a runtime parameter: put it in the search space")
        out[COMPILE_FLAG_OF.get(name, name)] = value
    # The options are checked whole here so a bad base flag fails the space, not every point.
    try:
        CompileOptions.from_json(out)
    except CompileError as exc:
        raise SpaceError(f"base flags: {exc.message}") from None
    return out


def build_space(
    rows: Iterable[Mapping[str, Any]],
    base: Mapping[str, Any] | Sequence[str] = (),
    constraints: Iterable[str] = (),
) -> SearchSpace:
    """Check every row (a mapping of parameter -> value) and group the valid ones."""
    base_values = _normalise_base(base)
    parsed = tuple(Constraint.parse(c) for c in constraints)
    points: list[Point] = []
    groups: dict[str, list[int]] = {}
    group_options: dict[str, tuple[CompileOptions, dict[str, Any]]] = {}
    for index, raw in enumerate(rows):
        if index >= MAX_POINTS:
            raise SpaceError(f"the search space has more than {MAX_POINTS} combinations")
        params = {canonical_param(k): _value(v) for k, v in raw.items()}
        params = {k: v for k, v in params.items() if v is not None}
        point = _check_point(index, params, base_values, parsed)
        if point.options is not None:
            key = point.options.to_json_str()
            if key not in groups:
                groups[key] = []
                compile_params = {k: v for k, v in params.items() if k not in RUNTIME_PARAMS}
                group_options[key] = (point.options, compile_params)
            point = Point(index, params, point.options, list(groups).index(key))
            groups[key].append(index)
        points.append(point)
    built = tuple(
        Group(i, group_options[key][0], group_options[key][1], tuple(members))
        for i, (key, members) in enumerate(groups.items())
    )
    return SearchSpace(tuple(points), built, base_values, parsed)


def _check_point(
    index: int, params: dict[str, Any], base: dict[str, Any], constraints: Sequence[Constraint]
) -> Point:
    for name in RUNTIME_PARAMS:
        problem = _check_runtime(name, params.get(name))
        if problem:
            return Point(index, params, reason=problem)
    values = dict(base)
    for name, value in params.items():
        if name in PRECISION_PARAMS:
            flag, choices = PRECISION_PARAMS[name]
            if str(value).lower() not in choices:
                shown = " or ".join(choices)
                return Point(index, params, reason=f"{name} must be {shown}, not {value!r}")
            values[flag] = choices[str(value).lower()]
        elif name not in RUNTIME_PARAMS:
            values[COMPILE_FLAG_OF.get(name, name)] = value
    try:
        options = CompileOptions.from_json(values)
    except CompileError as exc:
        return Point(index, params, reason=exc.message)
    cores = options.device.cores_per_soc
    instances = int(params.get("instances") or 1)
    if options.aic_num_cores * instances > cores:
        return Point(
            index,
            params,
            reason=f"cores x instances = {options.aic_num_cores * instances} is more than the "
            f"{cores} cores of {options.device.name}",
        )
    cards = int(params.get("cards") or 1)
    if cards > MAX_CARDS_PER_HOST:
        return Point(index, params, reason=f"cards = {cards}: a host takes at most "
                     f"{MAX_CARDS_PER_HOST}")  # fmt: skip
    socs = options.device.socs * cards
    if (options.mdp_devices or 1) > socs:
        return Point(index, params, reason=f"devices = {options.mdp_devices} is more than "
                     f"the {socs} SoCs of {cards} {options.device.name} card(s)")  # fmt: skip
    known = {"cores": options.aic_num_cores, "batchsize": options.batchsize or 1,
             "instances": instances, "set_size": int(params.get("set_size") or 1),
             "mos": options.mos or 0, "ols": options.ols,
             "devices": options.mdp_devices or 1, "cards": cards}  # fmt: skip
    for constraint in constraints:
        if not constraint.holds({**params, **known}):
            return Point(index, params, reason=f"fails the constraint {constraint.text}")
    return Point(index, params, options)


# ------------------------------------------------------------------------------ reading


def parse_csv(text: str, base: Mapping[str, Any] | Sequence[str] = ()) -> SearchSpace:
    """The vendor's form: a header row of parameter names, then one row per combination
    (blank cells leave a parameter unset; `#` lines are comments)."""
    lines = [
        line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]
    if not lines:
        raise SpaceError("the CSV search space is empty")
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    if reader.fieldnames is None or not any(f.strip() for f in reader.fieldnames):
        raise SpaceError("the CSV search space has no header row")
    for name in reader.fieldnames:
        canonical_param(name)
    rows = []
    for line_no, row in enumerate(reader, start=2):
        if None in row:
            raise SpaceError(f"CSV row {line_no} has more cells than the header")
        rows.append({k.strip(): v for k, v in row.items() if k and k.strip()})
    if not rows:
        raise SpaceError("the CSV search space has a header but no combinations")
    return build_space(rows, base)


def expand(parameters: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every combination of a mapping of parameter -> value or list of values, in order
    (the last parameter varies fastest)."""
    names = list(parameters)
    lists = []
    for name in names:
        values = parameters[name]
        values = list(values) if isinstance(values, list | tuple) else [values]
        if not values:
            raise SpaceError(f"parameter {name!r} has an empty list of values")
        lists.append(values)
    total = 1
    for values in lists:
        total *= len(values)
    if total > MAX_POINTS:
        raise SpaceError(f"the search space has {total} combinations (at most {MAX_POINTS})")
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*lists)]


def parse_mapping(data: Any, base: Mapping[str, Any] | Sequence[str] = ()) -> SearchSpace:
    """The compact form: `{"parameters": {name: [values]}, "constraints": [...],
    "base_flags": [...] or {...}}`; a mapping without `parameters` is the parameters
    themselves. Base flags given to the call come after the file's (they win)."""
    if not isinstance(data, Mapping):
        raise SpaceError("a JSON/YAML search space must be a mapping")
    known = {"parameters", "constraints", "base_flags", "base", "name", "description"}
    if "parameters" in data:
        unknown = set(data) - known
        if unknown:
            raise SpaceError(f"unknown search-space keys: {', '.join(sorted(unknown))}")
        parameters = data["parameters"]
        constraints = data.get("constraints") or []
        file_base = data.get("base_flags", data.get("base")) or {}
    else:
        parameters, constraints, file_base = data, [], {}
    if not isinstance(parameters, Mapping) or not parameters:
        raise SpaceError("`parameters` must be a non-empty mapping of name -> list of values")
    if isinstance(constraints, str):
        constraints = [constraints]
    if not isinstance(constraints, list) or not all(isinstance(c, str) for c in constraints):
        raise SpaceError("`constraints` must be a list of expressions")
    merged = {**_normalise_base(file_base), **_normalise_base(base)}
    return build_space(expand(parameters), merged, constraints)


def parse_text(text: str, fmt: str, base: Mapping[str, Any] | Sequence[str] = ()) -> SearchSpace:
    """A space from its text: `fmt` is csv, json or yaml."""
    if fmt == "csv":
        return parse_csv(text, base)
    if fmt == "json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpaceError(f"the search space is not valid JSON: {exc}") from None
        return parse_mapping(data, base)
    if fmt in ("yaml", "yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SpaceError(f"the search space is not valid YAML: {exc}") from None
        return parse_mapping(data, base)
    raise SpaceError(f"unknown search-space format {fmt!r} (csv, json or yaml)")


def load_space(path: str | Path, base: Mapping[str, Any] | Sequence[str] = ()) -> SearchSpace:
    """A space from a `.csv`, `.json`, `.yaml` or `.yml` file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpaceError(f"cannot read the search space {path}: {exc.strerror}") from None
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in ("csv", "json", "yaml", "yml"):
        raise SpaceError(f"{path}: a search space is a .csv, .json or .yaml file")
    return parse_text(text, suffix, base)


def with_cards(space: SearchSpace, cards: int) -> SearchSpace:
    """The space with `cards` cards for every combination that does not name its own
    (`qpcfarm configure --cards N`)."""
    rows = [{**p.params, "cards": p.params.get("cards", cards)} for p in space.points]
    return build_space(rows, space.base, [c.text for c in space.constraints])
