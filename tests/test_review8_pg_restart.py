"""Review 8 of the PostgreSQL backend: one backend (one pool) kept across a crash or a
restart of its server. The crash tests (test_postgres_token_crash.py) make a new
backend after each crash; here the same pool holds a lease and idle connections
when the server goes down, and must, once it is back:

- report the held lease lost (its confirm is False, its release is False), never held;
- replace the dead idle connections before use, and lock the same name again with a
  token above every earlier one (synchronous_commit off and on);
- fail with LockBackendUnavailable, not hang, while the server is down.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import pytest
from django.db import connections

from distlocks.backends.base import Holder
from distlocks.backends.postgres import PostgresBackend
from distlocks.exceptions import LockBackendUnavailable
from distlocks.testing.servers import PostgresServer
from tests.test_postgres_durable import (  # noqa: F401 - the fixtures
    ALIAS,
    durable,
    durable_template,
)
from tests.test_postgres_token_crash import _restart

HOLDER = Holder(host="test", pid=1, thread="main")


def bounded(call: Any) -> Any:
    """``call()``'s result or exception, failing the test if it hangs."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(90)
    assert not thread.is_alive(), "a call hung on a pool whose server went away"
    return box[0]


@pytest.mark.parametrize("synchronous_commit", ["off", "on"])
@pytest.mark.parametrize("how", ["crash", "restart"])
def test_one_pool_across_a_crash_or_restart_of_its_server(
    durable: PostgresServer,  # noqa: F811 - the fixture
    django_db_blocker: Any,
    synchronous_commit: str,
    how: str,
) -> None:
    name = f"review8:{how}:{synchronous_commit}"
    with django_db_blocker.unblock():
        backend = PostgresBackend(
            "pg_review8",
            {
                "DATABASE": ALIAS,
                "OPTIONS": {
                    "synchronous_commit": synchronous_commit,
                    "socket_timeout": 2,
                    "connect_timeout": 2,
                    "pool_timeout": 2,
                },
            },
        )
        try:
            tokens = []
            for i in range(3):  # idle connections in the pool
                result = backend.acquire(f"{name}:{i}", f"idle-{i}", 30.0, HOLDER)
                assert result.acquired
                tokens.append(result.fencing_token)
            for i in range(3):
                assert backend.release(f"{name}:{i}", f"idle-{i}")
            held = backend.acquire(name, "holder", 30.0, HOLDER)
            assert held.acquired
            assert len(backend.pool._idle) >= 2
            if how == "restart":
                _restart(durable)
            else:
                assert durable.process is not None
                durable.process.send_signal(signal.SIGQUIT)
                durable.process.wait(30)
                # Down: a lock fails quickly as an outage, never hangs.
                down = bounded(lambda: backend.acquire(f"{name}:down", "down", 30.0, HOLDER))
                assert isinstance(down, LockBackendUnavailable), repr(down)
                durable.start(port=durable.port)
                connections[ALIAS].close()  # Django's connection died with it
            # The held lease's session ended with the server: never reported held.
            assert bounded(lambda: backend.extend(name, "holder", 30.0)) is False
            assert bounded(lambda: backend.release(name, "holder")) is False
            again = bounded(lambda: backend.acquire(name, "again", 30.0, HOLDER))
            assert not isinstance(again, BaseException), repr(again)
            assert again.acquired
            assert again.fencing_token > max([*tokens, held.fencing_token])
            assert backend.release(name, "again")
            for i in range(3):
                result = bounded(lambda i=i: backend.acquire(f"{name}:{i}", f"n-{i}", 30.0, HOLDER))
                assert not isinstance(result, BaseException), repr(result)
                assert result.acquired and result.fencing_token > tokens[i]
                assert backend.release(f"{name}:{i}", f"n-{i}")
        finally:
            backend.close()
