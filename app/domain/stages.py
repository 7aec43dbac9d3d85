"""What a job's stage means to a person: the row keeps the machine's name (`graph-passes`),
pages and the CLI show these words. No heavy imports: `qpcfarm submit` uses it too."""

from __future__ import annotations

STAGE_WORDS = {
    "claimed": "starting",
    "import": "importing the model",
    "graph-passes": "optimising the graph",
    "lower": "lowering to kernels",
    "schedule": "scheduling kernels on the cores",
    "plan-memory": "planning memory",
    "emit-program": "generating the program",
    "write-qpc": "writing the QPC",
    "done": "done",
    "cancelled": "cancelled",
}


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
        return f"failed while {words}" if words and stage not in ("done",) else "failed"
    if status == "cancelled":
        stopped = words and stage not in ("cancelled", "done")
        return f"cancelled while {words}" if stopped else "cancelled"
    return words
