"""The backend kit (distlocks.testing.contract) run against backends outside the package
(tests/thirdparty/sqlite_locks.py: one with the required methods only, one that also
lists) and against built-in ones (LocMem, Redis, PostgreSQL): the same contract for all.
Broken variants of the third-party backend show the kit catches what it claims to, and a
backend that declares no capability shows that each skip names the one it lacks."""

from __future__ import annotations

import contextlib
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from distlocks import get_backend
from distlocks.backends.base import AcquireResult, BaseBackend, Holder, LockInfo
from distlocks.handler import backends
from distlocks.testing.contract import BackendContract
from tests.thirdparty.sqlite_locks import MinimalSQLiteBackend, SQLiteLockBackend

SQLITE = "tests.thirdparty.sqlite_locks.SQLiteLockBackend"
MINIMAL = "tests.thirdparty.sqlite_locks.MinimalSQLiteBackend"


class TestSQLiteBackend(BackendContract):
    """The third-party backend: its file is made for each test."""

    unreachable_config = {"BACKEND": SQLITE, "LOCATION": "/nonexistent-dir/x/locks.sqlite3"}

    @pytest.fixture
    def contract_config(self, tmp_path: Path) -> Mapping[str, Any]:
        return {"BACKEND": SQLITE, "LOCATION": str(tmp_path / "locks.sqlite3")}


class TestMinimalSQLiteBackend(BackendContract):
    """The narrow contract: the required methods only, no capability declared."""

    unreachable_config = {"BACKEND": MINIMAL, "LOCATION": "/nonexistent-dir/x/locks.sqlite3"}

    @pytest.fixture
    def contract_config(self, tmp_path: Path) -> Mapping[str, Any]:
        return {"BACKEND": MINIMAL, "LOCATION": str(tmp_path / "locks.sqlite3")}


class TestLocMemBackend(BackendContract):
    backend_config = {"BACKEND": "distlocks.backends.locmem.LocMemBackend", "LOCATION": "kit"}


class TestRedisBackend(BackendContract):
    unreachable_config = {
        "BACKEND": "distlocks.backends.redis.RedisBackend",
        # Port 1: nothing listens there, the connection is refused at once.
        "LOCATION": "redis://:kit-s3cret-pw@127.0.0.1:1/0",
        "OPTIONS": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
    }
    unreachable_secret = "kit-s3cret-pw"

    @pytest.fixture
    def contract_config(self) -> Mapping[str, Any]:
        return {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": settings.REDIS_URL}


@pytest.mark.django_db
class TestPostgresBackend(BackendContract):
    """A backend without expiry on the server (locks end with their session)."""

    @pytest.fixture
    def contract_config(self, pg_ready: None) -> Mapping[str, Any]:
        config = settings.DISTLOCKS_BACKENDS["pg"]
        assert isinstance(config, Mapping)
        return config

    def test_an_owner_acquiring_again_after_a_force_release_gets_a_new_lease(
        self, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        # The sequence the kit's model test found (the backend told the owner it held
        # the lock, with the evicted token, while nobody held it): acquire, force
        # release, acquire again by the same owner.
        backend, holder = contract_backend, self.holder()
        first = backend.acquire(contract_name, "owner-a", 30, holder)
        assert first.acquired
        assert backend.force_release(contract_name) is True
        again = backend.acquire(contract_name, "owner-a", 30, holder)
        try:
            assert again.acquired
            assert again.fencing_token > first.fencing_token, "the evicted token is reissued"
        finally:
            backend.release(contract_name, "owner-a")


# -- the kit fails a backend that breaks the contract ------------------------------------


class ReleasesForAnyone(SQLiteLockBackend):
    """Release without the owner check."""

    def release(self, name: str, owner: str) -> bool:
        info = self.inspect(name)
        return info is not None and super().release(name, info.owner)


class NewTokenOnRetry(SQLiteLockBackend):
    """A retried acquire by the holder mints a new token."""

    def acquire(
        self, name: str, owner: str, ttl: float, holder: Holder, **kw: Any
    ) -> AcquireResult:
        result = super().acquire(name, owner, ttl, holder, **kw)
        if result.acquired and self.inspect(name) is not None and result.fencing_token:
            info = self.inspect(name)
            assert info is not None
            if info.renewals == 0 and getattr(self, "_seen", {}).get(name) == owner:
                return AcquireResult(True, result.fencing_token + 1, result.remaining)
            self.__dict__.setdefault("_seen", {})[name] = owner
        return result


class ForceReleaseKeepsCounter(SQLiteLockBackend):
    """Force release evicts but leaves the counter where it was."""

    def force_release(self, name: str, token: int | None = None) -> bool:
        info = self.inspect(name)
        if info is None or (token is not None and info.fencing_token != token):
            return False
        return super().release(name, info.owner)


class ForceReleaseIgnoresToken(SQLiteLockBackend):
    """Force release evicts whoever holds the lock, whatever token it was given."""

    def force_release(self, name: str, token: int | None = None) -> bool:
        return super().force_release(name)


class CheckThenInsert(SQLiteLockBackend):
    """Acquire reads, then writes in another transaction: two callers both see it free."""

    def acquire(
        self, name: str, owner: str, ttl: float, holder: Holder, **kw: Any
    ) -> AcquireResult:
        if self.inspect(name) is not None:
            return super().acquire(name, owner, ttl, holder, **kw)
        time.sleep(0.02)  # the window between the read and the write

        def step(cursor: sqlite3.Cursor, now: float) -> AcquireResult:
            cursor.execute("DELETE FROM distlocks_lock WHERE name = ?", (name,))
            token = self._next_token(cursor, name)
            cursor.execute(
                "INSERT INTO distlocks_lock VALUES (?, ?, ?, ?, ?, ?, 0, ?, ?, ?, '{}')",
                (name, owner, token, now, now + ttl, ttl, holder.host, holder.pid, holder.thread),
            )
            return AcquireResult(True, token, ttl)

        return self._run("acquire", step)


class ListsNothing(SQLiteLockBackend):
    """Inspects, but forgets to list."""

    def iter_locks(self) -> Iterator[LockInfo]:
        return iter(())


class CountersPerInstance(SQLiteLockBackend):
    """Counts tokens in the instance's memory: another process starts again at 1."""

    def __init__(self, alias: str, config: Mapping[str, Any]) -> None:
        super().__init__(alias, config)
        self.counters: dict[str, int] = {}

    def _next_token(self, cursor: sqlite3.Cursor, name: str) -> int:  # type: ignore[override]
        self.counters[name] = self.counters.get(name, 0) + 1
        return self.counters[name]

    def fencing_counter(self, name: str) -> int:
        return self.counters.get(name, 0)


class RecordsNoHolder(SQLiteLockBackend):
    """Keeps the lock but not who holds it."""

    def acquire(
        self, name: str, owner: str, ttl: float, holder: Holder, **kw: Any
    ) -> AcquireResult:
        return super().acquire(name, owner, ttl, Holder("", 0, ""), **kw)


class NeverExpires(SQLiteLockBackend):
    """Declares expiry on the server, but keeps a lease that ran out."""

    def acquire(
        self, name: str, owner: str, ttl: float, holder: Holder, **kw: Any
    ) -> AcquireResult:
        return super().acquire(name, owner, max(ttl, 3600), holder, **kw)


class Impatient(TestSQLiteBackend):
    """The kit as a broken backend meets it: no need to wait 15 s for what never comes."""

    patience = 2.0


@contextlib.contextmanager
def configured(cls: type[BaseBackend], path: Path) -> Iterator[str]:
    config = {"BACKEND": f"{__name__}.{cls.__name__}", "LOCATION": str(path / "broken.sqlite3")}
    with override_settings(DISTLOCKS_BACKENDS={**settings.DISTLOCKS_BACKENDS, "broken": config}):
        try:
            yield "broken"
        finally:
            backends.reset()


def _with_backend(test: Callable[..., None]) -> Callable[[BackendContract, str], None]:
    return lambda kit, alias: test(kit, get_backend(alias), f"kit:{uuid.uuid4().hex}")


def _with_alias(test: Callable[..., None]) -> Callable[[BackendContract, str], None]:
    return lambda kit, alias: test(kit, alias, f"kit:{uuid.uuid4().hex}")


K = BackendContract
MUTANTS = [
    (
        ReleasesForAnyone,
        _with_backend(K.test_release_and_extend_check_the_owner_and_release_is_idempotent),
    ),
    (ReleasesForAnyone, _with_backend(K.test_any_sequence_of_operations_matches_the_model)),
    (NewTokenOnRetry, _with_backend(K.test_acquire_is_retry_safe_and_refuses_other_owners)),
    (NewTokenOnRetry, _with_backend(K.test_any_sequence_of_operations_matches_the_model)),
    (ForceReleaseKeepsCounter, _with_backend(K.test_force_release_evicts_and_moves_the_counter_on)),
    (ForceReleaseKeepsCounter, _with_backend(K.test_any_sequence_of_operations_matches_the_model)),
    (
        ForceReleaseIgnoresToken,
        _with_backend(K.test_force_release_with_a_token_leaves_a_newer_holder_alone),
    ),
    (ForceReleaseIgnoresToken, _with_backend(K.test_any_sequence_of_operations_matches_the_model)),
    (
        CheckThenInsert,
        lambda kit, alias: kit.test_threads_racing_for_a_lock_never_both_hold_it(alias),
    ),
    (NeverExpires, _with_alias(K.test_a_lease_left_to_run_out_frees_the_lock)),
    (ListsNothing, _with_backend(K.test_inspect_and_iter_locks_agree_with_what_is_held)),
    (
        CountersPerInstance,
        _with_backend(K.test_a_new_backend_instance_sees_and_frees_the_same_locks),
    ),
    (RecordsNoHolder, _with_backend(K.test_acquire_grants_a_free_lock_and_records_the_holder)),
]


@pytest.mark.parametrize(
    ("broken", "kit_test"),
    MUTANTS,
    ids=[f"{cls.__name__}-{i}" for i, (cls, _) in enumerate(MUTANTS)],
)
def test_the_kit_fails_a_backend_that_breaks_the_contract(
    broken: type[BaseBackend], kit_test: Callable[[BackendContract, str], None], tmp_path: Path
) -> None:
    with configured(broken, tmp_path) as alias:
        with pytest.raises((AssertionError, pytest.fail.Exception)):
            kit_test(Impatient(), alias)


def test_the_kit_passes_the_unbroken_backend_through_the_same_harness(tmp_path: Path) -> None:
    """The harness above is not what fails: the real backend passes the same calls."""
    with configured(SQLiteLockBackend, tmp_path) as alias:
        for _, kit_test in MUTANTS:
            kit_test(TestSQLiteBackend(), alias)


# -- the kit tests only what a backend declares ---------------------------------------------

UNDECLARED = [
    ("Listing", _with_backend(K.test_inspect_and_iter_locks_agree_with_what_is_held)),
    ("Waiting", _with_backend(K.test_a_waiter_is_woken_by_the_release)),
    (
        "Permits",
        lambda kit, alias: kit.test_semaphore_admits_up_to_its_limit(
            alias, get_backend(alias), f"kit:{uuid.uuid4().hex}"
        ),
    ),
    (
        "Permits",
        lambda kit, alias: kit.test_rwlock_shares_reads_and_fences_writes(
            alias, get_backend(alias), f"kit:{uuid.uuid4().hex}"
        ),
    ),
]


@pytest.mark.parametrize(("capability", "kit_test"), UNDECLARED, ids=[c for c, _ in UNDECLARED])
def test_each_skip_names_the_capability_not_declared(
    capability: str, kit_test: Callable[[BackendContract, str], None], tmp_path: Path
) -> None:
    with configured(MinimalSQLiteBackend, tmp_path) as alias:
        with pytest.raises(pytest.skip.Exception, match=rf"does not declare the {capability} "):
            kit_test(TestMinimalSQLiteBackend(), alias)
