"""tests.redis_clients: a test that drops its own connections to the shared Redis
leaves every other process's alone (the Celery workers, another fixture's clients)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import redis
from django.conf import settings

from tests.redis_clients import kill_own_connections

#: A client of another process: named, then idle until its stdin closes.
_OTHER = """
import socket, sys
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))
sock.sendall(b"CLIENT SETNAME other-process\\r\\n")
assert sock.recv(100).startswith(b"+OK"), "no answer"
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def other_process() -> Iterator[subprocess.Popen[str]]:
    parts = urlsplit(settings.REDIS_URL)
    proc = subprocess.Popen(
        [sys.executable, "-c", _OTHER, parts.hostname or "127.0.0.1", str(parts.port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(30)


def _names(admin: redis.Redis) -> list[str]:
    return [client["name"] for client in admin.client_list()]


def test_only_this_process_connections_are_closed(
    other_process: subprocess.Popen[str],
) -> None:
    admin = redis.Redis.from_url(settings.REDIS_URL)
    mine = redis.Redis.from_url(settings.REDIS_URL, retry_on_error=[])
    try:
        mine.client_setname("this-process")
        admin.client_setname("admin")
        assert {"this-process", "other-process", "admin"} <= set(_names(admin))
        assert kill_own_connections(admin) >= 1
        names = _names(admin)
        assert "this-process" not in names
        assert "other-process" in names
        assert "admin" in names
    finally:
        mine.close()
        admin.close()
