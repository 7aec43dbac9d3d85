"""Compiles in a child process (the embedded mode's worker threads): results, compiler
refusals, cancels and a crashed child, each coming back to the parent as it would in process.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import onnx
import pytest

from compiler_core import CompileError, CompileOptions
from tests.conftest import tiny_model
from worker.compile_process import CompileProcess


@pytest.fixture(scope="module")
def child() -> Iterator[CompileProcess]:
    process = CompileProcess()
    try:
        yield process
    finally:
        process.close()


def model_file(tmp_path: Path, batch: int | str = 2) -> Path:
    path = tmp_path / "m.onnx"
    onnx.save(tiny_model(batch=batch), path)
    return path


def options(tmp_path: Path, *flags: str) -> CompileOptions:
    return CompileOptions.from_flags([f"-aic-binary-dir={tmp_path / 'out'}", *flags])


def test_a_compile_in_the_child_writes_the_qpc_and_reports_progress(
    child: CompileProcess, tmp_path: Path
) -> None:
    stages: list[str] = []
    result = child.compile(model_file(tmp_path), options(tmp_path), lambda s, f: stages.append(s))
    assert result.qpc_path.is_file() and result.metrics and result.pass_times
    assert stages and stages[0] == "import"


def test_the_child_honours_options_that_leave_the_qpc_alone(
    child: CompileProcess, tmp_path: Path
) -> None:
    """The output folder and -aic-perf-warnings do not change the QPC's bytes, and the child
    still gets them (the farm's report always carries the perf analysis)."""
    wanted = options(tmp_path, "-aic-num-cores=2", "-aic-perf-warnings")
    result = child.compile(model_file(tmp_path), wanted, lambda s, f: None)
    assert result.qpc_path == tmp_path / "out" / "programqpc.bin"
    assert any(w["code"] == "fp32_compute" and w["kind"] == "perf" for w in result.warnings)


def test_a_compiler_refusal_comes_back_with_its_code_and_flag(
    child: CompileProcess, tmp_path: Path
) -> None:
    with pytest.raises(CompileError) as refused:
        child.compile(model_file(tmp_path, batch="N"), options(tmp_path), lambda s, f: None)
    assert refused.value.code == "dynamic_shape"


class Stop(BaseException):
    pass


def test_a_cancel_stops_the_child_and_the_next_compile_still_runs(
    child: CompileProcess, tmp_path: Path
) -> None:
    def cancel(stage: str, fraction: float) -> None:
        raise Stop

    with pytest.raises(Stop):
        child.compile(model_file(tmp_path), options(tmp_path), cancel)
    assert child.compile(model_file(tmp_path), options(tmp_path), lambda s, f: None).metrics


def test_a_cancel_sent_after_the_last_report_does_not_poison_the_next_compile(
    child: CompileProcess, tmp_path: Path
) -> None:
    """The last report (write-qpc done) comes after the child's last look for a cancel: the
    child finishes, and the cancel waits in the pipe where the next request is read."""

    seen: list[str] = []

    def cancel_at_the_end(stage: str, fraction: float) -> None:
        seen.append(stage)
        if seen.count("write-qpc") == 2:  # write-qpc reports as it starts and as it ends
            raise Stop

    with pytest.raises(Stop):
        child.compile(model_file(tmp_path), options(tmp_path), cancel_at_the_end)
    process = child._process
    process.join(2)  # a child that read the stray cancel as a request would be dead by now
    assert process.is_alive(), "the child died on the cancel that arrived after its compile"
    assert child.compile(model_file(tmp_path), options(tmp_path), lambda s, f: None).metrics


def test_a_child_that_dies_fails_the_compile_cleanly_and_is_replaced(
    child: CompileProcess, tmp_path: Path
) -> None:
    def kill_child(stage: str, fraction: float) -> None:
        os.kill(child._process.pid, signal.SIGKILL)

    with pytest.raises(CompileError) as crashed:
        child.compile(model_file(tmp_path), options(tmp_path), kill_child)
    assert crashed.value.code == "compiler_crashed"
    assert child.compile(model_file(tmp_path), options(tmp_path), lambda s, f: None).metrics
