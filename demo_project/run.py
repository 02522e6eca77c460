"""Run the demo site: ``make demo``, i.e. ``python -m demo_project.run``.

1. Start throwaway Redis and PostgreSQL servers (or reuse the ones named by
   ``DISTLOCKS_TEST_REDIS_URL`` / ``DISTLOCKS_TEST_DATABASE_URL``).
2. Create the ``distlocks_demo`` database if it is missing, migrate it, create
   or reset the ``admin`` superuser, add a few sample invoices.
3. Run ``manage.py runserver`` (with its auto-reloader) as a child process until
   Ctrl-C, then stop it, and the servers with it.

The servers belong to this process, not to runserver, so they stay up while
the reloader restarts the site after a code change. Every step is idempotent:
running ``make demo`` again just works.

Environment: ``DEMO_PORT`` (8000), ``DEMO_ADMIN_PASSWORD`` ("admin"), and the
variables read by :mod:`demo_project.settings`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
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
#: How long runserver gets to exit after each signal before the next, harder one.
STOP_GRACE = 10.0


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
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # A session of its own, so that stopping it reaches the reloader's child too
    # (killpg), and a terminal's Ctrl-C reaches only us: we decide the order.
    return subprocess.Popen(args, cwd=BASE_DIR, env=env, start_new_session=True)


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


def stop_runserver(child: subprocess.Popen[bytes]) -> None:
    """Stop runserver and its reloader child: SIGINT, then SIGTERM, then SIGKILL."""
    # A second Ctrl-C must not cut this short and leave the server behind.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signum)
            try:
                child.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                continue
            # The reloader's child may outlive its parent for a moment.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            return
    finally:
        signal.signal(signal.SIGINT, previous)


def banner(
    port: int, password_from_env: bool, redis_url: str, database_url: str, database: str
) -> str:
    site = f"http://{HOST}:{port}/"
    demo_database_url = urlsplit(database_url)._replace(path=f"/{database}").geturl()
    password = "(the value of DEMO_ADMIN_PASSWORD)" if password_from_env else DEFAULT_ADMIN_PASSWORD
    servers = started_servers()
    if servers is not None and (servers.redis or servers.postgres):
        stopping = "Press Ctrl-C to stop the site and its throwaway Redis and PostgreSQL."
    else:
        stopping = "Press Ctrl-C to stop the site (the servers were given, they keep running)."
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
            f"  {stopping}",
            rule,
            "",
        ]
    )


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    # SIGTERM/SIGHUP become SystemExit, so the finally clause below stops runserver
    # and atexit stops the servers, also when the servers were given (not started here).
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)
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

    # Only now: the settings read the server URLs exported just above.
    from demo_project.settings import DATABASE_NAME

    if ensure_database(database_url, DATABASE_NAME):
        log(f"Created database {DATABASE_NAME!r}.")
    debug = prepare_site(password)

    child = start_runserver(port, insecure=not debug)
    try:
        if not wait_until_listening(child, port):
            log("runserver did not start; see its output above.")
            return 1
        log(
            banner(port, password != DEFAULT_ADMIN_PASSWORD, redis_url, database_url, DATABASE_NAME)
        )
        return child.wait()
    except KeyboardInterrupt:
        log("\nStopping the demo...")
        return 0
    finally:
        # Also reached on SIGTERM/SIGHUP (SystemExit, see above).
        stop_runserver(child)


if __name__ == "__main__":
    sys.exit(main())
