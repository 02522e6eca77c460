"""The narrow backend contract (issue 28, item 1).

``BaseBackend`` requires only the lock operations every backend has; listing, waiting
and permits are capabilities a backend declares by inheriting
:class:`~distlocks.backends.capabilities.Listing`, ``Waiting`` or ``Permits``. Where one
is missing, every caller gets the one clear answer of
:func:`~distlocks.backends.capabilities.require`. Proved on a third-party backend that
writes the required methods only (tests/thirdparty/sqlite_locks.py), against its real
SQLite file.
"""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client, override_settings
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from distlocks import alock, get_backend, livelocks, lock, lock_many, metrics
from distlocks.backends.base import BaseBackend
from distlocks.backends.capabilities import (
    CAPABILITIES,
    Listing,
    Permits,
    Waiting,
    not_supported,
    require,
)
from distlocks.primitives import arwlock, asemaphore, rwlock, semaphore
from tests.thirdparty.sqlite_locks import MinimalSQLiteBackend

MINIMAL = "tests.thirdparty.sqlite_locks.MinimalSQLiteBackend"
LIST_URL = "/admin/distlocks/livelock/"
LOCK_URL = "/admin/distlocks/livelock/lock/"
RELEASE_URL = "/admin/distlocks/livelock/release/"


@pytest.fixture
def minimal(tmp_path: Path) -> Iterator[str]:
    """The alias ``"minimal"`` (the required methods only) next to ``"locmem"``, and no
    other backend, so a listing reads nothing else."""
    configs = {
        "locmem": {"BACKEND": "distlocks.backends.locmem.LocMemBackend"},
        "minimal": {"BACKEND": MINIMAL, "LOCATION": str(tmp_path / "locks.sqlite3")},
    }
    with override_settings(DISTLOCKS_BACKENDS=configs):
        livelocks.snapshots.clear()
        yield "minimal"
    livelocks.snapshots.clear()


# -- the contract ------------------------------------------------------------------------


def test_base_backend_requires_only_the_lock_operations() -> None:
    assert BaseBackend.__abstractmethods__ == {
        "acquire", "release", "extend", "inspect", "force_release", "fencing_counter",
    }  # fmt: skip
    assert MinimalSQLiteBackend.__abstractmethods__ == frozenset()
    for capability in CAPABILITIES:
        assert not issubclass(MinimalSQLiteBackend, capability)


def test_built_in_backends_declare_what_they_have() -> None:
    from distlocks.backends.etcd import EtcdBackend
    from distlocks.backends.locmem import LocMemBackend
    from distlocks.backends.postgres import PostgresBackend
    from distlocks.backends.redis import RedisBackend
    from distlocks.backends.redlock import RedlockBackend
    from distlocks.backends.zookeeper import ZooKeeperBackend

    everything = {Listing, Waiting, Permits}
    declared = {
        cls: {capability for capability in CAPABILITIES if issubclass(cls, capability)}
        for cls in (
            EtcdBackend, LocMemBackend, PostgresBackend, RedisBackend, RedlockBackend,
            ZooKeeperBackend,
        )
    }  # fmt: skip
    assert declared == {
        EtcdBackend: everything,
        LocMemBackend: everything,
        PostgresBackend: everything,
        RedisBackend: everything,
        RedlockBackend: {Listing, Waiting},  # a quorum of servers: no permits
        ZooKeeperBackend: everything,
    }


#: A method of each capability that a class may only define by declaring it.
_OWN_METHODS = [
    (Listing, "iter_locks"),
    (Listing, "iter_permits"),
    (Waiting, "wait"),
    (Waiting, "leave_queue"),
    (Waiting, "await_release"),
    (Permits, "permit_acquire"),
    (Permits, "permit_holders"),
    (Permits, "apermit_acquire"),
]


@pytest.mark.parametrize(("capability", "method"), _OWN_METHODS)
def test_a_capability_method_without_the_capability_is_refused(
    capability: type[BaseBackend], method: str
) -> None:
    """Written but not declared, the method would never be called (the page would say
    the backend cannot list, the lock layer would poll): refused when the class is made."""

    def body(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("never called")

    with pytest.raises(TypeError, match=rf"defines {method}\(\).*{capability.__name__}"):
        type("Undeclared", (MinimalSQLiteBackend,), {method: body})
    # Declared, the same class is fine.
    type("Declared", (capability, MinimalSQLiteBackend), {method: body})


def _backend_with(capabilities: frozenset[type[BaseBackend]]) -> BaseBackend:
    """A minimal backend that declares ``capabilities`` (their required methods are
    never called here)."""
    body: dict[str, Any] = {}
    for capability in capabilities:
        for method in capability.__abstractmethods__:

            def never(self: Any, *args: Any, **kwargs: Any) -> Any:
                raise AssertionError("never called")

            body[method] = never
    if Permits in capabilities:
        body["permit_kinds"] = frozenset({"semaphore", "read", "write"})
    bases = (*sorted(capabilities, key=CAPABILITIES.index), MinimalSQLiteBackend)
    cls = type("Declares" + "".join(c.__name__ for c in bases[:-1]), bases, body)
    return cls("alias-x", {"LOCATION": "/nonexistent/never-opened"})


@given(st.frozensets(st.sampled_from(CAPABILITIES)))
def test_require_answers_by_what_is_declared(capabilities: frozenset[type[BaseBackend]]) -> None:
    backend = _backend_with(capabilities)
    for capability in CAPABILITIES:
        if capability in capabilities:
            assert require(backend, capability) is backend
            continue
        with pytest.raises(ImproperlyConfigured) as refused:
            require(backend, capability)
        text = str(refused.value)
        assert text == str(not_supported(backend, capability))
        # Which backend, what it lacks, and what to do instead.
        assert "'alias-x'" in text
        assert type(backend).__name__ in text
        assert capability.__name__ in text
        assert "backend=" in text or "polls" in text or "distlocks inspect" in text
    for kind, what in (("semaphore", "semaphores"), ("read", "read-write locks")):
        if Permits in capabilities:
            assert require(backend, Permits, kind) is backend
        else:
            with pytest.raises(ImproperlyConfigured, match=f"does not support {what}"):
                require(backend, Permits, kind)


def test_a_permit_kind_not_served_is_refused_like_a_missing_capability() -> None:
    backend = _backend_with(frozenset({Permits}))
    assert isinstance(backend, Permits)
    backend.permit_kinds = frozenset({"semaphore"})
    assert require(backend, Permits, "semaphore") is backend
    with pytest.raises(ImproperlyConfigured, match="does not support read-write locks"):
        require(backend, Permits, "write")
    with pytest.raises(ImproperlyConfigured, match="does not support read-write locks"):
        backend.check_permit_kind("rwlock")
    with pytest.raises(ValueError, match="Unknown permit kind"):
        require(backend, Permits, "mutex")
    with pytest.raises(ValueError, match="not a backend capability"):
        require(backend, MinimalSQLiteBackend)
    with pytest.raises(ValueError, match="nothing is missing"):
        not_supported(_backend_with(frozenset({Listing})), Listing)


# -- the minimal backend at work -----------------------------------------------------------


def test_lock_alock_and_lock_many_work_on_the_minimal_backend(minimal: str, name: str) -> None:
    with lock(name, backend=minimal, ttl=30) as first:
        assert first.fencing_token > 0
        # A waiter is polled by the lock layer (no Waiting) and gets the lock once freed.
        got: list[Any] = []
        waiter = threading.Thread(
            target=lambda: got.append(lock(name, backend=minimal, ttl=30, timeout=60).acquire())
        )
        waiter.start()
        waiter.join(0.2)
        assert not got, "the waiter got a held lock"
    waiter.join(60)
    assert got, "the polled waiter never got the released lock"
    assert got[0].fencing_token > first.fencing_token
    assert got[0].release() is True

    async def main() -> tuple[int, int]:
        async with alock(name, backend=minimal, ttl=30) as held:
            waiting = asyncio.ensure_future(
                alock(name, backend=minimal, ttl=30, timeout=60).acquire()
            )
            await asyncio.sleep(0.05)
            assert not waiting.done()
        second = await waiting
        assert await second.release() is True
        return held.fencing_token, second.fencing_token

    before, after = asyncio.run(main())
    assert got[0].fencing_token < before < after

    names = [f"{name}:a", f"{name}:b"]
    with lock_many(names, backend=minimal, ttl=30) as leases:
        assert sorted(leases) == names
        assert all(get_backend(minimal).inspect(n) is not None for n in names)
    assert all(get_backend(minimal).inspect(n) is None for n in names)


def test_semaphores_and_read_write_locks_give_the_one_answer(minimal: str) -> None:
    semaphores = r"'minimal' \(MinimalSQLiteBackend\) does not support semaphores"
    rwlocks = r"'minimal' \(MinimalSQLiteBackend\) does not support read-write locks"
    for make in (
        lambda: semaphore("x", limit=2, backend=minimal),
        lambda: asemaphore("x", limit=2, backend=minimal),
    ):
        with pytest.raises(ImproperlyConfigured, match=semaphores) as refused:
            make()
        assert "Permits" in str(refused.value)
    for make_rw in (lambda: rwlock("x", backend=minimal), lambda: arwlock("x", backend=minimal)):
        with pytest.raises(ImproperlyConfigured, match=rwlocks):
            make_rw()


def test_a_listing_says_the_backend_cannot_list_its_locks(minimal: str, name: str) -> None:
    answer = str(not_supported(get_backend(minimal), Listing))
    assert "cannot list its locks" in answer
    with lock(name, backend=minimal, ttl=30), lock(name, backend="locmem", ttl=30):
        snapshot = livelocks.collect()
        assert snapshot.unlisted == {"minimal": answer}
        assert snapshot.errors == {}
        assert [(r.name, r.backend) for r in snapshot.locks if r.name == name] == [(name, "locmem")]
        counted = livelocks.tally()
        assert counted.unlisted == {"minimal": answer}
        assert counted.errors == {}
        assert counted.counts["locmem"]["ok"] >= 1
        # The one lock is still read by name (inspect is required of every backend).
        found = livelocks.inspect(minimal, name)
        assert found is not None
        assert found.backend == minimal


def test_permits_on_the_minimal_backend_give_the_one_answer(minimal: str) -> None:
    for call in (
        lambda: livelocks.inspect(minimal, "x", "semaphore", "owner-a"),
        lambda: livelocks.force_release(minimal, "x", kind="read", owner="owner-a"),
    ):
        with pytest.raises(ImproperlyConfigured, match="does not support"):
            call()


# -- the page, the command and the metrics -------------------------------------------------


@pytest.mark.django_db
def test_the_live_locks_page_says_the_backend_cannot_list(
    minimal: str, name: str, admin_client: Client
) -> None:
    with lock(name, backend="locmem", ttl=30):
        page = admin_client.get(LIST_URL)
        assert page.status_code == 200
        text = page.content.decode()
        assert "cannot list its locks" in text
        assert "MinimalSQLiteBackend" in text
        assert name in text  # the other backend's locks are listed all the same
        only = admin_client.get(LIST_URL, {"backend": minimal})
        assert only.status_code == 200
        assert "cannot list its locks" in only.content.decode()
    with lock(name, backend=minimal, ttl=30):
        # The page of one lock reads it by name: that works without Listing.
        shown = admin_client.get(LOCK_URL, {"backend": minimal, "name": name})
        assert shown.status_code == 200
        assert name in shown.content.decode()
    # A permit's page on it: the one answer as a message, never a server error.
    refused = admin_client.get(
        LOCK_URL, {"backend": minimal, "name": name, "kind": "semaphore", "owner": "o"},
        follow=True,
    )  # fmt: skip
    assert refused.status_code == 200
    assert "does not support semaphores" in refused.content.decode()


def _run(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("distlocks", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_the_command_says_the_backend_cannot_list(minimal: str, name: str) -> None:
    answer = str(not_supported(get_backend(minimal), Listing))
    with lock(name, backend="locmem", ttl=30), lock(name, backend=minimal, ttl=30) as held:
        out, err = _run("list")  # exit 0: nothing failed, one backend cannot list
        assert name in out
        assert answer in err
        with pytest.raises(CommandError, match="cannot list its locks"):
            _run("list", "--backend", minimal)
        out, _ = _run("inspect", name, "--backend", minimal)
        assert str(held.fencing_token) in out
        with pytest.raises(CommandError, match="does not support semaphores"):
            _run("inspect", name, "--backend", minimal, "--kind", "semaphore")
        with pytest.raises(CommandError, match="does not support read-write locks"):
            _run("release", name, "--backend", minimal, "--kind", "write", "--owner", "o", "--yes")
        # Across every backend, one that has no permits simply holds none of them.
        with pytest.raises(CommandError, match="No semaphore permit"):
            _run("inspect", name, "--kind", "semaphore")


def test_metrics_leave_out_a_backend_that_cannot_list(minimal: str, name: str) -> None:
    registry = CollectorRegistry()
    metrics.uninstall()
    metrics.install(registry)
    try:
        with lock(name, backend="locmem", ttl=30):
            sample = registry.get_sample_value
            assert sample("distlocks_backend_up", {"backend": "locmem"}) == 1
            assert sample("distlocks_live_locks", {"backend": "locmem", "status": "ok"}) >= 1
            # No numbers rather than misleading ones: it is not down, it cannot count.
            assert sample("distlocks_backend_up", {"backend": minimal}) is None
            assert sample("distlocks_live_locks", {"backend": minimal, "status": "ok"}) is None
    finally:
        metrics.uninstall()
