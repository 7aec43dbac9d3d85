"""Service figures of the farm against the DESIGN targets, measured in one run over loopback.

    python bench/service.py [--quick] [--farm] [--json out.json]

Starts its own farm (`qpcfarm serve` in a temporary data directory: SQLite, filesystem blobs,
in-process worker; with `--farm` also a PostgreSQL database of its own, Redis and a separate
`qpcfarm worker` process) on a free loopback port, and measures:

- **upload throughput**: `POST /v1/models` of a generated ~500 MiB ONNX model (one initializer),
  timed from the first byte sent to the 201 (so the server's hashing, store and model check are
  in it), against a plain copy of the same file in the same run (`shutil.copyfile`, and the
  copy followed by an fsync, since the blob store fsyncs what it keeps). Each repeat changes a
  trailing `doc_string` of the file, so no upload is a deduplicated one. Target >= 0.8x.
- **submit latency**: 50 concurrent clients (asyncio, one keep-alive connection each, started
  together) submit compile jobs, each (model, options) new, so every answer is a queued job and
  the worker compiles them meanwhile. p50/p99 from the client's send to its answer. Target
  p99 < 50 ms. The peer: the same clients sending `GET /healthz` just before (no database, no
  auth), the floor of the HTTP stack and of the client on the machine as loaded in this run.
  Also the API process's CPU time per request in each (user + system, its own process only):
  on a shared machine the latencies swing with the load, the CPU a request costs much less.
- **upload+submit load**: 100 concurrent clients, each uploading a model of its own and
  submitting its compile, twice (the embedded mode's SQLite writers and the farm's pool under
  a burst). Target: 0 server errors and 0 dropped connections; p50/p99 of each request.
- **cache-hit answer**: once the queue drained, the same submits again: each answer is a
  stored QPC (`cache_hit: true`). p50 of one client on an idle farm (the target, < 20 ms), and
  with 50 concurrent clients; the peer is a compile of a new job, submit to `succeeded`.

`--overhead` measures only the farm mode's per-job overhead (issue 23): ResNet-50 (98 MiB)
compiled with 6 different options one at a time, on a farm with the filesystem blob store
(a data directory the API and the worker share) and on one with the database store, in the
same run (`--blob-store` names the one judged; the other is its peer); each job's worker
time minus its compile time (its report's stage times), as a ratio to the compile time,
and its time outside the compiler's process (the job log's "the compiler ran" line). The
first job reads the model from the store; the later ones find it in the worker's model
cache (`worker/model_cache.py`). Target: the farm's own time per job (the job outside the
compiler's process: claiming, reading the model, storing the QPC and report) below 0.3x the
compile for each of those, with the filesystem store. The compile is the compiler's whole run
(its stages plus the fit check and the perf report it writes with every QPC): the stage times
leave those two out, so job minus stage times, printed too, counts compiler work as the farm's.

Loops are bounded; the farm is stopped (and the database dropped) at the end, also on failure.
Nothing asserts on time: the script prints figures and says which targets are met.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import shutil
import statistics
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
import numpy as np
import psutil
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from farm_processes import (  # noqa: E402  (bench/, the script's own folder, is on the path)
    admin_sql,
    bench_team_key,
    farm_env,
    free_port,
    qpcfarm,
    sibling_database_url,
    spawn,
    stop,
    wait_healthy,
)

from app.console.client import FarmClient, FarmError  # noqa: E402  (the repository root is put on the path above)
from worker.compile_jobs import COMPILER_RAN  # noqa: E402

MIB = 1 << 20
DRAIN_LIMIT_S = 900.0
TRAILER_BYTES = 16
DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS = "redis://127.0.0.1:6379/13"


@dataclass(frozen=True)
class Plan:
    upload_mib: int
    upload_repeats: int
    clients: int
    submits_per_client: int
    sequential_hits: int
    compiles: int
    load_clients: int = 100
    load_rounds: int = 2


FULL = Plan(
    upload_mib=512,
    upload_repeats=3,
    clients=50,
    submits_per_client=10,
    sequential_hits=200,
    compiles=10,
)
QUICK = Plan(
    upload_mib=64,
    upload_repeats=3,
    clients=50,
    submits_per_client=3,
    sequential_hits=50,
    compiles=3,
)


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms) if ms else float("nan"),
        "mean_ms": statistics.fmean(ms) if ms else float("nan"),
    }


# -------------------------------------------------------------------------------- models


def tiny_model(seed: int) -> bytes:
    """y = Relu(x @ W + b) with seed-dependent weights: distinct bytes, a fast compile."""
    rng = np.random.default_rng(seed)
    weights = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "W")
    bias = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("Add", ["h", "b"], ["z"]),
            helper.make_node("Relu", ["z"], ["y"]),
        ],
        f"tiny{seed}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [weights, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def write_big_model(path: Path, mib: int) -> int:
    """A MatMul model whose one float32 initializer is about `mib` MiB, in a single file,
    ending with a fixed-size `doc_string` field that `set_variant` rewrites in place."""
    cols = 1024
    rows = max(1, mib * MIB // (4 * cols))
    weights = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    tensor = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[rows, cols])
    tensor.raw_data = weights.tobytes()
    del weights
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cols])],
        [tensor],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    data = model.SerializeToString()
    del model, graph, tensor
    # ModelProto.doc_string is field 6 (length-delimited); a later occurrence wins.
    trailer = bytes([6 << 3 | 2, TRAILER_BYTES]) + b"0" * TRAILER_BYTES
    with open(path, "wb") as out:
        out.write(data)
        out.write(trailer)
    return path.stat().st_size


def set_variant(path: Path, index: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(-TRAILER_BYTES, os.SEEK_END)
        handle.write(f"{index:0{TRAILER_BYTES}x}".encode())


# ------------------------------------------------------------------------------ the farm


@dataclass
class Farm:
    mode: str
    url: str
    api_key: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    api_pid: int | None = None
    """The one API process (`serve --workers 1`), whose CPU time the submit run reports."""

    def api_cpu_s(self) -> float:
        """User + system CPU seconds of the API process so far (its own, not its children's:
        the embedded mode's job and describer processes are not in it); NaN without one."""
        if self.api_pid is None:
            return float("nan")
        times = psutil.Process(self.api_pid).cpu_times()
        return float(times.user + times.system)


@contextmanager
def farm_running(
    work: Path, farm_mode: bool, args: argparse.Namespace, blob_store: str | None = None
) -> Iterator[Farm]:
    """A farm on a free loopback port for the duration of the block, then stopped; in farm
    mode with `blob_store` (`QPCFARM_BLOB_STORE`, None: the mode's default, the database)."""
    data_dir = work / "data"
    extra: dict[str, str] = {}
    database: str | None = None
    if farm_mode:
        database = f"qpcfarm_bench_{uuid.uuid4().hex[:10]}"
        admin_sql(args.postgres, f'CREATE DATABASE "{database}"')
        extra = {
            "QPCFARM_DATABASE_URL": sibling_database_url(args.postgres, database),
            "QPCFARM_BROKER_URL": args.redis,
        }
        if blob_store is not None:
            extra["QPCFARM_BLOB_STORE"] = blob_store
    env = farm_env(data_dir, extra)
    port = free_port()
    farm = Farm("farm" if farm_mode else "embedded", f"http://127.0.0.1:{port}", "")
    try:
        if farm_mode:
            farm.api_key = bench_team_key(env)
            spawn(
                farm.procs,
                farm.logs,
                work,
                "worker",
                qpcfarm("worker", "--concurrency", "1", "--loglevel", "WARNING"),
                env,
            )
        spawn(
            farm.procs,
            farm.logs,
            work,
            "serve",
            qpcfarm(
                "serve",
                "--port",
                str(port),
                "--log-level",
                "warning",
                "--workers",
                str(args.workers),
            ),
            env,
        )
        wait_healthy(farm.url, farm.procs, farm.logs)
        if args.workers == 1:
            farm.api_pid = farm.procs[-1].pid
        if not farm_mode:
            farm.api_key = (data_dir / "api-key").read_text().strip()
        yield farm
    finally:
        for proc in reversed(farm.procs):
            stop(proc)
        if database is not None:
            admin_sql(args.postgres, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


# ------------------------------------------------------------------------------- uploads


def _timed_copy(src: Path, dst: Path, fsync: bool) -> float:
    dst.unlink(missing_ok=True)
    start = time.perf_counter()
    shutil.copyfile(src, dst)
    if fsync:
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    elapsed = time.perf_counter() - start
    dst.unlink()
    return elapsed


def _zip_of(model: Path, dest: Path) -> Path:
    import zipfile

    dest.unlink(missing_ok=True)
    with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.write(model, model.name)
    return dest


def measure_uploads(farm: Farm, work: Path, plan: Plan) -> dict[str, Any]:
    """Uploads of the big model as `.onnx`; if the server refuses that (see `refused`), as a
    stored `.zip` of it, the form `qpcfarm submit` uses for external data."""
    model = work / "big.onnx"
    print(f"  generating a {plan.upload_mib} MiB model ...", flush=True)
    write_big_model(model, plan.upload_mib)
    copies: list[float] = []
    synced: list[float] = []
    raw: list[float] = []
    multipart: list[float] = []
    kind, refused = "onnx", None
    with FarmClient(farm.url, farm.api_key, timeout=600.0) as client:
        set_variant(model, 1 << 40)  # a warm-up upload, also telling whether .onnx is taken
        try:
            client.upload_model(model, model.name)
        except FarmError as exc:
            kind, refused = "zip", exc.message
            print(
                f"  the server refused the .onnx upload ({exc.message}); measuring a .zip "
                "of the same model instead",
                flush=True,
            )

        def prepare(variant: int) -> Path:
            set_variant(model, variant)
            return model if kind == "onnx" else _zip_of(model, work / "big.zip")

        # Interleaved, so a busy disk or page cache slows every row alike.
        for i in range(plan.upload_repeats):
            for rows, multi, variant in ((raw, False, 2 * i), (multipart, True, 2 * i + 1)):
                path = prepare(variant)
                if not multi:
                    copies.append(_timed_copy(path, work / "copy.bin", fsync=False))
                    synced.append(_timed_copy(path, work / "copy.bin", fsync=True))
                start = time.perf_counter()
                client.upload_model(path, path.name, multipart=multi)
                rows.append(time.perf_counter() - start)
        size = path.stat().st_size
    model.unlink()
    (work / "big.zip").unlink(missing_ok=True)

    def rate(seconds: list[float]) -> float:
        return size / MIB / statistics.median(seconds)

    return {
        "kind": kind,
        "onnx_refused": refused,
        "bytes": size,
        "copy_s": copies,
        "copy_fsync_s": synced,
        "upload_raw_s": raw,
        "upload_multipart_s": multipart,
        "copy_mib_s": rate(copies),
        "copy_fsync_mib_s": rate(synced),
        "upload_raw_mib_s": rate(raw),
        "upload_multipart_mib_s": rate(multipart),
        "ratio_vs_copy": rate(raw) / rate(copies),
        "ratio_vs_copy_fsync": rate(raw) / rate(synced),
    }


# ------------------------------------------------------------------------------- submits


def _flags(j: int) -> list[str]:
    """Distinct canonical options per j (so distinct cache keys), all cheap to compile."""
    return [f"-vtcm-working-set-limit-ratio={1.0 - (j + 1) / 4096:.6f}"]


async def _client_run(
    url: str,
    key: str,
    model_id: str,
    jobs: Sequence[int],
    start: asyncio.Event,
    ready: list[int],
) -> tuple[list[float], list[str], list[dict[str, Any]]]:
    latencies: list[float] = []
    errors: list[str] = []
    answers: list[dict[str, Any]] = []
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120.0) as client:
        await client.get("/healthz")  # open the connection before the clock starts
        ready.append(1)
        await start.wait()
        for j in jobs:
            body = {"model_id": model_id, "flags": _flags(j)}
            t0 = time.perf_counter()
            try:
                response = await client.post("/v1/compile-jobs", json=body)
            except httpx.HTTPError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            latencies.append(time.perf_counter() - t0)
            if response.status_code >= 400:
                errors.append(f"HTTP {response.status_code}: {response.text[:200]}")
            else:
                answers.append(response.json())
    return latencies, errors, answers


async def _concurrent_submits(
    farm: Farm, model_ids: Sequence[str], jobs_per_client: int
) -> tuple[list[float], list[str], list[dict[str, Any]]]:
    start = asyncio.Event()
    ready: list[int] = []
    tasks = [
        asyncio.create_task(
            _client_run(farm.url, farm.api_key, mid, range(jobs_per_client), start, ready)
        )
        for mid in model_ids
    ]
    for _ in range(6000):  # bounded: every client connected (or failed)
        if len(ready) == len(tasks) or any(t.done() for t in tasks):
            break
        await asyncio.sleep(0.01)
    start.set()
    latencies: list[float] = []
    errors: list[str] = []
    answers: list[dict[str, Any]] = []
    for lat, err, ans in await asyncio.gather(*tasks):
        latencies += lat
        errors += err
        answers += ans
    return latencies, errors, answers


async def _floor_client(
    url: str, key: str, n: int, start: asyncio.Event, ready: list[int]
) -> list[float]:
    latencies: list[float] = []
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120.0) as client:
        await client.get("/healthz")
        ready.append(1)
        await start.wait()
        for _ in range(n):
            t0 = time.perf_counter()
            await client.get("/healthz")
            latencies.append(time.perf_counter() - t0)
    return latencies


async def _concurrent_floor(farm: Farm, clients: int, per_client: int) -> list[float]:
    """The stack's floor in this run: the same clients sending `GET /healthz` (no database,
    no auth): what uvicorn, FastAPI and the benchmark's own client cost right now."""
    start = asyncio.Event()
    ready: list[int] = []
    tasks = [
        asyncio.create_task(_floor_client(farm.url, farm.api_key, per_client, start, ready))
        for _ in range(clients)
    ]
    for _ in range(6000):
        if len(ready) == len(tasks) or any(t.done() for t in tasks):
            break
        await asyncio.sleep(0.01)
    start.set()
    return [s for lat in await asyncio.gather(*tasks) for s in lat]


async def _load_client(
    url: str,
    key: str,
    index: int,
    rounds: int,
    start: asyncio.Event,
    ready: list[int],
    out: dict[str, Any],
) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120.0) as client:
        await client.get("/healthz")
        ready.append(index)
        await start.wait()
        for r in range(rounds):
            seed = 1_000_000 + index * rounds + r  # no model of the submit run
            try:
                t0 = time.perf_counter()
                up = await client.post(
                    "/v1/models",
                    content=tiny_model(seed),
                    params={"filename": f"load{seed}.onnx"},
                    headers={"Content-Type": "application/octet-stream"},
                )
                out["upload_s"].append(time.perf_counter() - t0)
                out["statuses"].append(up.status_code)
                if up.status_code != 201:
                    continue
                t0 = time.perf_counter()
                job = await client.post(
                    "/v1/compile-jobs", json={"model_id": up.json()["id"], "flags": _flags(0)}
                )
                out["submit_s"].append(time.perf_counter() - t0)
                out["statuses"].append(job.status_code)
            except httpx.HTTPError as exc:
                out["dropped"].append(f"{type(exc).__name__}: {exc}")


async def _load(farm: Farm, clients: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"upload_s": [], "submit_s": [], "statuses": [], "dropped": []}
    start = asyncio.Event()
    ready: list[int] = []
    tasks = [
        asyncio.create_task(_load_client(farm.url, farm.api_key, i, rounds, start, ready, out))
        for i in range(clients)
    ]
    for _ in range(6000):  # bounded: every client connected (or failed)
        if len(ready) == len(tasks) or any(t.done() for t in tasks):
            break
        await asyncio.sleep(0.01)
    start.set()
    await asyncio.gather(*tasks)
    return out


def measure_load(farm: Farm, plan: Plan) -> dict[str, Any]:
    """`load_clients` concurrent clients uploading and submitting `load_rounds` times."""
    print(f"  {plan.load_clients} clients x {plan.load_rounds} uploads + submits ...", flush=True)
    began = time.perf_counter()
    out = asyncio.run(_load(farm, plan.load_clients, plan.load_rounds))
    wall = time.perf_counter() - began
    statuses: dict[str, int] = {}
    for status in out["statuses"]:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {
        "clients": plan.load_clients,
        "rounds": plan.load_rounds,
        "wall_s": wall,
        "upload": summary_ms(out["upload_s"]),
        "submit": summary_ms(out["submit_s"]),
        "statuses": statuses,
        "server_errors": sum(n for s, n in statuses.items() if int(s) >= 500),
        "dropped": len(out["dropped"]),
        "dropped_examples": out["dropped"][:5],
    }


def _active_jobs(client: httpx.Client) -> int:
    total = 0
    for status in ("queued", "running"):
        body = client.get("/v1/compile-jobs", params={"status": status, "limit": 1}).json()
        total += int(body["count"])
    return total


def _wait_drained(client: httpx.Client) -> tuple[bool, float]:
    start = time.perf_counter()
    while time.perf_counter() - start < DRAIN_LIMIT_S:
        if _active_jobs(client) == 0:
            return True, time.perf_counter() - start
        time.sleep(0.2)
    return False, time.perf_counter() - start


def _job_statuses(client: httpx.Client) -> dict[str, int]:
    out: dict[str, int] = {}
    for status in ("succeeded", "failed", "cancelled", "queued", "running"):
        body = client.get("/v1/compile-jobs", params={"status": status, "limit": 1}).json()
        out[status] = int(body["count"])
    return out


def measure_submits(farm: Farm, plan: Plan) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {farm.api_key}"}
    http = httpx.Client(base_url=farm.url, headers=headers, timeout=120.0)
    api = FarmClient(farm.url, farm.api_key, timeout=120.0)
    try:
        model_ids: list[str] = []
        with tempfile.TemporaryDirectory() as tmp:
            for seed in range(plan.clients):
                path = Path(tmp) / f"tiny{seed}.onnx"
                path.write_bytes(tiny_model(seed))
                model_ids.append(str(api.upload_model(path)["id"]))

        print(f"  {plan.clients} clients x {plan.submits_per_client} GET /healthz ...", flush=True)
        cpu_before = farm.api_cpu_s()
        floor_lat = asyncio.run(_concurrent_floor(farm, plan.clients, plan.submits_per_client))
        floor_cpu = farm.api_cpu_s() - cpu_before

        print(f"  {plan.clients} clients x {plan.submits_per_client} new jobs ...", flush=True)
        began = time.perf_counter()
        cpu_before = farm.api_cpu_s()
        miss_lat, miss_err, miss_ans = asyncio.run(
            _concurrent_submits(farm, model_ids, plan.submits_per_client)
        )
        submit_cpu = farm.api_cpu_s() - cpu_before
        submit_wall = time.perf_counter() - began
        queued = sum(1 for a in miss_ans if not a.get("cache_hit"))
        drained, drain_s = _wait_drained(http)
        statuses = _job_statuses(http)
        compiled = statuses["succeeded"]

        print(f"  {plan.sequential_hits} cache hits, one client ...", flush=True)
        seq_hits: list[float] = []
        seq_hit_flags: list[bool] = []
        for i in range(plan.sequential_hits):
            body = {
                "model_id": model_ids[i % len(model_ids)],
                "flags": _flags(i % plan.submits_per_client),
            }
            t0 = time.perf_counter()
            answer = http.post("/v1/compile-jobs", json=body)
            seq_hits.append(time.perf_counter() - t0)
            seq_hit_flags.append(answer.status_code < 400 and bool(answer.json().get("cache_hit")))

        print(f"  {plan.clients} clients x {plan.submits_per_client} cache hits ...", flush=True)
        hit_lat, hit_err, hit_ans = asyncio.run(
            _concurrent_submits(farm, model_ids, plan.submits_per_client)
        )
        concurrent_hits = sum(1 for a in hit_ans if a.get("cache_hit"))

        print(f"  {plan.compiles} compiles of new jobs, submit to succeeded ...", flush=True)
        compile_s: list[float] = []
        for i in range(plan.compiles):
            body = {
                "model_id": model_ids[i % len(model_ids)],
                "flags": _flags(plan.submits_per_client + 1 + i),
            }
            t0 = time.perf_counter()
            job = http.post("/v1/compile-jobs", json=body).json()
            for _ in range(60000):  # bounded poll, 1 ms apart
                if job.get("status") in ("succeeded", "failed", "cancelled"):
                    break
                time.sleep(0.001)
                job = http.get(f"/v1/compile-jobs/{job['id']}").json()
            if job.get("status") == "succeeded":
                compile_s.append(time.perf_counter() - t0)
    finally:
        http.close()
        api.close()

    return {
        "floor": summary_ms(floor_lat),
        "floor_api_cpu_ms": 1e3 * floor_cpu / max(1, len(floor_lat)),
        "submit_miss_api_cpu_ms": 1e3 * submit_cpu / max(1, len(miss_lat)),
        "submit_miss": summary_ms(miss_lat),
        "submit_miss_errors": miss_err[:10],
        "submit_miss_error_count": len(miss_err),
        "submit_miss_queued": queued,
        "submit_wall_s": submit_wall,
        "submits_per_s": len(miss_lat) / submit_wall if submit_wall else float("nan"),
        "drained": drained,
        "drain_s": drain_s,
        "job_statuses": statuses,
        "jobs_compiled": compiled,
        "cache_hit_sequential": summary_ms(seq_hits),
        "cache_hit_sequential_hits": sum(seq_hit_flags),
        "cache_hit_concurrent": summary_ms(hit_lat),
        "cache_hit_concurrent_hits": concurrent_hits,
        "cache_hit_concurrent_errors": hit_err[:10],
        "compile": summary_ms(compile_s),
    }


# ------------------------------------------------------------------------------- report


def verdicts(
    upload: dict[str, Any], submit: dict[str, Any], load: dict[str, Any]
) -> list[dict[str, Any]]:
    return [
        {
            "target": f"{load['clients']} concurrent clients uploading + submitting: "
            "0 server errors, 0 dropped connections",
            "value": float(load["server_errors"] + load["dropped"]),
            "met": load["server_errors"] == 0 and load["dropped"] == 0,
        },
        {
            "target": "upload throughput >= 0.8x a plain file copy",
            "value": upload["ratio_vs_copy"],
            "met": upload["ratio_vs_copy"] >= 0.8,
        },
        {
            "target": "upload throughput >= 0.8x a copy + fsync (the store's durability)",
            "value": upload["ratio_vs_copy_fsync"],
            "met": upload["ratio_vs_copy_fsync"] >= 0.8,
        },
        {
            "target": "submit latency p99 < 50 ms, 50 concurrent clients",
            "value": submit["submit_miss"]["p99_ms"],
            "met": submit["submit_miss"]["p99_ms"] < 50.0 and not submit["submit_miss_errors"],
        },
        {
            "target": "cache-hit answer p50 < 20 ms",
            "value": submit["cache_hit_sequential"]["p50_ms"],
            "met": submit["cache_hit_sequential"]["p50_ms"] < 20.0
            and submit["cache_hit_sequential_hits"] == submit["cache_hit_sequential"]["n"],
        },
    ]


def _ratio(value: dict[str, float], peer: dict[str, float], key: str) -> str:
    return f"{value[key] / peer[key]:.1f}" if peer.get(key) else "n/a"


def _row(name: str, s: dict[str, float]) -> str:
    return (
        f"  {name:<38} n={s['n']:<4} p50 {s['p50_ms']:7.2f} ms  p90 {s['p90_ms']:7.2f}  "
        f"p99 {s['p99_ms']:7.2f}  max {s['max_ms']:7.2f}"
    )


def render(
    mode: str,
    upload: dict[str, Any],
    submit: dict[str, Any],
    load: dict[str, Any],
    workers: int = 1,
) -> str:
    mib = upload["bytes"] / MIB
    lines = [
        f"== qpcfarm service benchmark ({mode} mode, loopback, {os.cpu_count()} CPUs, "
        f"{workers} API process{'es' if workers > 1 else ''}) ==",
        f"upload of a {mib:.0f} MiB model as .{upload['kind']} (median of "
        f"{len(upload['copy_s'])}):",
        f"  plain file copy        {upload['copy_mib_s']:8.0f} MiB/s",
        f"  copy + fsync           {upload['copy_fsync_mib_s']:8.0f} MiB/s",
        f"  POST /v1/models raw    {upload['upload_raw_mib_s']:8.0f} MiB/s"
        f"  = {upload['ratio_vs_copy']:.2f}x copy, {upload['ratio_vs_copy_fsync']:.2f}x "
        "copy+fsync",
        f"  POST /v1/models form   {upload['upload_multipart_mib_s']:8.0f} MiB/s (multipart)",
        *(
            [f"  NOTE: the server refused the .onnx upload: {upload['onnx_refused']}"]
            if upload["onnx_refused"]
            else []
        ),
        "submit latency, client send -> answer:",
        _row("GET /healthz (peer), 50 clients", submit["floor"]),
        _row("new jobs, 50 concurrent clients", submit["submit_miss"]),
        f"    p50 {_ratio(submit['submit_miss'], submit['floor'], 'p50_ms')}x, "
        f"p99 {_ratio(submit['submit_miss'], submit['floor'], 'p99_ms')}x the peer's; "
        f"API process CPU per request {submit['submit_miss_api_cpu_ms']:.2f} ms "
        f"(/healthz {submit['floor_api_cpu_ms']:.2f} ms)",
        f"    {submit['submit_miss_queued']} queued, {submit['submit_miss_error_count']} errors,"
        f" {submit['submits_per_s']:.0f} submits/s; queue drained in {submit['drain_s']:.1f} s"
        f" ({'yes' if submit['drained'] else 'NO'}); jobs: {submit['job_statuses']}",
        _row("cache hits, one client, idle farm", submit["cache_hit_sequential"]),
        f"    {submit['cache_hit_sequential_hits']} answered cache_hit: true",
        _row("cache hits, 50 concurrent clients", submit["cache_hit_concurrent"]),
        f"    {submit['cache_hit_concurrent_hits']} answered cache_hit: true; p99 "
        f"{_ratio(submit['cache_hit_concurrent'], submit['floor'], 'p99_ms')}x the /healthz peer's",
        _row("a compile (peer): submit -> succeeded", submit["compile"]),
    ]
    compile_p50 = submit["compile"]["p50_ms"]
    hit_p50 = submit["cache_hit_sequential"]["p50_ms"]
    if compile_p50 == compile_p50 and hit_p50 > 0:
        lines.append(f"    cache hit p50 = {hit_p50 / compile_p50:.2f}x a compile's p50")
    lines += [
        f"{load['clients']} clients x {load['rounds']} uploads + submits ({load['wall_s']:.1f} s):",
        _row("upload (raw body, tiny model)", load["upload"]),
        _row("submit after it", load["submit"]),
        f"    answers {load['statuses']}, {load['server_errors']} server errors, "
        f"{load['dropped']} dropped connections",
    ]
    lines.append("targets:")
    for v in verdicts(upload, submit, load):
        lines.append(f"  [{'MET' if v['met'] else 'NOT MET'}] {v['target']}: {v['value']:.2f}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------ per-job overhead

OVERHEAD_TARGET = 0.3
OVERHEAD_CORES = (1, 2, 4, 8, 3, 6)
OVERHEAD_STORES = ("filesystem", "database")


def _finished_job(client: httpx.Client, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + DRAIN_LIMIT_S
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/v1/compile-jobs/{job_id}").json()
        if job["finished_at"]:
            return job
        time.sleep(0.05)
    raise RuntimeError(f"job {job_id} did not finish")


def measure_overhead(farm: Farm, model: Path, runs: int) -> dict[str, Any]:
    """ResNet-50 (98 MiB, generated: bench/models.py) compiled `runs` times with different
    options, one at a time: each job's worker time (`finished_at - started_at`) minus its
    compile (the sum of its report's stage times) is the farm's overhead: reading the model,
    checking it, storing the QPC and report, the job's database writes. The first job reads
    the model from the store (cold); the later ones find it in the worker's model cache."""
    headers = {"Authorization": f"Bearer {farm.api_key}"}
    with httpx.Client(base_url=farm.url, headers=headers, timeout=600) as client:
        with open(model, "rb") as body:
            made = client.post("/v1/models", params={"filename": model.name}, content=body)
        made.raise_for_status()
        model_id = made.json()["id"]
        rows: list[dict[str, float]] = []
        for cores in OVERHEAD_CORES[:runs]:
            body_json = {"model_id": model_id, "options": {"aic-num-cores": cores}}
            submitted = client.post("/v1/compile-jobs", json=body_json)
            submitted.raise_for_status()
            job = _finished_job(client, submitted.json()["id"])
            if job["status"] != "succeeded":
                raise RuntimeError(f"the ResNet-50 compile failed: {job.get('error')}")
            started = dt.datetime.fromisoformat(job["started_at"])
            finished = dt.datetime.fromisoformat(job["finished_at"])
            job_s = (finished - started).total_seconds()
            compile_s = sum(v for k, v in job["pass_times"].items() if "/" not in k)
            qpc = client.get(f"/v1/qpcs/{job['qpc_id']}").json()
            ran = re.search(rf"{COMPILER_RAN} ([0-9.]+) s", qpc["report"]["log"])
            compiler_s = float(ran.group(1)) if ran else float("nan")
            rows.append({"cores": cores, "job_s": job_s, "compile_s": compile_s,
                         "overhead_s": job_s - compile_s,
                         "ratio": (job_s - compile_s) / compile_s,
                         "compiler_s": compiler_s,
                         "farm_overhead_s": job_s - compiler_s})  # fmt: skip
    warm = rows[1:] or rows
    warm_ratio = statistics.median(r["ratio"] for r in warm)
    farm_ratios = [r["farm_overhead_s"] / r["compiler_s"] for r in warm]
    return {
        "model_bytes": model.stat().st_size,
        "runs": rows,
        "cold_ratio": rows[0]["ratio"],
        "warm_ratio": warm_ratio,
        "warm_overhead_s": statistics.median(r["overhead_s"] for r in warm),
        "farm_ratio_max": max(farm_ratios),
        "farm_ratio_median": statistics.median(farm_ratios),
        "target": OVERHEAD_TARGET,
        "met": max(farm_ratios) < OVERHEAD_TARGET,
    }


def render_overhead(results: dict[str, dict[str, Any]], measured: str) -> str:
    any_result = next(iter(results.values()))
    lines = [
        f"== per-job overhead, ResNet-50 ({any_result['model_bytes'] / MIB:.0f} MiB), "
        "farm mode (PostgreSQL, one worker) =="
    ]
    for store, result in results.items():
        peer = "" if store == measured else " (the peer)"
        lines.append(f"  blob store {store}{peer}:")
        lines.extend(
            f"    -aic-num-cores={r['cores']}: job {r['job_s']:.2f} s, compile "
            f"{r['compile_s']:.2f} s, overhead {r['overhead_s']:.2f} s = {r['ratio']:.2f}x "
            f"(the compiler's process {r['compiler_s']:.2f} s: the job outside it "
            f"{r['farm_overhead_s']:.2f} s)"
            for r in result["runs"]
        )
        lines.append(
            f"    first job (model read from the store): {result['cold_ratio']:.2f}x; later "
            f"jobs (model in the worker's cache), median {result['warm_ratio']:.2f}x "
            f"({result['warm_overhead_s']:.2f} s)"
        )
    if len(results) == 2:
        a, b = (results[s]["warm_overhead_s"] for s in OVERHEAD_STORES)
        lines.append(f"  overhead filesystem / database (later jobs, medians): {a / b:.2f}x")
    judged = results[measured]
    lines.append(
        f"  the job outside the compiler's process / the compiler's process (later jobs): "
        f"median {judged['farm_ratio_median']:.2f}x, worst {judged['farm_ratio_max']:.2f}x"
    )
    lines.append(
        f"  [{'MET' if judged['met'] else 'NOT MET'}] the farm's own time per job (the job "
        f"outside the compiler's process) < {OVERHEAD_TARGET}x the compile (the compiler's "
        f"whole run: stages, fit check, perf report), every later job, the {measured} store"
    )
    return "\n".join(lines) + "\n"


def run_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """The measured store (`--blob-store`) and the other one as its peer, in one run."""
    from models import RESNET50, write_resnet

    stores = [args.blob_store] + [s for s in OVERHEAD_STORES if s != args.blob_store]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="qpcfarm-bench-", dir=args.work_dir) as tmp:
        model = write_resnet(RESNET50, Path(tmp) / "model")
        for store in stores:
            work = Path(tmp) / store
            work.mkdir()
            print(f"blob store {store}:", flush=True)
            with farm_running(work, True, args, blob_store=store) as farm:
                results[store] = measure_overhead(farm, model, args.overhead_runs)
    sys.stdout.write(render_overhead(results, args.blob_store))
    return {"measured": args.blob_store, "stores": results}


def run(mode_farm: bool, plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="qpcfarm-bench-", dir=args.work_dir) as tmp:
        work = Path(tmp)
        with farm_running(work, mode_farm, args) as farm:
            print(f"farm ({farm.mode}) at {farm.url}", flush=True)
            print("uploads:", flush=True)
            upload = measure_uploads(farm, work, plan)
            print("submits:", flush=True)
            submit = measure_submits(farm, plan)
            print("load:", flush=True)
            load = measure_load(farm, plan)
    text = render(farm.mode, upload, submit, load, args.workers)
    sys.stdout.write(text)
    return {
        "mode": farm.mode,
        "plan": plan.__dict__,
        "upload": upload,
        "submit": submit,
        "load": load,
        "verdicts": verdicts(upload, submit, load),
        "report": text,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="64 MiB upload, fewer submits")
    p.add_argument(
        "--farm",
        action="store_true",
        help="also run the farm mode: PostgreSQL + Redis + a worker process",
    )
    p.add_argument("--only-farm", action="store_true", help="run the farm mode only")
    p.add_argument(
        "--postgres",
        default=DEFAULT_POSTGRES,
        help="an admin URL of a PostgreSQL server (a database is created and dropped)",
    )
    p.add_argument("--redis", default=DEFAULT_REDIS, help="the Celery broker of --farm")
    p.add_argument("--workers", type=int, default=1, help="API processes (`serve --workers`)")
    p.add_argument("--work-dir", default=None, help="temporary files go here (default: $TMPDIR)")
    p.add_argument("--json", help="write every figure to this JSON file")
    p.add_argument(
        "--overhead",
        action="store_true",
        help="only the per-job overhead of ResNet-50 compiles in farm mode (issue 23)",
    )
    p.add_argument(
        "--overhead-runs",
        type=int,
        default=len(OVERHEAD_CORES),
        help=f"ResNet-50 compiles per store (<= {len(OVERHEAD_CORES)})",
    )
    p.add_argument(
        "--blob-store",
        choices=OVERHEAD_STORES,
        default="filesystem",
        help="--overhead: the store judged against the target (the other one is its peer)",
    )
    args = p.parse_args(argv)
    if args.overhead:
        result = run_overhead(args)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    plan = QUICK if args.quick else FULL
    modes = [True] if args.only_farm else ([False, True] if args.farm else [False])
    results: list[dict[str, Any]] = []
    failed: list[str] = []
    for mode in modes:
        try:
            results.append(run(mode, plan, args))
        except Exception as exc:  # noqa: BLE001 - report the mode's failure, keep the others
            name = "farm" if mode else "embedded"
            failed.append(name)
            print(f"{name} mode failed: {type(exc).__name__}: {exc}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    met = not failed and all(v["met"] for r in results for v in r["verdicts"])
    print("all targets met" if met else "some targets are not met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
