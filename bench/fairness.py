"""Fair share in farm mode: does one team's single compile get a worker soon while another
team's sweep-sized batch of compiles is queued?

    python bench/fairness.py [--jobs 200] [--workers 2] [--json out.json]

Starts its own farm (a scratch PostgreSQL database, Redis db 12 as the broker, `--workers`
`qpcfarm worker` processes of concurrency 1, `qpcfarm serve`), creates two teams, and:

1. team `batch` uploads a model (an MLP of `--layers` MatMul+Relu layers, width `--width`,
   symbolic batch) and submits `--jobs` distinct compiles of it (`-onnx-define-symbol=
   batch,N`, N = 1..jobs): every worker is busy and the rest wait queued;
2. after the first `--warmup` of them finished (their worker time is the compile duration
   measured in this run), team `person` submits one compile of its own model, `--probes`
   times one after the other; each probe's delay is its job's `started_at - created_at`
   (server clock both).

The target (issue 23): every probe starts within 1.5 compile durations of its submission.
The compile duration is the median worker time of team `batch`'s finished jobs
(`finished_at - started_at`: what one compile holds a worker for, its model read and QPC
store included); the pure compile time (the sum of its report's stage times) is printed
beside it. In arrival order the probe would wait for the whole queue ahead of it:
(jobs - finished) / workers compile durations, printed as the peer.

The farm is stopped, the database dropped and Redis db 12 flushed at the end, also on
failure. Nothing asserts on time: the script prints figures and a verdict.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from farm_processes import (  # noqa: E402  (bench/, the script's own folder, is on the path)
    admin_sql,
    farm_env,
    free_port,
    qpcfarm,
    sibling_database_url,
    spawn,
    stop,
    wait_healthy,
)

DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS = "redis://127.0.0.1:6379/12"
TARGET = 1.5
POLL_S = 0.05
WAIT_LIMIT_S = 1800.0


def mlp(layers: int, width: int, seed: int) -> bytes:
    """y = (Relu . MatMul)^layers (x), x: float[batch, width]; `seed` changes the weights."""
    rng = np.random.default_rng(seed)
    nodes, weights = [], []
    previous = "x"
    for i in range(layers):
        w = (rng.standard_normal((width, width)) * 0.05).astype(np.float32)
        weights.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [previous, f"w{i}"], [f"h{i}"]))
        nodes.append(helper.make_node("Relu", [f"h{i}"], [f"r{i}"]))
        previous = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info(previous, TensorProto.FLOAT, ["batch", width])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


@dataclass
class Farm:
    url: str
    keys: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)


def _run(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(qpcfarm(*args), env=env, check=True, capture_output=True, text=True)
    return done.stdout.strip()


def _flush_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


@contextmanager
def farm_running(work: Path, args: argparse.Namespace) -> Iterator[Farm]:
    database = f"qpcfarm_fair_{uuid.uuid4().hex[:10]}"
    admin_sql(args.postgres, f'CREATE DATABASE "{database}"')
    _flush_redis(args.redis)
    env = farm_env(
        work / "data",
        {
            "QPCFARM_DATABASE_URL": sibling_database_url(args.postgres, database),
            "QPCFARM_BROKER_URL": args.redis,
        },
    )
    farm = Farm(f"http://127.0.0.1:{free_port()}")
    try:
        _run(env, "db", "upgrade", "--init")
        for team in ("batch", "person"):
            _run(env, "admin", "create-team", team)
            farm.keys[team] = _run(env, "admin", "create-key", "--team", team).splitlines()[-1]
        for index in range(args.workers):
            spawn(farm.procs, farm.logs, work, f"worker{index}", qpcfarm(
                "worker", "--concurrency", "1", "--loglevel", "WARNING", "--no-reap",
            ), env)  # fmt: skip
        port = farm.url.rsplit(":", 1)[1]
        serve = qpcfarm("serve", "--port", port, "--log-level", "warning")
        spawn(farm.procs, farm.logs, work, "serve", serve, env)
        wait_healthy(farm.url, farm.procs, farm.logs)
        yield farm
    finally:
        for proc in reversed(farm.procs):
            stop(proc)
        admin_sql(args.postgres, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        _flush_redis(args.redis)


def _when(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _upload(client: httpx.Client, data: bytes) -> str:
    answer = client.post("/v1/models", files={"file": ("mlp.onnx", data)})
    answer.raise_for_status()
    return str(answer.json()["id"])


def _submit(client: httpx.Client, model_id: str, batch: int) -> dict[str, Any]:
    body = {"model_id": model_id, "options": {"onnx-define-symbol": [f"batch,{batch}"]}}
    answer = client.post("/v1/compile-jobs", json=body)
    answer.raise_for_status()
    job: dict[str, Any] = answer.json()
    return job


def _finished(client: httpx.Client) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for status in ("succeeded", "failed"):
        page = client.get("/v1/compile-jobs", params={"status": status, "limit": 200})
        page.raise_for_status()
        out += page.json()["items"]
    return out


def _wait(check: Any, what: str) -> Any:
    deadline = time.monotonic() + WAIT_LIMIT_S
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(POLL_S)
    raise RuntimeError(f"gave up waiting for {what}")


def measure(farm: Farm, args: argparse.Namespace) -> dict[str, Any]:
    batch, person = (
        httpx.Client(base_url=farm.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        for key in (farm.keys["batch"], farm.keys["person"])
    )
    with batch, person:
        batch_model = _upload(batch, mlp(args.layers, args.width, seed=1))
        person_model = _upload(person, mlp(args.layers, args.width, seed=2))
        for n in range(1, args.jobs + 1):
            _submit(batch, batch_model, n)
        _wait(lambda: len(_finished(batch)) >= args.warmup, f"{args.warmup} finished compiles")
        probes: list[dict[str, Any]] = []
        for k in range(args.probes):
            job = _submit(person, person_model, 1000 + k)
            started = _wait(
                lambda job=job: person.get(f"/v1/compile-jobs/{job['id']}").json()["started_at"],
                "the probe to start",
            )
            delay = (_when(started) - _when(job["created_at"])).total_seconds()
            done = _wait(
                lambda job=job: (
                    person.get(f"/v1/compile-jobs/{job['id']}").json()
                    if person.get(f"/v1/compile-jobs/{job['id']}").json()["finished_at"]
                    else None
                ),
                "the probe to finish",
            )
            probes.append({"delay_s": delay, "status": done["status"]})
        finished = [j for j in _finished(batch) if j["started_at"] and j["finished_at"]]
        worker_s = [
            (_when(j["finished_at"]) - _when(j["started_at"])).total_seconds() for j in finished
        ]
        compile_s = [sum(v for k, v in j["pass_times"].items() if "/" not in k) for j in finished]
        queued_left = args.jobs - len(finished)
    duration = statistics.median(worker_s)
    pure = statistics.median(compile_s)
    worst = max(p["delay_s"] for p in probes)
    return {
        "jobs": args.jobs,
        "workers": args.workers,
        "batch_finished_at_end": len(finished),
        "compile_duration_s": duration,
        "pure_compile_s": pure,
        "probes": probes,
        "worst_delay_s": worst,
        "worst_delay_in_durations": worst / duration,
        "worst_delay_in_pure_compiles": worst / pure if pure else float("nan"),
        "arrival_order_wait_in_durations": queued_left / args.workers,
        "target": TARGET,
        "met": worst / duration <= TARGET and all(p["status"] == "succeeded" for p in probes),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--jobs", type=int, default=200, help="team batch's distinct compiles")
    p.add_argument("--workers", type=int, default=2, help="worker processes (concurrency 1)")
    p.add_argument("--layers", type=int, default=150, help="the model's MatMul+Relu layers")
    p.add_argument("--width", type=int, default=128, help="the model's width")
    p.add_argument("--warmup", type=int, default=6, help="batch compiles finished before probing")
    p.add_argument("--probes", type=int, default=3, help="person's compiles, one after another")
    p.add_argument("--postgres", default=DEFAULT_POSTGRES, help="a PostgreSQL admin URL")
    p.add_argument("--redis", default=DEFAULT_REDIS, help="the broker (its db is flushed)")
    p.add_argument("--json", help="write the figures to this JSON file")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qpcfarm-fairness-") as tmp:
        with farm_running(Path(tmp), args) as farm:
            result = measure(farm, args)
    print(json.dumps(result, indent=2))
    print(
        f"probe start delay: worst {result['worst_delay_s']:.2f} s = "
        f"{result['worst_delay_in_durations']:.2f} compile durations "
        f"({result['compile_duration_s']:.2f} s of worker time each; pure compile "
        f"{result['pure_compile_s']:.2f} s); in arrival order it would wait "
        f"~{result['arrival_order_wait_in_durations']:.0f} durations; target <= {TARGET}: "
        + ("met" if result["met"] else "NOT met")
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
