"""The demo site (``make demo``): settings, system checks, pages, and the runner.

The demo has its own settings and apps, so everything that needs them runs in a
subprocess on the servers this test session started (tests/settings.py exported
their URLs): ``python -m tests.test_demo`` drives the demo pages through
Django's test client on a throwaway database and prints what it saw as JSON.
"""

from __future__ import annotations

import contextlib
import http.cookiejar
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from distlocks.testing.servers import DATABASE_URL_ENV, REDIS_URL_ENV

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 8
#: Upper bound for one subprocess; generous, as it migrates a fresh database.
SUBPROCESS_TIMEOUT = 180


def demo_env(**extra: str) -> dict[str, str]:
    """The environment of a demo subprocess: this session's servers, demo settings."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("DEMO_")}
    env["DJANGO_SETTINGS_MODULE"] = "demo_project.settings"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_python(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env or demo_env(),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        check=False,
    )


# -- settings and checks ----------------------------------------------------------


def test_settings_take_the_servers_from_the_environment() -> None:
    from demo_project import settings as demo

    database_url = urllib.parse.urlsplit(os.environ[DATABASE_URL_ENV])
    database = demo.DATABASES["default"]
    assert database["ENGINE"] == "django.db.backends.postgresql"
    assert database["NAME"] == "distlocks_demo"
    assert (database["HOST"], database["PORT"]) == (database_url.hostname, database_url.port)
    assert demo.DISTLOCKS_BACKENDS["default"] == {
        "BACKEND": "distlocks.backends.redis.RedisBackend",
        "LOCATION": os.environ[REDIS_URL_ENV],
    }
    assert demo.DISTLOCKS_BACKENDS["locmem"]["BACKEND"] == (
        "distlocks.backends.locmem.LocMemBackend"
    )
    assert demo.TEMPLATES[0]["DIRS"] == [ROOT / "templates"]
    assert (ROOT / "templates" / "base.html").is_file()


SETTINGS_PROBE = (
    "import json; from demo_project import settings as s; "
    "print(json.dumps([s.SECRET_KEY, s.DEBUG, s.ALLOWED_HOSTS]))"
)


def test_settings_defaults_are_for_local_development() -> None:
    result = run_python("-c", SETTINGS_PROBE)
    assert result.returncode == 0, result.stderr
    secret_key, debug, allowed_hosts = json.loads(result.stdout)
    assert secret_key.startswith("django-insecure-")
    assert debug is True
    assert allowed_hosts == ["127.0.0.1", "localhost", "[::1]"]


def test_settings_read_the_demo_variables() -> None:
    env = demo_env(DEMO_SECRET_KEY="s3cret", DEMO_DEBUG="0", DEMO_ALLOWED_HOSTS="a.test, b.test")
    result = run_python("-c", SETTINGS_PROBE, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["s3cret", False, ["a.test", "b.test"]]


def test_check_passes_on_demo_settings() -> None:
    result = run_python("manage.py", "check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues (0 silenced)." in result.stdout


def test_demo_migrations_are_up_to_date() -> None:
    result = run_python("manage.py", "makemigrations", "shop", "--check", "--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No changes detected" in result.stdout


# -- the pages, through the test client in a subprocess ---------------------------


def drive_demo() -> dict[str, Any]:
    """Exercise the demo pages on a throwaway database; runs with the demo's settings."""
    import django

    django.setup()
    from django.conf import settings
    from django.db import connection
    from django.test import Client
    from django.test.utils import setup_test_environment

    setup_test_environment()
    # A name of our own, so that two test sessions on one server do not collide.
    settings.DATABASES["default"].setdefault("TEST", {})["NAME"] = (
        f"test_distlocks_demo_{os.getpid()}"
    )
    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    try:
        return _drive_pages(Client())
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)


def _race(client: Any, invoice: Any, backend: str, mode: str) -> dict[str, Any]:
    before = invoice.charges.count()
    response = client.post(
        f"/invoices/{invoice.pk}/charge/",
        {"backend": backend, "workers": WORKERS, "mode": mode},
    )
    page = client.get(f"/invoices/{invoice.pk}/")
    race = client.session[f"shop:race:{invoice.pk}"]
    summary = re.search(r"Outcomes: ([^<]*)\.", page.content.decode())
    return {
        "status": response.status_code,
        "location": response.headers.get("Location"),
        "page_status": page.status_code,
        "new_charges": invoice.charges.count() - before,
        "outcomes": [attempt["outcome"] for attempt in race["attempts"]],
        "tokens": [attempt["fencing_token"] for attempt in race["attempts"]],
        "summary": summary.group(1) if summary else None,
    }


def _drive_pages(client: Any) -> dict[str, Any]:
    from demo_project.run import ensure_superuser
    from demo_project.shop.models import Invoice
    from distlocks import lock

    results: dict[str, Any] = {"charge": {}}
    for backend in ("default", "locmem"):
        invoice = Invoice.objects.create(customer="Test", amount="9.99")
        first = _race(client, invoice, backend, "lock")
        again = _race(client, invoice, backend, "lock")
        unlocked = _race(
            client, Invoice.objects.create(customer="T", amount="1.00"), backend, "none"
        )
        results["charge"][backend] = {"first": first, "again": again, "unlocked": unlocked}

    results["pages"] = {
        url: client.get(url).status_code
        for url in ["/", "/invoices/", "/locks/", "/fencing/", "/lock-many/", "/admin/login/"]
    }
    results["index"] = client.get("/").content.decode()

    name = f"test:live:{uuid.uuid4().hex[:8]}"
    results["live"] = {}
    for backend in ("default", "locmem"):
        with lock(name, backend=backend, ttl=30, timeout=0) as lease:
            held = client.get("/locks/table/").content.decode()
            results["live"][backend] = {"token": lease.fencing_token, "held": held}
        results["live"][backend]["after"] = client.get("/locks/table/").content.decode()
    results["pid"] = os.getpid()

    results["hold"] = {
        backend: _hold_and_abandon(client, backend) for backend in ("default", "locmem")
    }

    results["fencing"] = []
    for _ in range(2):
        client.post("/fencing/", {"backend": "default"})
        results["fencing"].append(client.session["shop:fencing"]["steps"])

    client.post("/lock-many/", {"backend": "default"})
    results["lock_many"] = client.session["shop:lock_many"]["transfers"]

    results["superuser_created"] = [ensure_superuser("admin", "first"), None]
    results["superuser_created"][1] = ensure_superuser("admin", "second")
    results["login"] = {
        "old": client.login(username="admin", password="first"),
        "new": client.login(username="admin", password="second"),
    }
    results["admin_index"] = client.get("/admin/").status_code
    return results


def _poll(condition: Any, timeout: float = 10.0) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _hold_and_abandon(client: Any, backend: str) -> dict[str, Any]:
    """Press the live-locks page's two buttons, with leases shrunk to fractions of a second."""
    from demo_project.shop import views
    from distlocks import get_backend

    views.HOLD_TTL, views.HOLD_SECONDS, views.ABANDON_TTL = 0.3, 1.0, 0.3
    server = get_backend(backend)
    held = client.post("/locks/hold/", {"backend": backend, "mode": "hold"}, follow=True)
    again = client.post("/locks/hold/", {"backend": backend, "mode": "hold"}, follow=True)
    info = server.inspect("demo:nightly-report")

    def renewed_twice() -> bool:
        current = server.inspect("demo:nightly-report")
        return current is not None and current.renewals >= 2

    renewed = _poll(renewed_twice)
    released = _poll(lambda: server.inspect("demo:nightly-report") is None)
    client.post("/locks/hold/", {"backend": backend, "mode": "abandon"})
    abandoned = server.inspect("demo:crashed-worker")
    expired = _poll(lambda: server.inspect("demo:crashed-worker") is None)
    return {
        "held_message": "Holding &#x27;demo:nightly-report&#x27;" in held.content.decode(),
        "busy_message": "is already held" in again.content.decode(),
        "held_at_first": info is not None,
        "renewed": renewed,
        "released": released,
        "abandoned_at_first": abandoned is not None,
        "abandoned_expired": expired,
    }


@pytest.fixture(scope="module")
def demo() -> dict[str, Any]:
    result = run_python("-m", "tests.test_demo")
    assert result.returncode == 0, result.stdout + result.stderr
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("backend", ["default", "locmem"])
def test_charge_view_charges_exactly_once(demo: dict[str, Any], backend: str) -> None:
    race = demo["charge"][backend]["first"]
    assert race["status"] == 302
    assert race["page_status"] == 200
    assert race["new_charges"] == 1
    assert Counter(race["outcomes"]) == {"charged": 1, "LockNotAcquired": WORKERS - 1}
    assert race["summary"] == f"1 charged, {WORKERS - 1} LockNotAcquired"
    # Only the holder got a lease, hence a fencing token.
    assert len([token for token in race["tokens"] if token is not None]) == 1


@pytest.mark.parametrize("backend", ["default", "locmem"])
def test_charging_a_paid_invoice_again_charges_nothing(demo: dict[str, Any], backend: str) -> None:
    race = demo["charge"][backend]["again"]
    assert race["new_charges"] == 0
    assert "charged" not in race["outcomes"]
    assert "already paid" in race["outcomes"]


@pytest.mark.parametrize("backend", ["default", "locmem"])
def test_without_the_lock_every_worker_charges(demo: dict[str, Any], backend: str) -> None:
    # The demo's point: the same code without the lock double-charges.
    race = demo["charge"][backend]["unlocked"]
    assert race["new_charges"] == WORKERS
    assert race["outcomes"] == ["charged"] * WORKERS


def test_pages_render(demo: dict[str, Any]) -> None:
    assert demo["pages"] == {
        "/": 200,
        "/invoices/": 200,
        "/locks/": 200,
        "/fencing/": 200,
        "/lock-many/": 200,
        "/admin/login/": 200,
    }
    for link in ["/invoices/", "/locks/", "/fencing/", "/lock-many/", "/admin/"]:
        assert f'href="{link}"' in demo["index"]


@pytest.mark.parametrize("backend", ["default", "locmem"])
def test_live_locks_page_lists_held_locks(demo: dict[str, Any], backend: str) -> None:
    live = demo["live"][backend]
    section = live["held"].split(f"<code>{backend}</code>", 1)[1].split("<h2>", 1)[0]
    assert "test:live:" in section
    assert f"<td>{live['token']}</td>" in section
    assert f"/ {demo['pid']} / MainThread" in section
    assert "test:live:" not in live["after"]


@pytest.mark.parametrize("backend", ["default", "locmem"])
def test_hold_renews_then_releases_and_abandon_expires(demo: dict[str, Any], backend: str) -> None:
    assert demo["hold"][backend] == {
        "held_message": True,
        "busy_message": True,
        "held_at_first": True,
        # Its lease is far shorter than the hold: only renewal keeps it alive.
        "renewed": True,
        "released": True,
        "abandoned_at_first": True,
        # Not renewed, so it ends by its TTL, like a crashed holder's lock.
        "abandoned_expired": True,
    }


def test_fencing_tokens_only_increase(demo: dict[str, Any]) -> None:
    tokens = [step["fencing_token"] for run in demo["fencing"] for step in run]
    assert tokens == sorted(set(tokens)), tokens
    for run in demo["fencing"]:
        evicted, after = run[-2]["fencing_token"], run[-1]["fencing_token"]
        # The force-release moved the counter: the evicted holder's token is outdated
        # at once, and the next holder's is higher still.
        assert after > evicted + 1
        assert "release() returned False" in run[-2]["note"]
        assert "raised LockLost" in run[-2]["note"]


def test_lock_many_crossing_transfers_both_finish(demo: dict[str, Any]) -> None:
    transfers = demo["lock_many"]
    assert [t["outcome"] for t in transfers] == ["done", "done"]
    assert [t["order"] for t in transfers] == [["account:alice", "account:bob"]] * 2


def test_superuser_is_created_then_reset(demo: dict[str, Any]) -> None:
    assert demo["superuser_created"] == [True, False]
    assert demo["login"] == {"old": False, "new": True}
    assert demo["admin_index"] == 200


# -- the runner, as `make demo` starts it -----------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class DemoProcess:
    """``python -m demo_project.run`` with its output collected line by line."""

    def __init__(self, env: dict[str, str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        #: runserver processes seen; a test that fails midway must not leave them running.
        self.site_pids: list[int] = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "demo_project.run"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str, timeout: float = SUBPROCESS_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while text not in "".join(self.output):
            remaining = deadline - time.monotonic()
            line = self.lines.get(timeout=max(0.0, remaining)) if remaining > 0 else None
            if line is None:
                raise AssertionError(f"{text!r} never appeared; output:\n{self.text}")
            self.output.append(line)

    @property
    def text(self) -> str:
        return "".join(self.output)

    def interrupt(self) -> int:
        """Ctrl-C, as a terminal sends it."""
        self.process.send_signal(signal.SIGINT)
        return self.process.wait(60)

    def kill(self) -> None:
        """Kill the runner, and whatever site processes it was seen to start, if alive."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        for pid in self.site_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def demo_process(env: dict[str, str]) -> Iterator[DemoProcess]:
    demo = DemoProcess(env)
    try:
        yield demo
    finally:
        demo.kill()


def _children(pid: int) -> dict[int, str]:
    """Direct children of ``pid``: pid -> command line."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                child = int(stat.parent.name)
                found[child] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    return found


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie (an exited process nobody reaped yet:
    a container's first process may never reap orphans)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _wait_gone(pids: list[int], limit: float = 15.0) -> list[int]:
    """The pids still running after up to ``limit`` seconds (bounded, not slept)."""
    deadline = time.monotonic() + limit
    while (alive := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _login(base: str, password: str) -> tuple[int, str]:
    """Log in to the admin over HTTP; the final status and page."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    opener.open(f"{base}admin/login/", timeout=10).read()
    token = next(cookie.value for cookie in jar if cookie.name == "csrftoken")
    data = urllib.parse.urlencode(
        {"csrfmiddlewaretoken": token, "username": "admin", "password": password, "next": "/admin/"}
    ).encode()
    with opener.open(f"{base}admin/login/?next=/admin/", data=data, timeout=10) as response:
        return response.status, response.read().decode()


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


@pytest.mark.slow
def test_run_starts_servers_serves_the_site_and_cleans_up() -> None:
    port = _free_port()
    env = demo_env(DEMO_PORT=str(port))
    # No server URLs: the runner starts (and must stop) its own, like `make demo`.
    del env[REDIS_URL_ENV], env[DATABASE_URL_ENV]
    base = f"http://127.0.0.1:{port}/"
    with demo_process(env) as demo:
        demo.wait_for("Log in with")
        assert base in demo.text
        assert "username: admin   password: admin" in demo.text
        children = _children(demo.process.pid)
        servers = [
            pid for pid, cmd in children.items() if "redis-server" in cmd or "postgres" in cmd
        ]
        assert len(servers) == 2, children
        runserver = [pid for pid, cmd in children.items() if "runserver" in cmd]
        assert len(runserver) == 1, children
        # The reloader's child is the process that actually serves.
        site = runserver + list(_children(runserver[0]))
        demo.site_pids.extend(site)
        assert len(site) == 2, site
        pgdata = [cmd.split("-D ", 1)[1].split()[0] for cmd in children.values() if "-D " in cmd]
        assert len(pgdata) == 1, children
        run_dir = Path(pgdata[0]).parent
        assert run_dir.is_dir()

        status, index = _get(base)
        assert status == 200
        assert "Charge an invoice once" in index
        assert _get(f"{base}locks/")[0] == 200
        status, page = _login(base, "admin")
        assert status == 200
        assert "Site administration" in page

        assert demo.interrupt() == 0
    assert not _wait_gone(servers + site)
    assert not run_dir.exists()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


@pytest.mark.slow
def test_run_twice_on_given_servers_resets_the_admin_and_leaves_servers_up() -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}/"
    for password in ("first-password", "second-password"):
        with demo_process(demo_env(DEMO_PORT=str(port), DEMO_ADMIN_PASSWORD=password)) as demo:
            demo.wait_for("Log in with")
            assert "password: (the value of DEMO_ADMIN_PASSWORD)" in demo.text
            assert password not in demo.text
            assert not [
                cmd for cmd in _children(demo.process.pid).values() if "redis-server" in cmd
            ]
            status, page = _login(base, password)
            assert "Site administration" in page, status
            assert demo.interrupt() == 0
    # The servers were given, not started by the runner: they are still up.
    client = redis.Redis.from_url(os.environ[REDIS_URL_ENV])
    try:
        assert client.ping()
    finally:
        client.close()


if __name__ == "__main__":
    print(json.dumps(drive_demo()))
