"""``lock_many()`` on a PostgreSQL alias against the size of its connection pool.

In session mode every lock held pins a pooled connection of its own, so a call with
more names than ``pool_size``, or with more names than the pool has room for beside
the leases whose ``with`` blocks enclose the call (only the caller can free those),
can never succeed: it fails at once, holding nothing, instead of waiting out its
timeout. A call that other threads can make room for still waits for them, and
transaction mode (every lock on Django's own connection) has no such limit.
Real servers only."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import transaction
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from distlocks import get_backend, lock, lock_many
from distlocks.backends.postgres import PostgresBackend
from distlocks.exceptions import LockError
from distlocks.primitives import semaphore
from tests.waiting import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]

#: Far longer than any of these calls may take: a call that waits it out has hung.
HUNG = 60.0


@pytest.fixture
def own_pg(settings: Any) -> Iterator[Any]:
    """``own_pg(**options)``: an alias of the test's own (its own pool, closed at the end)."""
    made: list[str] = []
    prefix = get_backend("pg").key_prefix

    def make(**options: Any) -> str:
        alias = f"pg-many-{len(made)}"
        settings.DISTLOCKS_BACKENDS = {
            **settings.DISTLOCKS_BACKENDS,
            alias: {
                "BACKEND": "distlocks.backends.postgres.PostgresBackend",
                "OPTIONS": {"key_prefix": prefix, **options},
            },
        }
        made.append(alias)
        return alias

    yield make
    for alias in made:
        get_backend(alias).close()


def pinned(alias: str) -> int:
    backend = get_backend(alias)
    assert isinstance(backend, PostgresBackend)
    return backend.held_connection_count()


def outcome(call: Any) -> BaseException | None:
    """Run ``call`` in a thread, in a copy of this thread's context (so the leases
    whose blocks enclose this call enclose it there too): the exception it raised
    (None if none), or a failure if it is still running after ``HUNG`` seconds (on a
    daemon thread, so a hung call does not hold the session)."""
    result: list[BaseException | None] = []
    context = contextvars.copy_context()

    def run() -> None:
        try:
            context.run(call)
        except BaseException as exc:
            result.append(exc)
        else:
            result.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HUNG)
    if not result:
        pytest.fail(f"the call was still waiting after {HUNG:g} s")
    return result[0]


@pytest.mark.parametrize("timeout", [None, 3600, 5])
def test_more_names_than_pool_size_is_refused_at_the_call(
    timeout: float | None, name: str, own_pg: Any
) -> None:
    alias = own_pg(pool_size=2)
    names = [f"{name}:{i}" for i in range(3)]
    error = outcome(lambda: lock_many(names, backend=alias, timeout=timeout))
    assert isinstance(error, ValueError), error
    text = str(error)
    assert "pool_size" in text and "3" in text and "2" in text
    assert "transaction" in text  # the other way out
    assert pinned(alias) == 0
    for each in names:  # nothing was taken, nothing is left held
        assert get_backend(alias).inspect(each) is None


def test_names_beside_the_callers_own_leases_beyond_pool_size_fail_at_once(
    name: str, own_pg: Any
) -> None:
    alias = own_pg(pool_size=3)
    names = [f"{name}:{i}" for i in range(3)]
    with lock(f"{name}:outer", backend=alias, timeout=0):

        def inner() -> None:
            with lock_many(names, backend=alias, timeout=None):
                pass

        error = outcome(inner)
        assert isinstance(error, LockError), error
        assert "pool_size" in str(error) and "1" in str(error)
        assert pinned(alias) == 1  # only the outer lease
    assert pinned(alias) == 0


def test_a_permit_the_caller_holds_counts_too(name: str, own_pg: Any) -> None:
    alias = own_pg(pool_size=2)
    with semaphore(f"{name}:sem", limit=2, backend=alias, timeout=0):

        def inner() -> None:
            with lock_many([f"{name}:a", f"{name}:b"], backend=alias, timeout=None):
                pass

        error = outcome(inner)
        assert isinstance(error, LockError), error
        assert "pool_size" in str(error)
        assert pinned(alias) == 1


def test_a_call_other_threads_can_make_room_for_waits_for_them(name: str, own_pg: Any) -> None:
    alias = own_pg(pool_size=2)
    backend = get_backend(alias)
    assert isinstance(backend, PostgresBackend)
    taken = threading.Event()
    give_back = threading.Event()

    def other_holder() -> None:
        with (
            lock(f"{name}:x", backend=alias, timeout=0),
            lock(f"{name}:y", backend=alias, timeout=0),
        ):
            taken.set()
            give_back.wait(HUNG)

    holder = threading.Thread(target=other_holder, daemon=True)
    holder.start()
    assert taken.wait(HUNG)
    got: list[dict[str, Any]] = []

    def call() -> None:
        with lock_many([f"{name}:a", f"{name}:b"], backend=alias, timeout=HUNG) as leases:
            got.append({key: lease.held() for key, lease in leases.items()})

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    # The call waits for a connection; then the other thread gives its two back.
    wait_for(lambda: backend.pool._waiting > 0, what="lock_many waiting for a connection")
    give_back.set()
    caller.join(HUNG)
    holder.join(HUNG)
    assert got == [{f"{name}:a": True, f"{name}:b": True}]


def test_transaction_mode_takes_more_names_than_pool_size(name: str, own_pg: Any) -> None:
    """Transaction mode takes every lock on Django's connection (the pool only writes
    the registry, a connection at a time): pool_size is no limit there."""
    alias = own_pg(mode="transaction", pool_size=1)
    names = [f"{name}:{i}" for i in range(4)]
    with transaction.atomic():
        with lock_many(names, backend=alias, timeout=5) as leases:
            assert sorted(leases) == sorted(names)
            assert all(lease.held() for lease in leases.values())


@pytest.fixture
def by_size(own_pg: Any) -> dict[int, str]:
    """The property's aliases by pool size: one pool each, for all its examples."""
    return {}


@hsettings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    size=st.integers(1, 3),
    outer=st.integers(0, 3),
    count=st.integers(1, 5),
    timeout=st.sampled_from([None, 0, 2.0]),
)
def test_lock_many_fails_at_once_exactly_when_it_never_could_succeed(
    size: int,
    outer: int,
    count: int,
    timeout: float | None,
    name: str,
    own_pg: Any,
    by_size: dict[int, str],
) -> None:
    """Alone on its alias, a call succeeds if its names fit beside the caller's own
    leases, and otherwise fails at once (before its timeout) and takes nothing."""
    outer = min(outer, size)
    alias = by_size.get(size)
    if alias is None:
        alias = by_size[size] = own_pg(pool_size=size)
    tag = f"{name}:{time.monotonic_ns()}"
    names = [f"{tag}:{i}" for i in range(count)]

    def scenario() -> None:
        with contextlib.ExitStack() as stack:
            for i in range(outer):
                stack.enter_context(lock(f"{tag}:outer{i}", backend=alias, timeout=0))
            fits = count + outer <= size
            refused: BaseException | None = None
            try:
                with lock_many(names, backend=alias, timeout=timeout) as leases:
                    assert fits, "took more locks than the pool has connections"
                    assert len(leases) == count
                    assert pinned(alias) == count + outer
            except (ValueError, LockError) as exc:
                refused = exc
            if refused is not None:
                assert not fits, f"refused a call that fits: {refused}"
                assert "pool_size" in str(refused)
                assert isinstance(refused, ValueError) == (count > size)
            assert pinned(alias) == outer
        assert pinned(alias) == 0

    assert outcome(scenario) is None
