"""Requests of the Redis backend whose reply was lost: the server ran them, the
connection broke before the answer came back, and the client sent them again.

The loss is real: a proxy between the backend and the test server (see
:mod:`tests.lost_reply_proxy`) forwards the request, swallows the server's reply and
resets the connection; redis-py reconnects and sends the same request once more.
Every lock operation must give the answer the first run would have given.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.conf import settings as django_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlocks import lock
from distlocks.backends.base import READ, SEMAPHORE, WRITE, Holder, permit_family
from distlocks.backends.redis import RedisBackend
from distlocks.backends.redis.permits import _SCRIPTS as _PERMIT_SCRIPTS
from tests.lost_reply_proxy import LostReplyProxy
from tests.waiting import wait_for

HOLDER = Holder("host", 1, "thread")


@pytest.fixture(scope="module")
def proxy(lost_reply_proxy: LostReplyProxy) -> LostReplyProxy:
    """The session's lost-reply proxy (tests/conftest.py)."""
    return lost_reply_proxy


@pytest.fixture(scope="module")
def backends(proxy: LostReplyProxy) -> Iterator[tuple[RedisBackend, RedisBackend]]:
    """The same prefix through the proxy (lossy) and straight to the server (direct)."""
    db = urlsplit(django_settings.REDIS_URL).path.strip("/") or "0"
    prefix = f"lost-{uuid.uuid4().hex[:8]}"
    options = {"key_prefix": prefix}
    lossy = RedisBackend("lossy", {"LOCATION": proxy.url(int(db)), "OPTIONS": options})
    direct = RedisBackend("direct", {"LOCATION": django_settings.REDIS_URL, "OPTIONS": options})
    load_scripts(direct)
    yield lossy, direct
    keys = list(direct.client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        direct.client.delete(*keys)
    lossy.close()
    direct.close()


def load_scripts(backend: RedisBackend) -> None:
    """Every script in the server's cache: the request whose reply is lost is then the
    script's run, not one answered NOSCRIPT."""
    for registered in backend._scripts.values():
        backend.client.script_load(registered.script)


def sha(backend: RedisBackend, script: str) -> bytes:
    return str(backend._scripts[script].sha).encode()


def lost(
    backend: RedisBackend,
    proxy: LostReplyProxy,
    needle: bytes,
    call: Callable[[], Any],
    before_reset: Callable[[], None] | None = None,
) -> Any:
    """``call()`` with the reply to its request containing ``needle`` lost once."""
    load_scripts(backend)
    before = proxy.lost
    proxy.lose_reply_to(needle, before_reset)
    result = call()
    assert proxy.lost == before + 1, "the proxy lost no reply: the fault did not bite"
    return result


def test_a_release_whose_reply_was_lost_reports_the_release(
    proxy: LostReplyProxy, backends: tuple[RedisBackend, RedisBackend], name: str
) -> None:
    lossy, direct = backends
    assert lossy.acquire(name, "A", 30, HOLDER).acquired
    assert lost(lossy, proxy, sha(lossy, "release"), lambda: lossy.release(name, "A")) is True
    assert direct.inspect(name) is None


def test_an_async_release_whose_reply_was_lost_reports_the_release(
    proxy: LostReplyProxy, backends: tuple[RedisBackend, RedisBackend], name: str
) -> None:
    lossy, direct = backends

    async def main() -> bool:
        assert (await lossy.aacquire(name, "A", 30, HOLDER)).acquired
        load_scripts(direct)
        proxy.lose_reply_to(sha(lossy, "release"))
        return await lossy.arelease(name, "A")

    before = proxy.lost
    assert asyncio.run(main()) is True
    assert proxy.lost == before + 1
    assert direct.inspect(name) is None


def test_a_lost_release_reply_and_a_new_holder_before_the_retry(
    proxy: LostReplyProxy, backends: tuple[RedisBackend, RedisBackend], name: str
) -> None:
    """Someone else takes the lock between the release and its retry: the retry still
    knows that the release was its own, and leaves the new holder alone."""
    lossy, direct = backends
    assert lossy.acquire(name, "A", 30, HOLDER).acquired

    def take() -> None:
        assert direct.acquire(name, "B", 30, HOLDER).acquired

    assert lost(lossy, proxy, sha(lossy, "release"), lambda: lossy.release(name, "A"), take) is True
    info = direct.inspect(name)
    assert info is not None and info.owner == "B"
    assert direct.release(name, "B") is True


def test_a_lock_released_with_its_reply_lost_raises_no_lock_lost(
    proxy: LostReplyProxy, backends: tuple[RedisBackend, RedisBackend], name: str, settings: Any
) -> None:
    lossy, direct = backends
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "lossy": {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": proxy.url(int(urlsplit(django_settings.REDIS_URL).path.strip("/") or 0)),
            "OPTIONS": {"key_prefix": lossy.key_prefix},
        },
    }
    held = lock(name, backend="lossy", ttl=30)
    lease = held.acquire()
    proxy.lose_reply_to(sha(lossy, "release"))
    before = proxy.lost
    assert lease.release() is True
    assert proxy.lost == before + 1
    assert lease.state == "released"
    assert direct.inspect(name) is None


def test_a_lost_lease_of_an_owner_that_released_before_is_still_lost(
    backends: tuple[RedisBackend, RedisBackend], name: str
) -> None:
    """A Lock keeps its owner id across acquisitions: the tombstone of its earlier
    release must not answer for a later lease that was taken from it."""
    _, direct = backends
    assert direct.acquire(name, "A", 30, HOLDER).acquired
    assert direct.release(name, "A") is True
    assert direct.acquire(name, "A", 30, HOLDER).acquired
    assert direct.force_release(name) is True  # evicted
    assert direct.acquire(name, "B", 30, HOLDER).acquired
    assert direct.release(name, "A") is False
    assert direct.release(name, "B") is True


def test_a_release_of_an_expired_lease_is_still_refused(
    backends: tuple[RedisBackend, RedisBackend], name: str
) -> None:
    _, direct = backends
    assert direct.acquire(name, "A", 0.05, HOLDER).acquired
    wait_for(lambda: direct.inspect(name) is None, what="the lease to expire")
    assert direct.release(name, "A") is False


@pytest.mark.parametrize("script", ["extend", "keep"])
def test_an_extend_whose_reply_was_lost_is_idempotent(
    proxy: LostReplyProxy, backends: tuple[RedisBackend, RedisBackend], name: str, script: str
) -> None:
    lossy, direct = backends
    assert lossy.acquire(name, "A", 30, HOLDER).acquired
    call = getattr(lossy, script)
    assert lost(lossy, proxy, sha(lossy, script), lambda: call(name, "A", 60)) is True
    assert 30_000 < direct.client.pttl(direct.all_keys(name).lock) <= 60_000
    assert direct.release(name, "A") is True


def test_an_acquire_whose_reply_was_lost_gets_the_lease_it_was_granted(
    proxy: LostReplyProxy, backends: tuple[RedisBackend, RedisBackend], name: str
) -> None:
    lossy, direct = backends
    result = lost(lossy, proxy, sha(lossy, "acquire"), lambda: lossy.acquire(name, "A", 30, HOLDER))
    info = direct.inspect(name)
    assert result.acquired and info is not None
    assert (info.owner, info.fencing_token) == ("A", result.fencing_token)
    assert direct.fencing_counter(name) == result.fencing_token  # granted once
    assert lossy.release(name, "A") is True


# A sequence of calls of two owners on one name, run twice: straight to the server, and
# through the proxy with the reply to one of them lost. The answers must be the same.
CALLS = st.lists(
    st.tuples(st.sampled_from(["acquire", "release", "extend", "keep"]), st.sampled_from("AB")),
    min_size=1,
    max_size=8,
)


def run(backend: RedisBackend, name: str, call: str, owner: str) -> bool:
    if call == "acquire":
        return backend.acquire(name, owner, 30, HOLDER).acquired
    if call == "release":
        return backend.release(name, owner)
    return bool(getattr(backend, call)(name, owner, 30))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(calls=CALLS, data=st.data())
def test_every_call_answers_the_same_after_a_lost_reply(
    proxy: LostReplyProxy, backends: tuple[RedisBackend, RedisBackend], calls: Any, data: Any
) -> None:
    lossy, direct = backends
    load_scripts(direct)
    at = data.draw(st.integers(0, len(calls) - 1), label="lost reply at")
    clean, faulty = f"clean:{uuid.uuid4().hex}", f"faulty:{uuid.uuid4().hex}"
    expected = [run(direct, clean, call, owner) for call, owner in calls]
    got = []
    for index, (call, owner) in enumerate(calls):
        if index == at:
            got.append(
                lost(lossy, proxy, b"EVALSHA", functools.partial(run, lossy, faulty, call, owner))
            )
        else:
            got.append(run(lossy, faulty, call, owner))
    assert got == expected
    holders = [direct.inspect(n) for n in (clean, faulty)]
    assert [h.owner if h else None for h in holders] == [holders[0] and holders[0].owner] * 2
    for n in (clean, faulty):
        for owner in "AB":
            direct.release(n, owner)


@pytest.mark.parametrize("kind", [SEMAPHORE, READ, WRITE])
def test_a_permit_release_whose_reply_was_lost_reports_the_release(
    proxy: LostReplyProxy, backends: tuple[RedisBackend, RedisBackend], name: str, kind: str
) -> None:
    lossy, direct = backends
    script = _PERMIT_SCRIPTS[permit_family(kind), "release"]
    direct.client.script_load(script.lua)
    assert lossy.permit_acquire(kind, name, "A", 30, HOLDER).acquired
    release = functools.partial(lossy.permit_release, kind, name, "A")
    assert lost(lossy, proxy, script.sha.encode(), release) is True
    assert direct.permit_holders(kind, name) == []
    # A second release, on purpose this time, is told the permit is not held.
    assert direct.permit_release(kind, name, "A") is False
