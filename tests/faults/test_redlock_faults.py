"""Redlock with a minority of its masters down: the quorum goes on without it.

And the replay of a double grant this suite found in Redlock's waiting path (fixed):
a failed attempt's give-back that reaches a slow master late.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings
from django.test import override_settings

from distlocks import get_backend, lock
from distlocks.backends import redis as single
from distlocks.backends import redlock as redlock_module
from distlocks.backends.base import Holder
from distlocks.exceptions import LockNotAcquired
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
        # timeout=0: one attempt per acquisition (waiting acquisitions, whose attempts
        # share one owner, are replayed under a slow master below).
        s.spawn(proc, backend=config, ttl=1.0, rounds=1000, timeout=0)
    s.wait_accepted(6)
    s.hold("w1", "inside")
    token = s.wait_at("w1", "inside")
    # A master the lease can do without: its quorum is the masters that record its token
    # (a grant can leave one master out, held by a predecessor's release still on its way).
    quorum = [i for i, m in enumerate(masters) if token_on(m, s.lock) == token]
    assert len(quorum) >= 2, quorum
    victim = masters[2] if len(quorum) == 3 else masters[({0, 1, 2} - set(quorum)).pop()]
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


class SteeredProxy(FaultProxy):
    """A fault proxy whose latency changes the moment given requests pass through it.

    ``steer(needle, this, then)``: the first chunk a client sends that contains
    ``needle`` is delayed by ``this`` seconds, and every chunk read after it (both
    ways) by ``then``. So one request can be made to overtake another, or an answer
    to be lost in the delay, whatever the load: nothing waits for a test thread to
    notice the request. (The proxy counts a watched needle in ``seen`` just before it
    stamps the chunk's due time with ``latency``; both are hooked here.)
    """

    _once: float | None = None

    def __init__(self, upstream_port: int) -> None:
        self._latency = 0.0
        super().__init__(upstream_port)
        self.rules: dict[bytes, tuple[float, float]] = {}
        self.seen = _Steering(self)

    @property  # type: ignore[override]
    def latency(self) -> float:
        once, self._once = self._once, None
        return self._latency if once is None else once

    @latency.setter
    def latency(self, seconds: float) -> None:
        self._latency = seconds

    def steer(self, needle: bytes, this: float, then: float) -> None:
        self.rules[needle] = (this, then)
        self.watch(needle)

    def passed(self, needle: bytes) -> None:
        rule = self.rules.pop(needle, None)
        if rule is not None:
            self._once, self._latency = rule


class _Steering(Counter[bytes]):
    def __init__(self, proxy: SteeredProxy) -> None:
        super().__init__()
        self.proxy = proxy

    def __setitem__(self, needle: bytes, count: int) -> None:
        super().__setitem__(needle, count)
        if count > 0:
            self.proxy.passed(needle)


def sha(script: str) -> bytes:
    """What an EVALSHA of ``script`` carries on the wire."""
    return hashlib.sha1(script.encode()).hexdigest().encode()


@pytest.mark.parametrize("confirmed", [False, True], ids=["unconfirmed", "confirmed"])
def test_a_late_give_back_does_not_undo_the_next_attempt(
    masters: list[RedisServer], tmp_path: Path, confirmed: bool
) -> None:
    """A waiting acquisition retries with one owner, and the third master (C) is slow.
    Its first attempt fails and gives back; the give-back to C is held up 3 s in the
    network, long enough for the owner's next attempt to be granted on C again (same
    owner) and to count it in its quorum. Once the give-back has landed, the holder
    must still hold its quorum, and nobody else may get the lock.

    unconfirmed: A and B are held; the first attempt is refused by both and gives back
    C's grant when it arrives. The next attempt comes when B's holder expires. (This
    one passed before the fix too: the give-back then spared an entry that a later
    attempt had confirmed. It fails if the give-back ignores attempts.)
    confirmed: A is held; the first attempt gets B and C, and its confirmation to C is
    delayed past the socket timeout: the attempt fails, and the confirmation lands on
    C afterwards. The next attempt's confirmation did not take over the entry the
    first one had marked, so the late give-back still matched and freed it, and once
    A was free a second caller got the lock. This one failed before the fix.
    """
    slow = SteeredProxy(masters[2].port).start()
    urls = [masters[0].url, masters[1].url, slow.url()]
    config = {"BACKEND": "distlocks.backends.redlock.RedlockBackend", "LOCATION": urls,
              "OPTIONS": {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}}  # fmt: skip
    holder = Holder("test", 1, "main")
    name = f"late-give-back-{tmp_path.name}"
    try:
        with override_settings(DISTLOCKS_BACKENDS={**settings.DISTLOCKS_BACKENDS, "rl": config}):
            redlock = get_backend("rl")
            first, second, third = redlock.masters  # type: ignore[attr-defined]
            # Warm connections and every script loaded: each call to the slow master
            # is then one delayed round trip, nothing more.
            pings = [threading.Thread(target=third.client.ping) for _ in range(8)]
            for thread in pings:
                thread.start()
            for thread in pings:
                thread.join()
            for script in [*single.SCRIPTS.values(), *redlock_module._SCRIPTS.values()]:
                third.client.script_load(script)
            assert first.acquire(name, "someone", 30, holder).acquired
            if confirmed:
                # The confirmation reaches C after 1.2 s, when the caller has given up
                # on its answer (1 s socket timeout).
                slow.steer(sha(redlock_module.CONFIRM), 1.2, 0.0)
            else:
                assert second.acquire(name, "someone-else", 1.0, holder).acquired
                slow.set_latency(0.2)  # C answers after A and B refused
            slow.steer(sha(redlock_module.GIVE_BACK), 3.0, 0.0)
            lease = lock(name, backend="rl", ttl=30, timeout=20, auto_renew=False).acquire()
            try:
                assert slow.seen[sha(redlock_module.GIVE_BACK)] >= 1
                # Let the give-back land: the proxy has passed everything on, and a
                # request on a fresh connection is served after it.
                wait_for(lambda: slow.stats["up_in"] == slow.stats["up_out"], LIMIT,
                         "the give-back delivered")  # fmt: skip
                owners = [owner_on(server, redlock, i, name) for i, server in enumerate(masters)]
                holding = [i for i, owner in enumerate(owners) if owner == lease.owner]
                assert holding == [1, 2], owners
                assert first.release(name, "someone")
                with pytest.raises(LockNotAcquired):
                    lock(name, backend="rl", timeout=0).acquire()
            finally:
                lease.release()
    finally:
        slow.close()


def token_on(server: RedisServer, name: str) -> int | None:
    """The fencing token of ``name``'s entry on a master (None if it has none)."""
    master = single.RedisBackend("probe", {"LOCATION": server.url})
    try:
        token = master.client.hget(master.all_keys(name).lock, "token")
    finally:
        master.close()
    return None if token is None else int(token)


def owner_on(server: RedisServer, backend: Any, index: int, name: str) -> str | None:
    """The owner of ``name``'s entry on a master, read straight from the server (a
    connection of its own, not through the proxy)."""
    client = redis.Redis.from_url(server.url, socket_timeout=10)
    try:
        owner = client.hget(backend.masters[index].all_keys(name).lock, "owner")
    finally:
        client.close()
    return None if owner is None else owner.decode()
