"""Review 8: the races left around a release that does not wait for a call in flight.

A renewal's (or the holder's ``extend()``) server call may be stuck until its socket
timeout. Nothing the holder does next may wait for it: two releases at the moment the
renewal ends, a reentrant lock taken again, a release meeting an ``extend()`` that has
the mutex and has not yet marked its call, the run lock of a Celery task released with
its queue marker. A renewal killed inside ``extend_many`` by a BaseException leaves no
mutex held behind it.

Most tests run on the in-process LocMem backend behind a gate (as in
``tests/test_lost_on_time_interleavings.py``): its ``extend()`` and ``release()`` enter,
and wait until the test lets them answer with what LocMem itself says. The one window a
gate cannot hold (a release that chose to go beside the call and has not yet decided) is
held by pausing that release right after its choice. The Celery test runs on the session's
Redis server through the fault proxy, whose blackhole leaves the renewal's call stuck.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from distlocks import alock, get_backend, lock
from distlocks.exceptions import LockLost, LockNotAcquired
from distlocks.signals import lock_lost
from tests.faults.helpers import session_redis_port
from tests.faults.proxy import FaultProxy
from tests.test_lost_on_time_interleavings import GatedLocMem
from tests.waiting import wait_for

LIMIT = 30.0  # seconds any step may wait for a thread (generous; never reached)
#: How long a release (or re-entry) racing a stuck call may take: far below LIMIT,
#: which is how long it takes when it waits for that call.
WITHIN = 20.0
ALIAS = "gated8"


class Killed(BaseException):
    """What a greenlet kill or a KeyboardInterrupt is to the renewer: not an Exception."""


class GatedReleases(GatedLocMem):
    """:class:`GatedLocMem` whose ``release()`` calls are counted, and wait at a gate of
    their own while it is closed; ``extend_many`` raises :class:`Killed` when told to."""

    # Its calls may wait at a gate: an asyncio lease awaits them in a thread.
    calls_block = True

    def __init__(self, alias: str, config: Mapping[str, Any]) -> None:
        super().__init__(alias, config)
        self.releases = 0
        self.release_gate = threading.Event()
        self.release_gate.set()
        self.kill_batches = False
        self.kill_extends = False

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        if self.kill_extends:
            raise Killed("the caller thread was killed in its call")
        return super().extend(name, owner, ttl)

    def release(self, name: str, owner: str) -> bool:
        self.releases += 1
        assert self.release_gate.wait(LIMIT)
        return super().release(name, owner)

    def extend_many(self, leases: Any) -> Any:
        if self.kill_batches:
            raise Killed("the caller thread was killed in its call")
        return super().extend_many(leases)


@pytest.fixture
def gated() -> Iterator[GatedReleases]:
    config = {**settings.DISTLOCKS_BACKENDS, ALIAS: {"BACKEND": f"{__name__}.GatedReleases"}}
    with override_settings(DISTLOCKS_BACKENDS=config):
        backend = get_backend(ALIAS)
        assert isinstance(backend, GatedReleases)
        yield backend
        backend.release_gate.set()
        backend.unstuck.set()
        backend.opened.set()


def _thread(target: Callable[[], object], out: list[object]) -> threading.Thread:
    def run() -> None:
        try:
            out.append(target())
        except BaseException as exc:  # looked at by the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _stuck_renewal(backend: GatedReleases, lease: Any) -> threading.Thread:
    """A renewal of ``lease`` (what a renewer's caller runs) whose call waits at the gate."""
    backend.entered.clear()
    backend.opened.clear()
    backend.armed = True
    renewal = _thread(lease._renew_once, [])
    assert backend.entered.wait(LIMIT), "the renewal did not send its call"
    return renewal


def _answer(backend: GatedReleases, renewal: threading.Thread, answer: str) -> None:
    backend.answer = answer
    backend.opened.set()
    renewal.join(LIMIT)
    assert not renewal.is_alive()


# -- 1. two releases at the moment the renewal ends -------------------------------------


@given(
    answer=st.sampled_from(["success", "gone", "error"]),
    order=st.permutations(["answer", "second", "first"]),
)
@hsettings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_two_releases_as_the_renewal_ends_send_one_call(
    gated: GatedReleases, answer: str, order: list[str]
) -> None:
    """A renewal's call is in flight; a first release chooses to go beside it and is
    held right there, before it decides; then, in every order: the renewal answers, a
    second release comes (taking the mutex if the renewal has ended), the first goes on.
    Release calls are held until both releases have decided. Exactly one release call is
    sent; a loss is reported only when the lock really was force-released ("gone"), once;
    otherwise exactly one release returns True and the lock is free."""
    backend = gated
    losses: list[str] = []
    name = f"review8-two:{time.monotonic_ns()}"
    lease = lock(
        name, backend=ALIAS, ttl=600, auto_renew=False, on_lost=lambda x: losses.append(x.name)
    ).acquire()
    backend.releases = 0
    backend.release_gate.clear()
    renewal = _stuck_renewal(backend, lease)

    real = lease._beside_a_call
    chose = threading.Event()
    go = threading.Event()
    first_call = [True]

    def paused() -> bool:
        beside = real()
        if first_call[0]:
            first_call[0] = False
            chose.set()
            assert beside  # the renewal's call is in flight
            assert go.wait(LIMIT)
        return bool(beside)

    lease._beside_a_call = paused  # type: ignore[method-assign]
    results: dict[str, list[object]] = {"first": [], "second": []}
    threads = {"first": _thread(lease.release, results["first"])}
    assert chose.wait(LIMIT), "the first release did not go beside the call in flight"
    sent = 0

    def decided(who: str) -> bool:
        # Finished, or its call is waiting at the release gate.
        return bool(results[who]) or backend.releases > sent

    for step in order:
        if step == "answer":
            _answer(backend, renewal, answer)
            continue
        sent = backend.releases
        if step == "first":
            go.set()
        else:
            threads["second"] = _thread(lease.release, results["second"])
        deadline = time.monotonic() + WITHIN
        while not decided(step):
            assert time.monotonic() < deadline, f"the {step} release waited for a call in flight"
            time.sleep(0.001)
    backend.release_gate.set()
    for thread in threads.values():
        thread.join(LIMIT)
        assert not thread.is_alive()
    outcomes = results["first"] + results["second"]
    assert all(isinstance(x, bool) for x in outcomes), outcomes
    assert backend.releases <= 1, f"{backend.releases} release calls"
    info = backend.inspect(name)
    assert info is None or info.owner != lease.owner
    if answer == "gone":
        assert lease.state == "lost" and len(losses) == 1
        assert True not in outcomes
    else:
        assert losses == [], lease.lost_reason
        assert outcomes.count(True) == 1, outcomes
        assert lease.state == "released"


def test_a_second_release_does_not_wait_for_the_first_ones_call(
    gated: GatedReleases, name: str
) -> None:
    """The first release's call (sent with the mutex held) gets no answer; a second
    release from another thread returns False at once instead of waiting for it, sends
    nothing, and the first one's answer frees the lock."""
    backend = gated
    lease = lock(name, backend=ALIAS, ttl=600, auto_renew=False).acquire()
    backend.releases = 0
    backend.release_gate.clear()
    first: list[object] = []
    releaser = _thread(lease.release, first)
    wait_for(lambda: backend.releases == 1, LIMIT, "the first release's call")
    second: list[object] = []
    other = _thread(lease.release, second)
    other.join(WITHIN)
    assert not other.is_alive(), "the second release waited for the first one's call"
    assert second == [False] and backend.releases == 1
    backend.release_gate.set()
    releaser.join(LIMIT)
    assert first == [True] and lease.state == "released"
    assert backend.inspect(name) is None


# -- 2. a reentrant lock taken again while its renewal is stuck ---------------------------


def test_reentry_does_not_wait_for_a_stuck_renewal(gated: GatedReleases, name: str) -> None:
    """The holder takes its reentrant lock again while the renewal's call is stuck: it
    is granted at once from local state (the call in flight is confirming it), one level
    deeper; the outer release then still holds it, the last one frees it."""
    backend = gated
    reentrant = lock(name, backend=ALIAS, ttl=600, auto_renew=False, reentrant=True)
    acquired = threading.Event()
    stuck = threading.Event()
    seen: list[object] = []

    def holder() -> None:
        outer = reentrant.acquire()
        seen.append(outer)
        acquired.set()
        assert stuck.wait(LIMIT)
        seen.append(reentrant.acquire(timeout=1))

    worker = _thread(holder, [])
    assert acquired.wait(LIMIT)
    lease: Any = seen[0]
    renewal = _stuck_renewal(backend, lease)
    stuck.set()
    worker.join(WITHIN)
    assert not worker.is_alive(), "the re-entry waited for the stuck renewal"
    assert seen[1] is lease and lease._depth == 2
    _answer(backend, renewal, "success")
    assert lease.held() and lease.renewals == 1
    assert lease.release() is False  # the inner level
    assert lease.held()
    assert lease.release() is True
    assert backend.inspect(name) is None


def test_reentry_confirms_with_the_server_when_no_call_is_in_flight(
    gated: GatedReleases, name: str
) -> None:
    """Without a call in flight the re-entry still asks the server: a lock force-released
    under the outer block fails loudly."""
    reentrant = lock(name, backend=ALIAS, ttl=600, auto_renew=False, reentrant=True)
    lease = reentrant.acquire()
    assert reentrant.acquire() is lease
    assert lease._depth == 2 and lease.renewals == 1  # extended by the re-entry
    assert lease.release() is False
    gated.force_release(name)
    with pytest.raises(LockLost):
        reentrant.acquire()
    assert lease.state == "lost" and lease._depth == 1
    assert lease.release() is False


def test_async_reentry_does_not_wait_for_a_stuck_renewal(gated: GatedReleases, name: str) -> None:
    """alock(): the same, with the renewal task awaiting its stuck call."""
    backend = gated

    async def main() -> None:
        reentrant = alock(name, backend=ALIAS, ttl=600, auto_renew=False, reentrant=True)
        lease = await reentrant.acquire()
        backend.entered.clear()
        backend.opened.clear()
        backend.armed = True
        turn = asyncio.get_running_loop().create_task(lease._arenew_once())
        limit = time.monotonic() + LIMIT
        while not backend.entered.is_set():
            assert time.monotonic() < limit, "the renewal did not send its call"
            await asyncio.sleep(0.001)
        try:
            async with asyncio.timeout(WITHIN):  # in this task: a re-entry
                again = await reentrant.acquire(timeout=1)
        except TimeoutError:
            pytest.fail("the re-entry waited for the stuck renewal")
        assert again is lease and lease._depth == 2
        backend.answer = "success"
        backend.opened.set()
        await asyncio.wait_for(turn, LIMIT)
        assert await lease.release() is False
        assert await lease.release() is True

    asyncio.run(asyncio.wait_for(main(), 120))
    assert backend.inspect(name) is None


# -- 3. a release meeting the holder's extend() before it marks its call ---------------------


def test_a_release_does_not_wait_for_an_extend_about_to_send(
    gated: GatedReleases, name: str
) -> None:
    """The holder's extend() has taken the mutex and not yet marked its call in flight
    (held there: the renewer it registers with is busy) when another thread releases the
    lease; the extension then sends its call, which is stuck. The release does not wait
    for it: it sees the call and is sent beside it; the extension ends in LockLost."""
    from distlocks.renewal import renewer

    backend = gated
    lease = lock(name, backend=ALIAS, ttl=600, auto_renew=False).acquire()
    watcher = renewer(ALIAS)
    extended: list[object] = []
    released: list[object] = []
    backend.entered.clear()
    backend.opened.clear()
    backend.armed = True
    with watcher._lock:  # extend() waits here, with the lease's mutex held
        extension = _thread(lease.extend, extended)
        deadline = time.monotonic() + LIMIT
        while lease._mutex.acquire(blocking=False):
            lease._mutex.release()
            assert time.monotonic() < deadline, "extend() did not take the mutex"
            time.sleep(0.001)
        releaser = _thread(lease.release, released)
        wait_for(lambda: lease._releasing, LIMIT, "the release marked as waiting")
    # extend() goes on: it marks its call and sends it, and the call is stuck.
    assert backend.entered.wait(LIMIT)
    releaser.join(WITHIN)
    assert not releaser.is_alive(), "release() waited for the extend() in flight"
    assert released == [True]
    assert lease.state == "released" and backend.inspect(name) is None
    backend.answer = "success"
    backend.opened.set()
    extension.join(LIMIT)
    assert not extension.is_alive()
    assert len(extended) == 1 and isinstance(extended[0], LockLost), extended
    assert lease.state == "released"


# -- 4. a batch renewal killed by a BaseException ---------------------------------------------


def test_a_batch_renewal_killed_in_extend_many_frees_its_leases(
    gated: GatedReleases, name: str
) -> None:
    """extend_many raises a BaseException (a greenlet killed, KeyboardInterrupt): the
    caller thread dies with it, and the leases of its batch are left with no mutex held
    and no call marked in flight: extend() and release() work at once afterwards, and
    the leases are looked at again by the renewer."""
    from distlocks.renewal import renewer

    leases = [
        lock(f"{name}:{n}", backend=ALIAS, ttl=600, auto_renew=False).acquire() for n in range(3)
    ]
    gated.kill_batches = True
    died: list[object] = []
    caller = _thread(lambda: renewer(ALIAS)._renew_together(leases), died)
    caller.join(LIMIT)
    assert len(died) == 1 and isinstance(died[0], Killed), died
    gated.kill_batches = False
    assert all(not x._renewing for x in leases)
    heap = renewer(ALIAS)._heap
    assert {id(x) for x in leases} <= {id(entry[2]()) for entry in heap}
    done: list[object] = []
    worker = _thread(lambda: [leases[0].extend(), leases[1].release()], done)
    worker.join(WITHIN)
    assert not worker.is_alive(), "a lease of the killed batch still has its mutex held"
    assert done == [[None, True]]
    assert leases[0].renewals == 1 and leases[0].held()
    assert leases[0].release() is True and leases[2].release() is True


def test_a_lone_renewal_killed_in_extend_frees_its_lease_and_schedules_it(
    gated: GatedReleases, name: str
) -> None:
    """The same for a lease renewed on its own (``extend``, not a batch): its mutex is
    freed and it is put back on the renewer's schedule, so it is renewed again."""
    from distlocks.renewal import renewer

    lease = lock(name, backend=ALIAS, ttl=600, auto_renew=False).acquire()
    gated.kill_extends = True
    died: list[object] = []
    caller = _thread(lambda: renewer(ALIAS)._renew_alone(lease), died)
    caller.join(LIMIT)
    assert len(died) == 1 and isinstance(died[0], Killed), died
    gated.kill_extends = False
    assert not lease._renewing
    assert id(lease) in {id(entry[2]()) for entry in renewer(ALIAS)._heap}
    done: list[object] = []
    worker = _thread(lambda: [lease.extend(), lease.release()], done)
    worker.join(WITHIN)
    assert not worker.is_alive(), "the lease still has its mutex held"
    assert done == [[None, True]]


# -- 5. the Celery run lock and its marker, released together on Redis ------------------------

#: The stuck call's own limit: far beyond the test.
STUCK = 60.0


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    started = FaultProxy(session_redis_port()).start()
    yield started
    started.close()


@pytest.fixture
def stuck_redis(proxy: FaultProxy) -> Iterator[str]:
    """An alias whose connections go through the proxy (socket timeout of a minute)."""
    config = {
        **settings.DISTLOCKS_BACKENDS,
        "stuckredis8": {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": proxy.url(),
            "OPTIONS": {"socket_timeout": STUCK},
        },
    }
    with override_settings(DISTLOCKS_BACKENDS=config):
        yield "stuckredis8"
        proxy.heal()
        proxy.reset()


def _free(name: str, alias: str) -> bool:
    try:
        with lock(name, backend=alias, timeout=0):
            return True
    except LockNotAcquired:
        return False


@pytest.mark.django_db(transaction=True)
def test_release_both_does_not_wait_for_a_stuck_renewal(
    stuck_redis: str, proxy: FaultProxy, name: str
) -> None:
    """The run lock's renewal is stuck (its request swallowed) when the task ends:
    ``release_both`` does not wait for it; it leaves the two releases to the caller
    (None), whose ``release()`` goes beside the stuck call. Both locks end free, and the
    stuck call's late end reports nothing."""
    from distlocks.contrib import celery_redis
    from distlocks.renewal import renewer

    alias = stuck_redis
    losses: list[str] = []
    receiver = lambda sender, lease, reason, **kw: losses.append(lease.name)  # noqa: E731
    lock_lost.connect(receiver, weak=False)
    try:
        lease = lock(name, backend=alias, ttl=120).acquire()
        marker = lock(f"{name}:queued", backend=alias, ttl=120, auto_renew=False).acquire()
        lease.extend()  # the connection and scripts are ready: the stall hits a renewal
        swallowed = proxy.stats["swallowed"]
        proxy.blackhole()
        renewer(alias).add(lease, time.monotonic())  # due now
        wait_for(
            lambda: lease._renewing and proxy.stats["swallowed"] > swallowed,
            30,
            "a stuck renewal",
        )
        proxy.heal()
        answered: list[object] = []
        releaser = _thread(lambda: celery_redis.release_both(lease, marker), answered)
        releaser.join(WITHIN)
        assert not releaser.is_alive(), "release_both() waited for the stuck renewal"
        assert answered == [None]  # the caller releases them one by one
        assert lease.release() is True
        assert marker.release() is True
        wait_for(lambda: _free(name, alias) and _free(f"{name}:queued", alias), 30, "both free")
        proxy.reset()  # the stuck call ends now, long after the release
        wait_for(lambda: not lease._renewing, 30, "the stuck call's end")
        assert lease.state == marker.state == "released"
        assert not losses
    finally:
        lock_lost.disconnect(receiver)
