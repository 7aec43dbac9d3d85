"""The model configurator on a farm: a brute sweep of the vendor's 104-combination space
(`config_8cores_only.csv`) over ResNet-50, with 1 and with 2 workers, then the same sweep again
(all cache hits), then optimize against brute.

    python bench/sweep.py [--model resnet50|resnet-quick|bert-base|encoder-small]
                          [--space docs/configurator/config_8cores_only.csv]
                          [--workers 1,2] [--json out.json]

Each worker count gets a farm of its own (`qpcfarm serve` + N `qpcfarm worker --concurrency 1`
processes on a fresh PostgreSQL database and a private `redis-server`), so no run sees
another's cache or messages. Measured from the sweep's POST to its `succeeded` (the client
polls every 0.5 s):

- **scale**: the wall time with 2 workers against 1, same sweep, same machine, same run
  (target >= 1.8x; it needs 2 free CPUs: other load on the machine shows in the ratio);
- **cache**: the same sweep submitted again on the warm farm: every compile a cache hit
  (target: seconds);
- **optimize**: the same space in optimize mode on a fresh farm: its compiles against brute's,
  and whether it found brute's best.

The ranked table (top 15) of the brute sweep is printed. Figures are the cost model's
estimates of each combination. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from farm_processes import (  # noqa: E402
    admin_sql,
    bench_team_key,
    farm_env,
    free_port,
    qpcfarm,
    sibling_database_url,
    stop,
)

from compiler_core.configurator.table import render  # noqa: E402  (the repository is put on the path above)

DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
DEFAULT_SPACE = REPO / "docs" / "configurator" / "config_8cores_only.csv"
BASE_FLAGS = ["-convert-to-fp16", "-aic-device=aic100-standard"]
POLL_S = 0.5
SWEEP_LIMIT_S = 3 * 3600.0
TARGET_SCALE = 1.8


def write_model(name: str, work: Path) -> Path:
    if name in ("resnet50", "resnet-quick"):
        from models import RESNET50, RESNET_QUICK, write_resnet

        return write_resnet(RESNET50 if name == "resnet50" else RESNET_QUICK, work)
    from transformer_models import BERT_BASE, EncoderSpec, write_encoder

    spec = (
        BERT_BASE
        if name == "bert-base"
        else EncoderSpec(layers=2, hidden=256, heads=4, ffn=1024, seq=128)
    )
    return write_encoder(spec, work)


@dataclass
class Farm:
    url: str
    key: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=120
        )


@contextmanager
def private_redis(work: Path) -> Iterator[str]:
    """A `redis-server` of this run on a free port (no persistence): a shared Redis database
    would hand this farm's job ids to another farm's workers, and theirs to ours."""
    import redis

    port = free_port()
    log = open(work / f"redis-{port}.log", "wb")  # noqa: SIM115  (closed below)
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(work)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log,
    )  # fmt: skip
    try:
        client = redis.Redis(port=port, socket_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.1)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


@contextmanager
def farm(work: Path, workers: int, args: argparse.Namespace, broker: str) -> Iterator[Farm]:
    database = f"qpcfarm_sweep_{uuid.uuid4().hex[:10]}"
    admin_sql(args.postgres, f'CREATE DATABASE "{database}"')
    env = farm_env(
        work / f"data-{database}",
        {
            "QPCFARM_DATABASE_URL": sibling_database_url(args.postgres, database),
            "QPCFARM_BROKER_URL": broker,
        },
    )
    port = free_port()
    running = Farm(f"http://127.0.0.1:{port}", "")
    try:
        running.key = bench_team_key(env)
        logs = []
        for name, cmd in [
            *[
                (f"worker{i}", qpcfarm("worker", "--concurrency", "1", "--loglevel", "WARNING"))
                for i in range(workers)
            ],
            ("serve", qpcfarm("serve", "--port", str(port), "--log-level", "warning")),
        ]:
            log = work / f"{database}-{name}.log"
            logs.append(log)
            with open(log, "wb") as handle:
                running.procs.append(
                    subprocess.Popen(
                        cmd, cwd=work, env=env, stdout=handle, stderr=subprocess.STDOUT
                    )
                )
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{running.url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in running.procs):
                tails = "\n".join(p.read_text(errors="replace")[-1500:] for p in logs)
                raise RuntimeError(f"the farm did not start:\n{tails}")
            time.sleep(0.2)
        time.sleep(3.0)  # the workers connect to the broker
        yield running
    finally:
        for proc in reversed(running.procs):
            stop(proc)
        admin_sql(args.postgres, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def upload(f: Farm, model: Path) -> str:
    with f.client() as http:
        answer = http.post(
            "/v1/models",
            params={"filename": model.name},
            content=model.read_bytes(),
            headers={"Content-Type": "application/octet-stream"},
        )
        answer.raise_for_status()
        return str(answer.json()["id"])


def run_sweep(f: Farm, model_id: str, space_csv: str, mode: str) -> tuple[float, dict[str, Any]]:
    """(seconds from POST to a finished sweep, the sweep)."""
    body = {"model_id": model_id, "space_csv": space_csv, "base_flags": BASE_FLAGS, "mode": mode}
    with f.client() as http:
        started = time.perf_counter()
        answer = http.post("/v1/sweeps", json=body)
        answer.raise_for_status()
        sweep = answer.json()
        while sweep["status"] == "running":
            if time.perf_counter() - started > SWEEP_LIMIT_S:
                raise RuntimeError("the sweep did not finish in time")
            time.sleep(POLL_S)
            sweep = http.get(f"/v1/sweeps/{sweep['id']}").json()
        return time.perf_counter() - started, sweep


def summary(seconds: float, sweep: dict[str, Any]) -> dict[str, Any]:
    p = sweep["progress"]
    best = sweep.get("best") or {}
    return {
        "seconds": round(seconds, 2),
        "status": sweep["status"],
        "compiles": p["compiles_submitted"],
        "compiles_run": p["compiles_run"],
        "cache_hits": p["cache_hits"],
        "failed": p["compiles_failed"],
        "combinations": p["combinations"],
        "best_index": best.get("index"),
        "best_flags": best.get("flags"),
        "best_throughput": best.get("throughput"),
        "best_latency_us": best.get("latency_us"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="resnet50",
        choices=("resnet50", "resnet-quick", "bert-base", "encoder-small"),
    )
    p.add_argument("--space", type=Path, default=DEFAULT_SPACE)
    p.add_argument("--workers", default="1,2", help="worker counts to compare, comma separated")
    p.add_argument("--postgres", default=DEFAULT_POSTGRES)
    p.add_argument("--no-optimize", action="store_true", help="skip the optimize run")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",") if n.strip()]
    space_csv = args.space.read_text()
    figures: dict[str, Any] = {"model": args.model, "space": args.space.name, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="qpcfarm-bench-sweep-") as tmp:
        work = Path(tmp)
        model = write_model(args.model, work)
        print(
            f"model {model.name} ({model.stat().st_size / 2**20:.1f} MiB), space {args.space.name}",
            flush=True,
        )
        brute: dict[str, Any] | None = None
        for n in counts:
            with private_redis(work) as broker, farm(work, n, args, broker) as f:
                model_id = upload(f, model)
                seconds, sweep = run_sweep(f, model_id, space_csv, "brute")
                again_s, again = run_sweep(f, model_id, space_csv, "brute")
                figures["runs"][n] = {
                    "first": summary(seconds, sweep),
                    "again": summary(again_s, again),
                }
                print(
                    f"{n} worker(s): brute {seconds:.1f} s ({sweep['progress']['compiles_run']} "
                    f"compiles); again {again_s:.2f} s ({again['progress']['cache_hits']} cache "
                    f"hits of {again['progress']['compiles_submitted']})",
                    flush=True,
                )
                brute = sweep
        if not args.no_optimize and brute is not None:
            with private_redis(work) as broker, farm(work, counts[-1], args, broker) as f:
                model_id = upload(f, model)
                seconds, sweep = run_sweep(f, model_id, space_csv, "optimize")
                figures["optimize"] = summary(seconds, sweep)
                brute_best = (brute.get("best") or {}).get("index")
                found = (sweep.get("best") or {}).get("index") == brute_best
                if not found and sweep.get("best") and brute.get("best"):  # a tie is a find
                    found = sweep["best"]["throughput"] == brute["best"]["throughput"]
                figures["optimize"]["found_brute_best"] = found
                print(
                    f"optimize: {sweep['progress']['compiles_submitted']} compiles in "
                    f"{seconds:.1f} s over {sweep['progress']['rounds']} rounds; found brute's "
                    f"best: {found}",
                    flush=True,
                )
    if brute is not None:
        print()
        print(render(brute["results"], 15))
        print(f"\nbest: {' '.join(brute['best']['flags']) if brute.get('best') else '-'}")
        print(
            f"{brute['progress']['invalid_combinations']} invalid combinations of "
            f"{brute['progress']['combinations']}"
        )
        figures["table"] = brute["results"][:15]
    runs = figures["runs"]
    if len(counts) >= 2 and counts[0] in runs and counts[-1] in runs:
        ratio = runs[counts[0]]["first"]["seconds"] / runs[counts[-1]]["first"]["seconds"]
        figures["scale"] = round(ratio, 2)
        verdict = "met" if ratio >= TARGET_SCALE else "MISSED"
        print(
            f"\nscale: {counts[-1]} workers are {ratio:.2f}x faster than {counts[0]} "
            f"(target >= {TARGET_SCALE}x: {verdict}; {os.cpu_count()} CPUs here, "
            f"load average {os.getloadavg()[0]:.1f})"
        )
    for n, run in runs.items():
        print(
            f"cache: the repeat with {n} worker(s) took {run['again']['seconds']:.2f} s, "
            f"{run['again']['cache_hits']} of {run['again']['compiles']} cache hits"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
