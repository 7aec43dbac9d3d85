"""Compile options that name a file (specializations, custom I/O list) on the farm.

The farm cannot read a client's disk, so such a file travels inside the model's archive and
the option names it relative to the model (`-network-specialization-config=specs.json` beside
`model.onnx`). The archive's bytes are the model's identity, so the cache key covers the
file's content too. The API checks the path's form and refuses file options on a bare
(non-archive) model at submit; the worker checks the file is in the extracted archive, and the
compiler reads it through a `ModelFolder` confined to that folder (compiler_core/model_folder.py).
"""

from __future__ import annotations

from pathlib import Path

from app.domain.services.archives import inside_parts
from app.domain.services.upload_check import KIND_ARCHIVE
from compiler_core import CompileError, CompileOptions
from compiler_core.options import MODEL_FILE_OPTIONS

# The options whose value is a file inside the model's upload (MODEL_FILE_OPTIONS: declared
# with `model_file=True`; a quantization profile and the calibration inputs too, so the cache
# key covers their bytes).


def check_model_file_paths(options: CompileOptions) -> None:
    """Each file option names a plain relative path (no `..`, not absolute)."""
    for spec in MODEL_FILE_OPTIONS:
        value = getattr(options, spec.attr)
        if value is not None:
            _relative(value, spec.flag)


def check_model_files(options: CompileOptions, model_dir: Path | None) -> None:
    """Each file option names a file of the extracted archive `model_dir` (None: the model
    was a bare .onnx, which carries no other files). The compiler then reads them through
    its `ModelFolder` of `model_dir`, which confines every read (and every file a list file
    names) to that folder; this check only gives the clearer message first."""
    for spec in MODEL_FILE_OPTIONS:
        value = getattr(options, spec.attr)
        if value is None:
            continue
        flag = spec.flag
        relative = _relative(value, flag)
        if model_dir is None:
            raise _bare(flag, value)
        if not model_dir.joinpath(*relative).is_file():
            raise CompileError(
                "invalid_option",
                f"{flag}={value}: the model's archive has no file {value} beside the model",
                flag=flag,
            )


def check_files_travel(options: CompileOptions, kind: str) -> None:
    """At submit: file options need a model uploaded as an archive (its `kind`); a bare
    .onnx carries no files, so the job is refused at once (422 `invalid_option`) instead of
    failing later in the worker."""
    if kind == KIND_ARCHIVE:
        return
    for spec in MODEL_FILE_OPTIONS:
        value = getattr(options, spec.attr)
        if value is not None:
            raise _bare(spec.flag, value)


def _bare(flag: str, value: str) -> CompileError:
    return CompileError(
        "invalid_option",
        f"{flag}={value}: the model was uploaded as a bare .onnx; upload an archive "
        f"(.zip or .tar) holding the model and {value} beside it",
        flag=flag,
    )


def _relative(value: str, flag: str) -> list[str]:
    """The path's parts inside the model's folder, by the rule archive members follow."""
    try:
        return inside_parts(value)
    except ValueError:
        raise CompileError(
            "invalid_option",
            f"{flag}={value}: on the farm the file travels in the model's archive; name it "
            "relative to the model (e.g. specializations.json), without '..'",
            flag=flag,
        ) from None
