"""The backend contract suite, for third-party backends.

(One module of about 830 lines on purpose: a third party imports one class, and reads the
whole contract it is held to in one place, test by test, as it reads
``docs/writing-a-backend.md``.)

Every distlocks backend keeps the same promises (see docs/writing-a-backend.md). This
module ships them as a test class to subclass in your own test suite, pointed at your
backend::

    # tests/test_my_backend.py
    from distlocks.testing.contract import BackendContract


    class TestMyBackend(BackendContract):
        backend_config = {"BACKEND": "myproject.locking.MyBackend", "LOCATION": "..."}

pytest then runs every contract test against a backend built from that entry (under the
alias :attr:`BackendContract.alias`, added to ``DISTLOCKS_BACKENDS`` with
``override_settings`` for each test). Where the entry needs a fixture of yours (a server
your session starts), override the ``contract_config`` fixture instead::

    @pytest.fixture
    def contract_config(self, my_server):
        return {"BACKEND": "myproject.locking.MyBackend", "LOCATION": my_server.url}

The required operations of :class:`~distlocks.backends.base.BaseBackend` are tested on
every backend. The rest only where the backend declares it, by inheriting a capability
of :mod:`distlocks.backends.capabilities`: the listing test for ``Listing``, the wake-up
test for ``Waiting`` (with ``wakes_on_release``), the permit tests for ``Permits`` and the
kinds in its ``permit_kinds``; the expiry tests when ``expires_on_server`` is True. Each
skip says what was not declared. A capability left undeclared is itself checked: it
must give the one clear "not supported" answer (``ImproperlyConfigured``), not half an
implementation.

It needs pytest, pytest-django (or Django settings configured some other way) and
Hypothesis. It uses only the public API (``lock``, ``alock``, ``semaphore``, ``rwlock``,
the live-locks listing) and the methods of ``BaseBackend`` and of the capabilities the
backend declares.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from distlocks import alock, get_backend, livelocks, lock
from distlocks.backends.base import READ, SEMAPHORE, WRITE, BaseBackend, Holder, LockInfo
from distlocks.backends.capabilities import Listing, NotSupported, Permits, Waiting, require
from distlocks.exceptions import LockBackendUnavailable, LockLost, LockNotAcquired
from distlocks.handler import backend_class, backends
from distlocks.locks import current_holder
from distlocks.primitives import arwlock, asemaphore, rwlock, semaphore

try:
    from hypothesis import HealthCheck, example, given
    from hypothesis import settings as hypothesis_settings
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "distlocks.testing.contract needs Hypothesis for its property tests: "
        "pip install hypothesis (or distlocks[dev])."
    ) from exc

__all__ = ["BackendContract", "wait_until"]

#: A lease long enough never to run out during a test (expiry is tested on its own).
_LONG = 30.0


def wait_until(predicate: Callable[[], object], limit: float = 15.0, what: str = "it") -> None:
    """Poll ``predicate`` until true; fail after ``limit`` seconds (a bound, never a
    measurement: a loaded machine only makes it take longer)."""
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {limit} s")
        time.sleep(0.01)


def _in_child(action: Callable[[], object]) -> str:
    """Run ``action`` in a forked child; its result's repr, or ``raised Type: msg``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child only
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
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


class BackendContract:
    """The contract tests; subclass it as ``Test<YourBackend>`` and set :attr:`backend_config`
    (or override the ``contract_config`` fixture). The other class attributes below tune
    the kit and are optional."""

    #: The ``DISTLOCKS_BACKENDS`` entry of the backend under test.
    backend_config: ClassVar[Mapping[str, Any] | None] = None
    #: The alias the entry is added under for each test.
    alias: ClassVar[str] = "contract"
    #: An entry of the same backend whose server cannot be reached (a closed port, a
    #: path that cannot exist), with short timeouts: the kit checks that a lock on it
    #: fails with LockBackendUnavailable. None skips that test.
    unreachable_config: ClassVar[Mapping[str, Any] | None] = None
    #: A credential written in :attr:`unreachable_config` (a password in its URL): the
    #: kit checks that the error, its message and its chained causes never show it.
    unreachable_secret: ClassVar[str | None] = None
    #: False skips the fork test (a forked child must not release or extend its
    #: parent's lease), where your processes never fork while holding a lease.
    forks: ClassVar[bool] = True
    #: Hypothesis examples per property test (more explore more, and take longer).
    max_examples: ClassVar[int] = 60
    #: Seconds the kit waits for what must happen by itself (a lease running out).
    patience: ClassVar[float] = 15.0

    # -- fixtures ------------------------------------------------------------------

    @pytest.fixture
    def contract_config(self) -> Mapping[str, Any]:
        """The backend's entry; override this fixture where it needs another fixture."""
        if self.backend_config is None:
            pytest.fail(
                f"{type(self).__name__} sets no backend_config: set it to your backend's "
                f"DISTLOCKS_BACKENDS entry, or override the contract_config fixture."
            )
        return self.backend_config

    @pytest.fixture
    def contract_alias(self, contract_config: Mapping[str, Any]) -> Iterator[str]:
        """:attr:`alias`, configured with ``contract_config`` for this test only."""
        configs = dict(getattr(settings, "DISTLOCKS_BACKENDS", None) or {})
        configs[self.alias] = dict(contract_config)
        with override_settings(DISTLOCKS_BACKENDS=configs):
            backends.reset()
            try:
                yield self.alias
            finally:
                backends.reset()

    @pytest.fixture
    def contract_backend(self, contract_alias: str) -> BaseBackend:
        return get_backend(contract_alias)

    @pytest.fixture
    def contract_name(self, request: pytest.FixtureRequest) -> str:
        """A lock name no other test (nor an earlier run on a shared server) uses."""
        return f"distlocks-contract:{request.node.name[:60]}:{uuid.uuid4().hex[:12]}"

    # -- helpers -------------------------------------------------------------------

    @staticmethod
    def holder() -> Holder:
        return current_holder()

    @staticmethod
    def fresh_instance(backend: BaseBackend) -> BaseBackend:
        """Another instance of ``backend``'s class on the same entry, as a restarted
        process (or another one) would build it."""
        return backend_class(backend.alias, backend.config)(backend.alias, backend.config)

    @staticmethod
    def skip_unless_declared(backend: BaseBackend, capability: type) -> None:
        """Skip the test, saying so, unless ``backend`` declares ``capability``."""
        if not isinstance(backend, capability):
            pytest.skip(
                f"{type(backend).__name__} does not declare the {capability.__name__} "
                f"capability (distlocks.backends.capabilities.{capability.__name__})"
            )

    def check_info(
        self, backend: BaseBackend, info: LockInfo | None, name: str, owner: str, token: int
    ) -> LockInfo:
        assert info is not None, f"inspect({name!r}) says free, but {owner!r} holds it"
        assert info.name == name
        assert info.backend == backend.alias
        assert info.owner == owner
        assert info.fencing_token == token
        return info

    # -- acquire, release, extend ----------------------------------------------------

    def test_acquire_grants_a_free_lock_and_records_the_holder(
        self, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        backend, name, holder = contract_backend, contract_name, self.holder()
        assert backend.inspect(name) is None
        result = backend.acquire(name, "owner-a", 20, holder)
        try:
            assert result.acquired
            assert result.fencing_token > 0
            if backend.expires_on_server:
                # The holder's local deadline is built from it: never longer than the
                # server keeps the lock, and not missing where the server expires it.
                assert result.remaining is not None
                assert 0 < result.remaining <= 20
            info = self.check_info(
                backend, backend.inspect(name), name, "owner-a", result.fencing_token
            )
            assert (info.host, info.pid, info.thread) == (holder.host, holder.pid, holder.thread)
            if info.ttl is not None:
                assert info.ttl == pytest.approx(20)
            assert backend.fencing_counter(name) == result.fencing_token
        finally:
            assert backend.release(name, "owner-a") is True

    def test_acquire_is_retry_safe_and_refuses_other_owners(
        self, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        backend, name, holder = contract_backend, contract_name, self.holder()
        first = backend.acquire(name, "owner-a", 10, holder)
        again = backend.acquire(name, "owner-a", 10, holder)
        other = backend.acquire(name, "owner-b", 10, holder)
        try:
            assert first.acquired
            assert again.acquired
            assert again.fencing_token == first.fencing_token, "a retried acquire is a new lease"
            assert not other.acquired
            assert other.fencing_token == 0
            assert other.remaining is None or 0 <= other.remaining <= 10
            self.check_info(backend, backend.inspect(name), name, "owner-a", first.fencing_token)
        finally:
            assert backend.release(name, "owner-a") is True

    def test_release_and_extend_check_the_owner_and_release_is_idempotent(
        self, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        backend, name = contract_backend, contract_name
        assert backend.release(name, "owner-a") is False, "released a lock never taken"
        assert backend.extend(name, "owner-a", 10) is False, "extended a lock never taken"
        taken = backend.acquire(name, "owner-a", 10, self.holder())
        assert taken.acquired
        assert backend.release(name, "owner-b") is False
        assert backend.extend(name, "owner-b", 10) is False
        self.check_info(backend, backend.inspect(name), name, "owner-a", taken.fencing_token)
        assert backend.extend(name, "owner-a", _LONG) is True
        assert backend.release(name, "owner-a") is True
        assert backend.release(name, "owner-a") is False
        assert backend.extend(name, "owner-a", 10) is False
        assert backend.inspect(name) is None

    def test_fencing_tokens_strictly_increase_per_name(
        self, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        backend, name, holder = contract_backend, contract_name, self.holder()
        assert backend.fencing_counter(name) == 0
        tokens = []
        for round_ in range(5):
            owner = f"owner-{round_}"
            result = backend.acquire(name, owner, 10, holder)
            assert result.acquired
            tokens.append(result.fencing_token)
            assert backend.fencing_counter(name) == result.fencing_token
            assert backend.release(name, owner) is True
        assert tokens == sorted(set(tokens)), f"tokens not strictly increasing: {tokens}"
        # Each name has its own counter: the other name's moves this one not at all.
        other = backend.acquire(name + ":other", "owner-x", 10, holder)
        assert other.acquired
        assert backend.release(name + ":other", "owner-x") is True
        assert backend.fencing_counter(name) == tokens[-1]

    # -- force release ------------------------------------------------------------------

    def test_force_release_evicts_and_moves_the_counter_on(
        self, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        backend, name, holder = contract_backend, contract_name, self.holder()
        before = backend.fencing_counter(name)
        assert backend.force_release(name) is False, "force-released a free lock"
        assert backend.fencing_counter(name) == before, "a free lock's counter was written"
        evicted = backend.acquire(name, "owner-a", _LONG, holder)
        assert evicted.acquired
        assert backend.force_release(name) is True
        assert backend.inspect(name) is None
        assert backend.force_release(name) is False
        # The evicted holder's token is outdated at once, before anyone acquires.
        assert backend.fencing_counter(name) > evicted.fencing_token
        assert backend.release(name, "owner-a") is False
        assert backend.extend(name, "owner-a", 10) is False
        after = backend.acquire(name, "owner-b", 10, holder)
        assert after.acquired
        assert after.fencing_token > evicted.fencing_token + 1
        assert backend.release(name, "owner-b") is True

    def test_force_release_with_a_token_leaves_a_newer_holder_alone(
        self, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        backend, name, holder = contract_backend, contract_name, self.holder()
        first = backend.acquire(name, "owner-a", _LONG, holder)
        assert backend.release(name, "owner-a") is True
        second = backend.acquire(name, "owner-b", _LONG, holder)
        assert first.acquired
        assert second.acquired
        # An operator who saw the first holder's token must not evict the second.
        assert backend.force_release(name, first.fencing_token) is False
        self.check_info(backend, backend.inspect(name), name, "owner-b", second.fencing_token)
        assert backend.force_release(name, second.fencing_token) is True
        assert backend.inspect(name) is None

    def test_a_new_backend_instance_sees_and_frees_the_same_locks(
        self, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        backend, name, holder = contract_backend, contract_name, self.holder()
        taken = backend.acquire(name, "owner-a", _LONG, holder)
        assert taken.acquired
        fresh = self.fresh_instance(backend)
        try:
            self.check_info(fresh, fresh.inspect(name), name, "owner-a", taken.fencing_token)
            assert not fresh.acquire(name, "owner-b", 10, holder).acquired
            assert fresh.fencing_counter(name) == taken.fencing_token
            assert fresh.force_release(name, taken.fencing_token + 1) is False
            assert fresh.force_release(name, taken.fencing_token) is True
            assert backend.inspect(name) is None
            again = fresh.acquire(name, "owner-b", 10, holder)
            assert again.acquired
            assert again.fencing_token > taken.fencing_token
            # The first instance sees what the second one did, and may evict it (a
            # release belongs to the instance that acquired: a lock may live in its
            # connection).
            self.check_info(backend, backend.inspect(name), name, "owner-b", again.fencing_token)
            assert backend.force_release(name, again.fencing_token) is True
            assert fresh.inspect(name) is None
        finally:
            fresh.close()

    # -- listing ------------------------------------------------------------------------

    def test_a_backend_that_cannot_list_says_so(
        self, contract_alias: str, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        """Without ``Listing``, the listing of live locks (admin page, command, metrics)
        gives the one clear answer for this backend instead of failing, and a held lock
        is still read by name."""
        backend = contract_backend
        if isinstance(backend, Listing):
            pytest.skip(f"{type(backend).__name__} declares the Listing capability")
        with pytest.raises(NotSupported, match="cannot list its locks") as refused:
            require(backend, Listing)
        assert repr(contract_alias) in str(refused.value)
        with lock(contract_name, backend=contract_alias, ttl=_LONG) as lease:
            snapshot = livelocks.collect([contract_alias])
            assert snapshot.unlisted == {contract_alias: str(refused.value)}
            assert snapshot.errors == {}
            found = livelocks.inspect(contract_alias, contract_name)
            assert found is not None
            assert found.info.fencing_token == lease.fencing_token

    def test_inspect_and_iter_locks_agree_with_what_is_held(
        self, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        backend, holder = contract_backend, self.holder()
        self.skip_unless_declared(backend, Listing)
        assert isinstance(backend, Listing)
        names = [f"{contract_name}:{i}" for i in range(4)]
        tokens = {}
        for i, name in enumerate(names):
            result = backend.acquire(name, f"owner-{i}", _LONG, holder)
            assert result.acquired
            tokens[name] = (f"owner-{i}", result.fencing_token)
        assert backend.release(names[0], "owner-0") is True
        del tokens[names[0]]

        def listed() -> dict[str, tuple[str, int]]:
            return {
                info.name: (info.owner, info.fencing_token)
                for info in backend.iter_locks()
                if info.name.startswith(contract_name + ":")
            }

        try:
            assert listed() == tokens
            for name, (owner, token) in tokens.items():
                self.check_info(backend, backend.inspect(name), name, owner, token)
            assert backend.inspect(names[0]) is None
        finally:
            for name, (owner, _) in tokens.items():
                assert backend.release(name, owner) is True
        assert listed() == {}

    # -- the whole contract, model-checked --------------------------------------------

    def test_any_sequence_of_operations_matches_the_model(
        self, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        """Random sequences of acquire, release, extend, force_release and inspect by
        three owners give exactly the answers of a one-holder model, and tokens only
        ever go up."""
        backend, holder = contract_backend, self.holder()
        # One flat choice, so that each owner's calls are as likely as a force release.
        operation = st.sampled_from(
            [(op, owner) for op in ("acquire", "release", "extend") for owner in range(3)]
            + [("force", mode) for mode in ("any", "current", "stale")]
            + [("inspect", "")]
        )

        @hypothesis_settings(
            max_examples=self.max_examples,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            report_multiple_bugs=False,
        )
        # Besides the random sequences, every kind of call is always tried once on a held
        # lock (a backend that gets one of them wrong fails on every run, not on some).
        @example([("acquire", 0), ("acquire", 0), ("acquire", 1), ("extend", 1), ("inspect", "")])
        @example([("acquire", 0), ("release", 1), ("extend", 0), ("release", 0), ("release", 0)])
        @example([("acquire", 0), ("force", "stale"), ("force", "current"), ("acquire", 1)])
        @example([("acquire", 2), ("force", "any"), ("release", 2), ("acquire", 0)])
        @given(st.lists(operation, min_size=2, max_size=30))
        def run(steps: list[tuple[str, Any]]) -> None:
            tag = uuid.uuid4().hex[:8]
            name = f"{contract_name}:{tag}"
            # Owners are new in each example, as a lease's owner is new at each acquisition.
            owners = [f"owner-{tag}-{i}" for i in range(3)]
            owner: str | None = None
            token = 0  # the holder's
            last = 0  # the highest token seen issued
            try:
                for op, which in steps:
                    arg = owners[which] if isinstance(which, int) else which
                    if op == "acquire":
                        result = backend.acquire(name, arg, _LONG, holder)
                        assert result.acquired == (owner in (None, arg)), (op, arg, owner)
                        if owner == arg:
                            assert result.fencing_token == token, "a retry changed the token"
                        elif owner is None:
                            assert result.fencing_token > last, "a token did not go up"
                            owner, token = arg, result.fencing_token
                            last = token
                    elif op == "release":
                        assert backend.release(name, arg) == (owner == arg), (op, arg, owner)
                        if owner == arg:
                            owner = None
                    elif op == "extend":
                        assert backend.extend(name, arg, _LONG) == (owner == arg), (op, arg)
                    elif op == "force":
                        given_token = {"any": None, "current": token, "stale": token - 1}[arg]
                        evicts = owner is not None and arg != "stale"
                        assert backend.force_release(name, given_token) == evicts, (op, arg)
                        if evicts:
                            owner = None
                            assert backend.fencing_counter(name) > token
                    info = backend.inspect(name)
                    assert (info.owner if info else None) == owner, (op, arg)
                    if info is not None:
                        assert info.fencing_token == token
                    counter = backend.fencing_counter(name)
                    assert counter >= last
                    last = counter
            finally:
                if owner is not None:
                    backend.release(name, owner)

        run()

    def test_threads_racing_for_a_lock_never_both_hold_it(self, contract_alias: str) -> None:
        """However many threads try at once, exactly one gets a free lock, and its token
        is above every earlier holder's."""

        @hypothesis_settings(
            max_examples=max(3, self.max_examples // 3),
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            report_multiple_bugs=False,
        )
        @given(st.integers(min_value=2, max_value=6), st.integers(min_value=1, max_value=3))
        def run(threads: int, rounds: int) -> None:
            name = f"distlocks-contract:race:{uuid.uuid4().hex}"
            last = 0
            for _ in range(rounds):
                start = threading.Barrier(threads)
                winners: list[Any] = []
                errors: list[BaseException] = []

                def attempt(
                    start: threading.Barrier = start,
                    winners: list[Any] = winners,
                    errors: list[BaseException] = errors,
                ) -> None:
                    try:
                        start.wait(30)
                        winners.append(lock(name, backend=contract_alias, timeout=0).acquire())
                    except LockNotAcquired:
                        pass
                    except BaseException as exc:
                        errors.append(exc)

                workers = [threading.Thread(target=attempt) for _ in range(threads)]
                for worker in workers:
                    worker.start()
                for worker in workers:
                    worker.join(60)
                assert not errors, errors
                assert len(winners) == 1, f"{len(winners)} of {threads} threads got the lock"
                assert winners[0].fencing_token > last
                last = winners[0].fencing_token
                assert winners[0].release() is True

        run()

    def test_threads_taking_turns_never_overlap(self, contract_alias: str) -> None:
        name = f"distlocks-contract:turns:{uuid.uuid4().hex}"
        inside = most = done = 0
        guard = threading.Lock()
        errors: list[BaseException] = []

        def worker() -> None:
            nonlocal inside, most, done
            try:
                for _ in range(5):
                    with lock(name, backend=contract_alias, ttl=_LONG, timeout=60):
                        with guard:
                            inside += 1
                            most = max(most, inside)
                        time.sleep(0.001)  # widens the window two holders would share
                        with guard:
                            inside -= 1
                            done += 1
            except BaseException as exc:
                errors.append(exc)

        workers = [threading.Thread(target=worker) for _ in range(4)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join(120)
        assert not errors, errors
        assert (most, done) == (1, 20)

    # -- the public API ---------------------------------------------------------------

    def test_lock_is_refused_while_held_and_times_out(
        self, contract_alias: str, contract_name: str
    ) -> None:
        name = contract_name
        with lock(name, backend=contract_alias, ttl=_LONG) as lease:
            assert lease.held()
            assert lease.fencing_token > 0
            with pytest.raises(LockNotAcquired, match="tried once") as refused:
                lock(name, backend=contract_alias, timeout=0).acquire()
            assert refused.value.name == name
            started = time.monotonic()
            with pytest.raises(LockNotAcquired, match=r"after waiting 0\.3s"):
                lock(name, backend=contract_alias, timeout=0.3).acquire()
            # A lower bound only: giving up early would be a bug, late is the machine.
            assert time.monotonic() - started >= 0.3
        assert not lease.held()
        assert lease.state == "released"
        assert get_backend(contract_alias).inspect(name) is None

    def test_a_waiter_gets_the_lock_when_it_is_released(
        self, contract_alias: str, contract_name: str
    ) -> None:
        first = lock(contract_name, backend=contract_alias, ttl=_LONG).acquire()
        got: list[Any] = []
        waiter = threading.Thread(
            target=lambda: got.append(
                lock(contract_name, backend=contract_alias, ttl=_LONG, timeout=60).acquire()
            )
        )
        waiter.start()
        # Lets the waiter start waiting (it gets the lock either way): it cannot end
        # while the lock is held.
        waiter.join(0.2)
        assert not got, "the waiter got a held lock"
        assert first.release() is True
        waiter.join(60)
        assert got, "the waiter never got the released lock"
        assert got[0].fencing_token > first.fencing_token
        assert got[0].release() is True

    def test_a_lease_lost_inside_the_block_raises_lock_lost(
        self, contract_alias: str, contract_name: str
    ) -> None:
        backend = get_backend(contract_alias)
        with (
            pytest.raises(LockLost) as lost,
            lock(contract_name, backend=contract_alias, ttl=_LONG) as lease,
        ):
            assert backend.force_release(contract_name, lease.fencing_token) is True
        assert lost.value.lease is lease
        assert lease.release() is False

    def test_alock_acquires_and_refuses_like_lock(
        self, contract_alias: str, contract_name: str
    ) -> None:
        async def main() -> tuple[int, int]:
            async with alock(contract_name, backend=contract_alias, ttl=_LONG) as first:
                with pytest.raises(LockNotAcquired):
                    await alock(contract_name, backend=contract_alias, timeout=0).acquire()
            async with alock(contract_name, backend=contract_alias, ttl=_LONG) as second:
                pass
            return first.fencing_token, second.fencing_token

        first, second = asyncio.run(main())
        assert 0 < first < second
        assert get_backend(contract_alias).inspect(contract_name) is None

    def test_bad_arguments_are_refused_at_the_call(
        self, contract_alias: str, contract_backend: BaseBackend, contract_config: Mapping[str, Any]
    ) -> None:
        cases: list[tuple[dict[str, Any], type[Exception]]] = [
            ({"name": ""}, ValueError),
            ({"name": b"bytes"}, TypeError),
            ({"ttl": 0}, ValueError),
            ({"ttl": -1}, ValueError),
            ({"timeout": -1}, ValueError),
        ]
        for bad, error in cases:
            arguments: dict[str, Any] = {"name": "distlocks-contract:bad", **bad}
            with pytest.raises(error):
                lock(arguments.pop("name"), backend=contract_alias, **arguments)
        with pytest.raises(ImproperlyConfigured, match="Unknown distlocks backend alias"):
            lock("distlocks-contract:bad", backend=contract_alias + "-not-configured")
        # A misspelt key in the entry is reported, not ignored.
        problems = type(contract_backend).validate_config(
            contract_alias, {**contract_config, "LOCATOIN": "x"}
        )
        assert any("LOCATOIN" in problem for problem in problems), problems
        assert type(contract_backend).validate_config(contract_alias, contract_config) == []

    def test_an_unreachable_server_gives_lock_backend_unavailable(self) -> None:
        if self.unreachable_config is None:
            pytest.skip("unreachable_config is not set: no server to find down")
        configs = dict(getattr(settings, "DISTLOCKS_BACKENDS", None) or {})
        configs[self.alias + "-down"] = dict(self.unreachable_config)
        with override_settings(DISTLOCKS_BACKENDS=configs):
            try:
                with pytest.raises(LockBackendUnavailable) as down:
                    lock("distlocks-contract:down", backend=self.alias + "-down").acquire()
                assert down.value.__cause__ is not None, "the driver's error is not chained"
                if self.unreachable_secret:
                    error: BaseException | None = down.value
                    while error is not None:
                        assert self.unreachable_secret not in f"{error} {error!r}", (
                            f"{type(error).__name__} shows the credential"
                        )
                        error = error.__cause__ or error.__context__
            finally:
                backends.reset()

    # -- declared capabilities ------------------------------------------------------------

    def test_a_lease_left_to_run_out_frees_the_lock(
        self, contract_alias: str, contract_name: str
    ) -> None:
        backend = get_backend(contract_alias)
        if not backend.expires_on_server:
            pytest.skip(f"{type(backend).__name__} declares expires_on_server = False")
        stale = lock(contract_name, backend=contract_alias, ttl=0.3, auto_renew=False).acquire()
        wait_until(
            lambda: backend.inspect(contract_name) is None,
            limit=self.patience,
            what="the lease's expiry",
        )
        fresh = lock(contract_name, backend=contract_alias, ttl=_LONG, timeout=0).acquire()
        try:
            assert fresh.fencing_token > stale.fencing_token
            # The stale holder can neither free nor extend the new holder's lock.
            assert stale.release() is False
            assert stale.state == "lost"
            assert backend.extend(contract_name, stale.owner, _LONG) is False
            info = backend.inspect(contract_name)
            assert info is not None
            assert info.owner == fresh.owner
        finally:
            assert fresh.release() is True

    def test_extend_pushes_the_expiry_on_the_server(
        self, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        backend, name = contract_backend, contract_name
        if not backend.expires_on_server:
            pytest.skip(f"{type(backend).__name__} declares expires_on_server = False")
        assert backend.acquire(name, "owner-a", 0.5, self.holder()).acquired
        try:
            assert backend.extend(name, "owner-a", _LONG) is True
            info = backend.inspect(name)
            assert info is not None
            if info.expires_in is not None:
                assert info.expires_in.total_seconds() > _LONG / 2
            if info.ttl is not None:
                assert info.ttl == pytest.approx(_LONG)
        finally:
            assert backend.release(name, "owner-a") is True

    def test_a_waiter_is_woken_by_the_release(
        self, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        """A waiter registered with ``acquire(wait=...)`` then blocked in ``wait()`` (or in
        ``acquire()`` itself, where the server queues it) is woken by the release, long
        before the 120 s it said it would wait."""
        backend, name, holder = contract_backend, contract_name, self.holder()
        self.skip_unless_declared(backend, Waiting)
        assert isinstance(backend, Waiting)
        if not backend.wakes_on_release:
            pytest.skip(f"{type(backend).__name__} declares wakes_on_release = False (it polls)")
        assert backend.acquire(name, "owner-a", _LONG, holder).acquired
        got: list[bool] = []

        def waiter() -> None:
            if not backend.acquire(name, "owner-w", _LONG, holder, wait=120).acquired:
                backend.wait(name, 120, owner="owner-w")
                got.append(backend.acquire(name, "owner-w", _LONG, holder, wait=120).acquired)
            else:
                got.append(True)

        thread = threading.Thread(target=waiter)
        thread.start()
        try:
            # Lets the waiter register (it cannot get the lock while it is held).
            thread.join(0.5)
            assert not got, "the waiter got a held lock"
            assert backend.release(name, "owner-a") is True
            thread.join(60)
            assert got == [True], "the waiter was not woken by the release"
        finally:
            thread.join(120)
            backend.release(name, "owner-w")
            backend.leave_queue(name, "owner-w")

    def test_semaphore_admits_up_to_its_limit(
        self, contract_alias: str, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        self.skip_unless_declared(contract_backend, Permits)
        assert isinstance(contract_backend, Permits)
        if SEMAPHORE not in contract_backend.permit_kinds:
            pytest.skip(f"{type(contract_backend).__name__} declares no 'semaphore' permits")
        with contextlib.ExitStack() as stack:
            permits = [
                stack.enter_context(
                    semaphore(contract_name, limit=2, backend=contract_alias, ttl=_LONG, timeout=0)
                )
                for _ in range(2)
            ]
            assert len({permit.owner for permit in permits}) == 2
            with pytest.raises(LockNotAcquired):
                semaphore(contract_name, limit=2, backend=contract_alias, timeout=0).acquire()
            # The plain lock of the same name is another thing.
            with lock(contract_name, backend=contract_alias, timeout=0):
                pass
        with semaphore(contract_name, limit=2, backend=contract_alias, timeout=0):
            pass

    def test_rwlock_shares_reads_and_fences_writes(
        self, contract_alias: str, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        self.skip_unless_declared(contract_backend, Permits)
        assert isinstance(contract_backend, Permits)
        if not {READ, WRITE} <= contract_backend.permit_kinds:
            pytest.skip(
                f"{type(contract_backend).__name__} declares no read-write lock permits "
                "('read' and 'write')"
            )
        catalog = rwlock(contract_name, backend=contract_alias)
        with (
            catalog.read(ttl=_LONG, timeout=0),
            catalog.read(ttl=_LONG, timeout=0),
            pytest.raises(LockNotAcquired),
        ):
            catalog.write(timeout=0).acquire()
        with catalog.write(ttl=_LONG, timeout=0) as first, pytest.raises(LockNotAcquired):
            catalog.read(timeout=0).acquire()
        with catalog.write(ttl=_LONG, timeout=0) as second:
            pass
        assert 0 < first.fencing_token < second.fencing_token
        assert catalog.fencing_counter() == second.fencing_token

    def test_an_undeclared_permit_kind_is_refused_clearly(
        self, contract_alias: str, contract_backend: BaseBackend, contract_name: str
    ) -> None:
        """Semaphores and read-write locks the backend does not serve (no ``Permits``, or
        a kind not in its ``permit_kinds``) are refused where they are made, with the one
        answer, before any ``permit_*`` method is called."""
        backend = contract_backend
        served = backend.permit_kinds if isinstance(backend, Permits) else frozenset()
        if {SEMAPHORE, READ, WRITE} <= served:
            pytest.skip(f"{type(backend).__name__} declares every permit kind")
        if SEMAPHORE not in served:
            for make_semaphore in (semaphore, asemaphore):
                with pytest.raises(ImproperlyConfigured, match="does not support semaphores"):
                    make_semaphore(contract_name, limit=2, backend=contract_alias)
        if not {READ, WRITE} <= served:
            for make_rwlock in (rwlock, arwlock):
                with pytest.raises(ImproperlyConfigured, match="does not support read-write locks"):
                    make_rwlock(contract_name, backend=contract_alias)
        if isinstance(backend, Listing):
            assert [i for i in backend.iter_permits() if i.name == contract_name] == []

    # -- fork -------------------------------------------------------------------------------

    def test_a_forked_child_cannot_release_its_parents_lease(
        self, contract_alias: str, contract_name: str
    ) -> None:
        if not hasattr(os, "fork"):
            pytest.skip("this platform has no os.fork")
        if not self.forks:
            pytest.skip(f"{type(self).__name__} sets forks = False")
        backend = get_backend(contract_alias)
        lease = lock(contract_name, backend=contract_alias, ttl=_LONG, auto_renew=False).acquire()
        try:
            assert _in_child(lambda: (lease.held(), lease.release(), lease.state)) == (
                "(False, False, 'held')"
            )
            text = _in_child(lease.extend)
            assert text.startswith("raised LockLost"), text
            assert "forked" in text, text
            assert lease.held()
            info = backend.inspect(contract_name)
            assert info is not None
            assert info.owner == lease.owner
        finally:
            assert lease.release() is True
