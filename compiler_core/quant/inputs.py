"""Calibration inputs (`-input-list-file`): a list file of input files, or an .npz set.

A list file has one inference per line; the entries of a line (separated by spaces or commas)
are the inputs, in the model's input order, or `name:=path` in any order. Each file is a .npy
array or raw bytes (`.raw`, `.bin`: the input's type and shape, little endian). Relative paths
are relative to the list file. Blank lines and lines starting with `#` are skipped. On the
farm (a confined `ModelFolder`) the list file and every file it names must resolve inside the
model's folder; messages name files as the list names them, never by their server path.

An .npz holds one array per input name: either one sample (the input's shape) or several
stacked on a new leading axis.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.model_folder import LOCAL, ModelFolder

FLAG = "-input-list-file"
Feeds = dict[str, np.ndarray]


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]


def _invalid(message: str) -> CompileError:
    return CompileError("invalid_option", f"{FLAG}: {message}", flag=FLAG)


def load_inputs(
    path: str | Path, specs: Sequence[InputSpec], folder: ModelFolder = LOCAL
) -> list[Feeds]:
    """Every calibration sample as feeds by input name, checked against the model's inputs."""
    name = str(path)
    real = folder.resolve(path, FLAG)
    if not real.is_file():
        raise _invalid(f"{name} does not exist")
    if zipfile.is_zipfile(real):
        samples = _from_npz(real, name, specs)
    else:
        samples = _from_list(real, name, specs, folder)
    if not samples:
        raise _invalid(f"{name} holds no sample")
    return samples


def _from_npz(real: Path, path: str, specs: Sequence[InputSpec]) -> list[Feeds]:
    """The samples of an .npz; each input's array shape is checked from its header first, so
    only arrays of the right shape are ever decompressed (and only the inputs' arrays)."""
    try:
        shapes = _npz_shapes(real)
        missing = [s.name for s in specs if s.name not in shapes]
        if missing:
            raise _invalid(
                f"{path} has no array for input {', '.join(missing)} (it has "
                f"{', '.join(sorted(shapes)) or 'none'})"
            )
        for spec in specs:
            _check_npz_shape(shapes[spec.name], spec, path)
        with np.load(real, allow_pickle=False) as data:
            arrays = {spec.name: np.asarray(data[spec.name]) for spec in specs}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise _invalid(f"{path} is not a readable .npz: {reason}") from None
    counts = set()
    stacked: dict[str, np.ndarray] = {}
    for spec in specs:
        array = arrays[spec.name]
        _check_npz_shape(array.shape, spec, path)
        if array.shape == spec.shape:
            array = array[None]
        stacked[spec.name] = array
        counts.add(array.shape[0])
    if len(counts) != 1:
        raise _invalid(f"{path}: the inputs have different sample counts {sorted(counts)}")
    count = counts.pop()
    return [
        {s.name: _typed(stacked[s.name][i], s, f"{path}[{s.name}]") for s in specs}
        for i in range(count)
    ]


def _npz_shapes(real: Path) -> dict[str, tuple[int, ...]]:
    """Array name -> shape, from each member's .npy header (nothing is decompressed beyond
    the header)."""
    shapes: dict[str, tuple[int, ...]] = {}
    with zipfile.ZipFile(real) as archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                continue
            with archive.open(info) as member:
                version = np.lib.format.read_magic(member)
                if version == (1, 0):
                    shape, _, _ = np.lib.format.read_array_header_1_0(member)
                else:
                    shape, _, _ = np.lib.format.read_array_header_2_0(member)
            shapes[info.filename[: -len(".npy")]] = tuple(shape)
    return shapes


def _check_npz_shape(shape: tuple[int, ...], spec: InputSpec, path: str) -> None:
    if shape != spec.shape and shape[1:] != spec.shape:
        raise _invalid(
            f"{path}: array {spec.name} has shape {list(shape)}; expected "
            f"{list(spec.shape)} or [samples, {', '.join(map(str, spec.shape))}]"
        )


def _from_list(
    real: Path, path: str, specs: Sequence[InputSpec], folder: ModelFolder
) -> list[Feeds]:
    try:
        text = real.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise _invalid(f"cannot read {path}: {reason}") from None
    by_name = {s.name: s for s in specs}
    samples = []
    for number, line in enumerate(text.splitlines(), start=1):
        entries = line.replace(",", " ").split()
        if not entries or entries[0].startswith("#"):
            continue
        where = f"{Path(path).name} line {number}"
        feeds: Feeds = {}
        for position, entry in enumerate(entries):
            if ":=" in entry:
                name, file = entry.split(":=", 1)
                if name not in by_name:
                    raise _invalid(f"{where}: the model has no input {name!r}")
                spec = by_name[name]
            else:
                if position >= len(specs):
                    raise _invalid(f"{where}: {len(entries)} files for {len(specs)} inputs")
                spec, file = specs[position], entry
            # Relative to the list file; confined: inside the model's folder, else refused.
            found = folder.resolve(file, FLAG, relative_to=real.parent)
            feeds[spec.name] = _read_file(found, file, spec, where)
        missing = [s.name for s in specs if s.name not in feeds]
        if missing:
            raise _invalid(f"{where}: no file for input {', '.join(missing)}")
        samples.append(feeds)
    return samples


def _read_file(file: Path, name: str, spec: InputSpec, where: str) -> np.ndarray:
    """One input's array from `file` (`name`: as the list names it, for messages)."""
    if not file.is_file():
        raise _invalid(f"{where}: {name} does not exist")
    dtype = np.dtype(spec.dtype).newbyteorder("<")
    want = math.prod(spec.shape) * dtype.itemsize
    if file.suffix == ".npy":
        try:
            # Mapped: the header's shape is checked before the data is read.
            array = np.load(file, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise _invalid(f"{where}: {name} is not a readable .npy: {reason}") from None
        if array.shape != spec.shape:
            raise _invalid(
                f"{where}: {Path(name).name} has shape {list(array.shape)}, input {spec.name} "
                f"is {list(spec.shape)}"
            )
        return _typed(np.array(array), spec, f"{where}: {Path(name).name}")
    size = file.stat().st_size
    if size != want:  # checked before reading: a wrong file is never read whole
        raise _invalid(
            f"{where}: {Path(name).name} has {size} bytes; input {spec.name} ({spec.dtype}"
            f"{list(spec.shape)}) takes {want}"
        )
    raw = file.read_bytes()
    return np.frombuffer(raw, dtype=dtype).reshape(spec.shape).astype(spec.dtype)


def _typed(array: np.ndarray, spec: InputSpec, where: str) -> np.ndarray:
    if array.dtype == np.dtype(spec.dtype):
        return np.ascontiguousarray(array)
    if array.dtype.kind == np.dtype(spec.dtype).kind == "f":
        return array.astype(spec.dtype)
    raise _invalid(f"{where} is {array.dtype}; input {spec.name} is {spec.dtype}")
