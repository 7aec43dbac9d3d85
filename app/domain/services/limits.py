"""The memory and wall-clock limits of the processes that run untrusted models: compiles
(`worker.compile_process`) and upload checks (`app.domain.services.describer`).

A team's model is code-like input: a small file can make the importer or the compiler
allocate without bound or run for hours. Both therefore run in child processes that set an
address-space limit on themselves (`RLIMIT_AS`: an allocation beyond it fails, as a
`MemoryError` in Python) and that their parent kills at a wall-clock deadline. This module
holds the numbers (from settings), the child's side (`apply_memory_limit`; for a program
that is not Python, such as the vendor's `qaic-compile`, `limited_command`) and how an
outcome is recognised (`caused_by_memory`).
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.domain.settings import Settings

MiB = 1 << 20
HOST_MEMORY_SHARE = 0.75
"""The default memory limit's share of the host's memory: a model that needs more would
push the host into swap or the OOM killer, which may pick another team's process."""
MIN_DEFAULT_MEMORY = 2048 * MiB
"""The default never goes below this (a small host still compiles ordinary models)."""


@dataclass(frozen=True)
class Limits:
    """A child's limits: address space in bytes and wall-clock seconds (None: unlimited)."""

    memory_bytes: int | None = None
    time_s: float | None = None

    @property
    def memory_mib(self) -> int | None:
        return None if self.memory_bytes is None else self.memory_bytes // MiB


def host_memory_bytes() -> int:
    """The host's physical memory (0 when the platform does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def default_memory_bytes() -> int:
    return max(MIN_DEFAULT_MEMORY, int(host_memory_bytes() * HOST_MEMORY_SHARE))


def _memory(setting_mib: int | None) -> int | None:
    if setting_mib is None:
        return default_memory_bytes()
    return setting_mib * MiB if setting_mib > 0 else None


def _seconds(value: float | None) -> float | None:
    return value if value is not None and value > 0 else None


def soft_time_limit(hard_s: int) -> int:
    """A job's soft time limit (Celery's `task_soft_time_limit`): it ends the compile as a
    failed job shortly before the hard limit kills its process (5% earlier, at least 5 s and
    at most 60 s earlier). Here, beside the compile's own limit that stays under it."""
    margin = min(60, max(5, hard_s // 20))
    return max(1, hard_s - margin)


def compile_limits(settings: Settings) -> Limits:
    """The limits of one compile (`compile_memory_limit_mib`, `compile_time_limit_s`)."""
    time_s = settings.compile_time_limit_s
    if time_s is None:  # under Celery's soft limit, which would end the task without a code
        time_s = max(1.0, soft_time_limit(int(settings.job_time_limit_s)) - 5.0)
    return Limits(_memory(settings.compile_memory_limit_mib), _seconds(time_s))


def check_limits(settings: Settings) -> Limits:
    """The limits of one upload check (`check_memory_limit_mib`, `check_time_limit_s`)."""
    return Limits(_memory(settings.check_memory_limit_mib), _seconds(settings.check_time_limit_s))


def apply_memory_limit(memory_bytes: int | None) -> None:
    """In a child: cap its address space (never above a hard limit set from outside)."""
    if memory_bytes is None:
        return
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = memory_bytes if hard == resource.RLIM_INFINITY else min(memory_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


_EXEC_LIMITED = """
import os, resource, sys
limit = int(sys.argv[1])
_soft, hard = resource.getrlimit(resource.RLIMIT_AS)
if hard != resource.RLIM_INFINITY:
    limit = min(limit, hard)
resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
try:
    os.execv(sys.argv[2], sys.argv[2:])
except OSError as exc:
    print(f"could not start {sys.argv[2]}: {exc.strerror}", file=sys.stderr)
    sys.exit(127)
"""
"""Sets the address-space limit as `apply_memory_limit` does, then becomes the program."""


def limited_command(argv: list[str], memory_bytes: int | None) -> list[str]:
    """`argv` run under an address-space limit of `memory_bytes` (None: `argv` as it is). A
    Python launcher sets the limit and execs the program, so the limit holds from the
    program's first instruction (no `preexec_fn`, which is unsafe in a threaded worker). The
    launcher runs isolated (`-I -S`): nothing of the working folder, which may be a team's
    model archive, or of the environment is imported."""
    if memory_bytes is None:
        return argv
    return [sys.executable, "-I", "-S", "-c", _EXEC_LIMITED, str(memory_bytes), *argv]


def caused_by_memory(exc: BaseException | None) -> bool:
    """Whether `exc` is, or was raised while handling, a MemoryError: the compiler and the
    importer wrap unexpected errors of a stage into their own (`from exc`, or `from None`
    which still keeps the context)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, MemoryError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False
