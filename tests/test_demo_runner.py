"""The demo's runner, as ``make demo`` starts it (``python -m demo_project.run``): the
servers, the site, the Celery worker and beats it starts, and what is left once it
stops. Apart from tests/test_demo.py (the settings and pages) so that the two, each
about a minute, can run side by side.
"""

from __future__ import annotations

import contextlib
import http.cookiejar
import os
import signal
import socket
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from distlocks.testing.servers import DATABASE_URL_ENV, REDIS_URL_ENV
from tests.interrupting import start_reading
from tests.test_demo import ROOT, SUBPROCESS_TIMEOUT, _summary, demo_env
from tests.waiting import wait_gone

#: The beats' period (DEMO_REPORT_PERIOD) in the test of the runner that waits for the job.
REPORT_PERIOD = 4.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class DemoProcess:
    """``python -m demo_project.run`` with its output collected line by line."""

    def __init__(self, env: dict[str, str], *, new_session: bool = False) -> None:
        self.output: list[str] = []
        #: runserver processes seen; a test that fails midway must not leave them running.
        self.site_pids: list[int] = []
        #: Process groups of the Celery processes seen (a worker and its pool), likewise.
        self.groups: list[int] = []
        # new_session: a group of its own, as `make demo` run by a process manager has.
        self.process, self.lines = start_reading(
            [sys.executable, "-m", "demo_project.run"], ROOT, env, new_session=new_session
        )

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
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


@contextlib.contextmanager
def demo_process(env: dict[str, str], *, new_session: bool = False) -> Iterator[DemoProcess]:
    demo = DemoProcess(env, new_session=new_session)
    try:
        yield demo
    finally:
        demo.kill()


def _cmdline(pid: int) -> str:
    return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()


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


def _session_members(sessions: set[int]) -> list[int]:
    """Running processes (not zombies) whose session id is in ``sessions``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            state, _ppid, _group, session = stat.read_text().rsplit(")", 1)[1].split()[:4]
            if int(session) in sessions and state != "Z":
                found.append(int(stat.parent.name))
    return found


def _celery_children(demo: DemoProcess) -> tuple[int, list[int]]:
    """The runner's Celery worker and beats (each leads a session of its own)."""
    children = _children(demo.process.pid)
    celery = {pid: cmd for pid, cmd in children.items() if "-m celery -A demo_project" in cmd}
    demo.groups.extend(celery)
    workers = [pid for pid, cmd in celery.items() if " worker " in cmd]
    beats = [pid for pid, cmd in celery.items() if " beat " in cmd]
    assert len(workers) == 1, children
    assert len(beats) == 2, children
    assert "--pool prefork --concurrency 2" in celery[workers[0]]
    return workers[0], beats


def _job_summary(base: str, done: Any, limit: float) -> dict[str, int]:
    """The Celery page's counts, polled until ``done(counts)`` (at most ``limit`` s)."""
    deadline = time.monotonic() + limit
    while True:
        counts = _summary(_get(f"{base}celery/table/")[1])
        if done(counts) or time.monotonic() >= deadline:
            return counts
        time.sleep(0.5)


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
    # The beats' period, shortened from 10 s: the job keeps its lock for 80% of it
    # (3.2 s), far more than the two beats, started together, are apart.
    env = demo_env(DEMO_PORT=str(port), DEMO_REPORT_PERIOD=str(REPORT_PERIOD))
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
        status, fenced = _get(f"{base}fenced/")
        assert status == 200
        # The runner created the accounts the page writes.
        assert "Ada Lovelace" in fenced
        status, page = _login(base, "admin")
        assert status == 200
        assert "Site administration" in page

        # One worker (prefork, two processes) and two beats, each with a schedule file.
        worker, beats = _celery_children(demo)
        schedules = [
            Path(cmd.split("--schedule ", 1)[1].split()[0]) for cmd in map(_cmdline, beats)
        ]
        assert len({path.parent for path in schedules}) == 1 and len(set(schedules)) == 2
        schedule_dir = schedules[0].parent
        assert schedule_dir.is_dir()
        demo.wait_for("Celery is up")
        for name in ("[worker]", "[beat node-a]", "[beat node-b]"):
            assert name in demo.text
        pool = list(_children(worker))
        assert len(pool) == 2, pool
        # Both beats send the job every period (the first a period after they start);
        # it runs once per period, and the other trigger is skipped.
        counts = _job_summary(
            base, lambda c: c["runs"] >= 1 and c["skipped"] >= 1, limit=SUBPROCESS_TIMEOUT
        )
        assert counts["runs"] >= 1 and counts["skipped"] >= 1, counts
        assert counts["triggers"] > counts["runs"], counts
        assert counts["failed"] == 0, counts
        table = _get(f"{base}celery/table/")[1]
        assert "node-a" in table and "node-b" in table
        demo.wait_for("Skipped task shop.refresh_sales_report")  # the worker's log says why

        assert demo.interrupt() == 0
    celery = [worker, *beats, *pool]
    assert not wait_gone(servers + site + celery)
    # Nothing is left in the Celery processes' sessions (a pool process included).
    assert not wait_gone(_session_members({worker, *beats}))
    assert not run_dir.exists()
    assert not schedule_dir.exists()
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
            worker, beats = _celery_children(demo)
            if password == "first-password":
                # A worker that dies is reported at once; the site stays up.
                demo.wait_for("Celery is up")
                os.kill(worker, signal.SIGKILL)
                demo.wait_for("The Celery worker exited with status -9")
                assert _get(base)[0] == 200
            assert demo.interrupt() == 0
            # Nothing is left, the killed worker's pool processes included.
            assert not wait_gone(_session_members({worker, *beats}))
    # The servers were given, not started by the runner: they are still up.
    client = redis.Redis.from_url(os.environ[REDIS_URL_ENV])
    try:
        assert client.ping()
    finally:
        client.close()


def _wait_for_login_page(demo: DemoProcess, base: str) -> None:
    """Until the admin login page answers (the moment a process manager may stop it)."""
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT
    while time.monotonic() < deadline:
        assert demo.process.poll() is None, demo.text
        with contextlib.suppress(OSError):
            if _get(f"{base}admin/login/")[0] == 200:
                return
        time.sleep(0.05)
    raise AssertionError("the admin login page never answered")


def _demo_tree(demo: DemoProcess) -> tuple[list[int], list[int]]:
    """(runserver and the reloader's child, the Celery processes' sessions)."""
    children = _children(demo.process.pid)
    runserver = [pid for pid, cmd in children.items() if "runserver" in cmd]
    site = runserver + [pid for pid in runserver for pid in _children(pid)]
    celery = [pid for pid, cmd in children.items() if "-m celery -A demo_project" in cmd]
    demo.site_pids.extend(site)
    demo.groups.extend(celery)
    return site, celery


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm-group-and-make", "sigkill-runner"])
def test_stopping_the_demo_at_once_leaves_nothing_running(how: str) -> None:
    """A process manager's SIGTERM to the group as soon as the login page answers (which
    `make` forwards to the runner a second time), or a SIGKILL of the runner: runserver,
    the reloader's child and Celery all end, whatever the moment."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}/"
    with demo_process(demo_env(DEMO_PORT=str(port)), new_session=True) as demo:
        _wait_for_login_page(demo, base)
        site, celery = _demo_tree(demo)
        assert len(site) == 2, (site, demo.text)
        if how == "sigkill-runner":
            demo.process.kill()
        else:
            os.killpg(demo.process.pid, signal.SIGTERM)
            with contextlib.suppress(ProcessLookupError):
                os.kill(demo.process.pid, signal.SIGTERM)
        demo.process.wait(90)
        assert not wait_gone(site + celery, limit=60), demo.text
        assert not wait_gone(_session_members({*site, *celery}), limit=30)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
