"""The model configurator: sweep compile and runtime parameters over a search space and
rank the combinations by the cost model's estimate (`space`, `scoring`, `search`, `local`;
the farm runs the same search as sweeps of compile jobs)."""

from compiler_core.configurator.scoring import OBJECTIVES, Score, parse_objective, score
from compiler_core.configurator.search import MODES, Result, best, next_groups, ranked, results
from compiler_core.configurator.space import (
    SearchSpace,
    SpaceError,
    build_space,
    load_space,
    parse_csv,
    parse_mapping,
    parse_text,
)

__all__ = [
    "MODES",
    "OBJECTIVES",
    "Result",
    "Score",
    "SearchSpace",
    "SpaceError",
    "best",
    "build_space",
    "load_space",
    "next_groups",
    "parse_csv",
    "parse_mapping",
    "parse_objective",
    "parse_text",
    "ranked",
    "results",
    "score",
]
