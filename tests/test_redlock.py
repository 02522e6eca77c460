"""RedlockBackend specifics: quorum, validity, fencing across masters, failures.

The contract suite (tests/test_locks.py and friends) also runs on the "redlock" alias
of tests/settings.py; the tests here start masters of their own, to kill, pause and
restart them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.test import override_settings

from distlocks import alock, get_backend, lock
from distlocks.backends.redlock import RedlockBackend, quorum
from distlocks.checks import check_settings
from distlocks.exceptions import LockBackendUnavailable, LockLost, LockNotAcquired
from distlocks.locks import current_holder
from distlocks.testing.servers import RedisServer
from tests.waiting import wait_for

REDLOCK = "distlocks.backends.redlock.RedlockBackend"
TIMEOUT = 0.5  # socket timeout of the backends built here
#: For tests that pause no master but expect every master to take part: a master slow
#: to answer on a loaded machine would otherwise be left out of the grant.
PATIENT = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0}
#: Socket timeout of the hung-master test: a healthy master answers well inside it even
#: on a loaded machine, and a hang (a paused master) lasts far longer.
HUNG_TIMEOUT = 2.0


def start_masters(base: Path, count: int) -> list[RedisServer]:
    # From this thread: a server gets a kill signal when the thread that started it ends.
    return [RedisServer(base / f"m{i}").start() for i in range(count)]


@pytest.fixture
def masters(tmp_path: Path) -> Iterator[list[RedisServer]]:
    """Three independent Redis masters of this test's own."""
    servers = start_masters(tmp_path, 3)
    yield servers
    stop_all(servers)


def stop_all(servers: list[RedisServer]) -> None:
    for server in servers:
        if server.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.pid, signal.SIGCONT)  # a paused server cannot stop
        server.stop()


def config(servers: list[RedisServer], **options: Any) -> dict[str, Any]:
    return {
        "BACKEND": REDLOCK,
        "LOCATION": [server.url for server in servers],
        "OPTIONS": {"socket_timeout": TIMEOUT, "socket_connect_timeout": TIMEOUT, **options},
    }


@contextlib.contextmanager
def redlock(servers: list[RedisServer], **options: Any) -> Iterator[RedlockBackend]:
    """Settings with a "rl" alias over ``servers``; yields its backend."""
    backends = {"default": {"BACKEND": "distlocks.backends.locmem.LocMemBackend"}}
    backends["rl"] = config(servers, **options)
    with override_settings(DISTLOCKS_BACKENDS=backends):
        backend = get_backend("rl")
        assert isinstance(backend, RedlockBackend)
        yield backend


def raw(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=5)


def lock_keys_present(backend: RedlockBackend, servers: list[RedisServer], name: str) -> list[int]:
    """Indexes of the (reachable) masters that hold a lock entry for ``name``."""
    found = []
    for index, server in enumerate(servers):
        if server.process is None or server.process.poll() is not None:
            continue
        client = raw(server)
        try:
            if client.exists(backend.masters[index].all_keys(name).lock):
                found.append(index)
        finally:
            client.close()
    return found


@contextlib.contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    """The server stops answering (SIGSTOP) but keeps its connections open: a hang."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def test_the_session_masters_are_exported_for_worker_processes() -> None:
    from django.conf import settings

    from distlocks.testing.servers import REDLOCK_URLS_ENV

    assert settings.DISTLOCKS_BACKENDS["redlock"]["LOCATION"] == settings.REDLOCK_URLS
    assert settings.REDLOCK_URLS[0] == settings.REDIS_URL
    assert os.environ[REDLOCK_URLS_ENV].split(",") == settings.REDLOCK_URLS[1:]
    assert len(set(settings.REDLOCK_URLS)) == 3


def test_quorum_is_a_strict_majority() -> None:
    assert [quorum(n) for n in (3, 4, 5, 6, 7)] == [2, 3, 3, 4, 4]


def test_masters_keep_no_listing_index(name: str) -> None:
    """Redlock lists each master by SCAN: nothing it does writes a Redis listing index."""
    from distlocks import get_backend, lock

    backend = get_backend("redlock")
    assert isinstance(backend, RedlockBackend)
    with lock(name, backend="redlock", ttl=5) as lease:
        lease.extend()
    held = lock(name, backend="redlock", ttl=5).acquire()
    assert backend.force_release(name, held.fencing_token)
    for master in backend.masters:
        assert master.listing_index is False
        assert not master.client.keys(f"{master.key_prefix}:listing*")


# -- failures of masters ------------------------------------------------------------


def test_one_master_down_still_grants_and_releases(masters: list[RedisServer], name: str) -> None:
    with redlock(masters) as backend:
        masters[2].kill()
        with lock(name, backend="rl", ttl=10, timeout=0) as lease:
            info = backend.inspect(name)
            assert info is not None and info.owner == lease.owner
            assert info.fencing_token == lease.fencing_token
            assert info.extra["masters"] == "2/3"
            assert lock_keys_present(backend, masters, name) == [0, 1]
            with pytest.raises(LockNotAcquired):  # still exclusive
                lock(name, backend="rl", timeout=0).acquire()
        assert lease.state == "released"
        assert backend.inspect(name) is None
        assert lock_keys_present(backend, masters, name) == []


def test_two_masters_down_refuse_with_a_clear_error(masters: list[RedisServer], name: str) -> None:
    with redlock(masters) as backend:
        masters[1].kill()
        masters[2].kill()
        with pytest.raises(LockBackendUnavailable) as excinfo:
            lock(name, backend="rl", timeout=5).acquire()
        message = str(excinfo.value)
        assert excinfo.value.backend == "rl"
        assert "only 1 of 3 Redis masters answered and a quorum needs 2" in message
        assert f"127.0.0.1:{masters[1].port}" in message and "ConnectionError" in message
        assert isinstance(excinfo.value.__cause__, LockBackendUnavailable)
        # The one master that granted its part gave it back (a late answer is given
        # back in the background, so wait for it under load).
        wait_for(lambda: lock_keys_present(backend, masters, name) == [], what="give back")
        with pytest.raises(LockBackendUnavailable, match="only 1 of 3"):
            backend.inspect(name)


def test_five_masters_tolerate_two_failures_not_three(tmp_path: Path, name: str) -> None:
    servers = start_masters(tmp_path, 5)
    try:
        with redlock(servers) as backend:
            assert backend.quorum == 3
            servers[0].kill()
            servers[3].kill()
            with lock(name, backend="rl", timeout=0) as lease:
                assert backend.inspect(name).extra["masters"] == "3/5"  # type: ignore[union-attr]
            assert lease.state == "released"
            servers[4].kill()
            with pytest.raises(LockBackendUnavailable, match=r"only 2 of 5 .* quorum needs 3"):
                lock(name, backend="rl", timeout=0).acquire()
    finally:
        stop_all(servers)


def test_a_hung_master_costs_at_most_the_socket_timeout(
    masters: list[RedisServer], name: str
) -> None:
    """A master that stops answering is waited for no longer than the socket timeout,
    and a dead one (connection refused) not at all."""
    # Not TIMEOUT (0.5 s): a healthy master slower than that on a loaded machine would
    # count as failed too, and leave no quorum with one master hung. The claim needs no
    # short timeout, only one far shorter than the hang (which lasts until the block ends).
    timeout = HUNG_TIMEOUT
    with redlock(masters, socket_timeout=timeout, socket_connect_timeout=timeout) as backend:
        with lock(name, backend="rl"):
            pass  # connections are open and pooled
        # release() returns once a quorum confirmed; the last master's delete may still
        # be on its way (a loaded machine). With master 1 hung, that master's old entry
        # would refuse the try-once below: a split vote, LockNotAcquired.
        wait_for(lambda: lock_keys_present(backend, masters, name) == [], what="release")
        with paused(masters[1]):
            start = time.monotonic()
            with lock(name, backend="rl", ttl=10, timeout=0) as lease:
                acquired_after = time.monotonic() - start
                assert lease.held()
            # The acquire waited for the hung master (a round waits for every master)...
            assert acquired_after >= timeout
            # ...but no longer than its socket timeout (never the hang itself, which lasts
            # until this block ends; the margin is for a loaded CI machine).
            assert acquired_after < timeout + 5.0, acquired_after
            # Two hung masters: no quorum, reported within the timeout too.
            with paused(masters[2]):
                start = time.monotonic()
                with pytest.raises(LockBackendUnavailable, match="only 1 of 3") as excinfo:
                    lock(name, backend="rl", timeout=10).acquire()
                assert time.monotonic() - start < timeout + 5.0
                assert "TimeoutError" in str(excinfo.value) or "did not answer" in str(
                    excinfo.value
                )


def test_answers_in_hand_at_the_deadline_count(masters: list[RedisServer], name: str) -> None:
    """The calling thread gets back to a round only after its deadline (descheduled on
    a loaded machine) while every master answered in time: those answers count; a
    master is "did not answer" only if its answer is not there when the round ends."""
    with redlock(masters) as backend:
        assert backend.inspect(name) is None  # pools and connections are up
        submit = backend._submit
        futures: list[Any] = []

        def late_caller(index: int, func: Any, *args: Any) -> Any:
            future = submit(index, func, *args)
            futures.append(future)
            if len(futures) == len(masters):  # the round's last request: stall
                past = time.monotonic() + backend.round_timeout
                wait_for(
                    lambda: time.monotonic() > past and all(f.done() for f in futures),
                    what="the answers, and the deadline to pass",
                )
            return future

        backend._submit = late_caller  # type: ignore[method-assign]
        try:
            replies = backend._round(lambda i: backend.masters[i].inspect(name))
        finally:
            del backend._submit
        assert (replies.results, replies.errors) == ({0: None, 1: None, 2: None}, {})


def test_validity_is_the_ttl_less_elapsed_time_and_drift(
    masters: list[RedisServer], name: str
) -> None:
    with redlock(masters, drift_factor=0.02, drift_margin=0.005) as backend:
        ttl = 5.0
        assert backend.drift(ttl) == pytest.approx(0.105)
        fast = backend.acquire(name, "fast", ttl, current_holder())
        assert fast.acquired and fast.remaining is not None
        assert fast.remaining <= ttl - backend.drift(ttl)
        assert backend.release(name, "fast") is True
        with paused(masters[2]):
            start = time.monotonic()
            slow = backend.acquire(name, "slow", ttl, current_holder())
            elapsed = time.monotonic() - start
        assert slow.acquired and slow.remaining is not None
        # The round waited for the hung master: that time came off the lease.
        assert slow.remaining <= ttl - TIMEOUT - backend.drift(ttl)
        assert slow.remaining >= ttl - elapsed - backend.drift(ttl)
        assert backend.release(name, "slow") is True


def test_a_grant_that_comes_too_late_is_given_back(masters: list[RedisServer], name: str) -> None:
    """ttl shorter than the round took: the quorum granted it, but nothing of the lease
    would be left, so the attempt fails and no master keeps anything."""
    with redlock(masters) as backend, paused(masters[2]):
        result = backend.acquire(name, "late", 0.2, current_holder())
        assert not result.acquired
        assert lock_keys_present(backend, masters[:2], name) == []


def test_a_failed_attempt_leaves_no_partial_keys(masters: list[RedisServer], name: str) -> None:
    with redlock(masters) as backend:
        # Another owner holds the lock on masters 1 and 2 only (a quorum).
        for index in (1, 2):
            assert backend.masters[index].acquire(name, "other", 30, current_holder()).acquired
        result = backend.acquire(name, "mine", 30, current_holder())
        assert not result.acquired
        assert result.remaining is not None and 0 < result.remaining <= 30
        # Master 0 granted its part; the failed attempt gave it back.
        wait_for(lambda: lock_keys_present(backend, masters, name) == [1, 2], what="give back")
        info = backend.inspect(name)
        assert info is not None and info.owner == "other"


def test_a_late_give_back_never_frees_a_later_grant(masters: list[RedisServer], name: str) -> None:
    """An attempt fails while its request to a hung master is still on its way; that
    master then grants it, and the owner's next attempt too (same owner: retry-safe).
    The first attempt's give-back reaches the master after the second attempt was
    granted: it must not free the entry that grant counts on, or a third caller could
    collect a quorum while the lease is held."""
    with redlock(masters, socket_timeout=5.0, socket_connect_timeout=5.0) as backend:
        a, b, c = backend.masters
        holder = current_holder()
        assert backend.inspect(name) is None  # connections to every master are open
        assert a.acquire(name, "other-a", 30, holder).acquired
        assert b.acquire(name, "other-b", 30, holder).acquired
        second: list[Any] = []
        second_done = threading.Event()
        given_back = threading.Event()
        give_back_on = backend._give_back_on

        def late(index: int, *args: Any) -> bool:
            if index == 2:  # hold the first attempt's give-back on C until the end
                assert second_done.wait(30)
            try:
                return give_back_on(index, *args)
            finally:
                given_back.set()

        def second_attempt() -> None:
            second.append(backend.acquire(name, "O", 30, holder))
            second_done.set()

        backend._give_back_on = late  # type: ignore[method-assign]
        assert masters[2].pid is not None
        os.kill(masters[2].pid, signal.SIGSTOP)
        try:
            # A and B refuse: decided without C, whose request waits in its socket.
            assert not backend.acquire(name, "O", 30, holder).acquired
            assert b.release(name, "other-b")
            thread = threading.Thread(target=second_attempt)
            thread.start()
            wait_for(lambda: b.inspect(name) is not None, what="second attempt under way")
        finally:
            os.kill(masters[2].pid, signal.SIGCONT)
        thread.join(30)
        assert second and second[0].acquired  # B and C (C granted both attempts)
        assert given_back.wait(10), "the first attempt never gave back on C"
        # The late give-back left the second grant's entry alone...
        assert raw(masters[2]).hget(c.all_keys(name).lock, "owner") == b"O"
        # ...so with A free again, nobody else collects a quorum.
        assert a.release(name, "other-a")
        assert not backend.acquire(name, "X", 30, holder).acquired
        assert backend.release(name, "O") is True


class Interceptor:
    """Stands between a Redlock backend and its masters to lose answers and delay
    requests, deterministically: what a slow or lossy network does to single requests.

    ``fail(key, index, nth)`` makes the ``nth`` call (1-based) of script ``key`` on
    master ``index`` fail as if its answer never came (the request is not run);
    ``hold(key, index)`` keeps every such call waiting until :meth:`deliver` (it then
    runs, as a late request would). The single-node backends' own calls pass through.
    """

    def __init__(self, backend: RedlockBackend) -> None:
        self.backend = backend
        self.calls: dict[tuple[str, int], int] = {}
        self.failing: set[tuple[str, int, int]] = set()
        self.holding: set[tuple[str, int]] = set()
        self.held = threading.Semaphore(0)
        self.go = threading.Event()
        #: (key, index, result) of each held call once delivered.
        self.delivered: list[tuple[str, int, Any]] = []
        self._guard = threading.Lock()
        self._run = backend._run
        self._acquire_on = backend._acquire_on
        backend._run = self.run  # type: ignore[method-assign]
        backend._acquire_on = self.acquire_on  # type: ignore[method-assign]

    def fail(self, key: str, index: int, nth: int = 1) -> None:
        self.failing.add((key, index, nth))

    def hold(self, key: str, index: int) -> None:
        self.holding.add((key, index))

    def deliver(self) -> None:
        self.go.set()

    def _enter(self, key: str, index: int) -> bool:
        """Count the call; raise if it is to fail; True if it is to be held."""
        with self._guard:
            nth = self.calls[key, index] = self.calls.get((key, index), 0) + 1
        if (key, index, nth) in self.failing:
            raise LockBackendUnavailable(f"rl[{index}]", f"the answer to {key} #{nth} was lost")
        return (key, index) in self.holding

    def _maybe_held(self, key: str, index: int, call: Any) -> Any:
        if not self._enter(key, index):
            return call()
        self.held.release()
        assert self.go.wait(60), "never delivered"
        result = call()
        with self._guard:
            self.delivered.append((key, index, result))
        return result

    def run(self, index: int, key: str, *args: Any) -> Any:
        if key == "acquire":  # an acquire's script: acquire_on has seen it already
            return self._run(index, key, *args)
        return self._maybe_held(key, index, lambda: self._run(index, key, *args))

    def acquire_on(self, index: int, *args: Any) -> Any:
        return self._maybe_held("acquire", index, lambda: self._acquire_on(index, *args))

    def wait_held(self, count: int = 1) -> None:
        for _ in range(count):
            assert self.held.acquire(timeout=60), "no call was held"

    def wait_delivered(self, count: int) -> list[tuple[str, int, Any]]:
        wait_for(lambda: len(self.delivered) >= count, 60, "the held calls delivered")
        return list(self.delivered)


def owners_on(backend: RedlockBackend, servers: list[RedisServer], name: str) -> list[Any]:
    """The owner recorded on each master (None where it holds no entry)."""
    found = []
    for index, server in enumerate(servers):
        client = raw(server)
        try:
            owner = client.hget(backend.masters[index].all_keys(name).lock, "owner")
        finally:
            client.close()
        found.append(owner.decode() if owner is not None else None)
    return found


def test_a_late_give_back_spares_an_entry_the_next_attempt_re_granted(
    masters: list[RedisServer], name: str
) -> None:
    """Attempt 1 is granted by B and C, and confirmed on C, but B's confirmation is
    lost: the attempt fails and gives back; its give-back to C is delayed. Attempt 2 of
    the same owner is granted by B, and by C again (same owner), and confirmed on both.
    The delayed give-back then reaches C: it must not free the entry attempt 2 counts
    on, or a third caller gets A and C while the lease is held."""
    with redlock(masters) as backend:
        a = backend.masters[0]
        assert backend.inspect(name) is None  # connections to every master are open
        assert a.acquire(name, "other", 30, current_holder()).acquired
        net = Interceptor(backend)
        net.fail("confirm", 1)
        net.hold("give_back", 2)
        lease = lock(name, backend="rl", ttl=30, timeout=20, auto_renew=False).acquire()
        try:
            net.wait_held()  # the first attempt's give-back to C did not arrive in time
            assert net.calls["acquire", 2] == 2  # C granted both attempts
            assert owners_on(backend, masters, name) == ["other", lease.owner, lease.owner]
            net.deliver()
            [(_, _, freed)] = net.wait_delivered(1)
            assert freed == 0  # the give-back script refused
            assert owners_on(backend, masters, name) == ["other", lease.owner, lease.owner]
            assert a.release(name, "other")
            with pytest.raises(LockNotAcquired):
                lock(name, backend="rl", timeout=0).acquire()
        finally:
            net.deliver()
            lease.release()


def test_a_renewal_takes_entries_out_of_reach_of_late_give_backs(
    masters: list[RedisServer], name: str
) -> None:
    """Attempt 1 is granted by A and C and confirmed on A only; it fails, and its
    give-back to A is delayed. Attempt 2 is granted by B and C (its request to A is
    lost). C then loses its data, and the lease is renewed: A and B make the quorum.
    The late give-backs (attempt 1's, and attempt 2's for its lost request) reach A
    afterwards: they must not free what the renewal counted on."""
    with redlock(masters) as backend:
        _, b, c = backend.masters
        assert backend.inspect(name) is None
        assert b.acquire(name, "other", 30, current_holder()).acquired
        net = Interceptor(backend)
        net.fail("confirm", 2)
        net.fail("acquire", 0, nth=2)
        net.hold("give_back", 0)
        # B frees up while attempt 1 gives back, so that attempt 2 gets it.
        freed = threading.Thread(target=lambda: (net.wait_held(), b.release(name, "other")))
        freed.start()
        lease = lock(name, backend="rl", ttl=30, timeout=20, auto_renew=False).acquire()
        try:
            freed.join(60)
            assert net.calls["acquire", 0] == 2
            assert owners_on(backend, masters, name) == [lease.owner] * 3
            client = raw(masters[2])
            assert client.delete(c.all_keys(name).lock) == 1  # C lost its data
            client.close()
            lease.extend()
            assert lease.held()
            net.deliver()
            net.wait_delivered(2)  # attempt 1's give-back, and attempt 2's to A
            assert owners_on(backend, masters, name) == [lease.owner, lease.owner, None]
            with pytest.raises(LockNotAcquired):
                lock(name, backend="rl", timeout=0).acquire()
        finally:
            net.deliver()
            lease.release()


def test_partial_leftovers_are_not_reported_as_locks(masters: list[RedisServer], name: str) -> None:
    with redlock(masters) as backend:
        assert backend.masters[0].acquire(name, "stray", 30, current_holder()).acquired
        assert backend.inspect(name) is None
        assert [i for i in backend.iter_locks() if i.name == name] == []
        # The stray entry blocks one master only: a quorum is still there to take.
        with lock(name, backend="rl", timeout=0) as lease:
            listed = [i for i in backend.iter_locks() if i.name == name]
            assert [i.owner for i in listed] == [lease.owner]
            assert listed[0].extra["masters"] == "2/3"


def test_split_votes_resolve(masters: list[RedisServer], name: str) -> None:
    """Many callers at once split the masters between them; retries after a random pause
    still serve everyone, one at a time."""
    with redlock(masters):
        inside = 0
        most = 0
        done = 0
        guard = threading.Lock()

        def worker() -> None:
            nonlocal inside, most, done
            for _ in range(5):
                with lock(name, backend="rl", ttl=10, timeout=60):
                    with guard:
                        inside += 1
                        most = max(most, inside)
                    time.sleep(0.001)
                    with guard:
                        inside -= 1
                        done += 1

        threads = [threading.Thread(target=worker) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert (done, most) == (30, 1)


# -- fencing tokens -----------------------------------------------------------------


def test_tokens_increase_across_masters_restarting_empty(
    masters: list[RedisServer], name: str
) -> None:
    with redlock(masters) as backend:
        tokens = []
        for restart in ([], [0], [1, 2], [0, 1, 2]):
            for index in restart:
                port = masters[index].port
                masters[index].kill()
                masters[index].start(port=port)  # no persistence: empty
            with lock(name, backend="rl", timeout=0) as lease:
                tokens.append(lease.fencing_token)
            assert backend.fencing_counter(name) == lease.fencing_token
        assert tokens == sorted(set(tokens))


def test_the_grant_raises_every_quorum_counter_to_its_token(
    masters: list[RedisServer], name: str
) -> None:
    """One master's counter is far ahead (of its clock and of the others): the token is
    that master's, and the other masters of the quorum are raised to it. So when that
    master later loses everything, the next token is still higher. Without the raise,
    the other masters would mint from their clocks, below the earlier token."""
    with redlock(masters, **PATIENT) as backend:
        ahead = (time.time_ns() // 1000) + 3_600_000_000  # an hour ahead of the clocks
        client = raw(masters[1])
        client.set(backend.masters[1].all_keys(name).fence, ahead)
        client.close()
        with lock(name, backend="rl", timeout=0) as first:
            assert first.fencing_token == ahead + 1
            for index, server in enumerate(masters):
                keys = backend.masters[index].all_keys(name)
                master = raw(server)
                assert int(master.hget(keys.lock, "token")) == first.fencing_token
                assert int(master.get(keys.fence)) == first.fencing_token
                master.close()
        port = masters[1].port
        masters[1].kill()
        masters[1].start(port=port)
        with lock(name, backend="rl", timeout=0) as second:
            assert second.fencing_token > first.fencing_token


def test_force_release_moves_the_counter_on(masters: list[RedisServer], name: str) -> None:
    with redlock(masters) as backend:
        lease = lock(name, backend="rl").acquire()
        assert backend.force_release(name) is True
        assert backend.fencing_counter(name) > lease.fencing_token
        assert backend.inspect(name) is None
        assert lease.release() is False and lease.state == "lost"
        masters[0].kill()
        assert backend.force_release(name) is False  # two answers are enough
        masters[1].kill()
        with pytest.raises(LockBackendUnavailable, match="force-release"):
            backend.force_release(name)
        with pytest.raises(LockBackendUnavailable, match="fencing counter"):
            backend.fencing_counter(name)


# -- renewal ------------------------------------------------------------------------


def test_renewal_by_quorum_and_loss_when_the_quorum_goes(
    masters: list[RedisServer], name: str
) -> None:
    lost = threading.Event()
    ttl = 1.0
    with redlock(masters) as backend:
        with pytest.raises(LockLost) as excinfo:
            with lock(name, backend="rl", ttl=ttl, on_lost=lambda _: lost.set()) as lease:
                masters[0].kill()
                renewals = lease.renewals
                # Two masters still renew it, past several lease lengths' worth of time.
                wait_for(lambda: lease.renewals >= renewals + 4, what="renewals by two")
                assert lease.held()
                assert backend.inspect(name).extra["masters"] == "2/3"  # type: ignore[union-attr]
                masters[1].kill()
                killed_at = time.monotonic()
                assert lost.wait(ttl + 5)
                # Not before the lease ran out: the masters might have come back.
                assert time.monotonic() - killed_at >= ttl / 3
                assert not lease.held()
        assert excinfo.value.lease is lease
        assert "only 1 of 3 Redis masters answered" in lease.lost_reason


#: One master confirmed, one never had the entry, one hung.
UNCONFIRMED = "1 of 3 Redis masters confirmed it, 1 did not have it and 1 did not answer"


def lease_on_two_masters(backend: RedlockBackend, masters: list[RedisServer], name: str) -> Any:
    """A lease whose entry is on masters 0 and 1 only: master 2 was down at the grant
    and came back empty (as after a grant it did not answer in time, whose late part
    was given back). Still a quorum, so still held. Reentrant, so a nested lock()
    of this thread re-enters it."""
    port = masters[2].port
    masters[2].kill()
    lease = lock(name, backend="rl", ttl=30, auto_renew=False, reentrant=True).acquire()
    masters[2].start(port=port)
    assert lock_keys_present(backend, masters, name) == [0, 1]
    return lease


def test_a_renewal_the_quorum_cannot_confirm_is_unavailable_not_lost(
    masters: list[RedisServer], name: str
) -> None:
    """The lease is on two masters; one of them hangs during an extend. One master
    confirms, one says "not mine", one does not answer: whether a quorum still holds
    the lease is unknown (the hung master has it), not "lost". The caller hears
    LockBackendUnavailable, and the lease stays held on its earlier validity, as on a
    single server that times out; it is extended once the master answers again."""
    with redlock(masters) as backend:
        lease = lease_on_two_masters(backend, masters, name)
        try:
            valid_until = lease.remaining()
            with paused(masters[1]):
                with pytest.raises(LockBackendUnavailable, match=UNCONFIRMED):
                    lease.extend(60)
                # The renewer's batch: an error (retried), not False (lost).
                [outcome] = backend.extend_many([(name, lease.owner, 60.0)])
                assert isinstance(outcome, LockBackendUnavailable), outcome
                # A reentrant re-entry confirms with the servers: the same error.
                with pytest.raises(LockBackendUnavailable):
                    lock(name, backend="rl", reentrant=True, timeout=0).acquire()
            assert lease.state == "held" and lease.held()
            remaining = lease.remaining()
            assert remaining is not None and valid_until is not None
            assert remaining <= valid_until  # not extended by the unconfirmed call
            lease.extend(60)
            assert lease.held() and lease.ttl == 60
        finally:
            lease.release()


def test_a_release_the_quorum_cannot_confirm_is_unavailable(
    masters: list[RedisServer], name: str
) -> None:
    """The same split at release: one master freed it, one never had it, one hangs.
    Whether this call freed a held lock is unknown: LockBackendUnavailable (the lease
    then ends by expiry), not "the server no longer had it"."""
    with redlock(masters) as backend:
        lease = lease_on_two_masters(backend, masters, name)
        with paused(masters[1]):
            with pytest.raises(LockBackendUnavailable, match=UNCONFIRMED):
                backend.release(name, lease.owner)
        assert lease.state == "held"
        assert backend.inspect(name) is None  # one entry left: no lock
        lease.release()


def test_a_lease_a_quorum_no_longer_has_is_lost_even_with_a_master_hung(
    masters: list[RedisServer], name: str
) -> None:
    """Two masters say "not held" and the third hangs: at most one entry is left, no
    quorum can hold it, so the lease is lost (not "unavailable")."""
    with redlock(masters) as backend:
        lease = lease_on_two_masters(backend, masters, name)
        client = raw(masters[0])
        client.delete(backend.masters[0].all_keys(name).lock)
        client.close()
        with paused(masters[1]):
            with pytest.raises(LockLost):
                lease.extend()
        assert lease.state == "lost"


def test_renewal_extends_every_master_by_the_ttl_and_the_drift(
    masters: list[RedisServer], name: str
) -> None:
    with redlock(masters, **PATIENT) as backend:
        lease = lock(name, backend="rl", ttl=20, auto_renew=False).acquire()
        try:
            lease.extend(100)
            for index, server in enumerate(masters):
                client = raw(server)
                key = backend.masters[index].all_keys(name).lock
                # extend() returns once a quorum confirmed: the last master's extend may
                # still be on its way.
                wait_for(
                    lambda c=client, k=key: c.pttl(k) > 100_000, 10, "the extend on every master"
                )
                # The master keeps it for longer than the lease counts on...
                assert client.pttl(key) > 100_000
                assert client.pttl(key) <= round((100 + backend.drift(100)) * 1000)
                # ...and reports the ttl asked for.
                assert client.hget(key, "ttl") == b"100000"
                client.close()
            info = backend.inspect(name)
            assert info is not None and (info.ttl, info.renewals) == (100, 1)
        finally:
            lease.release()


def test_late_requests_of_an_attempt_change_nothing_of_the_lease(
    masters: list[RedisServer], name: str
) -> None:
    """Requests of an attempt that reach a master late (a grant, a confirmation, a
    give-back of the grant's own attempt or of an older one) neither free nor shorten
    nor re-token an entry the lease renewed."""
    with redlock(masters, **PATIENT) as backend:
        lease = lock(name, backend="rl", ttl=5, auto_renew=False).acquire()
        try:
            client = raw(masters[0])
            grant = client.hget(backend.masters[0].all_keys(name).lock, "attempt").decode()
            client.close()
            lease.extend(100)
            attempts = sorted({"1", grant})  # the oldest there is, and the grant's own
            for index, server in enumerate(masters):
                keys = backend.masters[index].all_keys(name)
                client = raw(server)
                token = client.hget(keys.lock, "token")
                for attempt in attempts:
                    late = backend._acquire_on(
                        index, name, lease.owner, 5, current_holder(), 0.0, False, attempt
                    )
                    assert not late.acquired
                    assert backend._run(index, "confirm", "acquire", name, [keys.lock, keys.fence],
                                        [lease.owner, "1", attempt]) == 0  # fmt: skip
                    assert backend._give_back_on(index, name, lease.owner, attempt) is False
                assert client.hget(keys.lock, "owner") == lease.owner.encode()
                assert client.hget(keys.lock, "token") == token
                assert client.pttl(keys.lock) > 50_000  # not cut back to the 5 s ttl
                client.close()
            lease.extend()
            assert lease.held()
        finally:
            lease.release()
        # release() returns once a quorum confirmed; the last master's delete may still
        # be on its way.
        wait_for(lambda: lock_keys_present(backend, masters, name) == [], what="release")


# -- waiting ------------------------------------------------------------------------


def test_a_release_wakes_the_waiter(masters: list[RedisServer], name: str) -> None:
    """Blocking waits time out only after 4 s here: a grant sooner came from a wake-up."""
    with redlock(masters, socket_timeout=5.0) as backend:
        assert min(master.wait_chunk for master in backend.masters) >= 4
        holder = lock(name, backend="rl", ttl=30).acquire()
        granted: list[float] = []

        def waiter() -> None:
            with lock(name, backend="rl", ttl=30, timeout=20):
                granted.append(time.monotonic())

        thread = threading.Thread(target=waiter)
        thread.start()
        wait_for(lambda: (backend.inspect(name).waiters or 0) >= 1, what="registered")  # type: ignore[union-attr]
        released = time.monotonic()
        holder.release()
        thread.join(30)
        assert granted and granted[0] - released < 1.0
        assert backend.inspect(name) is None


def test_a_woken_waiter_ahead_of_a_lagging_release_is_woken_again(
    masters: list[RedisServer], name: str
) -> None:
    """A release reaches the masters one by one: a waiter woken by the first one may try
    while the others still hold the lock, and fail. It must then listen on a master
    that still holds it, whose part of the release wakes it: not on the master that
    woke it, where nothing is left to wake it and it waits a whole blocking chunk."""
    with redlock(masters, **PATIENT) as backend:
        holder = lock(name, backend="rl", ttl=120, auto_renew=False).acquire()
        assert lock_keys_present(backend, masters, name) == [0, 1, 2]
        # A spy on the waiter's blocking waits (the masters are real): which master each
        # one listens on, in order.
        listened: list[int] = []
        for index, master in enumerate(backend.masters):

            def wait(*args: Any, index: int = index, _wait: Any = master.wait, **kw: Any) -> None:
                listened.append(index)
                _wait(*args, **kw)

            master.wait = wait  # type: ignore[method-assign]
        granted: list[int] = []

        def waiter() -> None:
            with lock(name, backend="rl", ttl=30, timeout=100) as lease:
                granted.append(lease.fencing_token)

        thread = threading.Thread(target=waiter, daemon=True)
        thread.start()
        # Held everywhere: it listens on a master that refused it (the first to, or
        # master 0 if all three answered; a wait is one 4 s chunk at most).
        wait_for(lambda: listened, 60, what="the waiter to listen")
        # The release's first step only: master 0. Its wake-up (or a chunk's end)
        # brings an attempt that masters 1 and 2 refuse; the waiter must listen on one
        # of them, never only on master 0, where the lock is gone.
        assert backend.masters[0].release(name, holder.owner)
        wait_for(lambda: set(listened) & {1, 2}, 60, what="the waiter to listen on master 1 or 2")
        # The rest of the release wakes it there.
        assert backend.masters[1].release(name, holder.owner)
        assert backend.masters[2].release(name, holder.owner)
        thread.join(30)
        assert not thread.is_alive()
        assert granted and granted[0] > holder.fencing_token
        wait_for(lambda: lock_keys_present(backend, masters, name) == [], what="release")


def test_waiters_go_on_when_a_master_is_down(masters: list[RedisServer], name: str) -> None:
    with redlock(masters) as backend:
        masters[0].kill()  # the master waiters would listen on first
        holder = lock(name, backend="rl", ttl=30).acquire()
        outcome: list[int] = []

        def waiter() -> None:
            with lock(name, backend="rl", timeout=20) as lease:
                outcome.append(lease.fencing_token)

        thread = threading.Thread(target=waiter)
        thread.start()
        wait_for(lambda: (backend.inspect(name).waiters or 0) >= 1, what="registered")  # type: ignore[union-attr]
        holder.release()
        thread.join(30)
        assert outcome and outcome[0] > holder.fencing_token


def test_async_lock_with_a_master_down(masters: list[RedisServer], name: str) -> None:
    async def main() -> list[int]:
        tokens = []
        for _ in range(3):
            async with alock(name, backend="rl", ttl=5, timeout=5) as lease:
                tokens.append(lease.fencing_token)
        return tokens

    with redlock(masters):
        masters[1].kill()
        tokens = asyncio.run(main())
    assert tokens == sorted(set(tokens))


# -- configuration ------------------------------------------------------------------


URLS = ["redis://a:6379/0", "redis://b:6379/0", "redis://c:6379/0"]


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"LOCATION": "redis://a:6379/0"}, "not one URL string"),
        ({}, "it is missing"),
        ({"LOCATION": URLS[:2]}, "lists 2 master(s); Redlock needs at least 3"),
        ({"LOCATION": [*URLS[:2], "http://c"]}, "LOCATION[2] = 'http://c' must be a URL"),
        ({"LOCATION": [*URLS[:2], "redis://A:6379/1"]}, "points at the same Redis server"),
        ({"LOCATION": URLS, "CACHE": "redis"}, "unknown key(s) CACHE"),
        ({"LOCATION": URLS, "OPTIONS": {"drift": 0.1}}, "unknown OPTIONS key(s) drift"),
        ({"LOCATION": URLS, "OPTIONS": {"drift_factor": 1.5}}, "OPTIONS['drift_factor']"),
        ({"LOCATION": URLS, "OPTIONS": {"drift_margin": -1}}, "OPTIONS['drift_margin']"),
        ({"LOCATION": URLS, "OPTIONS": {"socket_timeout": 0}}, "OPTIONS['socket_timeout']"),
    ],
)
def test_bad_configuration_is_explained(entry: dict[str, Any], problem: str) -> None:
    problems = RedlockBackend.validate_config("rl", {"BACKEND": REDLOCK, **entry})
    assert any(problem in p for p in problems), problems


def test_good_configuration_has_no_problem() -> None:
    options = {"drift_factor": 0.05, "drift_margin": 0.01, "key_prefix": "locks"}
    entry = {"BACKEND": REDLOCK, "LOCATION": [*URLS, "unix:///tmp/r.sock"][:3], "OPTIONS": options}
    assert RedlockBackend.validate_config("rl", entry) == []


@pytest.mark.parametrize(
    ("location", "expected"),
    [
        (URLS, []),
        ([*URLS, "redis://d"], ["distlocks.W002"]),
        ([*URLS, "redis://d", "redis://e"], []),
        (URLS[:2], ["distlocks.E004"]),
        ("redis://a", ["distlocks.E004"]),
    ],
)
def test_system_checks(location: Any, expected: list[str]) -> None:
    backends = {"default": {"BACKEND": REDLOCK, "LOCATION": location}}
    with override_settings(DISTLOCKS_BACKENDS=backends):
        assert [message.id for message in check_settings()] == expected


def test_a_bad_configuration_fails_at_first_use() -> None:
    from django.core.exceptions import ImproperlyConfigured

    backends = {"default": {"BACKEND": REDLOCK, "LOCATION": URLS[:1]}}
    with (
        override_settings(DISTLOCKS_BACKENDS=backends),
        pytest.raises(ImproperlyConfigured, match="at least 3"),
    ):
        get_backend()
