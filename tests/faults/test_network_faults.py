"""Network faults between the holders and Redis, made by the test's own TCP proxy:
renewals that arrive after the lease ran out, a release (and so its wake-up)
that never arrives, and a run of resets, refused connections, latency and
partitions."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import pytest
from django.conf import settings

from distlocks.backends.redis import EXTEND
from tests.faults.helpers import MakeScenario, newer_write, of, redis_config, session_redis_port
from tests.faults.proxy import FaultProxy
from tests.faults.scenario import LIMIT
from tests.waiting import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

Proxies = Callable[[int], FaultProxy]


def test_renewals_arrive_after_the_lease_ran_out(scenario: MakeScenario, proxies: Proxies) -> None:
    """Latency on the holder's connection grows past its TTL while it is inside its
    critical section: its renewals reach Redis only after the lease expired, so
    they extend nothing; another worker takes over, and the holder is told it lost
    the lock at its deadline, while its late renewal is still on the wire. Its write
    is then refused."""
    ttl = 1.0
    proxy = proxies(session_redis_port())
    extend_sha = hashlib.sha1(EXTEND.encode()).hexdigest().encode()
    proxy.watch(extend_sha)
    s = scenario("late-renewals")
    s.hold("victim", "inside")
    # A socket timeout above the round trip, so the renewal's late answer is read.
    s.spawn("victim", backend=redis_config(proxy.url(), socket_timeout=10), ttl=ttl, rounds=1)
    s.spawn("w1", alias="redis", ttl=ttl, rounds=3, gate=True)
    token = s.wait_at("victim", "inside")
    # One renewal first, at no latency: the renewal's connection is then open and its
    # script loaded, so the late renewal is the one round trip of its own. (Without it,
    # the connection's handshake and the script's load, seven round trips in all at
    # 1.5 TTL each way, came before it: 20 s.)
    s.wait_event(of("renew", "victim", token=token), "the holder's first renewal")
    with s.fault("latency of 1.5 TTL on the holder's connection"):
        proxy.set_latency(1.5 * ttl)
        renewals = proxy.seen[extend_sha]
        s.open_gate("w1")
        s.wait_event(newer_write(token), "another holder's write")
        lost = s.wait_event(of("lost", "victim", token=token), "the holder told of its loss")
        proxy.set_latency(0)
    assert proxy.seen[extend_sha] > renewals  # renewals were sent under the latency
    s.go("victim", "inside")
    s.join()
    report = s.check()
    assert "no answer" in lost["reason"]  # told at the deadline, not by the late answer
    late = [e for e in s.events("write", "victim") if e["op"] == "increment"]
    assert [e["accepted"] for e in late] == [False]
    assert report.takeovers >= 1 and report.faults == 1


def test_waiter_is_not_held_up_by_a_lost_wake_up(scenario: MakeScenario, proxies: Proxies) -> None:
    """The holder's release is swallowed by a partition, so the wake-up it would have
    sent never comes. The waiter blocks in chunks of up to 5 s (its socket timeout
    allows that), yet it must get the lock within one TTL of the holder's lease
    running out: each wait is bounded by the holder's remaining TTL."""
    ttl = 2.0
    proxy = proxies(session_redis_port())
    s = scenario("lost-wake-up")
    s.hold("holder", "releasing")
    s.spawn("holder", backend=redis_config(proxy.url()), ttl=ttl, rounds=1)
    waiter_backend = redis_config(settings.REDIS_URL, socket_timeout=10)
    s.spawn("waiter", backend=waiter_backend, ttl=ttl, rounds=1, timeout=30, gate=True)
    s.wait_ready("waiter")
    s.wait_at("holder", "releasing")
    with s.fault("partition: the release and its wake-up are lost"):
        proxy.blackhole()
        s.open_gate("waiter")
        s.wait_event(of("attempt", "waiter"), "the waiter waiting")
        s.go("holder", "releasing")
        release = s.wait_event(of("release", "holder"), "the holder's release attempt")
    granted = s.wait_event(of("acquire", "waiter"), "the waiter's grant")
    s.join()
    report = s.check()
    assert release["ok"] is None and "Unavailable" in release["error"]
    assert proxy.stats["swallowed"] > 0
    # The server let the lease run out at most one TTL after the holder's last
    # request it answered; the waiter got the lock within one more TTL.
    answered = [e["t1"] for e in s.events(proc="holder") if e["kind"] in ("acquire", "renew")]
    expired_by = max(answered) + ttl
    assert granted["t0"] < expired_by  # it was waiting while the lease still ran
    assert granted["t1"] - expired_by <= ttl, granted["t1"] - expired_by
    assert report.faults == 1


def test_resets_refusals_latency_and_partitions(scenario: MakeScenario, proxies: Proxies) -> None:
    """Three workers go through one proxy that keeps breaking: connections reset,
    new connections refused, latency spikes past the renewal interval, short
    partitions. Whatever the outcome of each round, the history stays safe, and
    work goes on between the faults."""
    ttl = 1.0
    proxy = proxies(session_redis_port())
    via = redis_config(proxy.url(), socket_timeout=0.5, socket_connect_timeout=0.5)
    s = scenario("network-chaos")
    for proc in ("w1", "w2", "w3"):
        s.spawn(proc, backend=via, ttl=ttl, rounds=1000, timeout=10)
    s.wait_accepted(3)

    def reset() -> None:
        assert proxy.reset() > 0

    def refuse() -> None:
        dropped = proxy.stats["dropped"]
        proxy.drop()
        proxy.reset()  # the workers reconnect, and are refused
        wait_for(lambda: proxy.stats["dropped"] > dropped, LIMIT, "a refused connection")

    def spike() -> None:
        proxy.set_latency(0.6 * ttl)
        time.sleep(ttl)  # the fault's duration, not a synchronisation

    def partition() -> None:
        proxy.blackhole()
        time.sleep(0.6 * ttl)

    injected = 0
    for fault in [reset, refuse, spike, partition] * 2:
        with s.fault(fault.__name__):
            fault()
            proxy.heal()
        injected += 1
        s.wait_accepted(1, after=time.monotonic(), what=f"progress after {fault.__name__}")
    s.stop()
    s.join()
    report = s.check()
    assert report.faults == injected == 8
    assert proxy.stats["resets"] > 0 and proxy.stats["swallowed"] > 0
