"""What a job's stage means to a person: the row keeps the machine's name (`graph-passes`),
pages and the CLI show these words. The service's own stage names are declared here once. No
heavy imports: `qpcfarm submit` uses it too."""

from __future__ import annotations

CLAIMED = "claimed"
"""The stage of a compile its worker has just claimed (before the compiler reports)."""
DONE = "done"
CANCELLED = "cancelled"
"""The stages a compile ends in (a failure keeps the stage it failed in)."""

STAGE_WORDS = {
    CLAIMED: "starting",
    "import": "importing the model",
    "graph-passes": "optimising the graph",
    "lower": "lowering to kernels",
    "schedule": "scheduling kernels on the cores",
    "plan-memory": "planning memory",
    "emit-program": "generating the program",
    "write-qpc": "writing the QPC",
    DONE: "done",
    CANCELLED: "cancelled",
}
"""The words of every stage: the service's own above, and the compiler's
(`compiler_core.compile`'s progress stages; tests/test_job_kinds.py checks they all have words)."""


def stage_words(stage: str | None) -> str:
    """`graph-passes` -> `optimising the graph`; an unknown stage as it is, without dashes."""
    if not stage:
        return ""
    return STAGE_WORDS.get(stage, stage.replace("-", " "))


def describe_stage(status: str, stage: str | None, *, cache_hit: bool = False) -> str:
    """One phrase for the job's state: what it waits for, does, or where it stopped."""
    words = stage_words(stage)
    if status == "queued":
        return "waiting for a worker"
    if status == "running":
        return words or "starting"
    if status == "succeeded":
        return "done: an identical compile's QPC" if cache_hit else "done"
    if status == "failed":
        return f"failed while {words}" if words and stage != DONE else "failed"
    if status == "cancelled":
        stopped = words and stage not in (CANCELLED, DONE)
        return f"cancelled while {words}" if stopped else "cancelled"
    return words
