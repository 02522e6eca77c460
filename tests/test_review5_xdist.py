"""Review 5: under pytest-xdist each worker has servers of its own (tests/settings.py),
and the processes its tests start must reach those, never the controller's nor the
other worker's; a caller's own servers are kept. Runs in one process too."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from django.conf import settings

from distlocks.testing import servers

ROOT = Path(__file__).resolve().parent.parent

_REPORT = """
import json, os
os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
from tests import settings as s
print(json.dumps({
    "redis": s.REDIS_URL, "database": s.DATABASE_URL, "redlock": s.REDLOCK_URLS,
    "sqlite": s.DATABASES["sqlite"]["NAME"], "started": os.environ.get("DISTLOCKS_TEST_STARTED"),
}))
"""


def _mine() -> dict[str, Any]:
    from tests import settings as s

    return {
        "redis": s.REDIS_URL,
        "database": s.DATABASE_URL,
        "redlock": s.REDLOCK_URLS,
        "sqlite": settings.DATABASES["sqlite"]["NAME"],
    }


def _child(env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _REPORT],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=True,
    )  # fmt: skip
    report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return report


def _env(**changes: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def test_a_python_c_child_reaches_this_processs_servers() -> None:
    report = _child(_env())
    assert report.pop("started") == ""  # it started nothing: it uses what it was given
    assert report == _mine()


def test_the_servers_used_here_are_this_processs_own_or_the_callers() -> None:
    """A worker never uses a server another process started (the controller's, which
    it inherited the URLs of): each URL it uses is one it started itself, or one the
    caller named (not in DISTLOCKS_TEST_STARTED)."""
    started_here = set(filter(None, os.environ.get("DISTLOCKS_TEST_STARTED", "").split(",")))
    own = servers.started_servers()
    if servers.REDIS_URL_ENV in started_here:
        assert own is not None and own.redis is not None
        assert own.redis.url == _mine()["redis"]
    if servers.DATABASE_URL_ENV in started_here:
        assert own is not None and own.postgres is not None
        assert own.postgres.url == _mine()["database"]


def _spawned_report(queue: Any) -> None:
    from tests import settings as s

    queue.put((s.REDIS_URL, s.DATABASE_URL, s.REDLOCK_URLS))


def test_a_spawned_multiprocessing_child_reaches_this_processs_servers() -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_spawned_report, args=(queue,))
    child.start()
    try:
        got = queue.get(timeout=180)
    finally:
        child.join(60)
    mine = _mine()
    assert got == (mine["redis"], mine["database"], mine["redlock"])


def test_a_new_worker_keeps_what_the_caller_named_and_forgets_what_its_parent_made() -> None:
    """A process that finds itself a worker other than the one whose servers its
    environment names (as an xdist worker finds the controller's): the variables its
    parent set itself (here only the SQLite file, so that no server is started) are
    forgotten and made anew; those the caller named are kept as they are."""
    env = _env(
        PYTEST_XDIST_WORKER="gw-review5",
        DISTLOCKS_TEST_SERVERS_OF="",
        DISTLOCKS_TEST_STARTED="DISTLOCKS_TEST_SQLITE_PATH",
        DISTLOCKS_TEST_REDIS_URL=_mine()["redis"],
        DISTLOCKS_TEST_DATABASE_URL=_mine()["database"],
        DISTLOCKS_TEST_REDLOCK_URLS=",".join(_mine()["redlock"][1:]),
    )
    report = _child(env)
    assert report["redis"] == _mine()["redis"]
    assert report["database"] == _mine()["database"]
    assert report["redlock"] == _mine()["redlock"]
    assert report["sqlite"] != _mine()["sqlite"]
    assert report["started"] == "DISTLOCKS_TEST_SQLITE_PATH"
