"""The server's work for one uncontended Redis lock cycle (acquire plus release, the
listing index on), counted in the commands its two scripts run: INFO commandstats on a
server of this module's own, so no other test's calls are counted. Counted, not timed:
the budget guards against a change that puts more work in every cycle (issue 29: an
expiry sorted set and a per-release write took the cycle from 0.99x to 1.13x the floor).

Each grant runs TIME, HGET, ZREM (waiters), GET and SET ... PX (fence), HSET and PEXPIRE
(lock) and HSET (index); about one in INDEX_SWEEP_EVERY (its token a multiple of it) also
GET, HSCAN and SET (the sweep, and HDEL when it finds expired entries). Each release runs
TIME, HGET, DEL, SET ... PX (tombstone), GET and PEXPIRE (fence), HDEL (index) and EXISTS
(waiters).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest
import redis

from distlocks.backends.base import Holder
from distlocks.backends.redis import RedisBackend
from distlocks.backends.redis.scripts import INDEX_SWEEP_EVERY
from distlocks.testing.servers import RedisServer

HOLDER = Holder("host", 1, "thread")
CYCLES = 100 * INDEX_SWEEP_EVERY
#: Commands per cycle: 8 per grant and 3 more for about one grant in INDEX_SWEEP_EVERY
#: (twice that many here: which grants sweep follows the clock), 8 per release.
BUDGET = 8 + 2 * 3 / INDEX_SWEEP_EVERY + 8
#: Sorted-set commands per cycle: the grant's ZREM of the caller from the waiters only.
SORTED_SET_COMMANDS = 1


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-cycle-work")).start()
    yield server
    server.stop()


def _commands(client: redis.Redis) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT, without the test's own."""
    stats = client.info("commandstats")
    own = {"info", "config|resetstat", "config", "evalsha"}
    return {
        key.removeprefix("cmdstat_"): int(value["calls"])
        for key, value in stats.items()
        if key.removeprefix("cmdstat_") not in own
    }


@pytest.mark.parametrize("names", ["one name", "a name per cycle"])
def test_a_lock_cycle_runs_within_its_command_budget(server: RedisServer, names: str) -> None:
    backend = RedisBackend("work", {"LOCATION": server.url, "OPTIONS": {"key_prefix": "work"}})
    try:
        assert backend.listing_index
        client = backend.client
        owner = uuid.uuid4().hex
        assert backend.acquire("warm", owner, 30, HOLDER).acquired  # loads the scripts
        assert backend.release("warm", owner)
        client.config_resetstat()
        for i in range(CYCLES):
            name = "cycle" if names == "one name" else f"cycle:{i}"
            owner = uuid.uuid4().hex
            assert backend.acquire(name, owner, 30, HOLDER).acquired
            assert backend.release(name, owner)
        calls = _commands(client)
        per_cycle = sum(calls.values()) / CYCLES
        assert per_cycle <= BUDGET, f"{per_cycle:.2f} commands per cycle: {calls}"
        sorted_sets = sum(n for command, n in calls.items() if command.startswith("z"))
        assert sorted_sets / CYCLES <= SORTED_SET_COMMANDS, calls
    finally:
        backend.close()


def test_a_lock_cycle_makes_no_getpid_system_call(server: RedisServer) -> None:
    """The pinned connection is checked against distlocks.process.pid (renewed in a forked
    child), not os.getpid(): a system call per script run before."""
    backend = RedisBackend("pid", {"LOCATION": server.url, "OPTIONS": {"key_prefix": "pid"}})
    calls: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and getattr(arg, "__name__", "") == "getpid":
            calls.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")

    try:
        owner = uuid.uuid4().hex
        assert backend.acquire("warm", owner, 30, HOLDER).acquired  # connects, pins
        assert backend.release("warm", owner)
        sys.setprofile(profile)
        try:
            for _ in range(10):
                owner = uuid.uuid4().hex
                assert backend.acquire("cycle", owner, 30, HOLDER).acquired
                assert backend.extend("cycle", owner, 30)
                assert backend.release("cycle", owner)
        finally:
            sys.setprofile(None)
        assert calls == []
    finally:
        backend.close()
