"""Run graph passes in order with instruments around each one (timing, progress).

Passes never time or report themselves: the manager calls every instrument before and after
each pass, so `-time-passes` and the job row's progress come from one place. A pass failure
that is not already a `CompileError` is wrapped in one that names the pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import onnx_ir as ir

from compiler_core.errors import CompileError
from compiler_core.passes.base import GraphPass

log = logging.getLogger(__name__)


class PassInstrument(Protocol):
    """Hooks the manager calls around every pass that runs (disabled passes are skipped)."""

    def before_pass(self, name: str, index: int, total: int) -> None: ...

    def after_pass(self, name: str, index: int, total: int, modified: bool) -> None: ...

    def skip_pass(self, name: str, index: int, total: int) -> None: ...


@dataclass
class PassTiming:
    """Wall time of every pass run, in run order (a pass that runs twice has two rows)."""

    records: list[tuple[str, float]] = field(default_factory=list)
    _started: float = 0.0

    def before_pass(self, name: str, index: int, total: int) -> None:
        self._started = time.perf_counter()

    def after_pass(self, name: str, index: int, total: int, modified: bool) -> None:
        self.records.append((name, time.perf_counter() - self._started))

    def skip_pass(self, name: str, index: int, total: int) -> None:
        return None

    @property
    def total_seconds(self) -> float:
        return sum(seconds for _, seconds in self.records)

    def render(self) -> str:
        """A table for `-time-passes`: pass name, milliseconds, share of the total."""
        total = self.total_seconds
        width = max([len("pass")] + [len(name) for name, _ in self.records])
        lines = [f"{'pass':<{width}}  {'ms':>10}  {'%':>6}"]
        for name, seconds in self.records:
            share = 100.0 * seconds / total if total > 0 else 0.0
            lines.append(f"{name:<{width}}  {seconds * 1e3:>10.3f}  {share:>5.1f}%")
        lines.append(f"{'total':<{width}}  {total * 1e3:>10.3f}  {100.0 if total else 0.0:>5.1f}%")
        return "\n".join(lines)


class ProgressReporter:
    """Calls `callback(stage, fraction)` after each pass; `stage` defaults to the pass name."""

    def __init__(self, callback: Callable[[str, float], None], stage: str | None = None) -> None:
        self._callback = callback
        self._stage = stage

    def before_pass(self, name: str, index: int, total: int) -> None:
        return None

    def after_pass(self, name: str, index: int, total: int, modified: bool) -> None:
        self._callback(self._stage or name, (index + 1) / total if total else 1.0)

    def skip_pass(self, name: str, index: int, total: int) -> None:
        self.after_pass(name, index, total, False)


class PassContext:
    """The instruments and the disabled pass names for one run of a pass list."""

    def __init__(
        self,
        instruments: Iterable[PassInstrument] = (),
        disabled: Iterable[str] = (),
    ) -> None:
        self.instruments = list(instruments)
        self.disabled = frozenset(disabled)

    def run(self, model: ir.Model, passes: Sequence[GraphPass]) -> bool:
        """Run `passes` in order on `model` (in place); True when any of them changed it."""
        known = {p.name for p in passes}
        unknown = sorted(self.disabled - known)
        if unknown:
            raise CompileError(
                "unknown_pass",
                f"cannot disable unknown pass(es) {', '.join(unknown)}; "
                f"passes are: {', '.join(sorted(known))}",
                details={"unknown": unknown},
            )
        total = len(passes)
        modified = False
        for index, graph_pass in enumerate(passes):
            name = graph_pass.name
            if name in self.disabled:
                log.info("pass %s disabled", name)
                for instrument in self.instruments:
                    instrument.skip_pass(name, index, total)
                continue
            for instrument in self.instruments:
                instrument.before_pass(name, index, total)
            changed = _run_one(graph_pass, model)
            for instrument in self.instruments:
                instrument.after_pass(name, index, total, changed)
            modified = modified or changed
        return modified


def _run_one(graph_pass: GraphPass, model: ir.Model) -> bool:
    try:
        return graph_pass(model).modified
    except CompileError:
        raise
    except Exception as exc:
        raise CompileError(
            "pass_failed",
            f"{graph_pass.name}: {type(exc).__name__}: {exc}",
            details={"pass": graph_pass.name},
        ) from exc


def run_passes(
    model: ir.Model,
    passes: Sequence[GraphPass],
    *,
    timing: PassTiming | None = None,
    progress: ProgressReporter | None = None,
    disabled: Iterable[str] = (),
) -> bool:
    """Run `passes` in order on `model` in place; True when any pass changed it."""
    instruments: list[PassInstrument] = []
    if timing is not None:
        instruments.append(timing)
    if progress is not None:
        instruments.append(progress)
    return PassContext(instruments, disabled).run(model, passes)
