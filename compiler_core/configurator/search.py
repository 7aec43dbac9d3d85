"""Which compiles a sweep runs next: `brute` (every compile group of the space) or
`optimize` (a hill climb over the compile parameters that needs far fewer compiles).

Both are pure functions of the space and of the results so far, so a farm sweep can be
advanced by any process after any restart and two advancing at once propose the same
compiles. Runtime parameters (instances, set size) cost no compile: once a group is compiled
every point of it is scored.

`optimize` is coordinate hill climbing, the vendor's "configuration optimizer" idea: start
at the group in the middle of every axis (cores, batch size, mos, ols, other swept flags),
compile its neighbours (one step up or down one axis, the other axes kept as close as the
constraints allow) all at once, move to the best group found and repeat until no neighbour
of the best is unexplored. A round's compiles are independent, so a farm runs them in
parallel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compiler_core.configurator.scoring import LlmBounds, Score, meets, rank_key, score
from compiler_core.configurator.space import Group, Point, SearchSpace

MODES = ("brute", "optimize")

Metrics = Mapping[str, Any]
"""A compile's perf metrics; None in a results mapping marks a failed compile."""


@dataclass(frozen=True)
class Result:
    """A scored point (or a point whose compile failed: `score` None, `error` set)."""

    point: Point
    score: Score | None
    error: str | None = None


def score_point(point: Point, metrics: Metrics) -> Score:
    return score(
        metrics,
        instances=point.instances,
        batchsize=point.batchsize,
        set_size=point.set_size,
        cards=point.cards,
        socs_per_instance=point.socs_per_instance,
    )


def results(
    space: SearchSpace,
    done: Mapping[int, Metrics | None],
    errors: Mapping[int, str] | None = None,
) -> list[Result]:
    """A result per point of every finished group (input order)."""
    out: list[Result] = []
    for group in space.groups:
        if group.index not in done:
            continue
        metrics = done[group.index]
        for index in group.points:
            point = space.points[index]
            if metrics is None:
                error = (errors or {}).get(group.index, "compile failed")
                out.append(Result(point, None, error))
            else:
                out.append(Result(point, score_point(point, metrics)))
    out.sort(key=lambda r: r.point.index)
    return out


def ranked(
    items: Sequence[Result],
    objective: str,
    latency_bound_us: float | None,
    llm_bounds: LlmBounds | None = None,
) -> list[Result]:
    """Best first (see `scoring.rank_key`)."""
    return sorted(
        items,
        key=lambda r: rank_key(
            r.score,
            objective,
            latency_bound_us,
            (r.point.cores * r.point.instances, r.point.index),
            llm_bounds,
        ),
    )


def best(
    items: Sequence[Result],
    objective: str,
    latency_bound_us: float | None,
    llm_bounds: LlmBounds | None = None,
) -> Result | None:
    """The best result, if any was scored (under a bound: the best within it, else None)."""
    top = ranked(items, objective, latency_bound_us, llm_bounds)
    if not top or not meets(top[0].score, objective, latency_bound_us, llm_bounds):
        return None
    return top[0]


# ------------------------------------------------------------------------------ the climb


def _axes(space: SearchSpace) -> dict[str, list[Any]]:
    """Each compile parameter that takes more than one value, its values in order."""
    values: dict[str, list[Any]] = {}
    for group in space.groups:
        for name, value in group.compile_params.items():
            seen = values.setdefault(name, [])
            if value not in seen:
                seen.append(value)
    for group in space.groups:  # a parameter a group leaves unset is a value of its own
        for name, seen in values.items():
            if name not in group.compile_params and None not in seen:
                seen.append(None)
    return {name: sorted(v, key=_order) for name, v in values.items() if len(v) > 1}


def _order(value: Any) -> tuple[int, Any]:
    if value is None:
        return (0, 0)
    if isinstance(value, bool | int | float):
        return (1, float(value))
    return (2, str(value))


def _position(group: Group, axes: Mapping[str, list[Any]]) -> dict[str, int]:
    return {name: values.index(group.compile_params.get(name)) for name, values in axes.items()}


def start_group(space: SearchSpace) -> int:
    """The group nearest the middle of every axis (ties: the first)."""
    axes = _axes(space)
    middle = {name: (len(values) - 1) / 2 for name, values in axes.items()}

    def distance(group: Group) -> tuple[float, int]:
        pos = _position(group, axes)
        return (sum(abs(pos[n] - middle[n]) for n in axes), group.index)

    return min(space.groups, key=distance).index


def neighbours(space: SearchSpace, index: int) -> list[int]:
    """Groups one step up or down one axis from group `index`; the other axes stay as close
    as the valid groups allow (fewest other axes changed, then the smallest steps)."""
    axes = _axes(space)
    here = _position(space.groups[index], axes)
    found: list[int] = []
    positions = {g.index: _position(g, axes) for g in space.groups}
    for name in axes:
        for step in (-1, 1):
            target = here[name] + step
            if not 0 <= target < len(axes[name]):
                continue
            candidates = [g for g, pos in positions.items() if pos[name] == target]
            if not candidates:
                continue

            chosen = min(candidates, key=lambda g: _move_cost(positions[g], here, name))
            if chosen not in found:
                found.append(chosen)
    return found


def _move_cost(pos: Mapping[str, int], here: Mapping[str, int], axis: str) -> tuple[int, int]:
    """How far a move along `axis` drags the other axes: how many change, then by how much."""
    others = [abs(pos[n] - here[n]) for n in here if n != axis]
    return (sum(1 for d in others if d), sum(others))


def group_score(
    space: SearchSpace, group: int, metrics: Metrics | None, objective: str,
    latency_bound_us: float | None, llm_bounds: LlmBounds | None = None,
) -> tuple[Any, ...]:  # fmt: skip
    """The rank key of the best point of a compiled group (failed: worst)."""
    if metrics is None:
        return rank_key(None, objective, latency_bound_us, (group,), llm_bounds)
    keys = [
        rank_key(
            score_point(space.points[i], metrics),
            objective,
            latency_bound_us,
            (group,),
            llm_bounds,
        )  # fmt: skip
        for i in space.groups[group].points
    ]
    return min(keys)


def next_groups(
    space: SearchSpace,
    mode: str,
    done: Mapping[int, Metrics | None],
    pending: Sequence[int] | set[int],
    objective: str,
    latency_bound_us: float | None = None,
    llm_bounds: LlmBounds | None = None,
) -> list[int]:
    """The groups to compile now (none while a round is pending, or when finished)."""
    if mode == "brute":
        return [g.index for g in space.groups if g.index not in done and g.index not in pending]
    if mode != "optimize":
        raise ValueError(f"unknown mode {mode!r}")
    if pending or not space.groups:
        return []
    if not done:
        return [start_group(space)]
    scored = [g for g, m in done.items() if m is not None]
    if scored:
        current = min(
            scored,
            key=lambda g: group_score(space, g, done[g], objective, latency_bound_us, llm_bounds),
        )
        frontier = [current]
    else:  # every compile so far failed: widen around all of them
        frontier = sorted(done)
    proposed: list[int] = []
    for g in frontier:
        for n in neighbours(space, g):
            if n not in done and n not in proposed:
                proposed.append(n)
    return proposed
