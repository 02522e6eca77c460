"""Redlock with a minority of its masters down: the quorum goes on without it.

And a bug this suite found in Redlock's waiting path, kept as a strict xfail.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.conf import settings
from django.test import override_settings

from distlocks import get_backend, lock
from distlocks.backends import redis as single
from distlocks.backends.base import Holder
from distlocks.testing.servers import RedisServer
from tests.faults.helpers import MakeScenario, of
from tests.faults.proxy import FaultProxy
from tests.faults.scenario import LIMIT
from tests.waiting import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

WORKERS = ("w1", "w2", "w3")


@pytest.fixture
def masters(tmp_path: Path) -> Iterator[list[RedisServer]]:
    """Three Redis masters of the scenario's own."""
    servers = []
    try:
        for index in range(3):
            (tmp_path / f"master-{index}").mkdir()
            servers.append(RedisServer(tmp_path / f"master-{index}").start())
        yield servers
    finally:
        for server in servers:
            server.stop()


def test_redlock_with_a_minority_of_masters_down(
    scenario: MakeScenario, masters: list[RedisServer]
) -> None:
    """One master of three is killed while a worker holds the lock: nobody else gets
    in, and work goes on with the two left (no LockBackendUnavailable: a quorum
    answers). The master comes back empty; work goes on and the history stays
    safe, tokens still ordered."""
    config = {
        "BACKEND": "distlocks.backends.redlock.RedlockBackend",
        "LOCATION": [m.url for m in masters],
        "OPTIONS": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
    }
    s = scenario("redlock-minority")
    for proc in WORKERS:
        # timeout=0: each attempt has an owner of its own. Waiting attempts share one
        # owner, which the known bug below turns into a double grant.
        s.spawn(proc, backend=config, ttl=1.0, rounds=1000, timeout=0)
    s.wait_accepted(6)
    s.hold("w1", "inside")
    token = s.wait_at("w1", "inside")
    victim = masters[2]
    port = victim.port
    with s.fault("one master of three killed"):
        victim.kill()
    killed_at = time.monotonic()
    # The holder keeps its lease (renewed by the two left) and finishes its round.
    s.wait_event(lambda e: of("renew", "w1", token=token)(e) and e["t0"] > killed_at,
                 "a renewal by the quorum left")  # fmt: skip
    s.go("w1", "inside")
    mine = s.wait_event(of("write", "w1", op="increment", token=token), "w1's write")
    s.wait_accepted(6, after=time.monotonic(), what="progress with a master down")
    with s.fault("the master restarted empty", ends_leases=True):
        victim.start(port=port)
    restarted_at = time.monotonic()
    s.wait_accepted(4, after=restarted_at)
    s.stop()
    s.join()
    report = s.check()
    assert mine["accepted"] is True
    down = [e for e in s.events() if e["kind"] == "unavailable" and e["t"] > killed_at]
    assert down == []
    assert report.faults == 2
    before = [e["token"] for e in s.events("acquire") if e["t1"] < restarted_at]
    after = [e["token"] for e in s.events("acquire") if e["t0"] > restarted_at]
    assert after and min(after) > max(before)


@pytest.mark.xfail(
    strict=True,
    reason="Redlock bug: acquire_lease retries with one owner; an attempt that failed "
    "while a master's grant was still on the way gives that grant back late "
    "(_give_back's release_late), and by then the next attempt of the same owner may "
    "have counted that very master (its same-owner path re-grants): the caller "
    "believes it holds a quorum it no longer has, and another client can be granted "
    "the lock too. Seen as an overlap by the minority-down scenario when it waited.",
)
def test_a_late_give_back_does_not_undo_the_next_attempt(
    masters: list[RedisServer], proxies: Callable[[int], FaultProxy]
) -> None:
    """The third master is slow (a proxy adds 0.5 s each way). A waiting acquire's
    first attempt is refused by the two fast masters, which are held, and gives up
    while the slow master's grant is still on the way; one fast master is then
    released, which wakes the waiter, and its next attempt (same owner) counts the
    slow master in its quorum. Once everything on the way has landed, including the
    first attempt's give-back, the holder must still hold a quorum."""
    slow = proxies(masters[2].port)
    urls = [masters[0].url, masters[1].url, slow.url()]
    config = {"BACKEND": "distlocks.backends.redlock.RedlockBackend", "LOCATION": urls,
              "OPTIONS": {"socket_timeout": 5}}  # fmt: skip
    holder = Holder("test", 1, "main")
    name = "late-give-back"
    acquire_sha = hashlib.sha1(single.ACQUIRE.encode()).hexdigest().encode()
    slow.watch(acquire_sha)
    with override_settings(DISTLOCKS_BACKENDS={**settings.DISTLOCKS_BACKENDS, "rl": config}):
        redlock = get_backend("rl")
        first, second, third = redlock.masters  # type: ignore[attr-defined]
        # Warm connections and loaded scripts: every call to the slow master is then
        # one delayed round trip, nothing more.
        slow.set_latency(0.2)
        pings = [threading.Thread(target=third.client.ping) for _ in range(8)]
        for thread in pings:
            thread.start()
        for thread in pings:
            thread.join()
        for script in (single.ACQUIRE, single.RELEASE):
            third.client.script_load(script)
        assert first.acquire(name, "someone", 30, holder).acquired
        assert second.acquire(name, "someone-else", 30, holder).acquired
        slow.set_latency(0.5)

        def free_the_second_master() -> None:
            wait_for(lambda: slow.seen[acquire_sha] > 0, LIMIT, "the first attempt sent")
            second.release(name, "someone-else")

        freeing = threading.Thread(target=free_the_second_master)
        freeing.start()
        lease = lock(name, backend="rl", ttl=5, timeout=10, auto_renew=False).acquire()
        freeing.join()
        assert slow.seen[acquire_sha] >= 2  # the slow master did see both attempts
        # Let everything on the way to the slow master land and be answered.
        wait_for(
            lambda: (
                slow.stats["up_in"] == slow.stats["up_out"]
                and slow.last_down_read > slow.last_up_write
            ),
            LIMIT,
            "the proxy idle",
        )
        owners = [m.inspect(name) for m in redlock.masters]  # type: ignore[attr-defined]
        holding = [info for info in owners if info is not None and info.owner == lease.owner]
        assert len(holding) >= redlock.quorum  # type: ignore[attr-defined]
        lease.release()
