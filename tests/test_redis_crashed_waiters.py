"""A waiter killed while it waits (SIGKILL: no leave, no cleanup) on the Redis backend:
the waiters behind it are not held up, and its registration leaves no key for ever,
even if no script ever runs on that name again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import redis

from distlocks import get_backend, lock
from distlocks.backends.base import Holder
from distlocks.backends.redis import RedisBackend
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent

WAITER = """
import os, sys
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
import django
django.setup()
from distlocks import lock
lock(sys.argv[1], backend="redis", fair=sys.argv[2] == "1", timeout=300, ttl=30).acquire()
print("acquired", flush=True)
"""


def start_waiter(name: str, fair: bool) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    return subprocess.Popen(
        [sys.executable, "-c", WAITER, name, "1" if fair else "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
    )


def kill_once_registered(backend: RedisBackend, client: redis.Redis, name: str, fair: bool) -> None:
    """Start a waiting process, wait until it is registered, then SIGKILL it."""
    keys = backend.all_keys(name)
    waiter = start_waiter(name, fair)
    try:
        wait_for(
            lambda: client.zcard(keys.waiters) == 1 and client.zcard(keys.queue) == int(fair),
            limit=120,
            what="the waiting process to register",
        )
    finally:
        waiter.send_signal(signal.SIGKILL)
        waiter.wait(60)
        assert waiter.stdout is not None
        waiter.stdout.close()
    assert waiter.returncode == -signal.SIGKILL


def registered_keys(client: redis.Redis, backend: RedisBackend, name: str) -> list[str]:
    keys = backend.all_keys(name)
    return [key for key in (keys.waiters, keys.queue) if client.exists(key)]


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "plain"])
def test_the_sets_of_a_killed_waiter_expire_with_nobody_touching_the_name(
    name: str, redis_client: redis.Redis, fair: bool
) -> None:
    backend = get_backend("redis")
    assert isinstance(backend, RedisBackend)
    # A holder whose lease just runs out: no release, so no script prunes the sets.
    # Its ttl outlasts the waiter's start (seconds on a loaded machine): a lock that lapsed
    # first would be taken by the waiter, which would then never register.
    assert backend.acquire(name, "holder", 120, Holder("h", 1, "t")).acquired
    kill_once_registered(backend, redis_client, name, fair)
    keys = registered_keys(redis_client, backend, name)
    assert len(keys) == 1 + int(fair)
    # Each set expires with its latest registration, about a second past one wait.
    limit = (backend.wait_chunk + 1.0) * 1000
    for key in keys:
        assert 0 < redis_client.pttl(key) <= limit, key
    wait_for(
        lambda: not registered_keys(redis_client, backend, name),
        limit=60,
        what="the killed waiter's sets to expire",
    )


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "plain"])
def test_a_killed_waiter_holds_up_nobody_behind_it(
    name: str, redis_client: redis.Redis, fair: bool
) -> None:
    backend = get_backend("redis")
    assert isinstance(backend, RedisBackend)
    holder = lock(name, backend="redis", ttl=60).acquire()
    kill_once_registered(backend, redis_client, name, fair)
    got: list[Any] = []

    def wait_behind() -> None:
        lease = lock(name, backend="redis", fair=fair, timeout=60, ttl=30).acquire()
        got.append(lease)
        lease.release()

    behind = threading.Thread(target=wait_behind)
    behind.start()
    keys = backend.all_keys(name)
    wait_for(
        lambda: redis_client.zcard(keys.waiters) == 2 or not behind.is_alive(),
        limit=60,
        what="the second waiter to register",
    )
    assert holder.release() is True
    behind.join(90)
    assert not behind.is_alive() and len(got) == 1, "the waiter behind never got the lock"
    wait_for(
        lambda: not registered_keys(redis_client, backend, name),
        limit=60,
        what="the sets to go",
    )
