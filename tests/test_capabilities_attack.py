"""Attacks on the narrow backend contract (issue 28), as a third party's testers would.

Subclassing built-in and third-party backends the way users do (mixins, abstract
intermediate classes, overrides, each order of bases); a capability declared with a
method missing, or written without being declared; permit kinds a backend cannot
serve; every surface (locks, permits, the page, the command, checks) on a backend that
lacks a capability, with the lock layer's polling bounded. Real SQLite files and the
in-process LocMem store only: no server is faked.
"""

from __future__ import annotations

import asyncio
import copy
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client, override_settings
from hypothesis import given
from hypothesis import strategies as st

from distlocks import alock, get_backend, livelocks, lock, lock_many
from distlocks.backends.base import AcquireResult, Holder
from distlocks.backends.capabilities import (
    CAPABILITIES,
    Listing,
    Permits,
    Waiting,
    waiting_side,
)
from distlocks.backends.locmem import LocMemBackend
from distlocks.exceptions import LockNotAcquired
from distlocks.handler import backend_class
from distlocks.locks import MAX_POLL_INTERVAL
from distlocks.primitives import PermitServer, asemaphore, semaphore
from distlocks.testing.contract import BackendContract
from tests.thirdparty.sqlite_locks import MinimalSQLiteBackend, SQLiteLockBackend

HERE = "tests.test_capabilities_attack"
LIST_URL = "/admin/distlocks/livelock/"
LOCK_URL = "/admin/distlocks/livelock/lock/"
RELEASE_URL = "/admin/distlocks/livelock/release/"
#: Written in a LOCATION: no page, message or command output may show it.
SECRET = "hunter2-s3cret-pw"


# -- classes a user writes ---------------------------------------------------------------


class CountingBackend(MinimalSQLiteBackend):
    """A user's subclass overriding ``acquire`` (to count calls): no capability."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attempts = 0

    def acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        wait: float = 0.0,
        fair: bool = False,
    ) -> AcquireResult:
        self.attempts += 1
        return super().acquire(name, owner, ttl, holder, wait=wait, fair=fair)


class PlainPermitsLocMem(LocMemBackend):
    """Permits written without ``permit_wait`` (the default, which sleeps): as a third
    party that declares Waiting and Permits writes them. Counts the waits it is asked."""

    permit_wait = Permits.permit_wait
    apermit_wait = Permits.apermit_wait

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waits: list[float] = []


def _record_waits(backend: PlainPermitsLocMem) -> None:
    """Record each timeout the lock layer passes to permit_wait / apermit_wait."""
    sync, asynchronous = backend.permit_wait, backend.apermit_wait

    def permit_wait(kind: str, name: str, timeout: float, **kw: Any) -> None:
        backend.waits.append(timeout)
        sync(kind, name, timeout, **kw)

    async def apermit_wait(kind: str, name: str, timeout: float, **kw: Any) -> None:
        backend.waits.append(timeout)
        await asynchronous(kind, name, timeout, **kw)

    backend.permit_wait = permit_wait  # type: ignore[method-assign]
    backend.apermit_wait = apermit_wait  # type: ignore[method-assign]


class ListingMixin:
    """A user's own mixin, not a backend: it brings ``iter_locks``."""

    def iter_locks(self) -> Iterator[Any]:
        return iter(())


def _never(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise AssertionError("never called")


_PERMIT_METHODS = {method: _never for method in Permits.__abstractmethods__}


@pytest.fixture
def sqlite_path(tmp_path: Path) -> str:
    # The secret in the LOCATION itself: whatever quotes a LOCATION would show it.
    return str(tmp_path / f"{SECRET}.sqlite3")


@pytest.fixture
def mixed(sqlite_path: str) -> Iterator[dict[str, Any]]:
    """A backend that lists (LocMem) and one that cannot (CountingBackend)."""
    configs = {
        "default": {"BACKEND": "distlocks.backends.locmem.LocMemBackend", "LOCATION": "attack"},
        "minimal": {"BACKEND": f"{HERE}.CountingBackend", "LOCATION": sqlite_path},
    }
    with override_settings(DISTLOCKS_BACKENDS=configs):
        livelocks.snapshots.clear()
        yield configs
    livelocks.snapshots.clear()


# -- declaring: refused at definition where nothing would call it ----------------------


def test_a_mixin_that_brings_a_capabilitys_method_is_refused() -> None:
    """A capability method from a mixin of the user's own (not a backend class) would
    never be called either: the capability would be lost without a word."""
    with pytest.raises(TypeError, match=r"iter_locks\(\).*ListingMixin.*Listing"):
        type("Lost", (ListingMixin, MinimalSQLiteBackend), {})
    with pytest.raises(TypeError, match=r"iter_locks\(\).*Listing"):
        type("LostToo", (MinimalSQLiteBackend, ListingMixin), {})
    # Declared, the mixin's method is the listing.
    kept = type("Kept", (ListingMixin, Listing, MinimalSQLiteBackend), {})
    assert issubclass(kept, Listing)
    assert kept.__abstractmethods__ == frozenset()


@pytest.mark.parametrize(
    ("attribute", "value", "capability"),
    [
        ("wakes_on_release", True, Waiting),
        ("permit_kinds", frozenset({"semaphore"}), Permits),
    ],
)
def test_a_capabilitys_setting_without_the_capability_is_refused(
    attribute: str, value: Any, capability: type
) -> None:
    """``wakes_on_release = True`` on a backend without Waiting is still polled, and
    ``permit_kinds`` without Permits serves nothing: say so when the class is made."""
    with pytest.raises(TypeError, match=rf"{attribute}\b.*{capability.__name__}"):
        type("Undeclared", (MinimalSQLiteBackend,), {attribute: value})


def _kinds_id(kinds: Any) -> str:
    """A test id that is the same in every process (a set's order follows the hash seed,
    and pytest-xdist's workers must collect the same ids)."""
    if isinstance(kinds, (set, frozenset)):
        return f"{type(kinds).__name__}{sorted(kinds)}"
    return repr(kinds)


@pytest.mark.parametrize(
    "kinds",
    [
        frozenset({"semaphores"}),  # misspelt: never served, never said
        frozenset({"mutex"}),
        frozenset({"read"}),  # a read-write lock needs both sides
        frozenset({"semaphore", "write"}),
        "semaphore",  # a str, not a set of kinds
        ["semaphore"],
    ],
    ids=_kinds_id,
)
def test_permit_kinds_that_cannot_be_served_are_refused(kinds: Any) -> None:
    with pytest.raises(TypeError, match="permit_kinds"):
        type("Odd", (Permits, MinimalSQLiteBackend), {**_PERMIT_METHODS, "permit_kinds": kinds})


@pytest.mark.parametrize(
    "kinds",
    [
        frozenset(),
        frozenset({"semaphore"}),
        frozenset({"read", "write"}),
        frozenset({"semaphore", "read", "write"}),
        {"semaphore"},
    ],
    ids=_kinds_id,
)
def test_permit_kinds_that_can_be_served_are_accepted(kinds: Any) -> None:
    cls = type("Fine", (Permits, MinimalSQLiteBackend), {**_PERMIT_METHODS, "permit_kinds": kinds})
    backend = cls("x", {"LOCATION": "/nonexistent/never-opened"})
    for kind in ("semaphore", "read", "write"):
        if kind in kinds:
            backend.check_permit_kind(kind)
        else:
            with pytest.raises(ImproperlyConfigured, match="does not support"):
                backend.check_permit_kind(kind)


# -- subclassing the way users do: no false TypeError, no lost capability ---------------


def test_subclasses_of_built_in_backends_keep_their_capabilities() -> None:
    from distlocks.backends.redis import RedisBackend

    class MyRedis(RedisBackend):
        def acquire(self, *args: Any, **kwargs: Any) -> AcquireResult:
            return super().acquire(*args, **kwargs)

        def iter_locks(self) -> Iterator[Any]:
            return super().iter_locks()

        def wait(self, *args: Any, **kwargs: Any) -> None:
            super().wait(*args, **kwargs)

        def permit_acquire(self, *args: Any, **kwargs: Any) -> AcquireResult:
            return super().permit_acquire(*args, **kwargs)

    class Audited:  # a mixin of the user's own, of no capability
        def release(self, name: str, owner: str) -> bool:
            return super().release(name, owner)  # type: ignore[misc]

    class MyLocMem(Audited, LocMemBackend):
        pass

    class LocMemFirst(LocMemBackend, Audited):
        pass

    for cls in (MyRedis, MyLocMem, LocMemFirst):
        assert all(issubclass(cls, capability) for capability in CAPABILITIES), cls
        assert cls.__abstractmethods__ == frozenset(), cls
    backend = MyLocMem("x", {"LOCATION": "subclass"})
    assert isinstance(waiting_side(backend), LocMemBackend)
    # Copies keep what the class declares (nothing was moved off the class).
    for twin in (copy.copy(backend), copy.copy(SQLiteLockBackend("y", {"LOCATION": "/n"}))):
        assert type(twin) in (MyLocMem, SQLiteLockBackend)
        assert isinstance(twin, Listing)


@given(
    order=st.permutations([Listing, Waiting, Permits]),
    through_abstract=st.booleans(),
)
def test_capabilities_declared_in_any_order_or_through_an_abstract_class(
    order: list[type], through_abstract: bool
) -> None:
    methods: dict[str, Any] = {
        method: _never for capability in order for method in capability.__abstractmethods__
    }
    methods["permit_kinds"] = frozenset({"semaphore"})
    if through_abstract:
        # An abstract intermediate class declares; the concrete one writes the methods.
        middle = type("Middle", (*order, MinimalSQLiteBackend), {})
        assert middle.__abstractmethods__
        cls = type("Concrete", (middle,), methods)
    else:
        cls = type("Concrete", (*order, MinimalSQLiteBackend), methods)
    assert cls.__abstractmethods__ == frozenset()
    backend = cls("x", {"LOCATION": "/nonexistent/never-opened"})
    assert all(isinstance(backend, capability) for capability in order)


# -- a declared capability with a method missing: a configuration error, early ----------


class DeclaresListingOnly(Listing, MinimalSQLiteBackend):
    """Declares Listing but forgot iter_locks (an abstract class, as a setting)."""


class DeclaresPermitsPartly(Permits, MinimalSQLiteBackend):
    permit_kinds = frozenset({"semaphore"})

    def permit_acquire(self, *args: Any, **kwargs: Any) -> AcquireResult:
        raise AssertionError("never called")


@pytest.mark.parametrize(
    ("cls", "missing"),
    [
        ("DeclaresListingOnly", r"Listing.*iter_locks\(\)"),
        ("DeclaresPermitsPartly", r"Permits.*permit_counter\(\).*permit_release\(\)"),
    ],
)
def test_a_declared_capability_with_a_method_missing_is_a_configuration_error(
    cls: str, missing: str, sqlite_path: str
) -> None:
    config = {"BACKEND": f"{HERE}.{cls}", "LOCATION": sqlite_path}
    with pytest.raises(ImproperlyConfigured, match=missing):
        backend_class("broken", config)
    with override_settings(
        DISTLOCKS_BACKENDS={
            "default": {"BACKEND": "distlocks.backends.locmem.LocMemBackend"},
            "broken": config,
        }
    ):
        # manage.py check says so at start-up, and the first use says the same.
        errors = [m for m in run_checks() if m.id == "distlocks.E003"]
        assert len(errors) == 1
        assert "'broken'" in str(errors[0].hint)
        assert SECRET not in str(errors[0].hint)
        with pytest.raises(ImproperlyConfigured, match=missing):
            get_backend("broken")
        with pytest.raises(ImproperlyConfigured, match=missing):
            lock("x", backend="broken").acquire()


# -- waiting without Waiting: polled, with a bounded number of attempts -------------------


def test_a_waiter_on_a_backend_without_waiting_polls_a_bounded_number_of_times(
    mixed: dict[str, Any], name: str
) -> None:
    """In 1 s of waiting, about 16 attempts (pauses of 2 ms doubling up to 100 ms),
    never a busy loop: sync, async and lock_many."""
    backend = get_backend("minimal")
    assert isinstance(backend, CountingBackend)
    with lock(name, backend="minimal", ttl=60):
        backend.attempts = 0
        with pytest.raises(LockNotAcquired):
            lock(name, backend="minimal", timeout=1).acquire()
        assert 2 <= backend.attempts <= 25, backend.attempts

        backend.attempts = 0

        async def main() -> None:
            with pytest.raises(LockNotAcquired):
                await alock(name, backend="minimal", timeout=1).acquire()

        asyncio.run(main())
        assert 2 <= backend.attempts <= 25, backend.attempts

        backend.attempts = 0
        with (
            pytest.raises(LockNotAcquired),
            lock_many([f"{name}:free", name], backend="minimal", timeout=1),
        ):
            pass
        assert 3 <= backend.attempts <= 26, backend.attempts


def test_permits_without_their_own_wait_are_polled(name: str) -> None:
    """A backend that declares Waiting and Permits but writes no ``permit_wait`` gets
    the default, which only sleeps: the lock layer must poll it (pauses of at most
    100 ms), not sleep until the holder's lease or the caller's deadline ends."""
    configs = {
        "default": {"BACKEND": "distlocks.backends.locmem.LocMemBackend"},
        "plain": {"BACKEND": f"{HERE}.PlainPermitsLocMem", "LOCATION": "plain-permits"},
    }
    with override_settings(DISTLOCKS_BACKENDS=configs):
        backend = get_backend("plain")
        assert isinstance(backend, PlainPermitsLocMem)
        assert PermitServer(backend, "semaphore").wakes_on_release is False
        _record_waits(backend)
        holder = semaphore(name, limit=1, backend="plain", ttl=60).acquire()
        got: list[Any] = []
        waiter = threading.Thread(
            target=lambda: got.append(
                semaphore(name, limit=1, backend="plain", ttl=60, timeout=30).acquire()
            )
        )
        waiter.start()
        try:
            deadline = 200
            while not backend.waits and deadline:  # the waiter has started waiting
                waiter.join(0.05)
                deadline -= 1
            assert holder.release() is True
            waiter.join(60)
            assert got, "the waiter never got the released permit"
            assert got[0].release() is True
        finally:
            waiter.join(60)
        assert backend.waits and max(backend.waits) <= MAX_POLL_INTERVAL + 0.01, backend.waits

        backend.waits.clear()

        async def main() -> None:
            async with asemaphore(name, limit=1, backend="plain", ttl=60):
                with pytest.raises(LockNotAcquired):
                    await asemaphore(name, limit=1, backend="plain", timeout=0.5).acquire()

        asyncio.run(main())
        assert backend.waits and max(backend.waits) <= MAX_POLL_INTERVAL + 0.01, backend.waits


# -- the page, the command: a view-only operator, two kinds of backend -------------------


def _staff(django_user_model: Any, username: str, *perms: str) -> Any:
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user(username, password="pw", is_staff=True)
    for codename in perms:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="distlocks", codename=codename)
        )
    return user


@pytest.mark.django_db
def test_a_view_only_operator_sees_both_backends_and_no_secret(
    mixed: dict[str, Any], name: str, django_user_model: Any
) -> None:
    viewer = Client()
    viewer.force_login(_staff(django_user_model, "viewer", "view_livelock"))
    with lock(name, backend="default", ttl=30), lock(f"{name}:m", backend="minimal", ttl=30):
        for params in ({}, {"backend": "minimal"}, {"backend": "default"}, {"q": name}):
            page = viewer.get(LIST_URL, params)
            assert page.status_code == 200, params
            text = page.content.decode()
            assert SECRET not in text
            assert "Traceback" not in text
            if params.get("backend") != "default":
                assert "cannot list its locks" in text
        assert name in viewer.get(LIST_URL).content.decode()
        one = viewer.get(LOCK_URL, {"backend": "minimal", "name": f"{name}:m"})
        assert one.status_code == 200
        assert SECRET not in one.content.decode()
        for kind in ("semaphore", "read", "write"):
            refused = viewer.get(
                LOCK_URL,
                {"backend": "minimal", "name": name, "kind": kind, "owner": "o"},
                follow=True,
            )
            assert refused.status_code == 200
            text = refused.content.decode()
            assert "does not support" in text and SECRET not in text
        # Viewing is not releasing.
        denied = viewer.post(RELEASE_URL, {"backend": "minimal", "name": f"{name}:m"})
        assert denied.status_code == 403
        assert get_backend("minimal").inspect(f"{name}:m") is not None


def _run(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("distlocks", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


@pytest.mark.django_db
def test_the_command_on_a_backend_without_capabilities(mixed: dict[str, Any], name: str) -> None:
    held = lock(name, backend="minimal", ttl=60).acquire()
    try:
        out, err = _run("list", "--json")
        assert "cannot list its locks" in err and SECRET not in out + err
        with pytest.raises(CommandError, match="cannot list its locks") as failed:
            _run("list", "--backend", "minimal", "--json")
        assert SECRET not in str(failed.value)
        out, err = _run("inspect", name, "--backend", "minimal")
        assert str(held.fencing_token) in out and SECRET not in out + err
        # A plain lock is force-released on any backend (force_release is required).
        out, err = _run("release", name, "--backend", "minimal", "--yes")
        assert SECRET not in out + err
        assert get_backend("minimal").inspect(name) is None
        assert get_backend("minimal").fencing_counter(name) > held.fencing_token
        assert held.release() is False  # evicted: its release frees nothing
    finally:
        held.release()


# -- the kit against a backend that declares Permits for semaphores only --------------------


class SemaphoreOnlyLocMem(LocMemBackend):
    """Permits for semaphores only; its permit_acquire, as a third party writes it, does
    not check the kind itself (the primitives refuse a kind not served before it)."""

    permit_kinds = frozenset({"semaphore"})

    def permit_acquire(self, kind: str, *args: Any, **kwargs: Any) -> AcquireResult:
        if kind != "semaphore":
            return AcquireResult(True, 0, None)  # never reached through the public API
        return super().permit_acquire(kind, *args, **kwargs)


class TestSemaphoreOnlyBackend(BackendContract):
    """The kit asks what the docs say: semaphores work, read-write locks are refused
    with the one answer through the public API."""

    backend_config = {"BACKEND": f"{HERE}.SemaphoreOnlyLocMem", "LOCATION": "semaphores-only"}


# -- any hierarchy a user may build ------------------------------------------------------------

_WHERE = ["nowhere", "body", "mixin", "backend"]


@given(
    plan=st.fixed_dictionaries(
        {
            capability: st.tuples(st.booleans(), st.sampled_from(_WHERE))
            for capability in CAPABILITIES
        }
    ),
    mixins_first=st.booleans(),
)
def test_any_hierarchy_is_refused_exactly_when_a_capability_would_be_lost(
    plan: dict[type, tuple[bool, str]], mixins_first: bool
) -> None:
    """Each capability declared or not, its methods written nowhere, in the class body,
    in a mixin of no capability or in an intermediate backend class: refused at
    definition exactly when some capability's method is there undeclared; else usable
    exactly when every declared capability's methods are written (a configuration error
    naming them otherwise)."""
    declared = [c for c, (is_declared, _) in plan.items() if is_declared]
    lost = any(where != "nowhere" and not is_declared for is_declared, where in plan.values())
    # A mixin after the capability it implements is hidden behind its abstract methods.
    hidden = not mixins_first and any(
        is_declared and where == "mixin" for is_declared, where in plan.values()
    )

    def methods(capability: type) -> dict[str, Any]:
        body: dict[str, Any] = dict.fromkeys(capability.__abstractmethods__, _never)
        if capability is Permits:
            body["permit_kinds"] = frozenset({"semaphore"})
        return body

    def build() -> type:
        body: dict[str, Any] = {}
        mixins: list[type] = []
        direct = list(declared)
        intermediate: type = MinimalSQLiteBackend
        for capability, (is_declared, where) in plan.items():
            if where == "body":
                body.update(methods(capability))
            elif where == "mixin":
                mixins.append(type(f"{capability.__name__}Mixin", (), methods(capability)))
            elif where == "backend":
                # An intermediate backend class writes it (and declares it, if declared).
                bases = (capability, intermediate) if is_declared else (intermediate,)
                intermediate = type("Middle", bases, methods(capability))
                if is_declared:
                    direct.remove(capability)
        bases = (*mixins, *direct) if mixins_first else (*direct, *mixins)
        return type("Built", (*bases, intermediate), body)

    if lost:
        with pytest.raises(TypeError, match="does not declare the"):
            build()
        return
    if hidden:
        with pytest.raises(TypeError, match="hides"):
            build()
        return
    cls = build()
    assert all(issubclass(cls, capability) for capability in declared)
    unwritten = [c for c in declared if plan[c][1] == "nowhere"]
    config = {"BACKEND": "unused", "LOCATION": "/nonexistent/never-opened"}
    if unwritten:
        from distlocks.backends.capabilities import unwritten as describe

        text = describe(cls)
        assert all(f"the {c.__name__} capability" in text for c in unwritten), text
        with pytest.raises(TypeError):
            cls("x", config)
    else:
        assert cls.__abstractmethods__ == frozenset()
        cls("x", config)
