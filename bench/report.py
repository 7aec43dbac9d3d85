"""The end of a benchmark's run, shared by the scripts: progress lines on stderr, the report
on stdout, the figures as JSON when asked (`--json`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def progress(message: str) -> None:
    """A progress line on stderr, so stdout holds only the report."""
    print(message, file=sys.stderr, flush=True)


def emit(lines: Sequence[str], records: Any, json_path: Path | None) -> None:
    """Print the report's lines; also write `records` to `json_path` when one is given."""
    print("\n".join(lines))
    if json_path is not None:
        json_path.write_text(json.dumps(records, indent=1))
