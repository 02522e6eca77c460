"""A backend whose driver is not installed says which extra to install, whatever the
import path that met the missing module first (a fresh interpreter per case, the
driver made unimportable in it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CASES = [
    ("distlocks.backends.redis.RedisBackend", {"LOCATION": "redis://127.0.0.1:9/0"}, "redis",
     ("redis", "hiredis", "django_redis"), "redis"),
    ("distlocks.backends.redlock.RedlockBackend",
     {"LOCATION": [f"redis://127.0.0.1:{p}/0" for p in (7, 8, 9)]}, "redis",
     ("redis", "hiredis", "django_redis"), "redis"),
    ("distlocks.backends.postgres.PostgresBackend", {"DATABASE": "default"}, "postgres",
     ("psycopg", "psycopg_binary", "psycopg_pool"), "psycopg"),
    ("distlocks.backends.zookeeper.ZooKeeperBackend", {"LOCATION": "127.0.0.1:9"}, "zookeeper",
     ("kazoo",), "kazoo"),
]  # fmt: skip

SCRIPT = """
import sys
for module in {blocked!r}:
    sys.modules[module] = None
import django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["distlocks"],
    DATABASES={{"default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}}},
    DISTLOCKS_BACKENDS={{"default": {{"BACKEND": {path!r}, **{config!r}}}}},
)
django.setup()
from distlocks import lock
try:
    lock("x", ttl=5, timeout=0).acquire()
except Exception as exc:
    print(type(exc).__name__, exc)
else:
    print("no error")
"""


@pytest.mark.parametrize(
    ("path", "config", "extra", "blocked", "driver"),
    CASES,
    ids=[c[0].split(".")[-1] for c in CASES],
)
def test_a_missing_driver_names_its_extra(
    path: str, config: dict[str, object], extra: str, blocked: tuple[str, ...], driver: str
) -> None:
    code = textwrap.dedent(SCRIPT).format(blocked=blocked, path=path, config=config)
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    out = result.stdout + result.stderr
    assert out.startswith("ImproperlyConfigured"), out
    assert f"pip install 'distlocks[{extra}]'" in out, out
