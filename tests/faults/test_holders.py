"""Faults of the lock holder's process: paused past its lease, killed inside its
critical section, killed while its release is on the wire."""

from __future__ import annotations

import hashlib
import signal
from collections.abc import Callable

import pytest

from distlocks import get_backend
from distlocks.backends.redis import RELEASE
from tests.faults.helpers import MakeScenario, newer_write, redis_config, session_redis_port
from tests.faults.proxy import FaultProxy
from tests.faults.scenario import LIMIT
from tests.waiting import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_holder_paused_past_its_ttl(scenario: MakeScenario) -> None:
    """SIGSTOP inside the critical section, long enough for the lease to run out
    and another worker to take the lock and write; then SIGCONT. The resumed
    holder's write must be refused by the storage, and it must learn the loss."""
    s = scenario("paused")
    s.hold("victim", "inside")
    s.spawn("victim", alias="redis", ttl=1.0, rounds=2)
    for proc in ("w1", "w2"):
        s.spawn(proc, alias="redis", ttl=1.0, rounds=6, gate=True)
    token = s.wait_at("victim", "inside")
    with s.fault("SIGSTOP past the TTL"):
        s.signal("victim", signal.SIGSTOP)
        s.open_gate("w1")
        s.open_gate("w2")
        s.wait_event(newer_write(token), "a newer holder's write")
        s.go("victim", "inside")
        s.signal("victim", signal.SIGCONT)
    s.join()
    report = s.check()
    late = [
        e for e in s.events("write", "victim") if e["token"] == token and e["op"] == "increment"
    ]
    assert [e["accepted"] for e in late] == [False]
    assert report.takeovers >= 1 and report.faults == 1
    assert any(e["token"] == token for e in s.events("lost", "victim"))
    assert report.increments == 2 * 6 + 1  # the victim's second round went through


@pytest.mark.parametrize("backend_alias", ["redis", "pg"])
def test_holder_killed_inside_its_critical_section(
    scenario: MakeScenario, backend_alias: str
) -> None:
    """SIGKILL after the claim and the read, before the write: the lock comes back
    (Redis: by expiry; PostgreSQL: the session ends with the process), the others
    go on, and nothing the dead holder started is counted."""
    alias = backend_alias
    s = scenario(f"killed-inside-{alias}")
    s.hold("victim", "inside")
    s.spawn("victim", alias=alias, ttl=1.0, rounds=3)
    for proc in ("w1", "w2"):
        s.spawn(proc, alias=alias, ttl=1.0, rounds=5, gate=True)
    token = s.wait_at("victim", "inside")
    s.open_gate("w1")
    s.open_gate("w2")
    s.expect_death("victim")
    with s.fault("SIGKILL inside", ends_leases=alias == "pg"):
        s.signal("victim", signal.SIGKILL)
        s.procs["victim"].join(30)
    assert s.procs["victim"].exitcode == -signal.SIGKILL
    s.join("w1", "w2")
    report = s.check()
    assert report.increments == 2 * 5
    killed_at = s.events("fault")[0]["t1"]
    later = [e["token"] for e in s.events("acquire") if e["t0"] > killed_at]
    assert later and min(later) > token
    assert not [e for e in s.events("write", "victim") if e["op"] == "increment"]
    assert report.faults == 1


def test_holder_killed_while_its_release_is_delayed(
    scenario: MakeScenario, proxies: Callable[[int], FaultProxy]
) -> None:
    """The holder's release is held up on the wire (by the proxy) and the holder is
    killed: its lease runs out, another worker takes the lock, and the release
    that arrives late must not free the new holder's lock."""
    proxy = proxies(session_redis_port())
    release_sha = hashlib.sha1(RELEASE.encode()).hexdigest().encode()
    proxy.watch(release_sha)
    # Loaded beforehand, so the late EVALSHA runs instead of asking for the script.
    get_backend("redis").client.script_load(RELEASE)
    ttl = 1.0
    s = scenario("killed-releasing")
    s.hold("victim", "releasing")
    s.spawn("victim", backend=redis_config(proxy.url()), ttl=ttl, rounds=1)
    s.spawn("w1", alias="redis", ttl=ttl, rounds=4, gate=True)
    s.wait_ready("w1")
    token = s.wait_at("victim", "releasing")
    s.expect_death("victim")
    with s.fault("SIGKILL during a delayed release"):
        # Later renewals arrive after the lease ran out, and so does the release,
        # well after the next holder got the lock.
        proxy.set_latency(3 * ttl)
        s.go("victim", "releasing")
        wait_for(lambda: proxy.seen[release_sha] > 0, LIMIT, "the release inside the proxy")
        s.signal("victim", signal.SIGKILL)
        s.procs["victim"].join(30)
    # The lease runs out; the next holder takes the lock and stops inside.
    s.hold("w1", "inside")
    s.open_gate("w1")
    new_token = s.wait_at("w1", "inside")
    assert new_token > token
    # The dead holder's release reaches Redis, which answers it...
    wait_for(lambda: proxy.stats["up_out"] == proxy.stats["up_in"], LIMIT, "late release sent")
    wait_for(lambda: proxy.last_down_read > proxy.last_up_write, LIMIT, "Redis answering it")
    # ...and the lock is still the new holder's.
    holder = get_backend("redis").inspect(s.lock)
    assert holder is not None and holder.fencing_token == new_token
    granted = s.wait_event(lambda e: e["kind"] == "acquire" and e["token"] == new_token, "grant")
    assert proxy.last_up_write > granted["t1"]  # the release did come after the grant
    s.go("w1", "inside")
    s.join("w1")
    report = s.check()
    assert report.increments == 1 + 4
    assert report.faults == 1
