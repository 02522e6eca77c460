"""An attacker's pass over the hardening of issue 14 (defects 1-10), on every backend:
LocMem, Redis, Redis Cluster, Redlock, PostgreSQL session and transaction mode, and
ZooKeeper. Each test tries to break one guarantee the way the issue describes, or in
a nearby way it does not. Real servers only."""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from django.core.management import call_command
from django.db import transaction

from distlocks import get_backend, lock, lock_many
from distlocks.exceptions import LockError, LockNotAcquired
from distlocks.primitives import rwlock, semaphore
from distlocks.validation import MAX_SEMAPHORE_LIMIT, MAX_TIMEOUT, MAX_TTL
from tests.conftest import PERMIT_BACKENDS
from tests.redis_contract import redis_alias
from tests.test_hardening import _in_child
from tests.test_hardening_postgres import own_pg
from tests.test_redaction import (
    SECRET,
    test_check_messages,
    test_the_command,
    test_the_exception_from_lock,
    test_the_live_locks_page_for_view_only_staff,
)
from tests.waiting import wait_for

__all__ = [  # collected here again, on the ZooKeeper cases of the "bad" fixture below
    "own_pg",
    "test_check_messages",
    "test_the_command",
    "test_the_exception_from_lock",
    "test_the_live_locks_page_for_view_only_staff",
]

#: Every backend and mode: the ``alias`` fixture below gives each in turn.
EVERY = ["locmem", "redis", "cluster", "redlock", "pg", "pgx", "zk"]
#: Those whose locks OS processes share (a forked child is another holder there).
SHARED = ["redis", "cluster", "redlock", "pg", "zk"]

fork_only = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@pytest.fixture(params=EVERY)
def alias(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each backend alias in turn ("cluster": the session's Redis Cluster). Named
    ``alias`` so that tests/conftest.py gives the PostgreSQL ones the test database."""
    value = str(request.param)
    if value.startswith("pg"):
        request.getfixturevalue("pg_ready")
    elif value == "zk":
        request.getfixturevalue("zk_ready")
    if value == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        with redis_alias("cluster", cluster.url):
            yield value
    else:
        yield value


class _nothing:
    """A context manager that does nothing (``contextlib.nullcontext`` without a value)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def in_child(action: Callable[[], object]) -> str:
    """Run ``action`` in a forked child; its result's repr (or the exception it
    raised, as ``raised Type: message``) comes back through a pipe."""
    return _in_child(action)[1]


# -- 4. fork ------------------------------------------------------------------------


@fork_only
def test_a_forked_child_cannot_use_an_inherited_lease(
    alias: str, name: str, django_db_blocker: Any
) -> None:
    """The fork rule on every backend, ZooKeeper, the Cluster and transaction mode
    included (tests/test_hardening.py covers LocMem, Redis, Redlock and session mode)."""
    django_db_blocker.unblock()
    backend = get_backend(alias)
    with transaction.atomic() if alias == "pgx" else _nothing():
        lease = lock(name, backend=alias, ttl=30).acquire()
        try:
            assert in_child(lambda: (lease.held(), lease.release(), lease.state)) == (
                "(False, False, 'held')"
            )
            for action in (lease.extend, lease.ensure_held):
                text = in_child(action)
                assert text.startswith("raised LockLost"), text
                assert "forked" in text
            assert lease.held()
            lease.extend()  # the parent's lease is intact on the server
            info = backend.inspect(name)
            assert info is not None and info.owner == lease.owner
        finally:
            assert lease.release() is True


@fork_only
@pytest.mark.parametrize("alias", [a for a in EVERY if a != "pgx"], indirect=True)
def test_a_child_asking_for_a_reentrant_lock_its_parent_holds_is_another_caller(
    alias: str, name: str, django_db_blocker: Any
) -> None:
    """A child that needs the lock acquires it itself: with ``reentrant=True`` it must
    not be handed the parent's lease (which it may not use: LockLost) but wait for
    the lock like any other caller (here: timeout=0, refused while the parent holds
    it; on LocMem, one process's memory, the child's copy of it is held too).
    Transaction mode: see test_a_forked_child_cannot_lock_in_its_parents_transaction."""
    django_db_blocker.unblock()
    with lock(name, backend=alias, ttl=30, reentrant=True) as lease:
        text = in_child(
            lambda: lock(name, backend=alias, ttl=30, reentrant=True, timeout=0).acquire()
        )
        assert text.startswith("raised LockNotAcquired"), text
        assert lease.held()


@fork_only
@pytest.mark.parametrize("alias", SHARED, indirect=True)
def test_a_forked_child_takes_a_free_lock_of_its_own(
    alias: str, name: str, django_db_blocker: Any
) -> None:
    """A backend used by the parent works in a forked child (a Celery prefork worker
    forks from a parent that has used it): the child takes, and frees, a lock of its
    own while the parent holds another."""
    django_db_blocker.unblock()
    with lock(name, backend=alias, ttl=30):
        other = f"{name}:child"

        def take() -> tuple[bool, bool]:
            with lock(other, backend=alias, ttl=30, timeout=5) as lease:
                held = lease.held()
            return held, lease.held()

        assert in_child(take) == "(True, False)"
        assert get_backend(alias).inspect(other) is None


@fork_only
@pytest.mark.parametrize("alias", ["pgx"], indirect=True)
def test_a_forked_child_cannot_lock_in_its_parents_transaction(
    alias: str, name: str, django_db_blocker: Any
) -> None:
    """Transaction mode locks on Django's own connection. A forked child inherits it,
    with the parent's open transaction and the parent's advisory locks: taking the
    lock there was granted (a second holder, on the parent's session, while the
    parent holds it). It must be refused, saying why, and leave the parent alone."""
    django_db_blocker.unblock()
    backend = get_backend(alias)
    with transaction.atomic(), lock(name, backend=alias, ttl=30) as lease:
        text = in_child(lambda: lock(name, backend=alias, ttl=30, timeout=0).acquire())
        assert text.startswith("raised LockError"), text
        assert "inherited" in text and "forked" in text
        text = in_child(lambda: lock(f"{name}:other", backend=alias, ttl=30).acquire())
        assert text.startswith("raised LockError"), text
        info = backend.inspect(name)
        assert info is not None and info.owner == lease.owner
        assert lease.held()


# -- 1. credentials: ZooKeeper ---------------------------------------------------------

ZK = "distlocks.backends.zookeeper.ZooKeeperBackend"
#: Careless ZooKeeper settings that carry a credential. kazoo reads "u:pw@host" as
#: the host alone (and connects without it), so the first three were taken as they
#: were and quoted, password included, by every message naming the location.
ZK_BAD = {
    "zk user info without a scheme": {"BACKEND": ZK, "LOCATION": f"u:{SECRET}@127.0.0.1:1"},
    "zk digest in the host": {"BACKEND": ZK, "LOCATION": f"digest:u:{SECRET}@127.0.0.1:1/app"},
    "zk second host with user info": {
        "BACKEND": ZK,
        "LOCATION": f"127.0.0.1:1,u:{SECRET}@127.0.0.1:2",
    },
    "zk auth not a pair": {
        "BACKEND": ZK,
        "LOCATION": "127.0.0.1:1",
        "OPTIONS": {"auth": [("digest", f"u:{SECRET}", "x")]},
    },
    "zk auth as a string": {
        "BACKEND": ZK,
        "LOCATION": "127.0.0.1:1",
        "OPTIONS": {"auth": f"digest:u:{SECRET}"},
    },
    "zk tls flag as a string": {
        "BACKEND": ZK,
        "LOCATION": "127.0.0.1:1",
        "OPTIONS": {"use_ssl": "no", "keyfile": "/nonexistent", "keyfile_password": SECRET},
    },
}


@pytest.fixture(params=list(ZK_BAD), ids=list(ZK_BAD))
def bad(request: pytest.FixtureRequest, settings: Any) -> str:
    """The alias "bad", configured with one of ZK_BAD (for the redaction tests
    imported above from tests/test_redaction.py)."""
    from distlocks.handler import backends
    from distlocks.livelocks import snapshots

    settings.DISTLOCKS_BACKENDS = {**settings.DISTLOCKS_BACKENDS, "bad": ZK_BAD[request.param]}
    backends.reset()
    snapshots.clear()  # the live-locks listing is shared for a while: read it afresh
    return "bad"


@pytest.mark.parametrize("case", list(ZK_BAD)[:3])
def test_a_zookeeper_location_with_credentials_is_refused_saying_where_they_go(
    case: str,
) -> None:
    from distlocks.backends.zookeeper import ZooKeeperBackend

    problems = ZooKeeperBackend.validate_config("z", ZK_BAD[case])
    text = " | ".join(problems)
    assert "OPTIONS['auth']" in text, text
    assert SECRET not in text


@pytest.mark.parametrize("key", ["use_ssl", "verify_certs", "check_hostname"])
@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
def test_zookeeper_tls_flags_must_be_bools(key: str, value: Any) -> None:
    """kazoo takes any truthy value: ``use_ssl="false"`` turned TLS on."""
    from distlocks.backends.zookeeper import ZooKeeperBackend

    config = {"BACKEND": ZK, "LOCATION": "127.0.0.1:2181", "OPTIONS": {key: value}}
    problems = ZooKeeperBackend.validate_config("z", config)
    assert any(key in problem and "True or False" in problem for problem in problems)


def test_a_missing_default_alias_shows_no_zookeeper_credential(settings: Any) -> None:
    """E001 quotes the start of the setting: a ZooKeeper ``auth`` credential there
    (no ``password`` key, no URL) was shown as it was."""
    from distlocks.checks import check_settings

    settings.DISTLOCKS_BACKENDS = {
        "o": {"OPTIONS": {"auth": [("digest", f"u:{SECRET}")]}, "BACKEND": ZK, "LOCATION": "h"}
    }
    messages = check_settings()
    assert [m.id for m in messages][:1] == ["distlocks.E001"]
    assert SECRET not in "\n".join(f"{m.msg} {m.hint}" for m in messages)


# -- 2 and 10. bounds and types, checked at the call on every backend -----------------

BAD_NUMBERS = [1e300, 10**400, -(10**400), 1e17, sys.maxsize, MAX_TTL + 1, math.inf, math.nan]
BAD_TYPES = [True, False, "5", b"5", None, [5], Decimal("5"), Fraction(5)]


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:8]}..{len(text)}ch"


def in_transaction(alias: str) -> Any:
    """Transaction mode locks only inside a transaction."""
    return transaction.atomic() if alias == "pgx" else _nothing()


def nothing_written(alias: str, name: str) -> bool:
    backend = get_backend(alias)
    return backend.inspect(name) is None and backend.fencing_counter(name) == 0


@pytest.mark.parametrize("ttl", [*BAD_NUMBERS, 0, -1, 0.001], ids=short)
def test_a_ttl_out_of_bounds_is_a_value_error_on_every_backend(
    alias: str, name: str, ttl: Any
) -> None:
    with in_transaction(alias):
        with pytest.raises(ValueError, match="ttl must"):
            lock(name, backend=alias, ttl=ttl)
        with pytest.raises(ValueError, match="max_hold must"):
            lock(name, backend=alias, max_hold=ttl)
        with pytest.raises(ValueError, match="ttl must"):
            lock_many([name, f"{name}:2"], backend=alias, ttl=ttl)
        with lock(name, backend=alias, ttl=30, auto_renew=False) as lease:
            with pytest.raises(ValueError, match="ttl must"):
                lease.extend(ttl)
            assert lease.ttl == 30
            assert lease.held()


@pytest.mark.parametrize("timeout", [1e300, 10**400, -(10**400), MAX_TIMEOUT + 1, math.inf,
                                     math.nan, -1], ids=short)  # fmt: skip
def test_a_timeout_out_of_bounds_is_a_value_error_on_every_backend(
    alias: str, name: str, timeout: Any
) -> None:
    with pytest.raises(ValueError, match="timeout must"):
        lock(name, backend=alias, timeout=timeout)
    with pytest.raises(ValueError, match="timeout must"):
        lock(name, backend=alias).acquire(timeout=timeout)
    assert nothing_written(alias, name)


@pytest.mark.parametrize("value", BAD_TYPES, ids=repr)
def test_a_ttl_or_timeout_of_the_wrong_type_is_a_type_error(
    alias: str, name: str, value: Any
) -> None:
    with pytest.raises(TypeError, match="ttl must be a number"):
        lock(name, backend=alias, ttl=value) if value is not None else _raise_type("ttl")
    if value is not None:  # None waits forever
        with pytest.raises(TypeError, match="timeout must be a number"):
            lock(name, backend=alias, timeout=value)
    assert nothing_written(alias, name)


def _raise_type(what: str) -> None:
    raise TypeError(f"{what} must be a number (None is the default ttl)")


@pytest.mark.parametrize(
    "bad",
    ["a\x00b", "a\udc80b", "\ud800", "a\x1b[2Jb", "a\r\nb", "", "x" * 201, b"bytes", 5, None],
    ids=repr,
)
def test_a_bad_name_is_refused_at_the_call_on_every_backend(alias: str, bad: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        lock(bad, backend=alias)
    with pytest.raises((ValueError, TypeError)):
        lock_many(["fine", bad], backend=alias)
    if alias in PERMIT_BACKENDS:
        with pytest.raises((ValueError, TypeError)):
            semaphore(bad, backend=alias, limit=2)
        with pytest.raises((ValueError, TypeError)):
            rwlock(bad, backend=alias)


@pytest.mark.parametrize("argument", ["auto_renew", "reentrant", "fair"])
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, b""], ids=repr)
def test_flags_must_be_bools_on_every_backend(
    alias: str, name: str, argument: str, value: Any
) -> None:
    with pytest.raises(TypeError, match=f"{argument} must be True or False"):
        lock(name, backend=alias, **{argument: value})
    if argument == "auto_renew":
        with pytest.raises(TypeError, match="auto_renew must be True or False"):
            lock_many([name], backend=alias, auto_renew=value)


@pytest.mark.parametrize(
    "limit", [0, -1, MAX_SEMAPHORE_LIMIT + 1, 10**9, 10**400, True, "3", 2.0, None], ids=short
)
def test_a_semaphore_limit_out_of_bounds_is_refused_on_every_backend(
    alias: str, name: str, limit: Any
) -> None:
    with pytest.raises((ValueError, TypeError), match="limit must"):
        semaphore(name, backend=alias, limit=limit)


# -- 3. force release is bound to the token, on every backend --------------------------


class Holder(threading.Thread):
    """Holds ``name`` in a thread of its own (in transaction mode: in a transaction on
    the thread's own database connection, which a force release may end) until
    :meth:`done`."""

    def __init__(self, alias: str, name: str) -> None:
        super().__init__(daemon=True)
        self.alias, self.name = alias, name
        self.lease: Any = None
        self.ready, self.stop = threading.Event(), threading.Event()
        self.start()
        assert self.ready.wait(30), "the holder did not get the lock"

    def run(self) -> None:
        from django.db import connection

        try:
            with in_transaction(self.alias):
                self.lease = lock(self.name, backend=self.alias, ttl=30).acquire()
                self.ready.set()
                self.stop.wait(60)
                with contextlib.suppress(LockError):
                    self.lease.release()
        except Exception:  # transaction mode: its connection was ended by the eviction
            pass
        finally:
            connection.close()

    def done(self) -> None:
        self.stop.set()
        self.join(30)


def test_force_release_with_a_wrong_token_leaves_the_holder_on_every_backend(
    alias: str, name: str
) -> None:
    """tests/test_hardening.py covers LocMem, Redis and Redlock, and
    tests/test_hardening_postgres.py PostgreSQL session mode; here every backend
    (ZooKeeper, the Cluster and transaction mode included), with tokens above, below
    and far from the holder's, then the right one."""
    backend = get_backend(alias)
    holder = Holder(alias, name)
    try:
        token = holder.lease.fencing_token
        for wrong in (token + 1, token - 1, 0, 2**63 - 1):
            assert backend.force_release(name, wrong) is False
            info = backend.inspect(name)
            assert info is not None and info.owner == holder.lease.owner, wrong
        assert backend.fencing_counter(name) == token
        assert backend.force_release(name, token) is True
        assert backend.fencing_counter(name) > token
        wait_for(lambda: backend.inspect(name) is None, what="the eviction")
        with in_transaction(alias), lock(name, backend=alias, ttl=30, timeout=5) as newer:
            assert newer.fencing_token > token
    finally:
        holder.done()


def test_force_release_of_a_free_name_writes_nothing_on_every_backend(
    alias: str, name: str
) -> None:
    backend = get_backend(alias)
    with in_transaction(alias):
        for token in (None, 1, 2**53):
            assert backend.force_release(name, token) is False
        assert nothing_written(alias, name)
    if alias == "zk":  # not even the fence node
        assert backend._client.exists(backend.lock_path(name)) is None  # type: ignore[attr-defined]


# -- 2. listing survives any lock a server holds: ZooKeeper ---------------------------


@pytest.mark.parametrize(
    "data",
    [
        b'{"extra": [1, 2], "owner": "x"}',
        b'{"extra": "text", "ttl": Infinity, "pid": 1e400}',
        b'{"extra": {"k": "\\u001b[2J"}, "ttl": NaN, "host": ["h"], "thread": null}',
        b"[1, 2]",
        b"\xff\xfe not json",
    ],
    ids=["extra-list", "extra-text-inf", "nan", "list", "bytes"],
)
@pytest.mark.django_db
@pytest.mark.parametrize("alias", ["zk"], indirect=True)
def test_a_zookeeper_node_written_by_another_program_does_not_break_the_listing(
    alias: str, name: str, data: bytes
) -> None:
    """A contender node whose data distlocks did not write (another version, another
    program, a hand-made node): the listing, inspect, the command and the page go on
    (the Redis form of this is in tests/test_hardening.py)."""
    backend = get_backend(alias)
    with lock(name, backend=alias, ttl=30) as lease:
        other = f"{name}:other"
        client = backend._client  # type: ignore[attr-defined]
        parent = backend.lock_path(other)  # type: ignore[attr-defined]
        client.ensure_path(parent)
        node = client.create(f"{parent}/c-someone-", data, ephemeral=True, sequence=True)
        try:
            assert backend.inspect(name).owner == lease.owner
            shown_everywhere(alias, name, other)
        finally:
            client.delete(node)


def shown_everywhere(alias: str, name: str, other: str) -> None:
    """``other`` (a lock with foreign data) is listed and inspected by the backend, the
    command and the live-locks page, beside ``name``; no escape code reaches the
    terminal."""
    from django.contrib.auth import get_user_model
    from django.test import Client

    from distlocks.livelocks import snapshots

    backend = get_backend(alias)
    listed = {info.name: info for info in backend.iter_locks()}
    assert name in listed and other in listed
    assert backend.inspect(other) is not None
    out = io.StringIO()
    for args in (["list"], ["list", "--json"], ["inspect", other]):
        call_command("distlocks", *args, "--backend", alias, stdout=out)
    assert other in out.getvalue() and "\x1b" not in out.getvalue()
    snapshots.clear()
    user = get_user_model().objects.create_superuser("attacker", password="pw")
    client = Client()
    client.force_login(user)
    page = client.get("/admin/distlocks/livelock/", {"refresh": "0", "backend": alias})
    assert page.status_code == 200 and name in page.content.decode()
    detail = client.get("/admin/distlocks/livelock/lock/", {"backend": alias, "name": other})
    assert detail.status_code == 200


FOREIGN_EXTRA = ["[1, 2]", '"text"', "17", "not json", '{"k": "\\u001b[2J"}']


@pytest.mark.django_db
@pytest.mark.parametrize("extra", FOREIGN_EXTRA)
@pytest.mark.parametrize("alias", ["redis", "pg"], indirect=True)
def test_a_lock_whose_extra_details_are_not_an_object_does_not_break_the_listing(
    alias: str, name: str, extra: str, redis_client: Any
) -> None:
    """The extra details of a holder, as another program (or version) may have written
    them: not a JSON object. PostgreSQL's listing failed for the whole backend (list
    has no pop("of")), and the command's inspect on Redis ('list' has no items())."""
    from tests.test_hardening_postgres import raw_connection

    backend = get_backend(alias)
    other = f"{name}:other"
    with lock(name, backend=alias, ttl=30), lock(other, backend=alias, ttl=30):
        if alias == "redis":
            redis_client.hset(backend.all_keys(other).lock, "extra", extra)  # type: ignore[attr-defined]
        else:
            value = extra if extra != "not json" else '"not json"'
            # Committed at once, where the backend's own connections see it.
            with raw_connection() as conn:
                done = conn.execute(
                    "UPDATE distlocks_lockregistry SET extra = %s::jsonb WHERE key = %s",
                    [value, backend.key(other)],  # type: ignore[attr-defined]
                )
                assert done.rowcount == 1
        shown_everywhere(alias, name, other)


# -- 10. held() and ensure_held() do no I/O: not even behind a stalled server ---------


@contextlib.contextmanager
def stalled(alias: str, name: str, request: pytest.FixtureRequest) -> Iterator[None]:
    """Every server ``alias`` talks to stops answering for a while (Redis: CLIENT
    PAUSE on each server or node; PostgreSQL: the lock's session SIGSTOPped)."""
    import signal

    import redis as redis_lib
    from django.conf import settings

    if alias == "pg":
        pid = int(get_backend(alias).inspect(name).extra["backend_pid"])  # type: ignore[union-attr]
        try:
            os.kill(pid, signal.SIGSTOP)
        except PermissionError:
            pytest.skip("the PostgreSQL server runs as another user")
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)
        return
    if alias == "cluster":
        urls = [
            f"redis://127.0.0.1:{n.port}" for n in request.getfixturevalue("redis_cluster").nodes
        ]
    elif alias == "redlock":
        urls = list(settings.DISTLOCKS_BACKENDS["redlock"]["LOCATION"])
    else:
        urls = [settings.REDIS_URL]
    clients = [redis_lib.Redis.from_url(url) for url in urls]
    for client in clients:
        client.execute_command("CLIENT", "PAUSE", 20_000, "WRITE")
    try:
        yield
    finally:
        for client in clients:
            client.execute_command("CLIENT", "UNPAUSE")
            client.close()


@pytest.mark.parametrize("alias", ["redis", "cluster", "redlock", "pg"], indirect=True)
def test_held_and_ensure_held_answer_at_once_while_an_extend_waits_on_the_server(
    alias: str, name: str, request: pytest.FixtureRequest
) -> None:
    """The issue's "no I/O" claim on real servers: an extend() (what the renewer does)
    is stuck on a server that does not answer, holding the lease's mutex; held(),
    ensure_held(), state and remaining() still answer from local knowledge at once.
    (tests/test_hardening.py holds the mutex by hand, with no server involved.)"""
    lease = lock(name, backend=alias, ttl=60, auto_renew=False).acquire()
    try:
        with stalled(alias, name, request):
            extender = threading.Thread(target=_quiet, args=(lease.extend,), daemon=True)
            extender.start()

            def mutex_busy() -> bool:
                if lease._mutex.acquire(blocking=False):
                    lease._mutex.release()
                    return False
                return True

            wait_for(mutex_busy, what="the extend in flight")
            started = time.monotonic()
            for _ in range(100):
                assert lease.held()
                lease.ensure_held()
                assert lease.state == "held"
                assert lease.remaining() is None or lease.remaining() > 0
            assert time.monotonic() - started < 2.0  # the server stays silent for 20 s
            assert extender.is_alive()  # the extend was still waiting all along
        extender.join(30)
    finally:
        with contextlib.suppress(LockError):
            lease.release()


def _quiet(action: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):
        action()


# -- 6. PostgreSQL: waited grants then a timeout, for permits and transaction mode ----


def _take(alias: str, kind: str, name: str) -> Any:
    if kind == "semaphore":
        return semaphore(name, backend=alias, limit=1, ttl=30, timeout=30)
    if kind == "write":
        return rwlock(name, backend=alias).write(ttl=30, timeout=30)
    return lock(name, backend=alias, ttl=30, timeout=30)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("pg_ready")
@pytest.mark.parametrize(
    ("waiter", "kind"), [("pg", "semaphore"), ("pg", "write"), ("pgx", "lock")]
)
def test_a_timeout_after_waited_grants_is_refused_cleanly_for_permits_and_transactions(
    waiter: str, kind: str, name: str, own_pg: Any
) -> None:
    """Defect 6 beyond plain session locks: a semaphore permit, a write lease, and a
    transaction-mode lock, granted three times after waiting in the server's queue
    (another session holds them), then asked for with timeout=0.5 while held: a
    LockNotAcquired after the timeout, not a driver error."""
    other = own_pg()  # another pool: other server sessions, the same keys
    for _ in range(3):
        held = _take(other, kind, name).acquire()
        timer = threading.Timer(0.2, held.release)
        timer.start()
        with transaction.atomic() if waiter == "pgx" else _nothing():
            lease = _take(waiter, kind, name).acquire()
            assert lease.held()
            lease.release()
        timer.join()
    held = _take(other, kind, name).acquire()
    try:
        started = time.monotonic()
        with transaction.atomic() if waiter == "pgx" else _nothing():
            with pytest.raises(LockNotAcquired):
                _take(waiter, kind, name).acquire(timeout=0.5)
        assert time.monotonic() - started >= 0.5
    finally:
        held.release()
    with transaction.atomic() if waiter == "pgx" else _nothing():
        with _take(waiter, kind, name) as lease:
            assert lease.held()


# -- 8. distinct names never share keys, on every backend ----------------------------


def test_names_that_look_alike_are_different_locks(alias: str, name: str) -> None:
    """Braces (Redis hash tags), the '#' + hash form a braced name is stored under,
    percent-escapes (ZooKeeper quotes names into paths), a trailing slash, case and
    Unicode normal forms: each a lock of its own, with a fencing counter of its own."""
    backend = get_backend(alias)
    braced = f"{name}{{x}}"
    variants = [braced, f"{name}/", f"{name}%2F", f"{name}{{}}", name.upper(),
                f"{name}\u00e9", f"{name}e\u0301"]  # fmt: skip
    if alias in ("redis", "cluster"):
        tag = backend.all_keys(braced).lock.split("{", 1)[1].split("}", 1)[0]  # type: ignore[attr-defined]
        variants.append(tag)
    with in_transaction(alias), contextlib.ExitStack() as stack:
        leases = [stack.enter_context(lock(v, backend=alias, ttl=30, timeout=0)) for v in variants]
        assert len({lease.fencing_token for lease in leases}) == len(variants)
        for variant, lease in zip(variants, leases, strict=True):
            info = backend.inspect(variant)
            assert info is not None and info.owner == lease.owner, variant
            assert info.name == variant
