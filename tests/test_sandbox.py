"""The quickstart's "try it on your machine" step, run as a user would run it: a brand-new
Django project outside this repository, `python -m distlocks.testing.sandbox` in another
terminal, its settings pasted in, `migrate`, a lock on Redis and one on PostgreSQL, then
Ctrl-C: the servers are gone."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from distlocks.testing.sandbox import READY

pytestmark = pytest.mark.slow

PROBE = """
from distlocks import lock
for alias in ("default", "pg"):
    with lock("try-it", backend=alias, ttl=10, timeout=5) as lease:
        print(alias, "token", lease.fencing_token)
"""


def _clean_env() -> dict[str, str]:
    """A user's shell: none of this test session's variables."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DISTLOCKS_", "DJANGO_", "PYTEST", "DEMO_"))
    }


def _reader(stream: object, lines: queue.Queue[str | None]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.put(line)
    lines.put(None)


def _start(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """Start the sandbox as ``command`` and read its output up to the ready line
    (within 180 s): the process and what it printed."""
    sandbox = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_reader, args=(sandbox.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while READY not in "".join(seen):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "".join(seen)
            seen.append(line)
    except BaseException:
        sandbox.kill()
        sandbox.wait(10)
        raise
    return sandbox, "".join(seen)


def test_try_it_in_a_new_project(tmp_path: Path) -> None:
    env = _clean_env()
    bin_dir = Path(sys.executable).parent
    subprocess.run(
        [str(bin_dir / "django-admin"), "startproject", "mysite", str(tmp_path)],
        check=True,
        env=env,
        timeout=60,
    )
    settings_file = tmp_path / "mysite" / "local_settings.py"
    sandbox, printed = _start(
        [sys.executable, "-m", "distlocks.testing.sandbox", "--settings-file", str(settings_file)],
        tmp_path,
        env,
    )
    try:
        assert "DISTLOCKS_BACKENDS = {" in printed and "DATABASES = {" in printed
        assert settings_file.read_text() in printed

        # The user pastes the settings and adds the app.
        with (tmp_path / "mysite" / "settings.py").open("a") as settings:
            settings.write("\nINSTALLED_APPS += ['distlocks']\nfrom .local_settings import *\n")
        manage = [sys.executable, "manage.py"]
        run = {"cwd": tmp_path, "env": env, "capture_output": True, "text": True, "timeout": 180}
        migrate = subprocess.run([*manage, "migrate"], **run)  # type: ignore[call-overload]
        assert migrate.returncode == 0, migrate.stdout + migrate.stderr
        probe = subprocess.run([*manage, "shell", "-c", PROBE], **run)  # type: ignore[call-overload]
        assert probe.returncode == 0, probe.stdout + probe.stderr
        assert "default token" in probe.stdout and "pg token" in probe.stdout

        namespace: dict[str, object] = {}
        exec(settings_file.read_text(), namespace)
        redis_port = urlsplit(namespace["CELERY_BROKER_URL"]).port  # type: ignore[arg-type]
        pg_port = int(namespace["DATABASES"]["default"]["PORT"])  # type: ignore[index]
    finally:
        sandbox.send_signal(signal.SIGINT)
        code = sandbox.wait(60)
    assert code == 0, printed
    for port in (redis_port, pg_port):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()


@pytest.mark.parametrize("inherited", ["ignored", "blocked"])
def test_ctrl_c_stops_it_whatever_sigint_it_inherited(inherited: str, tmp_path: Path) -> None:
    """Started as a shell's background job (SIGINT ignored, which exec keeps) or by a
    parent with SIGINT blocked, the sandbox still stops its servers on SIGINT. Found by
    the suite: an earlier test left the pytest process so, and the sandbox hung."""
    trap = "trap '' INT" if inherited == "ignored" else ""
    command = f"{trap}; exec {sys.executable} -m distlocks.testing.sandbox"
    if inherited == "blocked":
        # A blocked signal mask also survives exec; a helper blocks it, then execs.
        command = (
            f"exec {sys.executable} -c 'import os, signal, sys; "
            "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}); "
            f'os.execv(sys.executable, [sys.executable, "-m", "distlocks.testing.sandbox"])\''
        )
    sandbox, printed = _start(["sh", "-c", command], tmp_path, _clean_env())
    try:
        sandbox.send_signal(signal.SIGINT)
        code = sandbox.wait(60)
    finally:
        if sandbox.poll() is None:
            sandbox.kill()
            sandbox.wait(10)
    assert code == 0, printed
