"""``manage.py distlocks`` in a project without Django's admin (an API-only service):
list, inspect and release work, and a force release still leaves a trace, on the
``distlocks.audit`` logger, since there is no action history to write it to."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from distlocks.backends.base import Holder
from distlocks.backends.redis import RedisBackend
from distlocks.testing.servers import REDIS_URL_ENV

ROOT = Path(__file__).resolve().parent.parent

SETTINGS = textwrap.dedent(
    """
    import os
    SECRET_KEY = "not-secret"
    INSTALLED_APPS = ["distlocks"]
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3",
                             "NAME": os.path.join(os.path.dirname(__file__), "db.sqlite3")}}
    DISTLOCKS_BACKENDS = {"default": {"BACKEND": "distlocks.backends.redis.RedisBackend",
                                      "LOCATION": os.environ["REDIS_FOR_TEST"],
                                      "OPTIONS": {"key_prefix": "noadmin"}}}
    USE_TZ = True
    LOGGING = {"version": 1, "disable_existing_loggers": False,
               "handlers": {"err": {"class": "logging.StreamHandler"}},
               "loggers": {"distlocks.audit": {"handlers": ["err"], "level": "INFO"}}}
    """
)


def _manage(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(project), str(ROOT)]),
        "DJANGO_SETTINGS_MODULE": "noadmin_settings",
        "REDIS_FOR_TEST": os.environ[REDIS_URL_ENV],
    }
    return subprocess.run(
        [sys.executable, "-m", "django", "distlocks", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "noadmin_settings.py").write_text(SETTINGS)
    return tmp_path


def test_list_inspect_and_release_without_the_admin(project: Path) -> None:
    config = {"LOCATION": os.environ[REDIS_URL_ENV], "OPTIONS": {"key_prefix": "noadmin"}}
    backend = RedisBackend("default", config)
    name = f"no-admin-{uuid.uuid4().hex}"
    owner = uuid.uuid4().hex
    try:
        assert backend.acquire(name, owner, 60, Holder("h", 1, "t")).acquired
        listed = _manage(project, "list")
        assert listed.returncode == 0, listed.stderr
        assert name in listed.stdout
        assert "Traceback" not in listed.stderr
        inspected = _manage(project, "inspect", name)
        assert inspected.returncode == 0, inspected.stderr
        assert name in inspected.stdout

        refused = _manage(project, "release", name, "--backend", "default", "--yes", "--user", "x")
        assert refused.returncode != 0
        assert "Nothing was released" in refused.stderr
        assert backend.inspect(name) is not None

        released = _manage(project, "release", name, "--backend", "default", "--yes")
        assert released.returncode == 0, released.stderr
        assert "logged on distlocks.audit" in released.stdout
        # The trace: the audit logger's WARNING, naming the lock and the holder's token.
        assert "Force-released" in released.stderr and name in released.stderr
        assert "not in the admin's action history" in released.stderr
        assert backend.inspect(name) is None
    finally:
        backend.release(name, owner)
        backend.close()
