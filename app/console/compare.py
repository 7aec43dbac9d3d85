"""`qpcfarm compare A B`: two compiles on a farm side by side (`GET /v1/compare`).

    qpcfarm compare A B [--all] [--json] [--server URL] [--api-key KEY]

A and B are QPC ids or compile job ids of the team. Prints the status change, the metrics
that changed (each with both values, the ratio B/A and its change bucket; `--all` prints the
unchanged ones too), the warnings added and removed, and the pass times. `--json` prints the
API's answer as it is. Exit 0 once compared, 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NoReturn, TextIO

from app.console.submit import DEFAULT_SERVER, PROG, resolve_api_key


class CompareError(Exception):
    """A user-facing failure: one line on stderr, exit 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CompareError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=f"{PROG} compare",
        description="Compare two compiles on a farm: A before, B after (QPC or job ids).",
    )
    parser.add_argument("a", help="a QPC id or compile job id (before)")
    parser.add_argument("b", help="a QPC id or compile job id (after)")
    parser.add_argument("--all", action="store_true", help="print unchanged metrics too")
    parser.add_argument("--json", action="store_true", help="print the API's JSON answer")
    parser.add_argument(
        "--server", default=None, metavar="URL",
        help=f"the farm (default: $QPCFARM_SERVER, else {DEFAULT_SERVER})",
    )  # fmt: skip
    parser.add_argument("--api-key", default=None, help="the team's API key")
    return parser


def compare_command(argv: list[str]) -> int:
    """The `compare` entry of `app.console.cli.SERVICE_COMMANDS`."""
    from compiler_core.errors import CompileError

    try:
        args = build_parser().parse_args(argv)
        server = args.server or os.environ.get("QPCFARM_SERVER") or DEFAULT_SERVER
        key = resolve_api_key(args.api_key, dict(os.environ))
        from app.console.client import FarmClient

        with FarmClient(server, key) as client:
            answer = client.compare(args.a, args.b)
    except (CompareError, CompileError) as exc:
        message = exc.message if isinstance(exc, CompileError) else str(exc)
        print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(answer, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render(answer, sys.stdout, show_all=args.all)
    return 0


def _side(side: dict[str, Any]) -> str:
    what = side.get("qpc_id") or side.get("job_id") or side.get("ref")
    version = side.get("compiler_version") or "?"
    text = f"{side.get('kind')} {what} ({side.get('status')}, compiler {version})"
    error = side.get("error")
    return f"{text}: {error.get('code')}: {error.get('message')}" if error else text


def _number(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _table(rows: list[dict[str, Any]], out: TextIO, show_all: bool) -> int:
    shown = [r for r in rows if show_all or r.get("bucket") != "same"]
    if not shown:
        return 0
    width = max(len(r["name"]) for r in shown)
    for r in shown:
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.3f}x"
        arrow = {"up": "+", "down": "-"}.get(r.get("direction") or "", "")
        out.write(
            f"  {r['name']:<{width}}  {_number(r.get('a')):>12}  {_number(r.get('b')):>12}"
            f"  {ratio:>9}  {arrow}{r.get('bucket')}\n"
        )
    return len(shown)


def render(answer: dict[str, Any], out: TextIO, *, show_all: bool = False) -> None:
    out.write(f"A: {_side(answer['a'])}\nB: {_side(answer['b'])}\n")
    out.write(f"status: {answer['status']}\n")
    changed = answer.get("changed") or {}
    summary = ", ".join(f"{n} at {k}" for k, n in changed.items()) or "none"
    out.write(f"\nmetrics changed: {summary}\n")
    _table(answer.get("metrics") or [], out, show_all)
    for title in ("warnings added", "warnings removed"):
        items = answer.get(title.replace(" ", "_")) or []
        out.write(f"\n{title}: {len(items)}\n")
        for w in items:
            text = w.get("message") if isinstance(w, dict) else str(w)
            code = w.get("code") if isinstance(w, dict) else None
            out.write(f"  {code + ': ' if code else ''}{text}\n")
    if answer.get("pass_times"):
        out.write("\npass times (s):\n")
        _table(answer["pass_times"], out, True)
