"""`qpcfarm configure`: the model configurator, on this machine or on a farm.

    qpcfarm configure -m=model.onnx --search-space space.csv [--mode brute|optimize]
                      [--objective OBJECTIVE] [--latency-bound-us US]
                      [--max-ttft-ms MS] [--max-tpot-ms MS] [-aic-binary-dir=DIR]
                      [base compile flags]
                      [--server URL [--api-key KEY]] [--jobs N] [--json FILE]

Every combination of the search space (a `.csv` in the vendor's form, or a `.json`/`.yaml`
in the compact one) is checked first; the invalid ones are listed, never compiled. Locally the
compiles run in `--jobs` processes; with `--server` they run on the farm as a sweep
(`/v1/sweeps`) whose combinations are ordinary compile jobs. Either way the ranked table is
printed, and the best combination's QPC is written to `DIR/programqpc.bin`. The objectives
are the configurator's table (`compiler_core.configurator.scoring.OBJECTIVE_TABLE`); an LLM's
(`max-tokens-per-s`, `max-decode-tokens-per-s`) take bounds on the time to first token and
per output token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.console.submit import DEFAULT_SERVER, PROG, resolve_api_key

TERMINAL = ("succeeded", "failed", "cancelled")
POLL_S = 0.5
TABLE_ROWS = 40
INVALID_SHOWN = 12


class ConfigureError(Exception):
    """A user-facing failure: one line on stderr, exit 1."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} configure",
        description="Sweep compile and runtime parameters over a search space and rank the "
        "combinations by the cost model's estimate; writes the best QPC.",
        epilog="Other single-dash arguments are compile flags every combination shares "
        "(-convert-to-fp16, -aic-device=..., ...).",
    )
    parser.add_argument(
        "--search-space",
        required=True,
        type=Path,
        metavar="FILE",
        help="a .csv (vendor form) or .json/.yaml (compact form) space",
    )
    parser.add_argument("--mode", choices=("brute", "optimize"), default="brute")
    from compiler_core.configurator.scoring import OBJECTIVE_TABLE

    parser.add_argument(
        "--objective",
        default="max-throughput",
        help="; ".join(f"{o.name}: {o.summary}" for o in OBJECTIVE_TABLE)
        + " (default max-throughput)",
    )
    parser.add_argument("--latency-bound-us", type=float, default=None, metavar="US",
                        help="the bound of max-throughput-under-latency")  # fmt: skip
    parser.add_argument("--max-ttft-ms", type=float, default=None, metavar="MS",
                        help="an LLM objective's bound on the time to first token")  # fmt: skip
    parser.add_argument("--max-tpot-ms", type=float, default=None, metavar="MS",
                        help="an LLM objective's bound on the time per output token")  # fmt: skip
    parser.add_argument("--server", default=None, metavar="URL",
                        help="run the sweep on this farm instead of locally")  # fmt: skip
    parser.add_argument("--api-key", default=None, help="the team's key (farm mode)")
    parser.add_argument("--cards", type=int, default=None, metavar="N",
                        help="cards in the host for every combination that names none "
                             "(default 1; every SoC of each card runs the instances)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                        help="local compile processes (default: the CPUs)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="also write every result as JSON")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=24 * 3600.0, metavar="S",
                        help="farm mode: give up waiting after S seconds")  # fmt: skip
    return parser


def split_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the command's own `--options`, the single-dash compile flags)."""
    own: list[str] = []
    flags: list[str] = []
    items = iter(argv)
    for arg in items:
        if arg.startswith("--") or arg in ("-h",):
            own.append(arg)
            if "=" not in arg and arg not in ("-h", "--help"):
                value = next(items, None)
                if value is not None:
                    own.append(value)
        else:
            flags.append(arg)
    return own, flags


def configure_command(argv: list[str]) -> int:
    """The `configure` entry of `app.console.cli.SERVICE_COMMANDS`: 0 when a best combination was
    found (and written), 1 on any failure or when none met the objective."""
    from compiler_core.errors import CompileError

    try:
        return _configure(argv)
    except (ConfigureError, CompileError) as exc:
        message = exc.message if isinstance(exc, CompileError) else str(exc)
        print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
        return 1


def _configure(argv: list[str]) -> int:
    own, flags = split_flags(argv)
    args = build_parser().parse_args(own)
    from compiler_core.configurator.scoring import parse_llm_bounds, parse_objective
    from compiler_core.configurator.space import load_space, with_cards
    from compiler_core.errors import CompileError
    from compiler_core.options import CompileOptions

    try:
        options = CompileOptions.from_flags(flags)
        objective, bound = parse_objective(args.objective, args.latency_bound_us)
        llm_bounds = parse_llm_bounds(objective, args.max_ttft_ms, args.max_tpot_ms)
        base = options.with_(model=None, aic_binary_dir=None).to_flags()
        space = load_space(args.search_space, base)
        if args.cards is not None:
            if args.cards < 1:
                raise ConfigureError(f"--cards must be a positive integer, not {args.cards}")
            space = with_cards(space, args.cards)
    except CompileError as exc:
        raise ConfigureError(exc.message) from None
    if options.model is None:
        raise ConfigureError("no model given (-m=<model.onnx>)")
    model = Path(options.model)
    if not model.is_file():
        raise ConfigureError(f"{model}: no such model file")
    out_dir = Path(options.aic_binary_dir) if options.aic_binary_dir else None
    for point in space.invalid_points[:INVALID_SHOWN]:
        _say(f"invalid combination {point.index + 1} ({_params(point.params)}): {point.reason}")
    if len(space.invalid_points) > INVALID_SHOWN:
        _say(f"... and {len(space.invalid_points) - INVALID_SHOWN} more invalid combinations")
    if not space.groups:
        raise ConfigureError("no combination of the search space is valid")
    _say(
        f"{len(space.points)} combinations: {len(space.valid_points)} valid in "
        f"{len(space.groups)} compile groups, {len(space.invalid_points)} invalid"
    )
    if args.server:
        summary = _on_farm(args, model, space, base, objective, bound, out_dir)
    else:
        summary = _locally(args, model, space, objective, bound, out_dir, llm_bounds)
    from compiler_core.configurator.table import render

    print(render(summary["results"], TABLE_ROWS))
    best = summary.get("best")
    if best is None:
        _say("no combination met the objective")
    else:
        _say(f"best: {' '.join(best['flags'])}")
        if out_dir is not None:
            _say(f"wrote {out_dir / 'programqpc.bin'}")
    _say(summary["line"])
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1, default=str))
    return 0 if best is not None else 1


def _params(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _locally(
    args: argparse.Namespace, model: Path, space: Any, objective: str, bound: float | None,
    out_dir: Path | None, llm_bounds: Any = None,
) -> dict[str, Any]:  # fmt: skip
    from compiler_core.configurator.local import run_local
    from compiler_core.configurator.table import rows_of

    total = len(space.groups) if args.mode == "brute" else None
    count = 0

    def progress(group: int, outcome: dict[str, Any]) -> None:
        nonlocal count
        count += 1
        state = "failed: " + outcome["error"] if "error" in outcome else "done"
        _say(f"compile {count}{'/' + str(total) if total else ''} (group {group}) {state}")

    run = run_local(model, space, mode=args.mode, objective=objective, latency_bound_us=bound,
                    llm_bounds=llm_bounds, jobs=args.jobs, out_dir=out_dir,
                    on_result=progress)  # fmt: skip
    rows = rows_of(run.ranked)
    best = next((r for r in rows if run.best and r["index"] == run.best.point.index), None)
    line = (
        f"{args.mode}: {run.compiles} compiles ({run.failed} failed) of {len(space.groups)} "
        f"groups in {run.seconds:.1f} s, {args.jobs} processes (estimated figures)"
    )
    return {"mode": args.mode, "objective": objective, "results": rows, "best": best,
            "compiles": run.compiles, "seconds": run.seconds, "line": line}  # fmt: skip


def _space_body(path: Path, cards: int | None = None) -> dict[str, Any]:
    """The request's space: the file's text, with `cards` for the rows that name none."""
    text = path.read_text()
    if path.suffix.lower() == ".csv":
        return {"space_csv": _csv_with_cards(text, cards) if cards is not None else text}
    if path.suffix.lower() == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if cards is not None and isinstance(data, dict):
        params = data.get("parameters", data)
        if isinstance(params, dict) and not any(k.lower() in _CARD_KEYS for k in params):
            params["cards"] = [cards]
    return {"space": data}


_CARD_KEYS = ("cards", "num-cards", "num_cards")


def _csv_with_cards(text: str, cards: int) -> str:
    """A `cards` column filled with `cards` where the CSV has none (comments dropped)."""
    import csv
    import io

    rows = [r for r in csv.reader(io.StringIO(text)) if r and not r[0].lstrip().startswith("#")]
    if not rows or any(h.strip().lower() in _CARD_KEYS for h in rows[0]):
        return text
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*rows[0], "cards"])
    for row in rows[1:]:
        writer.writerow([*row, cards])
    return out.getvalue()


def _on_farm(
    args: argparse.Namespace, model: Path, space: Any, base: list[str], objective: str,
    bound: float | None, out_dir: Path | None,
) -> dict[str, Any]:  # fmt: skip
    from app.console.client import FarmClient
    from app.console.submit import upload_source

    server = args.server if args.server != "default" else DEFAULT_SERVER
    key = resolve_api_key(args.api_key, dict(os.environ))
    started = time.monotonic()
    with FarmClient(server, key) as client:
        with upload_source(model) as (path, name):
            model_id = client.upload_model(path, name)["id"]
        body = {
            "model_id": model_id,
            "base_flags": base,
            "mode": args.mode,
            "objective": objective,
            "latency_bound_us": bound,
            "max_ttft_ms": args.max_ttft_ms,
            "max_tpot_ms": args.max_tpot_ms,
            **_space_body(args.search_space, args.cards),
        }
        sweep = client.create_sweep(body)
        _say(f"sweep {sweep['id']} on {server}")
        last = ""
        try:
            while sweep["status"] not in TERMINAL:
                if time.monotonic() - started > args.timeout:
                    raise ConfigureError(f"the sweep did not finish in {args.timeout:g} s")
                time.sleep(POLL_S)
                sweep = client.get_sweep(sweep["id"])
                p = sweep["progress"]
                line = (
                    f"{p['compiles_done']}/{p['compiles_submitted']} compiles done "
                    f"({p['cache_hits']} cache hits, {p['compiles_failed']} failed)"
                )
                if line != last:
                    _say(line)
                    last = line
        except KeyboardInterrupt:
            client.cancel_sweep(sweep["id"])
            _say(f"cancelled sweep {sweep['id']}")
            raise
        if sweep["status"] == "failed":
            raise ConfigureError(f"the sweep failed: {sweep.get('error')}")
        best = sweep.get("best")
        if best is not None and out_dir is not None and best.get("qpc_id"):
            client.download_qpc(best["qpc_id"], out_dir / "programqpc.bin")
    p = sweep["progress"]
    line = (
        f"{args.mode} on the farm: {p['compiles_submitted']} compiles ({p['cache_hits']} cache "
        f"hits, {p['compiles_failed']} failed) of {p['compile_groups']} groups in "
        f"{time.monotonic() - started:.1f} s (estimated figures)"
    )
    return {**sweep, "line": line}
