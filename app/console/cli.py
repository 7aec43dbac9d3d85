"""`qpcfarm`: the console script. Service commands live here; the compiler's own commands
(`compile`, `run`, `qpc`, `opstats`, ...) go to `compiler_core.cli.main` unchanged.

Service commands (each parses its own arguments, so clients may take qaic-compile flags):
  serve    the HTTP API; with no configuration the embedded mode (SQLite and blobs under
           `./qpcfarm-data`, in-process worker), creating team `local` and its key on first start
  worker   a Celery worker for `QPCFARM_BROKER_URL` (farm mode)
  admin    create-team | create-key | list-keys | revoke-key | verify-blobs | set-limits |
           show-team | gc
  db       upgrade
  compare  two compiles on a farm side by side (`GET /v1/compare`)
  submit   (slot) the HTTP client: add `"submit": (help, handler)` to SERVICE_COMMANDS

Only argparse is imported at start: fastapi, celery, sqlalchemy and the compiler are imported
inside the handlers, so `qpcfarm compile` starts as fast as the compiler alone. Errors print
one line, `qpcfarm: error: ...`, and exit non-zero (`QPCFARM_DEBUG=1` shows tracebacks).
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from app.console.compare import compare_command
from app.console.configure import configure_command
from app.console.submit import submit_command
from compiler_core.blas_core import set_openblas_core

if TYPE_CHECKING:
    from app.domain.settings import Settings

PROG = "qpcfarm"
LOCAL_TEAM = "local"
API_KEY_FILE = "api-key"
"""`Settings.local_key_file`'s name, for callers that must not import the settings (pydantic)."""
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
SWITCH_INTERVAL_S = 0.001

Handler = Callable[[list[str]], int]


class CliError(Exception):
    """A user-facing failure of a service command: printed as one line, exit 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(f"{self.prog}: {message}")


# ---------------------------------------------------------------------------------- serve


def serve_command(argv: list[str]) -> int:
    parser = _Parser(prog=f"{PROG} serve", description="Run the qpcfarm HTTP API.")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"default {DEFAULT_HOST}")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    parser.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="API processes (default 1). Each embedded-mode process also runs its own job "
        "threads (QPCFARM_WORKER_CONCURRENCY each): safe, since a job is claimed by one "
        "conditional UPDATE, but N processes compile up to N x that many jobs at once",
    )
    parser.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--ssl-keyfile", help="the certificate's private key (PEM)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        raise CliError("--workers must be at least 1")
    # Before anything is created (a farm, its key): a busy port would fail the start after.
    check_port_free(args.host, args.port)

    import uvicorn

    from app.console.serve import APP_FACTORY, start_farm_reaper
    from app.domain.db.session import upgrade_database, wait_for_database
    from app.domain.settings import get_settings

    settings = get_settings()
    if settings.environment == "production":
        problems = production_problems(settings, args.host, tls=bool(args.ssl_certfile))
        if problems:
            raise CliError("refusing to start in production: " + "; ".join(problems))
    if not settings.is_sqlite:
        wait_for_database(settings.database_url, timeout=60.0)
    upgrade_database(settings.database_url)
    if settings.is_sqlite and settings.embedded_worker:
        _announce_local_key(settings)
    if settings.broker_url:
        start_farm_reaper(settings)
    # Compiles run in threads of this process in the embedded mode: a CPU-bound thread keeps
    # the GIL for a whole switch interval (5 ms by default) each time a request's thread
    # gives it up for I/O, and a request gives it up a dozen times. 1 ms bounds that wait.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvicorn.run(
        APP_FACTORY,
        factory=True,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        workers=args.workers,
        proxy_headers=True,
        forwarded_allow_ips=settings.forwarded_allow_ips or "127.0.0.1",
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
    )
    return 0


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on, as uvicorn would bind it (SO_REUSEADDR, so
    a port left in TIME_WAIT by a stopped server is free), with what to do instead."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CliError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise CliError(
                    f"port {port} on {host} is in use (another {PROG} serve, or another "
                    "program): stop it, or choose a free port with --port N"
                ) from None
            if exc.errno == errno.EACCES:
                raise CliError(
                    f"port {port} on {host} needs privileges this user lacks: choose a port "
                    "above 1023 with --port N"
                ) from None
            raise CliError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


DEFAULT_SECRETS = frozenset({"qpcfarm", "postgres", "password", "secret", "changeme", "admin"})
"""Passwords of examples and images (docker-compose.yml's among them): not a secret."""
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


def production_problems(settings: Settings, host: str, *, tls: bool) -> list[str]:
    """Why `settings` and the bind address are not fit for production (none: fit)."""
    from sqlalchemy.engine import make_url

    problems = []
    if not settings.require_auth:
        problems.append("QPCFARM_REQUIRE_AUTH=false lets anyone in")
    for name, url in (("database", settings.database_url), ("broker", settings.broker_url)):
        if url and make_url(url).password in DEFAULT_SECRETS:
            problems.append(f"the {name} password in QPCFARM_{name.upper()}_URL is a default one")
    if host not in LOOPBACK_HOSTS and not tls and not settings.forwarded_allow_ips:
        problems.append(
            f"--host {host} is reachable from other machines without TLS: put a TLS-terminating "
            "reverse proxy in front and set QPCFARM_FORWARDED_ALLOW_IPS to its address, or "
            "give --ssl-certfile/--ssl-keyfile"
        )
    return problems


def _announce_local_key(settings: Settings) -> None:
    """Embedded mode: on the first start (no team yet) create team `local` and a key, print
    the key on its own line and save it to `<data_dir>/api-key` (mode 0600) for local
    clients; on later starts say where the key is."""
    key = ensure_local_key(settings)
    key_file = settings.local_key_file
    if key is not None:
        print(
            f"{PROG}: created team {LOCAL_TEAM!r}; its API key (saved to {key_file}):",
            file=sys.stderr,
        )
        print(key, flush=True)
    elif key_file.exists():
        print(f"{PROG}: the local API key is in {key_file}", file=sys.stderr)


def ensure_local_key(settings: Settings) -> str | None:
    """Create team `local` and a key when the (migrated) database has no team; returns the
    key, or None when there were teams already."""
    from sqlalchemy import func, select

    from app.domain.db.models import Team
    from app.domain.db.session import make_engine, make_session_factory, session_scope
    from app.domain.services import teams

    engine = make_engine(settings.database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            if session.execute(select(func.count()).select_from(Team)).scalar_one():
                return None
            team = teams.create_team(session, LOCAL_TEAM)
            key, _ = teams.create_api_key(
                session, team, name="created by qpcfarm serve", admin=True
            )
            # Written before the commit: if the key cannot be saved, no team is created.
            write_secret(settings.local_key_file, key + "\n")
        return key
    finally:
        engine.dispose()


def write_secret(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by its owner only (mode 0600 from the start)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------- worker


def worker_command(argv: list[str]) -> int:
    from app.domain.settings import get_settings

    settings = get_settings()
    parser = _Parser(prog=f"{PROG} worker", description="Run a Celery compile worker.")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=settings.worker_concurrency,
        help="compiles at a time (default: QPCFARM_WORKER_CONCURRENCY)",
    )
    parser.add_argument("--loglevel", default="INFO", help="default INFO")
    parser.add_argument(
        "--no-reap",
        "--no-sweep",  # its name before the reaper was named apart from the configurator's sweeps
        dest="no_reap",
        action="store_true",
        help="do not hand out again the jobs of dead workers from this process (no reaper)",
    )
    parser.add_argument(
        "--ping",
        action="store_true",
        help="exit 0 if a worker on this host answers over the broker (a health check)",
    )
    args = parser.parse_args(argv)
    if not settings.broker_url:
        raise CliError(
            "no broker configured: set QPCFARM_BROKER_URL (e.g. redis://localhost:6379/0); "
            "without one, `qpcfarm serve` runs jobs in process"
        )
    if args.concurrency < 1:
        raise CliError(f"--concurrency must be at least 1, not {args.concurrency}")

    from app.domain.db.session import make_engine, make_session_factory, wait_for_database
    from worker.celery_app import make_celery_app
    from worker.tasks import register_tasks

    if args.ping:
        return ping_local_worker(settings)

    wait_for_database(settings.database_url, timeout=60.0)
    celery = make_celery_app(settings)
    register_tasks(celery, settings)
    from app.domain.compilers import local_compilers, queue_name
    from worker.advertise import Advertiser
    from worker.celery_app import QUEUE_NAME
    from worker.runner import default_worker_name

    # In the main process, before the pool forks: children build their own engines.
    sessions = make_session_factory(make_engine(settings.database_url))
    if not args.no_reap:
        from worker.queues import CeleryQueue
        from worker.reaper import start_reaper

        start_reaper(sessions, CeleryQueue(settings, sessions), settings)
    # The default queue (jobs naming no compiler, profiles) and one per compiler it has.
    have = local_compilers(settings)
    queues = ",".join([QUEUE_NAME, *(queue_name(c) for c in have)])
    advertiser = Advertiser(
        sessions, default_worker_name("celery"), have, stale_after_s=settings.stale_after_s
    ).start()
    try:
        celery.worker_main(
            [
                "worker",
                f"--concurrency={args.concurrency}",
                f"--loglevel={args.loglevel}",
                f"--hostname=qpcfarm-{os.getpid()}@%h",
                f"--queues={queues}",
                "--without-gossip",
                "--without-mingle",
            ]
        )
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    finally:
        advertiser.stop()
    return 0


def ping_local_worker(settings: Settings, timeout: float = 2.0) -> int:
    """`worker --ping`: 0 when a worker of this host answers a broadcast ping."""
    import socket

    from worker.celery_app import make_celery_app

    celery = make_celery_app(settings)
    try:
        replies = celery.control.ping(timeout=timeout) or []
    finally:
        celery.close()
    host = socket.gethostname()
    if any(name.endswith(f"@{host}") for reply in replies for name in reply):
        return 0
    raise CliError(f"no worker on {host} answered a ping within {timeout:g} s")


# --------------------------------------------------------------------------------- admin, db


INIT_HELP = (
    "create the farm's database if there is none (without it, a command run outside the farm's "
    "folder or database refuses instead of starting an empty farm there)"
)


def _init_option() -> _Parser:
    common = _Parser(add_help=False)
    common.add_argument("--init", action="store_true", help=INIT_HELP)
    return common


def require_database(settings: Settings, init: bool) -> None:
    """Outside `serve`, a command acts on an existing farm database only, unless `--init`: run
    in the wrong folder, it would otherwise create an empty farm there and report on that."""
    if init or database_initialized(settings.database_url):
        return
    from sqlalchemy.engine import make_url

    url = make_url(settings.database_url)
    if settings.is_sqlite:
        where = f"{Path(url.database or '').resolve()} does not exist or holds no farm"
        how = (
            f"run the command in the folder where `{PROG} serve` keeps its data "
            f"(QPCFARM_DATA_DIR is {settings.data_dir}, relative to the current folder) or set "
            "QPCFARM_DATA_DIR"
        )
    else:
        where = f"{url.render_as_string(hide_password=True)} holds no farm schema"
        how = "check QPCFARM_DATABASE_URL"
    raise CliError(f"no farm database: {where}; {how}, or pass --init to create one")


def database_initialized(url: str) -> bool:
    """Whether `url` holds a farm (migrated at least once), without creating anything."""
    from sqlalchemy import inspect
    from sqlalchemy.engine import make_url

    from app.domain.db.session import make_engine

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            return True
        if not Path(parsed.database).is_file():
            return False
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return inspect(connection).has_table("alembic_version")
    finally:
        engine.dispose()


def admin_command(argv: list[str]) -> int:
    parser = _Parser(
        prog=f"{PROG} admin", description="Manage teams, API keys, quotas and retention."
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    common = _init_option()
    team = actions.add_parser("create-team", help="create a team", parents=[common])
    team.add_argument("name", metavar="NAME")
    key = actions.add_parser(
        "create-key", help="create an API key; prints it on its own line", parents=[common]
    )
    key.add_argument("--team", required=True, metavar="NAME")
    key.add_argument("--name", metavar="LABEL", help="a label to tell keys apart")
    key.add_argument(
        "--admin", action="store_true", help="a team admin's key (may manage keys over /v1/keys)"
    )
    listing = actions.add_parser(
        "list-keys", help="list API keys (never the keys themselves)", parents=[common]
    )
    listing.add_argument("--team", metavar="NAME", help="only this team's keys")
    revoke = actions.add_parser(
        "revoke-key",
        help="revoke an API key by id or prefix (effective within 1 s)",
        parents=[common],
    )
    revoke.add_argument("key", metavar="ID|PREFIX")
    revoke.add_argument("--team", metavar="NAME", help="the key must be this team's")
    scrub = actions.add_parser(
        "verify-blobs",
        help="read and hash every stored blob, quarantine the corrupt ones, list the blobs "
        "rows name that are gone; exit 1 when anything was found",
        parents=[common],
    )
    scrub.add_argument("--json", action="store_true", help="print the report as JSON")
    limits = actions.add_parser(
        "set-limits",
        help="set a team's quotas and retention (0 or 'none': no limit; omitted: unchanged)",
        parents=[common],
    )
    limits.add_argument("--team", required=True, metavar="NAME")
    limits.add_argument("--max-queued", type=_limit, metavar="N", help="compile jobs queued")
    limits.add_argument("--max-running", type=_limit, metavar="N", help="compile jobs running")
    limits.add_argument(
        "--max-stored", type=_size_limit, metavar="SIZE", help="bytes stored (e.g. 500G, 2T)"
    )
    limits.add_argument(
        "--retention-days", type=_days, metavar="DAYS", help="collect unreferenced older data"
    )
    show = actions.add_parser(
        "show-team", help="a team's usage against its limits", parents=[common]
    )
    show.add_argument("--team", required=True, metavar="NAME")
    show.add_argument("--json", action="store_true", help="print it as JSON")
    gc = actions.add_parser(
        "gc",
        help="collect models and QPCs that nothing references and that are older than their "
        "team's retention period",
        parents=[common],
    )
    gc.add_argument("--dry-run", action="store_true", help="list what would go, delete nothing")
    gc.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    from app.domain.settings import get_settings

    settings = get_settings()
    require_database(settings, args.init)
    if args.action == "verify-blobs":
        return verify_blobs_command(args.json)

    from app.domain.db.session import (
        make_engine,
        make_session_factory,
        session_scope,
        upgrade_database,
    )
    from app.domain.services import teams

    upgrade_database(settings.database_url)
    engine = make_engine(settings.database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            if args.action == "create-team":
                made = teams.create_team(session, args.name)
                print(f"{PROG}: created team {made.name!r}", file=sys.stderr)
                return 0
            if args.action == "gc":
                store = store_of(settings, make_session_factory(engine))
                return gc_command(session, store, settings, args.dry_run, args.json)
            found = _team_arg(session, args.team) if args.team else None
            if args.action == "set-limits":
                return set_limits_command(session, found, args)
            if args.action == "show-team":
                return show_team_command(session, found, args.json)
            if args.action == "list-keys":
                print_keys(teams.list_keys(session, found))
                return 0
            if args.action == "revoke-key":
                row = teams.revoke_key(session, teams.find_key(session, args.key, found))
                print(f"{PROG}: revoked key {row.prefix} ({row.id})", file=sys.stderr)
                return 0
            assert found is not None
            secret, _ = teams.create_api_key(session, found, name=args.name, admin=args.admin)
        print(f"{PROG}: created an API key for team {args.team!r}:", file=sys.stderr)
        print(secret, flush=True)
        return 0
    finally:
        engine.dispose()


UNSET = None
NO_LIMIT = -1
"""`set-limits`' value for "no limit" (the column becomes NULL)."""


def _limit(text: str) -> int:
    if text.strip().lower() in ("none", "0"):
        return NO_LIMIT
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a count is 0 (no limit) or more, not {value}")
    return value


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _size_limit(text: str) -> int:
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    if raw.lower() in ("none", "0"):
        return NO_LIMIT
    unit = raw[-1:] if raw[-1:] in _UNITS and raw[-1:] else ""
    try:
        value = float(raw[: len(raw) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a size is 0 (no limit) or more, not {text!r}")
    return int(value * _UNITS[unit])


def _days(text: str) -> float:
    if text.strip().lower() == "none":
        return float(NO_LIMIT)
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of days: {text!r}") from None
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"days are 0 or more, not {text!r}")
    return value


def set_limits_command(session: Any, team: Any, args: argparse.Namespace) -> int:
    for column, value in (
        ("max_queued_jobs", args.max_queued),
        ("max_running_jobs", args.max_running),
        ("max_stored_bytes", args.max_stored),
        ("retention_days", args.retention_days),
    ):
        if value is not UNSET:
            setattr(team, column, None if value == NO_LIMIT else value)
    session.flush()
    return show_team_command(session, team, False)


def show_team_command(session: Any, team: Any, as_json: bool) -> int:
    import json

    from app.domain.services import quotas

    described = quotas.describe(session, team)
    if as_json:
        print(json.dumps(described, indent=2))
        return 0
    usage, limits = described["usage"], described["limits"]

    def of(value: Any) -> str:
        return "no limit" if value is None else f"{value:,}"

    print(f"team {team.name}")
    print(f"  queued jobs   {usage['queued_jobs']:,} of {of(limits['max_queued_jobs'])}")
    print(f"  running jobs  {usage['running_jobs']:,} of {of(limits['max_running_jobs'])}")
    print(f"  stored bytes  {usage['stored_bytes']:,} of {of(limits['max_stored_bytes'])}")
    days = limits["retention_days"]
    print(f"  retention     {'farm default' if days is None else f'{days:g} days'}")
    return 0


def store_of(settings: Settings, sessions: Any) -> Any:
    from app.domain.blobs.factory import blob_store_from_settings

    return blob_store_from_settings(settings, sessions)


def gc_command(session: Any, store: Any, settings: Settings, dry_run: bool, as_json: bool) -> int:
    import json

    from app.domain.services import retention

    report = retention.collect(
        session, store, dry_run=dry_run, default_days=settings.retention_days
    )
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(report.summary(dry_run))
    return 0


def _team_arg(session: Any, name: str) -> Any:
    from app.domain.services import teams

    found = teams.get_team_by_name(session, name)
    if found is None:
        raise CliError(f"no team named {name!r} (qpcfarm admin create-team NAME)")
    return found


def print_keys(rows: list[tuple[Any, Any]]) -> None:
    """One line per key: team, prefix, id, admin, created, revoked."""
    for team, key in rows:
        state = f"revoked {key.revoked_at:%Y-%m-%d %H:%M}" if key.revoked_at else "active"
        role = "admin" if key.admin else "member"
        label = f"  {key.name}" if key.name else ""
        print(
            f"{team.name}\t{key.prefix}\t{key.id}\t{role}\t"
            f"created {key.created_at:%Y-%m-%d %H:%M}\t{state}{label}"
        )


def verify_blobs_command(as_json: bool) -> int:
    import json

    from app.domain.db.session import upgrade_database
    from app.domain.farm import open_farm
    from app.domain.services.scrub import scrub
    from app.domain.settings import get_settings

    settings = get_settings()
    upgrade_database(settings.database_url)
    farm = open_farm(settings)
    try:
        with farm.sessions() as session:
            report = scrub(session, farm.store)
    finally:
        farm.close()
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(
            f"checked {report.checked} blobs ({report.bytes:,} bytes): "
            f"{len(report.corrupt)} corrupt, {len(report.missing)} missing"
        )
        for sha256 in report.corrupt:
            print(f"corrupt {sha256}: quarantined")
        for gone in report.missing:
            why = "quarantined as corrupt" if gone.quarantined else "not in the store"
            print(f"missing {gone.sha256} ({gone.referenced_by}): {why}")
    return 0 if report.clean else 1


def db_command(argv: list[str]) -> int:
    parser = _Parser(prog=f"{PROG} db", description="Database schema.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    upgrade = actions.add_parser(
        "upgrade", help="apply the migrations (idempotent)", parents=[_init_option()]
    )
    upgrade.add_argument("--revision", default="head", help="default head")
    args = parser.parse_args(argv)

    from app.domain.db.session import upgrade_database
    from app.domain.settings import get_settings

    settings = get_settings()
    require_database(settings, args.init)
    upgrade_database(settings.database_url, args.revision)
    print(f"{PROG}: database upgraded to {args.revision}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------- dispatch

SERVICE_COMMANDS: dict[str, tuple[str, Handler]] = {
    "serve": ("run the HTTP API (embedded mode with no configuration)", serve_command),
    "worker": ("run a Celery compile worker (farm mode: QPCFARM_BROKER_URL)", worker_command),
    "admin": ("create teams and API keys", admin_command),
    "db": ("apply database migrations", db_command),
    "submit": ("compile on a farm, like compile (the same flags)", submit_command),
    "configure": ("sweep a search space of compile/runtime parameters", configure_command),
    "compare": ("compare two compiles on a farm (QPC or job ids)", compare_command),
}
"""Service commands: name -> (help, handler(argv) -> exit code)."""


def service_help() -> str:
    width = max(len(name) for name in SERVICE_COMMANDS)
    lines = [f"    {name:<{width}}  {text}" for name, (text, _) in SERVICE_COMMANDS.items()]
    return "\nservice commands:\n" + "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    set_openblas_core()  # before numpy is imported: see compiler_core/blas_core.py
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SERVICE_COMMANDS:
        return _run_service(SERVICE_COMMANDS[args[0]][1], args[1:])

    from compiler_core import cli as core_cli

    if not args or args[0] in ("-h", "--help"):
        text = core_cli.build_parser().format_help() + service_help()
        (sys.stdout if args else sys.stderr).write(text)
        return 0 if args else 1
    return core_cli.main(args)


FAST_EXIT_COMMANDS = frozenset({"compile"})
"""Commands after which the console script exits without tearing the interpreter down."""


def entry() -> NoReturn:
    """The console script (`qpcfarm`): `main`, then, after a compile, exit at once.

    Python's normal exit frees every object and module one by one: 55-100 ms of CPU after a
    ResNet-50 compile (5-8% of the process), for nothing, since the QPC is written and closed
    by then. atexit handlers still run and stdout and stderr are flushed, so only that
    freeing is skipped. Other commands exit normally (a service waits for its threads).
    """
    code = main()
    if sys.argv[1:2] and sys.argv[1] in FAST_EXIT_COMMANDS:
        _exit_now(code)
    sys.exit(code)


def _exit_now(code: int) -> NoReturn:
    atexit._run_exitfuncs()  # logging.shutdown, weakref finalizers...
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that left, a closed stream
            pass
    os._exit(code)


def _run_service(handler: Handler, argv: list[str]) -> int:
    try:
        return handler(argv)
    except SystemExit as exc:  # argparse's -h
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        _error_line("interrupted")
        return 130
    except CliError as exc:
        _error_line(str(exc))
        return 1
    except Exception as exc:
        if os.environ.get("QPCFARM_DEBUG") == "1":
            traceback.print_exc()
        _error_line(_describe(exc))
        return 1 if _is_user_error(exc) else 2


def _is_user_error(exc: Exception) -> bool:
    from app.domain.services.errors import ServiceError

    return isinstance(exc, ServiceError)


def _describe(exc: Exception) -> str:
    from app.domain.services.errors import ServiceError

    if isinstance(exc, ServiceError):
        return exc.message
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first} (QPCFARM_DEBUG=1 for details)"


def _error_line(message: str) -> None:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)


if __name__ == "__main__":
    entry()
