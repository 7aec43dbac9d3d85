"""Run a sweep on this machine: each compile group in a worker process of its own
(`jobs` at once), scored as the farm scores it, the best QPC kept.

The same `search.next_groups` as the farm decides what to compile, so a local sweep and a
farm sweep of the same space, mode and objective compile the same groups.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler_core.configurator.scoring import LlmBounds
from compiler_core.configurator.search import Result, best, next_groups, ranked, results
from compiler_core.configurator.space import SearchSpace
from compiler_core.errors import CompileError
from compiler_core.options import CompileOptions

QPC_FILE = "programqpc.bin"


@dataclass
class LocalSweep:
    """What a local sweep did: its ranked results, the compiles it ran, and the best."""

    ranked: list[Result]
    best: Result | None
    compiles: int
    failed: int
    seconds: float
    best_qpc: Path | None = None
    errors: dict[int, str] = field(default_factory=dict)


def compile_group(model: str, options_json: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """In a worker process: compile one group; its perf metrics, or its error."""
    from compiler_core.compile import compile_model

    options = CompileOptions.from_json(options_json).with_(
        aic_binary_dir=out_dir, aic_perf_metrics=True
    )
    try:
        result = compile_model(model, options)
        return {"metrics": result.metrics}
    except CompileError as exc:
        return {"error": f"{exc.code}: {exc.message}"}


def run_local(
    model: str | Path,
    space: SearchSpace,
    *,
    mode: str = "brute",
    objective: str = "max-throughput",
    latency_bound_us: float | None = None,
    llm_bounds: LlmBounds | None = None,
    jobs: int = 1,
    out_dir: Path | None = None,
    on_result: Callable[[int, dict[str, Any]], None] | None = None,
) -> LocalSweep:
    """Compile what the search asks for, `jobs` processes at once, until it is done; the
    best combination's QPC is copied to `out_dir/programqpc.bin` when given."""
    started = time.monotonic()
    done: dict[int, dict[str, Any] | None] = {}
    errors: dict[int, str] = {}
    with (
        tempfile.TemporaryDirectory(prefix="qpcfarm-configure-") as tmp,
        ProcessPoolExecutor(max_workers=max(1, jobs)) as pool,
    ):
        running: dict[Future[dict[str, Any]], int] = {}
        while True:
            for g in next_groups(space, mode, done, set(running.values()), objective,
                                 latency_bound_us, llm_bounds):  # fmt: skip
                options = space.groups[g].options.to_json()
                future = pool.submit(compile_group, str(model), options, f"{tmp}/g{g}")
                running[future] = g
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                g = running.pop(future)
                try:
                    outcome = future.result()
                except Exception as exc:  # a crashed worker process
                    outcome = {"error": f"internal_error: {type(exc).__name__}: {exc}"}
                done[g] = outcome.get("metrics")
                if "error" in outcome:
                    errors[g] = outcome["error"]
                if on_result is not None:
                    on_result(g, outcome)
        items = results(space, done, errors)
        top = best(items, objective, latency_bound_us, llm_bounds)
        best_qpc = None
        if top is not None and out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            best_qpc = out_dir / QPC_FILE
            shutil.copyfile(Path(tmp) / f"g{top.point.group}" / QPC_FILE, best_qpc)
    return LocalSweep(
        ranked=ranked(items, objective, latency_bound_us, llm_bounds),
        best=top,
        compiles=len(done),
        failed=len(errors),
        seconds=time.monotonic() - started,
        best_qpc=best_qpc,
        errors=errors,
    )
