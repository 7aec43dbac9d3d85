"""Compiles and upload checks under limits, cancel, clean-up and broker recovery (issue 26).

- A compile runs in a child process with an address-space limit and a wall-clock limit: a
  hostile model that allocates without bound fails `compile_memory_limit`, one that runs for
  hours fails `compile_time_limit`, and the next compile gets a fresh child.
- A cancel stops a compile stuck inside one pass (no progress report for hours) within
  seconds, through the job row, and the next job runs.
- An upload check past its limits is refused 422 `model_check_limit` and only its checker
  is replaced: other uploads keep theirs.
- The work folder of a job whose process was killed is removed by the next worker start and
  by the sweep; the folder of a running job never is.
- A Redis broker that comes back without its messages gets every queued job again at once.

The hostile models are valid ONNX built here; their cost is real compiler work (see
`stuck_model` and `hungry_model`), not a test hook. The checker's hostile work is a function
of this module run by the checker pool itself (`describer.run_limited`), since the importer's
own unbounded paths are closed by their own bounds.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from sqlalchemy.orm import Session

from app.domain.db.models import CompileJob, JobStatus, Team
from app.domain.services import describer, jobs
from app.domain.services.errors import ServiceError
from app.domain.services.limits import Limits, MiB, caused_by_memory
from compiler_core import CompileError, CompileOptions
from tests.conftest import Farm, tiny_model
from tests.test_worker import queued_job, reload, run, wait_for
from worker.compile_process import CompileProcess
from worker.workdirs import job_folder, remove_abandoned

GiB = 1 << 30
SLACK_S = 60.0
"""How long a test waits for something that takes seconds: only a broken limit reaches it
(the hostile compiles need far longer than this)."""


# ---------------------------------------------------------------------------- hostile models


def stuck_model(n: int = 2048, dets: int = 2000) -> onnx.ModelProto:
    """A valid 1 KB model whose compile runs for about an hour inside one pass, with flat
    memory: fold-constants evaluates `Det` of a constant n x n matrix `dets` times (each an
    O(n^3) LU factorisation, about a second here) and reports no progress in between."""
    shape = numpy_helper.from_array(np.array([n, n], dtype=np.int64), "shape")
    one = numpy_helper.from_array(np.array([1.0], dtype=np.float32))
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["c"], value=one)]
    acc = "x"
    for i in range(dets):
        nodes.append(helper.make_node("Det", ["c"], [f"d{i}"]))
        nodes.append(helper.make_node("Add", [acc, f"d{i}"], [f"a{i}"]))
        acc = f"a{i}"
    nodes.append(helper.make_node("Identity", [acc], ["y"]))
    return _model(nodes, [shape], "stuck")


def hungry_model(rows: int = 16384, cols: int = 32768) -> onnx.ModelProto:
    """A valid 300-byte model whose compile allocates rows x cols float32 (2 GiB): fold-
    constants materialises ConstantOfShape to reduce it to the scalar the graph adds."""
    shape = numpy_helper.from_array(np.array([rows, cols], dtype=np.int64), "shape")
    one = numpy_helper.from_array(np.array([1.0], dtype=np.float32))
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["big"], value=one),
        helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
        helper.make_node("Add", ["x", "s"], ["y"]),
    ]
    return _model(nodes, [shape], "hungry")


def _model(nodes: list[Any], inits: list[Any], name: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def saved(model: onnx.ModelProto, folder: Path, name: str = "m.onnx") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / name)
    return folder / name


def options(folder: Path) -> CompileOptions:
    return CompileOptions.from_flags([f"-aic-binary-dir={folder / 'out'}"])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Stop(BaseException):
    pass


# --------------------------------------------------------------------- compiles in a child


def test_the_compile_child_runs_under_its_address_space_limit(tmp_path: Path) -> None:
    child = CompileProcess(Limits(memory_bytes=3 * GiB)).start()
    try:
        pid = child.pid
        assert pid is not None
        wait_for(lambda: resource.prlimit(pid, resource.RLIMIT_AS)[0] == 3 * GiB, "the limit")
    finally:
        child.close()


def test_a_compile_past_its_time_limit_is_killed_and_fails_compile_time_limit(
    tmp_path: Path,
) -> None:
    child = CompileProcess(Limits(time_s=2.0))
    try:
        child.start()
        first = child.pid
        assert first is not None
        with pytest.raises(CompileError) as stopped:
            child.compile(saved(stuck_model(), tmp_path), options(tmp_path), lambda s, f: None)
        assert stopped.value.code == "compile_time_limit"
        assert "2 s" in stopped.value.message
        assert "QPCFARM_COMPILE_TIME_LIMIT_S" in stopped.value.message
        assert stopped.value.details == {"limit": "time", "limit_s": 2.0}
        assert not alive(first)  # killed, not left compiling for nobody

        small = saved(tiny_model(), tmp_path / "next")
        assert child.compile(small, options(tmp_path / "next"), lambda s, f: None).metrics
        assert child.pid != first
    finally:
        child.close()


def test_a_compile_past_its_memory_limit_fails_compile_memory_limit(tmp_path: Path) -> None:
    child = CompileProcess(Limits(memory_bytes=1 * GiB))
    try:
        with pytest.raises(CompileError) as stopped:
            child.compile(saved(hungry_model(), tmp_path), options(tmp_path), lambda s, f: None)
        assert stopped.value.code == "compile_memory_limit"
        assert "1,024 MiB" in stopped.value.message
        assert stopped.value.details == {"limit": "memory", "limit_mib": 1024}

        small = saved(tiny_model(), tmp_path / "next")
        assert child.compile(small, options(tmp_path / "next"), lambda s, f: None).metrics
    finally:
        child.close()


def test_a_stop_reaches_a_compile_stuck_inside_one_pass(tmp_path: Path) -> None:
    """`poll` is asked between reports: a stop raised there ends the compile (the child is
    killed after the grace, since it reports nothing for an hour) though no report comes."""
    child = CompileProcess(Limits())
    stages: list[str] = []
    after_stop: list[str] = []
    stopped_at: list[float] = []

    def progress(stage: str, fraction: float) -> None:
        (after_stop if stopped_at else stages).append(stage)

    def poll() -> None:
        if "graph-passes" in stages and not stopped_at:
            stopped_at.append(time.monotonic())
            raise Stop

    try:
        child.start()
        first = child.pid
        assert first is not None
        with pytest.raises(Stop):
            child.compile(saved(stuck_model(), tmp_path), options(tmp_path), progress, poll=poll)
        assert time.monotonic() - stopped_at[0] < SLACK_S
        assert after_stop == [] and not alive(first)
        small = saved(tiny_model(), tmp_path / "next")
        assert child.compile(small, options(tmp_path / "next"), lambda s, f: None).metrics
    finally:
        child.close()


def test_a_memory_error_wrapped_by_the_compiler_is_still_recognised() -> None:
    try:
        try:
            raise MemoryError
        except MemoryError as exc:
            raise CompileError("pass_failed", "evaluating constant inputs failed") from exc
    except CompileError as wrapped:
        assert caused_by_memory(wrapped)
    try:
        try:
            raise MemoryError
        except MemoryError:
            raise ServiceError("invalid_model", "the importer failed", 422) from None
    except ServiceError as hidden:
        assert caused_by_memory(hidden)
    assert not caused_by_memory(CompileError("dynamic_shape", "x"))


# ------------------------------------------------------------------------- jobs under limits


def test_a_job_past_the_compile_time_limit_fails_with_the_limit_and_the_next_job_runs(
    farm: Farm, session: Session, team: Team
) -> None:
    child = CompileProcess(Limits(time_s=2.0))
    try:
        stuck = queued_job(farm, session, team, stuck_model().SerializeToString())
        assert run(farm, stuck.id, compiler=child) == JobStatus.failed
        failed = reload(farm, stuck.id)
        assert failed.error_code == "compile_time_limit"
        assert failed.error_detail is not None
        assert failed.error_detail["details"] == {"limit": "time", "limit_s": 2.0}
        assert failed.stage == "graph-passes"

        after = queued_job(farm, session, team, tiny_model().SerializeToString())
        assert run(farm, after.id, compiler=child) == JobStatus.succeeded
    finally:
        child.close()


def test_a_cancel_reaches_a_compile_stuck_inside_one_pass_through_the_job_row(
    farm: Farm, session: Session, team: Team
) -> None:
    """The heartbeat is set to a minute, so what stops the compile is the relay's poll of
    the row's cancel flag; the compile itself would report nothing for an hour."""
    child = CompileProcess(Limits()).start()
    try:
        stuck = queued_job(farm, session, team, stuck_model().SerializeToString())
        outcome: list[JobStatus | None] = []
        relay = threading.Thread(
            target=lambda: outcome.append(run(farm, stuck.id, compiler=child, heartbeat_s=60)),
            daemon=True,
        )
        relay.start()
        wait_for(lambda: reload(farm, stuck.id).stage == "graph-passes", "the stuck pass")
        first = child.pid
        with farm.session() as other:
            row = other.get(CompileJob, stuck.id)
            assert row is not None
            jobs.cancel(other, team, row)
            other.commit()
        relay.join(SLACK_S)
        assert not relay.is_alive(), "the cancel did not stop the compile"
        assert outcome == [JobStatus.cancelled]
        assert reload(farm, stuck.id).status == JobStatus.cancelled
        assert first is not None and not alive(first)

        after = queued_job(farm, session, team, tiny_model().SerializeToString())
        assert run(farm, after.id, compiler=child) == JobStatus.succeeded
    finally:
        child.close()


# ----------------------------------------------------------------------------- work folders

HOLDER = """
import sys, time, uuid
from pathlib import Path
from worker.workdirs import job_folder
with job_folder("compile", uuid.uuid4(), Path(sys.argv[1])) as folder:
    (folder / "model.onnx").write_bytes(b"x" * 4096)
    print(folder, flush=True)
    time.sleep(600)
"""


def hold_folder(root: Path) -> tuple[subprocess.Popen[str], Path]:
    """A process (as a job's would) that holds a job folder under `root` until killed."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert holder.stdout is not None
    folder = Path(holder.stdout.readline().strip())
    assert folder.is_dir(), "the holder did not start"
    return holder, folder


def test_a_killed_jobs_folder_is_removed_and_folders_of_running_jobs_are_kept(
    tmp_path: Path,
) -> None:
    root = tmp_path / "work"
    killed, orphan = hold_folder(root)
    running, kept = hold_folder(root)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        with job_folder("profile", uuid.uuid4(), root) as mine:
            assert remove_abandoned(root) == [orphan]
            assert not orphan.exists() and kept.is_dir() and mine.is_dir()
            assert not (root / f"{orphan.name}.lock").exists()
        assert not mine.exists()
        assert remove_abandoned(root) == []  # the running job's folder stays
        assert kept.is_dir()
    finally:
        for holder in (killed, running):
            holder.kill()
            holder.wait()


def test_the_sweep_removes_the_folder_of_a_killed_job(farm: Farm, tmp_path: Path) -> None:
    from tests.test_worker import RecordingQueue
    from worker.reaper import Reaper

    root = tmp_path / "work"
    holder, folder = hold_folder(root)
    holder.kill()
    holder.wait()
    reaper = Reaper(farm.db.sessions, RecordingQueue(), 0.05, work_root=root).start()
    try:
        wait_for(lambda: not folder.exists(), "the sweep to remove the folder")
    finally:
        reaper.stop()


def test_a_job_process_killed_mid_compile_leaves_a_folder_the_next_worker_start_removes(
    tmp_path: Path,
) -> None:
    """The embedded mode's job process is SIGKILLed while its compile runs: its folder
    (the model, the compiler's files) outlives it until the next worker start."""
    from tests.test_job_process import Embedded
    from worker.inprocess import InProcessQueue
    from worker.job_process import JobProcess, config_for

    embedded = _embedded_sqlite(tmp_path)
    root = tmp_path / "work"
    base = config_for(embedded.settings, embedded.store)
    assert base is not None
    config = type(base)(**{**base.__dict__, "work_root": str(root)})
    child = JobProcess(config, embedded.sessions).start()
    try:
        job = Embedded.queued_job(embedded, 0.1)
        with embedded.sessions() as session:  # a stuck model in place of the tiny one
            row = session.get(CompileJob, job.id)
            assert row is not None
            model = _store_model(embedded, session, stuck_model())
            row.model_id = model.id
            session.commit()
        relay = threading.Thread(
            target=child.run, args=("compile", job.id, "w:1:inproc-0"), daemon=True
        )
        relay.start()
        wait_for(lambda: embedded.reload(job.id).stage == "graph-passes", "the compile")
        folders = [p for p in root.iterdir() if p.is_dir()]
        assert len(folders) == 1 and folders[0].name.startswith(f"compile-{job.id}-")
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        relay.join(SLACK_S)
        assert folders[0].is_dir()  # nobody removed it: its process was killed

        queue = InProcessQueue(embedded.sessions, embedded.store, work_root=root).start()
        try:
            assert not folders[0].exists()
        finally:
            queue.close()
    finally:
        child.close()
        embedded.close()


def _embedded_sqlite(tmp_path: Path) -> Any:
    from app.domain.blobs.filesystem import FilesystemBlobStore
    from app.domain.db import models as tables  # noqa: F401 - registers the tables
    from app.domain.db.base import Base
    from app.domain.db.session import make_engine, make_session_factory
    from app.domain.settings import Settings
    from tests.test_job_process import Embedded

    url = f"sqlite:///{tmp_path / 'qpcfarm.db'}"
    engine = make_engine(url)
    Base.metadata.create_all(engine)
    farm = Embedded(
        Settings(data_dir=tmp_path, database_url=url),
        make_session_factory(engine),
        FilesystemBlobStore(tmp_path / "blobs"),
    )
    farm.close = engine.dispose  # type: ignore[attr-defined]
    return farm


def _store_model(embedded: Any, session: Session, model: onnx.ModelProto) -> Any:
    import io

    from app.domain.db.models import Team as TeamRow
    from app.domain.services import models

    team = session.query(TeamRow).first()
    assert team is not None
    stored = models.store_model(
        session, embedded.store, team, io.BytesIO(model.SerializeToString()), "m.onnx",
        max_bytes=1 << 26,
    )  # fmt: skip
    session.flush()
    return stored


# ---------------------------------------------------------------------------- upload checks


def spin(seconds: float) -> tuple[Any, ...]:
    """A checker's work that takes `seconds` (a check that never ends, for the test)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return ("ok", os.getpid())


def allocate(size: int) -> tuple[Any, ...]:
    """A checker's work that allocates `size` bytes."""
    block = bytearray(size)
    return ("ok", len(block))


@contextmanager
def checkers_limited_to(time_s: float) -> Iterator[None]:
    """Two checkers with a `time_s` and 512 MiB limit; the defaults again afterwards."""
    describer.configure(Limits(memory_bytes=512 * MiB, time_s=time_s))
    try:
        yield
    finally:
        describer.configure(Limits())
        describer.shutdown()


@pytest.fixture
def limited_checkers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Checkers with a 2 s limit (a spinning check is stopped soon)."""
    monkeypatch.setattr(describer, "DESCRIBE_PROCESSES", 2)
    with checkers_limited_to(2.0):
        yield


@pytest.fixture
def memory_limited_checkers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Checkers whose time limit no loaded machine reaches first: the memory limit stops them
    (a 2 s wall-clock limit was reached first on a CI machine running other work)."""
    monkeypatch.setattr(describer, "DESCRIBE_PROCESSES", 2)
    with checkers_limited_to(600.0):
        yield


@pytest.mark.usefixtures("limited_checkers")
def test_an_upload_check_past_its_time_limit_is_refused_and_only_its_checker_replaced(
    tmp_path: Path,
) -> None:
    path = saved(tiny_model(), tmp_path)
    describer.inspect_in_child(path, "m.onnx", 1 << 20, tmp_path / "w0")  # a checker warm
    refused: list[ServiceError] = []

    def hostile() -> None:
        with pytest.raises(ServiceError) as caught:
            describer.run_limited(spin, 3600.0)
        refused.append(caught.value)

    thread = threading.Thread(target=hostile, daemon=True)
    thread.start()
    wait_for(lambda: bool(describer._get_slots()._busy), "the hostile check to start")
    hostile_pids = describer.checker_pids()  # the warm checker, now busy with the hostile
    # Meanwhile another team's upload is checked by the other checker.
    kind, (_opset, inputs, _outputs) = describer.inspect_in_child(
        path, "m.onnx", 1 << 20, tmp_path / "w1"
    )
    assert kind == "onnx" and inputs[0]["name"] == "x"
    other = set(describer.checker_pids()) - set(hostile_pids)
    thread.join(SLACK_S)
    assert not thread.is_alive()

    error = refused[0]
    assert (error.code, error.status) == ("model_check_limit", 422)
    assert error.detail == {"limit": "time", "limit_s": 2.0}
    assert "QPCFARM_CHECK_TIME_LIMIT_S" in error.message
    assert hostile_pids
    # the kill is sent before the refusal; the process may take a moment to be gone
    wait_for(lambda: not any(alive(pid) for pid in hostile_pids), "the hostile checker's end")
    assert len(other) == 1 and other <= set(describer.checker_pids())  # the other one stays
    assert describer.inspect_in_child(path, "m.onnx", 1 << 20, tmp_path / "w2")[0] == "onnx"


@pytest.mark.usefixtures("memory_limited_checkers")
def test_an_upload_check_past_its_memory_limit_is_refused_with_the_limit(
    tmp_path: Path,
) -> None:
    with pytest.raises(ServiceError) as refused:
        describer.run_limited(allocate, 2 * GiB)
    assert (refused.value.code, refused.value.status) == ("model_check_limit", 422)
    assert refused.value.detail == {"limit": "memory", "limit_mib": 512}
    assert describer.run_limited(allocate, 64 * MiB) == ("ok", 64 * MiB)
    path = saved(tiny_model(), tmp_path)
    assert describer.inspect_in_child(path, "m.onnx", 1 << 20, tmp_path / "w")[0] == "onnx"


# ------------------------------------------------------------------------ broker recovery


def broker_messages(url: str) -> list[str]:
    """The job ids of the messages waiting in the farm's queue of the broker at `url`."""
    import json

    import redis

    from worker.celery_app import QUEUE_NAME

    client = redis.Redis.from_url(url)
    try:
        raw = client.lrange(QUEUE_NAME, 0, -1)
    finally:
        client.close()
    ids = []
    for message in raw:
        headers = json.loads(message)["headers"]
        ids.append(headers["argsrepr"].strip("[]()',\" "))
    return ids


def test_a_broker_that_lost_its_messages_gets_every_queued_job_again_at_once(
    farm: Farm, session: Session, team: Team, private_redis: Any, tmp_path: Path
) -> None:
    import redis

    from app.domain.settings import Settings
    from worker import compile_jobs
    from worker.queues import CeleryQueue
    from worker.reaper import requeue_if_broker_lost

    waiting = [queued_job(farm, session, team, tiny_model(0.1 * i).SerializeToString()).id
               for i in (1, 2)]  # fmt: skip
    running = queued_job(farm, session, team, tiny_model(0.3).SerializeToString()).id
    assert compile_jobs.claim(session, running, "busy-worker")
    queue = CeleryQueue(Settings(data_dir=tmp_path, broker_url=private_redis.url))
    try:
        # The first look at a broker sends what is queued (it may be a new, empty one).
        assert requeue_if_broker_lost(farm.db.sessions, queue) == waiting
        assert requeue_if_broker_lost(farm.db.sessions, queue) == []  # nothing changed
        assert sorted(broker_messages(private_redis.url)) == sorted(map(str, waiting))

        client = redis.Redis.from_url(private_redis.url)
        client.flushdb()  # every message gone, the broker itself still up
        client.close()
        assert requeue_if_broker_lost(farm.db.sessions, queue) == waiting
        assert sorted(broker_messages(private_redis.url)) == sorted(map(str, waiting))

        private_redis.stop()  # a restart without persistence
        private_redis.start()
        assert requeue_if_broker_lost(farm.db.sessions, queue) == waiting
        assert requeue_if_broker_lost(farm.db.sessions, queue) == []
        assert sorted(broker_messages(private_redis.url)) == sorted(map(str, waiting))
    finally:
        queue.close()


def test_two_sweepers_see_one_broker_restart_once(
    farm: Farm, session: Session, team: Team, private_redis: Any, tmp_path: Path
) -> None:
    from app.domain.settings import Settings
    from worker.queues import CeleryQueue

    settings = Settings(data_dir=tmp_path, broker_url=private_redis.url)
    queues = [CeleryQueue(settings), CeleryQueue(settings)]
    try:
        assert [q.broker_lost_messages() for q in queues] == [True, False]
        private_redis.stop()
        private_redis.start()
        assert [q.broker_lost_messages() for q in queues] == [True, False]
        assert [q.broker_lost_messages() for q in queues] == [False, False]
    finally:
        for q in queues:
            q.close()


# ----------------------------------------------------------------- the real services, both modes


def test_embedded_serve_fails_a_compile_past_its_time_limit_and_runs_the_next(
    tmp_path: Path,
) -> None:
    from tests.service_helpers import (
        Api,
        free_port,
        processes,
        read_key_line,
        service_env,
        wait_for_http,
    )

    env = service_env(
        QPCFARM_DATA_DIR=str(tmp_path / "data"),
        QPCFARM_COMPILE_TIME_LIMIT_S="2",
        QPCFARM_WORK_DIR=str(tmp_path / "work"),
    )
    port = free_port()
    with processes(tmp_path) as procs:
        serve = procs.start("serve", ["serve", "--port", str(port)], env, capture_stdout=True)
        api = Api(f"http://127.0.0.1:{port}", read_key_line(serve))
        wait_for_http(api.base_url, serve)

        stuck = api.submit(api.upload(stuck_model().SerializeToString())["id"], {})
        failed = api.wait(stuck["id"], ("succeeded", "failed", "cancelled"), timeout=SLACK_S)
        assert failed["status"] == "failed"
        assert failed["error"]["code"] == "compile_time_limit", failed["error"]
        assert "2 s" in failed["error"]["message"]

        small = api.submit(api.upload(tiny_model().SerializeToString())["id"], {})
        done = api.wait(small["id"], ("succeeded", "failed", "cancelled"), timeout=SLACK_S)
        assert done["status"] == "succeeded", done["error"]
        assert [p for p in (tmp_path / "work").iterdir()] == []  # each job's folder removed


def test_farm_mode_cancels_a_stuck_compile_limits_memory_and_resends_what_the_broker_lost(
    tmp_path: Path,
) -> None:
    """One Celery worker, a private Redis, requeue threshold 10 minutes: the folder of a job
    killed earlier is removed; a compile stuck in a pass is cancelled; a job whose message
    the broker lost in a restart runs at once; a compile past the memory limit fails with
    it; the worker stays up throughout."""
    from tests.conftest import _postgres_problem, postgres_url
    from tests.service_helpers import (
        Api,
        fresh_postgres_database,
        processes,
        redis_problem,
        redis_server,
        service_env,
        wait_for_worker,
    )
    from tests.test_service_e2e import start_farm_api

    problem = _postgres_problem() or redis_problem()
    if problem is not None:
        pytest.skip(problem)
    with fresh_postgres_database(postgres_url()) as db_url, redis_server(tmp_path) as broker:
        env = service_env(
            QPCFARM_DATA_DIR=str(tmp_path / "data"),
            QPCFARM_DATABASE_URL=db_url,
            QPCFARM_BROKER_URL=broker.url,
            QPCFARM_HEARTBEAT_S="0.5",
            QPCFARM_STALE_AFTER_S="4",
            QPCFARM_REQUEUE_AFTER_S="600",
            QPCFARM_COMPILE_MEMORY_LIMIT_MIB="1024",
            QPCFARM_WORK_DIR=str(tmp_path / "work"),
        )
        holder, abandoned = hold_folder(tmp_path / "work")  # a job killed before this start
        holder.kill()
        holder.wait()
        with processes(tmp_path) as procs:
            api: Api = start_farm_api(procs, env, tmp_path)
            worker = procs.start("worker", ["worker"], env)
            wait_for_worker(worker)
            wait_for(lambda: not abandoned.exists(), "the worker to remove the killed job's folder")

            stuck = api.submit(api.upload(stuck_model().SerializeToString())["id"], {})
            api.wait(stuck["id"], ("running",), timeout=SLACK_S)
            lost = api.submit(api.upload(tiny_model(0.2).SerializeToString())["id"], {})
            assert api.job(lost["id"])["status"] == "queued"  # its message waits in Redis
            broker.stop()  # ... and is gone with it
            broker.start()

            with api.client() as http:
                assert http.post(f"/v1/compile-jobs/{stuck['id']}/cancel").status_code == 200
            cancelled = api.wait(stuck["id"], ("cancelled", "failed", "succeeded"), SLACK_S)
            assert cancelled["status"] == "cancelled"
            done = api.wait(lost["id"], ("succeeded", "failed", "cancelled"), timeout=SLACK_S)
            assert done["status"] == "succeeded", done["error"]

            hungry = api.submit(api.upload(hungry_model().SerializeToString())["id"], {})
            failed = api.wait(hungry["id"], ("succeeded", "failed", "cancelled"), SLACK_S)
            assert failed["status"] == "failed"
            assert failed["error"]["code"] == "compile_memory_limit", failed["error"]
            assert worker.alive()
