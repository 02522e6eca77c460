"""The quickstart's "try it on your machine" step, run as a user would run it: a brand-new
Django project outside this repository, `python -m distlocks.testing.sandbox` in another
terminal, its settings pasted in, `migrate`, a lock on Redis and one on PostgreSQL, then
Ctrl-C: the servers are gone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from distlocks.testing.sandbox import READY
from tests.interrupting import ctrl_c, start_until

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
    sandbox, printed = start_until(
        [sys.executable, "-m", "distlocks.testing.sandbox", "--settings-file", str(settings_file)],
        tmp_path,
        env,
        READY,
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
        code = ctrl_c(sandbox)
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
    sandbox, printed = start_until(["sh", "-c", command], tmp_path, _clean_env(), READY)
    assert ctrl_c(sandbox) == 0, printed
