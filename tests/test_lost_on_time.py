"""A lost lease is reported at its deadline even while the renewal that would find
out is stuck inside the backend call.

Each test puts the holder's connection behind the fault proxy of the fault suite and
stalls it (a blackhole: no answer, no reset) or delays it far past the lease, with a
socket timeout of a minute: the stuck call would return only then. ``on_lost`` must
run within the lease's ttl plus a generous slack of the moment the stall began (the
lease's deadline is at most one ttl after it), never at the end of the stuck call.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from distlocks import alock, get_backend, lock
from distlocks.backends.postgres import PostgresBackend
from distlocks.exceptions import LockBackendUnavailable, LockLost, LockNotAcquired
from distlocks.signals import lock_lost
from tests.faults.helpers import session_redis_port
from tests.faults.proxy import FaultProxy
from tests.waiting import wait_for

TTL = 1.0
#: The stuck call's own limit: far beyond the deadline.
STUCK = 60.0
#: Generous: the machine may be loaded. A notice that waits for the stuck call to end
#: comes STUCK seconds late, far outside this.
SLACK = 6.0


@dataclass
class Losses:
    """What ``on_lost`` and the ``lock_lost`` signal saw: (monotonic time, reason)."""

    calls: list[tuple[float, str]] = field(default_factory=list)
    signals: list[Any] = field(default_factory=list)

    def __call__(self, lease: Any) -> None:
        self.calls.append((time.monotonic(), lease.lost_reason))


@pytest.fixture
def losses() -> Iterator[Callable[[], Losses]]:
    made: list[tuple[Losses, Callable[..., None]]] = []

    def make() -> Losses:
        found = Losses()

        def receiver(sender: Any, lease: Any, reason: str, **kwargs: Any) -> None:
            if lease.on_lost is found:  # this test's lease, not another one's
                found.signals.append(lease)

        lock_lost.connect(receiver, weak=False)
        made.append((found, receiver))
        return found

    yield make
    for _, receiver in made:
        lock_lost.disconnect(receiver)


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    started = FaultProxy(session_redis_port()).start()
    yield started
    started.close()


@pytest.fixture
def stuck_redis(proxy: FaultProxy) -> Iterator[str]:
    """An alias whose connections go through the proxy, with a one-minute socket
    timeout (a stalled call stays stuck that long)."""
    config = {
        **settings.DISTLOCKS_BACKENDS,
        "stuckredis": {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": proxy.url(),
            "OPTIONS": {"socket_timeout": STUCK},
        },
    }
    with override_settings(DISTLOCKS_BACKENDS=config):
        yield "stuckredis"
        proxy.heal()  # unstick what is still waiting, before the backends close
        proxy.reset()


@pytest.fixture
def pg_proxy() -> Iterator[FaultProxy]:
    started = FaultProxy(int(connection.settings_dict["PORT"])).start()
    yield started
    started.close()


@pytest.fixture
def stuck_pg(pg_proxy: FaultProxy, pg_ready: None) -> Iterator[str]:
    """A PostgreSQL alias whose lock connections go through the proxy (socket timeout
    of a minute)."""
    config = {
        **settings.DISTLOCKS_BACKENDS,
        "stuckpg": {
            "BACKEND": "distlocks.backends.postgres.PostgresBackend",
            "OPTIONS": {"socket_timeout": STUCK},
        },
    }
    with override_settings(DISTLOCKS_BACKENDS=config):
        backend = get_backend("stuckpg")
        assert isinstance(backend, PostgresBackend)
        params = {**backend._connect_kwargs(), "host": "127.0.0.1", "port": pg_proxy.port}
        backend._connect_kwargs = lambda: params  # type: ignore[method-assign]
        yield "stuckpg"
        pg_proxy.heal()
        pg_proxy.reset()


def _warm(lease: Any) -> None:
    """Wait for a first renewal: the renewal's connection is then open and its script
    loaded, so the stall hits a renewal, not a connection's set-up."""
    wait_for(lambda: lease.renewals >= 1, 30, "a first renewal")


def _free(name: str, alias: str) -> bool:
    try:
        with lock(name, backend=alias, timeout=0):
            return True
    except LockNotAcquired:
        return False


# -- Redis, threads ------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_stalled_redis_renewal_reports_the_loss_at_the_deadline(
    stuck_redis: str, proxy: FaultProxy, name: str, losses: Callable[[], Losses]
) -> None:
    """Two leases on the stalled alias and one on another alias: both stalled ones are
    reported lost at their deadlines although their renewal is stuck for a minute, the
    one that was waiting behind the stuck call too; the other backend's lease is kept."""
    first, second, other = losses(), losses(), losses()
    a = lock(f"{name}:a", backend=stuck_redis, ttl=TTL, on_lost=first).acquire()
    b = lock(f"{name}:b", backend=stuck_redis, ttl=TTL * 3, on_lost=second).acquire()
    c = lock(f"{name}:c", backend="redis", ttl=TTL, on_lost=other).acquire()
    try:
        _warm(a)
        _warm(b)
        proxy.blackhole()
        cut = time.monotonic()
        wait_for(lambda: first.calls and second.calls, TTL * 3 + SLACK, "both losses")
        assert first.calls[0][0] - cut <= TTL + SLACK
        assert second.calls[0][0] - cut <= TTL * 3 + SLACK
        for seen in (first, second):
            assert len(seen.calls) == 1
            assert "no answer" in seen.calls[0][1], seen.calls[0][1]
        assert not a.held() and not b.held()
        assert a.state == b.state == "lost"
        assert proxy.stats["swallowed"] > 0  # the renewal was sent, and is still stuck
        # The other backend's renewer was never held up.
        renewed = c.renewals
        wait_for(lambda: c.renewals > renewed, 30, "a renewal of the other lease")
        assert c.held() and not other.calls
    finally:
        proxy.heal()
        proxy.reset()
        c.release()
    assert len(first.calls) == len(second.calls) == 1
    assert len(first.signals) == len(second.signals) == 1


@pytest.mark.django_db(transaction=True)
def test_a_late_answer_after_the_deadline_does_not_report_twice(
    stuck_redis: str, proxy: FaultProxy, name: str, losses: Callable[[], Losses]
) -> None:
    """Latency far past the ttl: the renewal's answer (the lock already expired) comes
    long after the deadline, which reported the loss; the answer adds nothing."""
    seen = losses()
    lease = lock(name, backend=stuck_redis, ttl=TTL, on_lost=seen).acquire()
    _warm(lease)
    # Each way: the answer comes 10 s after its request, past TTL + SLACK.
    proxy.set_latency(5 * TTL)
    cut = time.monotonic()
    wait_for(lambda: seen.calls, TTL + SLACK, "the loss at the deadline")
    assert seen.calls[0][0] - cut <= TTL + SLACK
    proxy.set_latency(0)
    # The renewal's own answer arrives (False or an error), and changes nothing.
    answered = proxy.stats["down_out"]
    wait_for(lambda: proxy.stats["down_out"] > answered, 10 * TTL + SLACK, "the late answer")
    lease.release()
    assert len(seen.calls) == len(seen.signals) == 1
    assert lease.state == "lost"


# -- PostgreSQL: a late success --------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_late_successful_pg_renewal_leaves_the_lease_lost_and_frees_the_lock(
    stuck_pg: str, pg_proxy: FaultProxy, name: str, losses: Callable[[], Losses]
) -> None:
    """PostgreSQL keeps a session lock while the session lives, so a renewal delayed
    past the deadline answers "still held". The loss was already reported at the
    deadline: the lease stays lost (another holder may have been told the lock was
    free), and what the late answer kept on the server is given back."""
    seen = losses()
    lease = lock(name, backend=stuck_pg, ttl=TTL, on_lost=seen).acquire()
    _warm(lease)
    delay = 5 * TTL  # each way: the answer comes 10 s after its request, past TTL + SLACK
    pg_proxy.set_latency(delay)
    cut = time.monotonic()
    wait_for(lambda: seen.calls, TTL + SLACK, "the loss at the deadline")
    assert seen.calls[0][0] - cut <= TTL + SLACK
    assert "no answer" in seen.calls[0][1], seen.calls[0][1]
    pg_proxy.set_latency(0)  # the late answer still comes `delay` after its request
    wait_for(lambda: _free(name, "pg"), 2 * delay + SLACK + 10, "the lock given back")
    assert lease.state == "lost" and not lease.held()
    assert len(seen.calls) == len(seen.signals) == 1
    assert lease.release() is False


@pytest.mark.django_db(transaction=True)
def test_a_holders_own_stuck_extend_is_reported_at_the_deadline(
    stuck_pg: str, pg_proxy: FaultProxy, name: str, losses: Callable[[], Losses]
) -> None:
    """Nothing renews the lease (auto_renew=False); its holder calls extend() and the
    call is stuck. The loss is reported at the deadline, from another thread, while the
    holder still waits; the holder's call then ends in an error, never a success."""
    seen = losses()
    lease = lock(name, backend=stuck_pg, ttl=TTL * 2, auto_renew=False, on_lost=seen).acquire()
    lease.extend()  # the connection is warm
    ended: list[BaseException | None] = []

    def extend() -> None:
        try:
            lease.extend()
            ended.append(None)
        except (LockLost, LockBackendUnavailable) as exc:
            ended.append(exc)

    pg_proxy.blackhole()
    cut = time.monotonic()
    holder = threading.Thread(target=extend)
    holder.start()
    wait_for(lambda: seen.calls, TTL * 2 + SLACK, "the loss at the deadline")
    assert seen.calls[0][0] - cut <= TTL * 2 + SLACK
    assert not ended  # the holder's call is still stuck
    assert not lease.held()
    pg_proxy.heal()
    pg_proxy.reset()
    holder.join(30)
    assert not holder.is_alive()
    assert ended and ended[0] is not None
    assert len(seen.calls) == len(seen.signals) == 1


# -- asyncio -----------------------------------------------------------------------------


@pytest.fixture
def stuck_etcd(etcd_ready: str) -> Iterator[tuple[str, FaultProxy]]:
    """An etcd alias whose connections go through a proxy (socket timeout of a minute)."""
    from urllib.parse import urlsplit

    from tests.settings import etcd_alias

    proxy = FaultProxy(int(urlsplit(etcd_ready).port or 2379)).start()
    config = etcd_alias(f"http://127.0.0.1:{proxy.port}")
    config["OPTIONS"] = {"connect_timeout": 2, "socket_timeout": STUCK}
    try:
        with override_settings(
            DISTLOCKS_BACKENDS={**settings.DISTLOCKS_BACKENDS, "stucketcd": config}
        ):
            yield "stucketcd", proxy
            proxy.heal()
            proxy.reset()
    finally:
        proxy.close()


@pytest.fixture(params=["redis", "pg", "etcd"])
def stuck_alias(request: pytest.FixtureRequest) -> tuple[str, FaultProxy]:
    """(alias, its proxy) for each backend with a stalled-call test of its own."""
    if request.param == "redis":
        return request.getfixturevalue("stuck_redis"), request.getfixturevalue("proxy")
    if request.param == "etcd":
        found: tuple[str, FaultProxy] = request.getfixturevalue("stuck_etcd")
        return found
    return request.getfixturevalue("stuck_pg"), request.getfixturevalue("pg_proxy")


@pytest.mark.django_db(transaction=True)
def test_a_stalled_renewal_reports_the_loss_at_the_deadline_on_every_backend(
    stuck_alias: tuple[str, FaultProxy], name: str, losses: Callable[[], Losses]
) -> None:
    alias, proxy = stuck_alias
    seen = losses()
    lease = lock(name, backend=alias, ttl=TTL, on_lost=seen).acquire()
    _warm(lease)
    proxy.blackhole()
    cut = time.monotonic()
    wait_for(lambda: seen.calls, TTL + SLACK, "the loss at the deadline")
    assert seen.calls[0][0] - cut <= TTL + SLACK
    assert "no answer" in seen.calls[0][1], seen.calls[0][1]
    assert not lease.held() and lease.state == "lost"
    proxy.heal()
    proxy.reset()
    assert lease.release() is False
    assert len(seen.calls) == len(seen.signals) == 1


@pytest.mark.django_db(transaction=True)
def test_a_stalled_async_renewal_reports_the_loss_at_the_deadline(
    stuck_alias: tuple[str, FaultProxy], name: str, losses: Callable[[], Losses]
) -> None:
    """alock(): the renewal task awaits a call that is stuck for a minute; the loop's
    renewer reports the loss at the deadline, and the loop is never blocked meanwhile."""
    alias, proxy = stuck_alias
    seen = losses()

    async def main() -> None:
        lease = await alock(name, backend=alias, ttl=TTL, on_lost=seen).acquire()
        limit = time.monotonic() + 30
        while lease.renewals < 1:
            assert time.monotonic() < limit, "no first renewal"
            await asyncio.sleep(0.01)
        proxy.blackhole()
        cut = time.monotonic()
        limit = cut + TTL + SLACK
        while not seen.calls:
            assert time.monotonic() < limit, "no loss reported at the deadline"
            await asyncio.sleep(0.01)
        assert seen.calls[0][0] - cut <= TTL + SLACK
        assert "no answer" in seen.calls[0][1], seen.calls[0][1]
        assert not lease.held()
        proxy.heal()  # then the stuck call is cut: the release need not wait for it
        proxy.reset()
        assert await lease.release() is False

    asyncio.run(asyncio.wait_for(main(), 120))
    assert len(seen.calls) == len(seen.signals) == 1


# -- a release never waits for a stuck call -------------------------------------------

#: A lease long enough that its deadline never passes while the test runs: the release
#: below races a stuck call, not a loss.
LONG = 120.0
#: How long a release racing a stuck call may take: far below STUCK, which is what it
#: would take if it waited for that call.
RELEASED_WITHIN = 20.0


def _stuck_renewal(lease: Any, alias: str, proxy: FaultProxy) -> None:
    """Start a renewal turn of ``lease`` now and leave it stuck: its request swallowed by
    the blackhole, its answer never to come (until STUCK, or the proxy's reset). The
    proxy is healed after it: calls made from now on (the release) are answered."""
    from distlocks.renewal import renewer

    swallowed = proxy.stats["swallowed"]
    proxy.blackhole()
    renewer(alias).add(lease, time.monotonic())  # due now, instead of at a third of LONG
    wait_for(
        lambda: lease._renewing and proxy.stats["swallowed"] > swallowed, 30, "a stuck renewal"
    )
    proxy.heal()


@pytest.mark.django_db(transaction=True)
def test_a_release_does_not_wait_for_a_stuck_renewal(
    stuck_alias: tuple[str, FaultProxy], name: str, losses: Callable[[], Losses]
) -> None:
    """The renewer's call for the lease is stuck (no answer for a minute) when its holder
    leaves the ``with`` block: the release is sent beside it and returns at once, the
    lock is free for others, and the stuck call's late end reports nothing."""
    alias, proxy = stuck_alias
    seen = losses()
    lease = lock(name, backend=alias, ttl=LONG, on_lost=seen).acquire()
    lease.extend()  # the connections and statements are ready: the stall hits a renewal
    _stuck_renewal(lease, alias, proxy)
    released: list[bool] = []
    releaser = threading.Thread(target=lambda: released.append(lease.release()))
    releaser.start()
    releaser.join(RELEASED_WITHIN)
    assert not releaser.is_alive(), "release() waited for the stuck renewal"
    assert released == [True]
    assert lease.state == "released" and not lease.held()
    wait_for(lambda: _free(name, alias), 30, "the lock free for others")
    proxy.reset()  # the stuck call ends now (an error), long after the release
    wait_for(lambda: not lease._renewing, 30, "the stuck call's end")
    assert lease.state == "released"
    assert not seen.calls and not seen.signals
    assert lease.release() is False  # idempotent
    backend = get_backend(alias)
    if isinstance(backend, PostgresBackend):
        # The connection the stuck call held was closed once, by that call's thread:
        # every connection the pool counts is idle again, none pinned, none leaked.
        pool = backend.pool
        wait_for(lambda: pool._count == len(pool._idle), 30, "the pool's count settled")
        assert backend.held_connection_count() == 0


@pytest.mark.django_db(transaction=True)
def test_a_release_does_not_wait_for_the_holders_own_stuck_extend(
    stuck_alias: tuple[str, FaultProxy], name: str, losses: Callable[[], Losses]
) -> None:
    """One thread of the holder is stuck in ``extend()``; another releases the lease: the
    release does not wait for the extension, and the extension ends in an error."""
    alias, proxy = stuck_alias
    seen = losses()
    lease = lock(name, backend=alias, ttl=LONG, auto_renew=False, on_lost=seen).acquire()
    lease.extend()
    ended: list[BaseException | None] = []

    def extend() -> None:
        try:
            lease.extend()
            ended.append(None)
        except (LockLost, LockBackendUnavailable) as exc:
            ended.append(exc)

    swallowed = proxy.stats["swallowed"]
    proxy.blackhole()
    holder = threading.Thread(target=extend)
    holder.start()
    wait_for(lambda: lease._renewing and proxy.stats["swallowed"] > swallowed, 30, "a stuck extend")
    proxy.heal()
    released: list[bool] = []
    releaser = threading.Thread(target=lambda: released.append(lease.release()))
    releaser.start()
    releaser.join(RELEASED_WITHIN)
    assert not releaser.is_alive(), "release() waited for the stuck extend()"
    assert released == [True]
    wait_for(lambda: _free(name, alias), 30, "the lock free for others")
    proxy.reset()
    holder.join(30)
    assert not holder.is_alive()
    assert ended and ended[0] is not None  # never a success for a released lease
    assert lease.state == "released"
    assert not seen.calls and not seen.signals


@pytest.mark.django_db(transaction=True)
def test_an_async_release_does_not_wait_for_a_stuck_renewal(
    stuck_alias: tuple[str, FaultProxy], name: str, losses: Callable[[], Losses]
) -> None:
    """alock(): the loop's renewal task awaits a call that is stuck for a minute when the
    holder releases the lease; the release does not wait for it."""
    from distlocks.renewal import loop_renewer

    alias, proxy = stuck_alias
    seen = losses()

    async def main() -> None:
        lease = await alock(name, backend=alias, ttl=LONG, on_lost=seen).acquire()
        await lease.extend()
        swallowed = proxy.stats["swallowed"]
        proxy.blackhole()
        loop_renewer(asyncio.get_running_loop()).add(lease, time.monotonic())
        limit = time.monotonic() + 30
        while not (lease._renewing and proxy.stats["swallowed"] > swallowed):
            assert time.monotonic() < limit, "no stuck renewal"
            await asyncio.sleep(0.01)
        proxy.heal()
        try:
            released = await asyncio.wait_for(lease.release(), RELEASED_WITHIN)
        except TimeoutError:
            pytest.fail("release() waited for the stuck renewal")
        assert released is True
        assert lease.state == "released" and not lease.held()

    asyncio.run(asyncio.wait_for(main(), 120))
    wait_for(lambda: _free(name, alias), 30, "the lock free for others")
    proxy.reset()
    assert not seen.calls and not seen.signals


# -- cost ------------------------------------------------------------------------------


def test_repeated_extends_keep_one_watch_entry(name: str) -> None:
    """Each extend() asks to be looked at its deadline; a holder extending in a loop must
    not leave one heap entry per call behind (they would last until their deadlines)."""
    from distlocks.renewal import loop_renewer, renewer

    lease = lock(name, backend="locmem", ttl=600, auto_renew=False).acquire()
    try:
        for _ in range(200):
            lease.extend()
        entries = [e for e in renewer("locmem")._heap if e[2]() is lease]
        assert len(entries) == 1
    finally:
        lease.release()

    async def main() -> int:
        alease = await alock(f"{name}:a", backend="locmem", ttl=600, auto_renew=False).acquire()
        try:
            for _ in range(200):
                await alease.extend()
            heap = loop_renewer(asyncio.get_running_loop())._heap
            return len([e for e in heap if e[2]() is alease])
        finally:
            await alease.release()

    assert asyncio.run(main()) == 1
