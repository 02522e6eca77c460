"""Defects found by adversarial review (issue "Hardening"), one test or more each:
input bounds, force release bound to a token, the fork rule, key collisions, and
held() that never waits for I/O. Real servers only."""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
import threading
import time
from typing import Any

import pytest
import redis as redis_lib

from distlocks import get_backend, lock
from distlocks.exceptions import LockLost, LockNotAcquired
from distlocks.primitives import rwlock, semaphore
from distlocks.renewal import lateness
from distlocks.validation import MAX_SEMAPHORE_LIMIT, MAX_TIMEOUT, MAX_TTL

HUGE_TTLS = [1e17, sys.maxsize, 1e300, 10**400, 1e12, MAX_TTL + 1, -(10**400)]


def _keys_of(client: redis_lib.Redis, name: str) -> list[bytes]:
    return [key for key in client.keys("*") if name.encode() in key]


# -- 2. bounds: a value the server cannot store is refused before anything is written --


@pytest.mark.parametrize("ttl", HUGE_TTLS, ids=str)
def test_a_ttl_beyond_the_bound_is_refused_at_the_call(
    ttl: Any, name: str, redis_client: redis_lib.Redis
) -> None:
    with pytest.raises(ValueError, match=r"ttl must|ttl must not") as excinfo:
        lock(name, backend="redis", ttl=ttl)
    if ttl > 0:
        assert f"{MAX_TTL:,}" in str(excinfo.value)  # the message names the bound
    with pytest.raises(ValueError):
        semaphore(name, backend="redis", limit=2, ttl=ttl)
    with pytest.raises(ValueError):
        rwlock(name, backend="redis").write(ttl=ttl)
    assert _keys_of(redis_client, name) == []


@pytest.mark.parametrize("timeout", [1e17, 10**400, math.inf, MAX_TIMEOUT * 2], ids=str)
def test_a_timeout_beyond_the_bound_is_refused(timeout: Any, name: str) -> None:
    with pytest.raises(ValueError, match="timeout must"):
        lock(name, backend="redis", timeout=timeout)
    lock_object = lock(name, backend="redis")
    with pytest.raises(ValueError, match="timeout must"):
        lock_object.acquire(timeout=timeout)


def test_the_largest_allowed_ttl_is_stored_listed_and_force_released(
    name: str, redis_client: redis_lib.Redis
) -> None:
    backend = get_backend("redis")
    lease = lock(name, backend="redis", ttl=MAX_TTL, auto_renew=False).acquire()
    try:
        key = backend.all_keys(name).lock
        assert 0 < redis_client.pttl(key) <= MAX_TTL * 1000
        info = backend.inspect(name)
        assert info is not None and info.expires_at is not None
        assert any(item.name == name for item in backend.iter_locks())
        assert backend.force_release(name, lease.fencing_token) is True
    finally:
        lease.release()


@pytest.mark.parametrize("limit", [MAX_SEMAPHORE_LIMIT + 1, 10**6, 10**9, 10**400])
@pytest.mark.parametrize("alias", ["redis", "locmem"])
def test_a_semaphore_limit_beyond_the_bound_is_refused(alias: str, limit: int, name: str) -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_SEMAPHORE_LIMIT:,} permits"):
        semaphore(name, backend=alias, limit=limit)


@pytest.mark.parametrize("argument", ["auto_renew", "reentrant", "fair"])
@pytest.mark.parametrize("value", ["no", "yes", 0, 1, None])
def test_flags_must_be_bools(argument: str, value: Any, name: str) -> None:
    with pytest.raises(TypeError, match=f"{argument} must be True or False"):
        lock(name, backend="locmem", **{argument: value})


def test_a_name_with_a_lone_surrogate_is_refused_at_the_call(redis_client: Any) -> None:
    with pytest.raises(ValueError, match="lone surrogate"):
        lock("bad\udc80name", backend="redis")


def test_max_hold_beyond_the_bound_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="max_hold must be at most"):
        lock(name, backend="locmem", max_hold=1e300)


def test_a_lock_written_by_another_program_does_not_break_the_listing(
    name: str, redis_client: redis_lib.Redis
) -> None:
    # An entry no distlocks of this version writes (a huge acquired_at): listing and
    # inspection must still work, showing what can be shown.
    backend = get_backend("redis")
    with lock(name, backend="redis", ttl=30) as lease:
        other = f"{name}:other"
        key = backend.all_keys(other).lock
        redis_client.hset(
            key,
            mapping={
                "owner": "x" * 32, "token": 5, "name": other, "host": "h", "pid": 1,
                "thread": "t", "extra": "{}", "ttl": 10**15, "renewals": 0,
                "acquired_at": 10**18,
            },
        )  # fmt: skip
        redis_client.pexpire(key, 10**13)
        try:
            listed = {info.name: info for info in backend.iter_locks()}
            assert listed[name].owner == lease.owner
            assert listed[other].acquired_at is None
            assert backend.inspect(other) is not None
        finally:
            redis_client.delete(key)


# -- 3. force release is bound to the token shown -----------------------------------


@pytest.mark.parametrize("alias", ["locmem", "redis", "redlock"])
def test_force_release_with_a_changed_token_leaves_the_new_holder(alias: str, name: str) -> None:
    backend = get_backend(alias)
    first = lock(name, backend=alias, ttl=30).acquire()
    seen = first.fencing_token
    first.release()
    second = lock(name, backend=alias, ttl=30).acquire()
    try:
        assert backend.force_release(name, seen) is False
        info = backend.inspect(name)
        assert info is not None and info.owner == second.owner
        assert second.held()
        counter = backend.fencing_counter(name)
        assert backend.force_release(name, second.fencing_token) is True
        assert backend.inspect(name) is None
        assert backend.fencing_counter(name) > counter
    finally:
        second.release()


@pytest.mark.parametrize("alias", ["locmem", "redis", "redlock"])
def test_force_release_of_a_free_name_writes_nothing(alias: str, name: str) -> None:
    backend = get_backend(alias)
    assert backend.force_release(name) is False
    assert backend.force_release(name, 12345) is False
    assert backend.fencing_counter(name) == 0


def _take_and_free(url: str, prefix: str, name: str, stop: Any, evicted: Any) -> None:
    """Another process: take and free ``name`` in a loop; report the tokens of the
    acquisitions that someone else ended (their release found the lock gone)."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from distlocks.backends.base import Holder
    from distlocks.backends.redis import RedisBackend

    backend = RedisBackend("race", {"LOCATION": url, "OPTIONS": {"key_prefix": prefix}})
    holder = Holder("race", os.getpid(), "loop")
    while not stop.is_set():
        owner = os.urandom(16).hex()
        result = backend.acquire(name, owner, 30.0, holder)
        if result.acquired and not backend.release(name, owner):
            evicted.put(result.fencing_token)
    evicted.put(None)


@pytest.mark.slow
def test_force_release_never_evicts_a_holder_it_was_not_asked_to(name: str) -> None:
    """The server compares the token and deletes in one step: with another process
    taking and freeing the lock in a loop, every holder evicted is one whose token a
    force release named (before, 154 of about 4,000 evicted someone else)."""
    from django.conf import settings

    backend = get_backend("redis")
    context = multiprocessing.get_context("spawn")
    stop, evicted = context.Event(), context.Queue()
    worker = context.Process(
        target=_take_and_free, args=(settings.REDIS_URL, backend.key_prefix, name, stop, evicted)
    )
    worker.start()
    asked: set[int] = set()
    attempts = 0
    deadline = time.monotonic() + 60
    try:
        while attempts < 3000 and time.monotonic() < deadline:
            info = backend.inspect(name)
            if info is None:
                continue
            attempts += 1
            if backend.force_release(name, info.fencing_token):
                asked.add(info.fencing_token)
    finally:
        stop.set()
    ended: set[int] = set()
    while (token := evicted.get(timeout=60)) is not None:
        ended.add(token)
    worker.join(30)
    assert attempts > 100, "the race never got going"
    assert asked, "no force release found its holder"
    assert ended - asked == set(), "holders evicted whose token nobody named"
    assert ended == asked


# -- 4. fork: a child cannot release, extend or renew a lease it inherited ------------


def _in_child(action: Any) -> tuple[int, str]:
    """Run ``action`` in a forked child; its result (repr) comes back through a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            text = repr(action())
        except BaseException as exc:
            text = f"raised {type(exc).__name__}: {exc}"
        os.write(write, text.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    return status, b"".join(chunks).decode()


FORK_BACKENDS = ["locmem", "redis", "redlock", "pg"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("alias", FORK_BACKENDS)
def test_a_forked_child_cannot_release_or_extend_an_inherited_lease(
    alias: str, name: str, request: pytest.FixtureRequest
) -> None:
    if alias == "pg":
        request.getfixturevalue("pg_ready")
        request.getfixturevalue("django_db_blocker").unblock()
    backend = get_backend(alias)
    lease = lock(name, backend=alias, ttl=30).acquire()
    try:
        status, text = _in_child(lambda: (lease.held(), lease.release(), lease.state))
        assert status == 0
        assert text == "(False, False, 'held')"
        status, text = _in_child(lease.extend)
        assert text.startswith("raised LockLost") and "forked" in text
        status, text = _in_child(lease.ensure_held)
        assert text.startswith("raised LockLost")
        assert lease.held()
        lease.extend()  # the parent's lease is intact on the server
        info = backend.inspect(name)
        assert info is not None and info.owner == lease.owner
    finally:
        assert lease.release() is True


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_leaving_the_with_block_in_a_child_keeps_the_parents_lock(name: str) -> None:
    backend = get_backend("redis")
    with lock(name, backend="redis", ttl=30) as lease:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child leaves the block it inherited
            code = 0
            try:
                lease.release()
                from distlocks.locks import finish_lease

                finish_lease(lease, body_failed=False)
            except BaseException:
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        info = backend.inspect(name)
        assert info is not None and info.owner == lease.owner
        assert lease.held()


# -- 8. distinct names never share keys -------------------------------------------------


@pytest.mark.parametrize("alias", ["redis", "redlock"])
def test_a_braced_name_and_its_hashed_tag_are_different_locks(alias: str, name: str) -> None:
    backend = get_backend(alias)
    braced = f"{name}{{x}}"
    keys = (backend.masters[0] if alias == "redlock" else backend).all_keys(braced)
    tag = keys.lock.split("{", 1)[1].split("}", 1)[0]
    assert tag.startswith("#")
    with lock(braced, backend=alias, ttl=30) as first:
        # The plain name equal to the tag is a lock of its own, with its own counter.
        with lock(tag, backend=alias, ttl=30, timeout=0) as second:
            assert second.fencing_token != first.fencing_token
            assert backend.inspect(braced).owner == first.owner
            assert backend.inspect(tag).owner == second.owner


# -- 10. held() never waits for a renewal in flight --------------------------------------


@pytest.mark.parametrize("alias", ["locmem", "redis"])
def test_held_does_not_wait_behind_a_renewal_in_flight(alias: str, name: str) -> None:
    lease = lock(name, backend=alias, ttl=0.05, auto_renew=False).acquire()
    deadline = time.monotonic() + 30
    while (lease.remaining() or 0) > 0:  # its local deadline passes
        assert time.monotonic() < deadline
        time.sleep(0.01)
    entered, leave = threading.Event(), threading.Event()

    def renewal_in_flight() -> None:
        # What the renewer holds while its request is on the wire.
        with lease._mutex:
            entered.set()
            leave.wait(60)

    blocker = threading.Thread(target=renewal_in_flight)
    blocker.start()
    assert entered.wait(30)
    answers: list[bool] = []
    asker = threading.Thread(target=lambda: answers.append(lease.held()))
    asker.start()
    asker.join(30)
    finished = not asker.is_alive()
    leave.set()
    blocker.join(30)
    asker.join(30)
    assert finished, "held() waited for the renewal's lock"
    assert answers == [False]
    assert lease.state == "lost"
    with pytest.raises(LockLost):
        lease.ensure_held()


def test_a_refused_acquire_leaves_nothing_behind(name: str, redis_client: Any) -> None:
    with lock(name, backend="redis", ttl=30):
        before = sorted(_keys_of(redis_client, name))
        with pytest.raises(LockNotAcquired):
            lock(name, backend="redis", timeout=0).acquire()
        assert sorted(_keys_of(redis_client, name)) == before


# -- renewal in batches (one script per batch of due leases, not one per lease) --------


@pytest.mark.slow
def test_thousands_of_leases_are_renewed_in_batches(own_redis: Any, settings: Any) -> None:
    settings.DISTLOCKS_BACKENDS = {
        "own": {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": own_redis.url}
    }
    client = redis_lib.Redis.from_url(own_redis.url)
    count = 2000
    leases = [lock(f"batch:{i}", backend="own", ttl=1.5).acquire() for i in range(count)]
    try:
        client.config_resetstat()
        deadline = time.monotonic() + 120
        while min(lease.renewals for lease in leases) < 2:
            assert time.monotonic() < deadline, "leases were not renewed"
            assert all(lease.held() for lease in leases), "a lease was lost"
            time.sleep(0.05)
        calls = int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
        assert all(lease.held() for lease in leases)
        # 2 renewals of 2,000 leases: one call each would be 4,000 or more.
        assert calls < count / 2, f"{calls} script calls for {2 * count} renewals"
        late = lateness()["own"]
        assert 0 <= late["p50"] <= late["p99"] and late["turns"] >= 2
    finally:
        for lease in leases:
            lease.release()
        client.close()


def test_a_permit_with_an_unrepresentable_date_does_not_break_the_listing(
    name: str, redis_client: redis_lib.Redis
) -> None:
    import json

    backend = get_backend("redis")
    with semaphore(name, backend="redis", limit=2, ttl=30) as permit:
        base = backend.all_keys(name).lock.removesuffix(":lock")
        info_key = f"{base}:sem:info"
        about = json.loads(redis_client.hget(info_key, permit.owner))
        about["acquired_at"] = 10**18
        redis_client.hset(info_key, permit.owner, json.dumps(about))
        listed = [info for info in backend.iter_permits() if info.name == name]
        assert [info.owner for info in listed] == [permit.owner]
        assert listed[0].acquired_at is None


def test_redlock_renews_many_leases_with_one_round(name: str) -> None:
    backend = get_backend("redlock")
    leases = [lock(f"{name}:{i}", backend="redlock", ttl=30, auto_renew=False).acquire()
              for i in range(30)]  # fmt: skip
    try:
        stranger = (f"{name}:0", "0" * 32, 30.0)
        answers = backend.extend_many([(x.name, x.owner, 20.0) for x in leases] + [stranger])
        assert answers == [True] * len(leases) + [False]
        for lease in leases:
            info = backend.inspect(lease.name)
            assert info is not None and info.owner == lease.owner and info.ttl == 20.0
    finally:
        for lease in leases:
            lease.release()
