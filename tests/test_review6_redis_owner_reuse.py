"""A timed-out acquire's give-back must not release a later acquire by the same owner.

Owners are not always one per attempt: the Celery queue marker's owner is the task id,
so a retry of the task (same id, maybe on another worker) takes the marker again, and
the ACQUIRE script answers a second acquire by the owner that holds the lock as granted
("a retried request whose first reply was lost"). The give-back of an acquire that timed
out releases by owner: sent behind the acquire, and again on a new connection
(RedisCalls._acquire_error), it releases the lock that the later acquire was told it
holds. Fixed: a grant records its request's id, and a give-back takes back only its own
request's (tests/test_redis_giveback_scope.py explores the orders). Every path that
gives back: the sync acquire on a pinned connection and through the pool, the
wait-and-acquire pipeline, asyncio, and the semaphore's and read-write lock's permits.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from distlocks.backends.base import READ, SEMAPHORE, WRITE, Holder
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import LockBackendUnavailable
from tests.test_redis_giveback import HoldingProxy, _holds_acquire, _settle, proxy  # noqa: F401
from tests.test_redis_halfwritten import own_prefix

pytestmark = pytest.mark.django_db(transaction=False)

HOLDER = Holder(host="test", pid=1, thread="t", extra={})
PATHS = ["pinned", "pool", "wait", "asyncio", SEMAPHORE, READ, WRITE]


def _take(backend: RedisBackend, path: str, name: str, owner: str) -> bool:
    """Acquire ``name`` for ``owner`` the way ``path`` does."""
    if path in (SEMAPHORE, READ, WRITE):
        return backend.permit_acquire(path, name, owner, 60, HOLDER, limit=1).acquired
    if path == "asyncio":
        return asyncio.run(backend.aacquire(name, owner, 60, HOLDER)).acquired
    if path == "wait":
        found = backend.wait_and_acquire(name, owner, 60, HOLDER, 30, wait=30, fair=False)
        assert found is not None
        return found.acquired
    return backend.acquire(name, owner, 60, HOLDER).acquired


def _held_give_back(proxy: HoldingProxy, name: str) -> bool:  # noqa: F811
    """The give-back (it names the release tombstone) is held behind the acquire."""
    link = proxy.held_link()
    return link is not None and any(
        name.encode() in chunk and b"released:" in chunk for chunk in link.held or ()
    )


def _holders(backend: RedisBackend, path: str, name: str) -> set[str]:
    if path in (SEMAPHORE, READ, WRITE):
        return {info.owner for info in backend.permit_holders(path, name)}
    info = backend.inspect(name)
    return set() if info is None else {info.owner}


def _release(backend: RedisBackend, path: str, name: str, owner: str) -> None:
    if path in (SEMAPHORE, READ, WRITE):
        backend.permit_release(path, name, owner)
    else:
        backend.release(name, owner)


@pytest.mark.parametrize("path", PATHS)
def test_a_give_back_leaves_a_later_acquire_of_the_same_owner(
    settings: Any,
    proxy: HoldingProxy,  # noqa: F811
    name: str,
    path: str,
) -> None:
    with own_prefix(settings, "reuse", proxy.url(), socket_timeout=0.5) as slow:
        direct = type(slow)(slow.alias, {"LOCATION": settings.REDIS_URL,
                                         "OPTIONS": {"key_prefix": slow.key_prefix}})  # fmt: skip
        if path == "pool":
            slow.MAX_PINNED = 0  # type: ignore[misc]
        warm = "pinned" if path in ("pool", "wait") else path
        try:
            # The scripts loaded, the connection made: the held request is the acquire.
            assert _take(slow, warm, f"{name}:warm", "warm")
            hold: Callable[[bytes], bool] = _holds_acquire(name)
            if path == "wait":
                # A holder the waiter waits for; it lets go before the wait reaches
                # the server, so the late attempt would grant.
                assert _take(direct, "pinned", name, "other")
                hold = _holds_acquire(name, "BLPOP")
            proxy.hold(hold)
            with pytest.raises(LockBackendUnavailable):
                _take(slow, path, name, "task-1")
            if path == "wait":
                direct.release(name, "other")
            # The task retried (same owner), on a connection nothing holds up.
            assert _take(direct, path if path != "wait" else "pinned", name, "task-1")
            link = proxy.held_link()
            assert link is not None
            proxy.let_go()
            # The connection ends once the late acquire and the give-back behind it
            # have run (the server runs a connection's commands in order).
            _settle(lambda: link.server_done, "the late acquire and its give-back run")
            assert _holders(direct, path, name) == {"task-1"}, "the retry's lock was released"
        finally:
            _release(direct, path, name, "task-1")
            direct.close()


def test_redlock_a_late_attempt_of_another_process_leaves_the_newer_grant(
    settings: Any, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redlock orders the attempts of one process by their ids; an owner reused by
    another process (a task retried on another worker) numbers its attempts from its
    own counter. A failed attempt's request held up on one master reaches it after the
    other process's grant there, with a larger id: it took the entry over, and its
    give-back behind it then freed that master's part of the other process's lease."""
    from django.test import override_settings

    from distlocks import get_backend
    from distlocks.backends.redis import lock as single
    from distlocks.backends.redlock import attempts

    port = int(settings.REDLOCK_URLS[0].rsplit(":", 1)[1].split("/")[0])
    relay = HoldingProxy(port)
    alias = f"reuse-{uuid.uuid4().hex[:8]}"
    options = {"socket_timeout": 0.5, "key_prefix": alias}
    slow_config = {
        "BACKEND": "distlocks.backends.redlock.RedlockBackend",
        "LOCATION": [relay.url(), *settings.REDLOCK_URLS[1:]],
        "OPTIONS": options,
    }
    direct_config = {**slow_config, "LOCATION": settings.REDLOCK_URLS}
    backends = {**settings.DISTLOCKS_BACKENDS, alias: slow_config, f"{alias}-d": direct_config}
    try:
        with override_settings(DISTLOCKS_BACKENDS=backends):
            slow, direct = get_backend(alias), get_backend(f"{alias}-d")
            masters = direct.masters  # type: ignore[attr-defined]
            assert slow.acquire(f"{name}:warm", "warm", 5, HOLDER).acquired
            # Held elsewhere on the two other masters: the attempt fails without master 0.
            for master in masters[1:]:
                assert master.acquire(name, "other", 60, HOLDER).acquired
            relay.hold(_holds_acquire(name))
            assert not slow.acquire(name, "task-1", 60, HOLDER).acquired
            # Master 0's request timed out: its give-back is held behind it.
            _settle(lambda: _held_give_back(relay, name), "the give-back sent behind")
            for master in masters[1:]:
                assert master.release(name, "other")
            # The task retried in another process: its own process id, its own count.
            monkeypatch.setattr(single, "_process_id", [uuid.uuid4().hex[:16]])
            monkeypatch.setattr(attempts, "_attempt_ids", itertools.count(1))
            assert direct.acquire(name, "task-1", 60, HOLDER).acquired
            link = relay.held_link()
            assert link is not None
            relay.let_go()
            _settle(lambda: link.server_done, "the late acquire and its give-back run")
            info = masters[0].inspect(name)
            assert info is not None and info.owner == "task-1", "the newer grant was freed"
            direct.release(name, "task-1")
            slow.close()
            direct.close()
    finally:
        relay.close()
