"""Expected failures are logged as one line at WARNING, the traceback at DEBUG.

Leaving a wait queue while Redis is down, or a clean-up release that cannot reach
it, is an expected condition: its WARNING record says what failed and why on one
line (no chained traceback of 25 to 110 lines per call), and the traceback is still
there for whoever turns on DEBUG.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from distlocks import get_backend
from distlocks.exceptions import LockBackendUnavailable, LockNotAcquired
from distlocks.locks import aacquire_lease, acquire_lease
from distlocks.testing.servers import RedisServer


@pytest.fixture
def down_alias(own_redis: RedisServer, settings: Any) -> str:
    """A Redis alias whose server has just stopped."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "down": {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": own_redis.url,
            "OPTIONS": {"socket_timeout": 2, "socket_connect_timeout": 2},
        },
    }
    assert get_backend("down").acquire("warm", "me", 60, _holder()).acquired
    own_redis.stop()
    return "down"


def _holder() -> Any:
    from distlocks.backends.base import Holder

    return Holder(host="h", pid=1, thread="t", extra={})


def _check_one_line(caplog: pytest.LogCaptureFixture, what: str) -> None:
    """Exactly one WARNING record from distlocks about ``what``, on one line with its
    cause and no traceback; the traceback in a DEBUG record right with it."""
    records = [r for r in caplog.records if r.name.startswith("distlocks")]
    # A request sent on a pooled connection the stopped server had closed may have run
    # (the client cannot tell): its give-back, tried in the background on a new
    # connection, is a clean-up step of its own with a line of its own, held to the
    # same rule: one line, its cause, no traceback.
    gave_back = [r for r in records if r.levelno >= logging.WARNING
                 and "Could not give back after a broken connection" in r.getMessage()]  # fmt: skip
    for record in gave_back:
        assert "\n" not in record.getMessage() and not record.exc_info, record.getMessage()
    warnings = [r for r in records if r.levelno >= logging.WARNING and r not in gave_back]
    assert [r.getMessage() for r in warnings if what in r.getMessage()] == [
        r.getMessage() for r in warnings
    ], "only the expected warning"
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    (warning,) = warnings
    message = warning.getMessage()
    assert what in message
    assert "\n" not in message and not warning.exc_info and not warning.stack_info
    assert "LockBackendUnavailable" in message and "Connection" in message, message
    # The record as a handler formats it: one line.
    assert "\n" not in logging.Formatter().format(warning)
    debug = [r for r in records if r.levelno == logging.DEBUG and r.exc_info]
    assert debug, "the traceback is logged at DEBUG"
    assert isinstance(debug[-1].exc_info[1], LockBackendUnavailable)


def test_leaving_the_wait_queue_while_redis_is_down(
    down_alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="distlocks")
    with pytest.raises(LockBackendUnavailable):
        acquire_lease(get_backend(down_alias), "q", ttl=30, timeout=5, fair=True)
    _check_one_line(caplog, "Could not leave the wait queue of 'q'")


def test_leaving_the_wait_queue_while_redis_is_down_async(
    down_alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="distlocks")
    backend = get_backend(down_alias)

    async def main() -> None:
        with pytest.raises(LockBackendUnavailable):
            await aacquire_lease(backend, "q", ttl=30, timeout=5, fair=True)

    asyncio.run(main())
    _check_one_line(caplog, "Could not leave the wait queue of 'q'")


def test_a_quiet_release_while_redis_is_down(
    down_alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="distlocks")
    assert get_backend(down_alias).release_quietly("warm", "me") is False
    _check_one_line(caplog, "Could not release lock 'warm'")


def test_locmem_waits_log_nothing_at_warning(caplog: pytest.LogCaptureFixture) -> None:
    """LocMem's expected conditions (a wait that times out, a fair waiter leaving its
    queue) raise or return; nothing is logged at WARNING."""
    from distlocks.backends.locmem import LocMemBackend

    caplog.set_level(logging.DEBUG, logger="distlocks")
    backend = LocMemBackend("quiet", {"LOCATION": "quiet-logs"})
    assert backend.acquire("x", "h", 60, _holder()).acquired
    with pytest.raises(LockNotAcquired):
        acquire_lease(backend, "x", ttl=30, timeout=0.05, fair=True)
    assert backend.release_quietly("x", "not-the-owner") is False
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_permit_given_back_in_the_background_while_redis_is_down(
    down_alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    """After a permit request whose answer timed out, the permit is given back in the
    background; with the server down that fails, on one line."""
    from distlocks.backends.base import SEMAPHORE

    caplog.set_level(logging.DEBUG, logger="distlocks")
    backend = get_backend(down_alias)
    undo = backend._permit_acquire_call(SEMAPHORE, "sem", "me", 60, _holder(), 1, 0.0)[3]
    backend._give_back_now(undo, "after a reply that did not come")  # what the thread runs
    _check_one_line(caplog, "Could not give back after a reply that did not come (key '")


def test_a_quiet_permit_release_while_redis_is_down(
    down_alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    from distlocks.backends.base import SEMAPHORE
    from distlocks.primitives import PermitServer

    caplog.set_level(logging.DEBUG, logger="distlocks")
    server = PermitServer(get_backend(down_alias), SEMAPHORE, limit=2)
    assert server.release_quietly("sem", "me") is False
    _check_one_line(caplog, "Could not give back a semaphore permit of 'sem' on backend 'down'")
    caplog.clear()
    assert asyncio.run(server.arelease_quietly("sem", "me")) is False
    _check_one_line(caplog, "Could not give back a semaphore permit of 'sem' on backend 'down'")


def test_giving_back_what_a_cancelled_acquisition_took_while_redis_is_down(
    down_alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A cancelled acquisition's lock is given back after its thread ends; with the
    server down that fails, on one line (the lock lapses with its ttl)."""
    caplog.set_level(logging.DEBUG, logger="distlocks")
    backend = get_backend(down_alias)

    def give_back(result: Any) -> None:
        backend.release("warm", "me")

    backend._give_back_quietly(give_back, None)
    _check_one_line(caplog, "Could not give back what a cancelled acquisition took")
