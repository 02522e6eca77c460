"""Random sequences of lock operations on every backend, checked against a model.

One :class:`LockMachine` per backend (LocMem, Redis, Redis Cluster, Redlock,
PostgreSQL in session mode) takes, re-enters, waits for, releases, extends and
force-releases locks on a few names (strange ones included), lets leases run out,
forks, and kills the client connections (and, in the fuzz profile, restarts the
servers). After every step the server is read back (``inspect``, ``iter_locks``,
``fencing_counter``) and compared with the model:

* at most one holder per name, and it is the model's (owner and token);
* fencing tokens strictly increase per name, across acquisitions, force releases,
  expiries, restarts and examples;
* only the owner frees: a stale, released or forked-off lease never frees or
  extends the lock, a force release naming another token evicts nobody;
* every error is a ``LockError`` or the documented ``ValueError``/``TypeError``;
  nothing is left on the server after an error (no lock, no waiter, no counter for a
  name that was never taken).

PostgreSQL's transaction mode, where a lock ends at COMMIT, has its own smaller
machine (:class:`TransactionMachine`).

"Holders" are separate owners within this process (one lease per acquisition); a
forked child stands for another process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import signal
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import redis
from django.db import connection, connections, transaction
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from distlocks import get_backend, lock, reentrancy
from distlocks.backends.base import BaseBackend, LockInfo
from distlocks.exceptions import LockError, LockLost, LockNotAcquired
from distlocks.lease import Lease
from distlocks.testing.servers import RedisServer
from distlocks.validation import MAX_NAME_LENGTH, MAX_TTL
from tests.stateful.conftest import TEST_TIMEOUT, fuzzing, profile
from tests.waiting import wait_for

#: Long enough that no lease of the model runs out by itself during a run.
LONG_TTL = 3600.0
#: The lease that the "expire" rule lets run out.
SHORT_TTL = 0.3
#: How long a refused waiting acquire waits.
WAIT = 0.2
#: Generous bound for anything the machine waits for (a loaded machine is slow).
PATIENCE = 20.0
#: Holders kept for the rules to pick from (held, stale, ended).
MAX_HOLDERS = 10


def machine_names(tag: str) -> list[str]:
    """The names one test works on: plain, with braces, the plain name equal to the
    hashed tag of the braced one, unicode, and one of the maximum length."""
    braces = f"{tag}:inv{{42}}"
    hashed_tag = "#" + hashlib.sha256(braces.encode()).hexdigest()[:32]
    longest = (f"{tag}:long:" + "é" * MAX_NAME_LENGTH)[:MAX_NAME_LENGTH]
    return [f"{tag}:plain", braces, hashed_tag, f"{tag}:ключ🔒名前 {{", longest]


@dataclass(eq=False)
class Holder:
    """One acquisition, as the model sees it."""

    lease: Lease
    name: str
    token: int
    reentrant: bool
    depth: int = 1
    #: "held": the model's holder of its name; "gone": the server dropped it (evicted,
    #: ran out, session ended, server restarted) and the lease may not know yet;
    #: "ended": released, or its loss was reported to us.
    status: str = "held"

    def __repr__(self) -> str:
        return f"<Holder {self.name[:24]!r} token={self.token} {self.status} depth={self.depth}>"


# -- what each backend runs on: killing connections, restarting ---------------------


def _redis_kill(urls: list[str]) -> None:
    for url in urls:
        client = redis.Redis.from_url(url, socket_timeout=5)
        try:
            client.client_kill_filter(_type="normal", skipme=True)
        finally:
            client.close()


_TERMINATE_IDLE = """
SELECT pg_terminate_backend(a.pid, 5000) FROM pg_stat_activity a
WHERE a.application_name = 'distlocks' AND a.datname = current_database()
  AND a.pid <> pg_backend_pid()
  AND NOT EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory')
"""


def _pg_terminate(sql: str, params: list[Any] | None = None) -> int:
    with connection.cursor() as cursor:
        cursor.execute(sql, params or [])
        return len(cursor.fetchall())


@dataclass
class Servers:
    """How a machine disturbs its backend's servers."""

    #: End distlocks' client connections that hold no lock (the server side closes them).
    kill_connections: Callable[[], None]
    #: Restart every server empty (None: not offered for this backend).
    restart: Callable[[], None] | None = None


def servers_for(alias: str, found: dict[str, Any]) -> Servers:
    if alias == "sf-redis":
        server: RedisServer = found[alias]
        return Servers(lambda: _redis_kill([server.url]), lambda: _restart([server]))
    if alias == "sf-redlock":
        masters: list[RedisServer] = found[alias]
        return Servers(lambda: _redis_kill([m.url for m in masters]), lambda: _restart(masters))
    if alias == "sf-cluster":
        cluster = found[alias]
        urls = [f"redis://127.0.0.1:{node.port}/0" for node in cluster.nodes]
        # No restart: the session cluster is shared, and a restarted node rejoins
        # only through a failover (tests/faults covers that).
        return Servers(lambda: _redis_kill(urls))
    if alias.startswith("pg"):
        # No restart: the session's PostgreSQL server is the whole suite's database.
        return Servers(lambda: _pg_terminate(_TERMINATE_IDLE) and None)
    return Servers(lambda: None)


def _restart(servers: list[RedisServer]) -> None:
    for server in servers:
        port = server.port
        server.kill()
        server.start(port=port)


# -- the machine ----------------------------------------------------------------------


class LockMachine(RuleBasedStateMachine):
    """Plain locks on one backend (``alias``), several owners, a few names."""

    alias: ClassVar[str]
    names: ClassVar[list[str]]
    servers: ClassVar[Servers]
    #: Shared by every example of one test: the last token seen per name (tokens must
    #: keep increasing across examples too) and the names ever taken.
    tokens: ClassVar[dict[str, int]]
    taken: ClassVar[set[str]]

    def __init__(self) -> None:
        super().__init__()
        self.backend: BaseBackend = get_backend(self.alias)
        self.expires = self.backend.expires_on_server
        self.holders: list[Holder] = []
        #: The model: the holder of each name (None: free).
        self.owner_of: dict[str, Holder | None] = dict.fromkeys(self.names)
        #: Our record of the reentrant lease of each name the library may re-enter.
        self.reentrant: dict[str, Holder] = {}

    # -- helpers ----------------------------------------------------------------

    def pick(self, index: int, status: str | None = None) -> Holder:
        pool = [h for h in self.holders if status is None or h.status == status]
        return pool[index % len(pool)]

    def has(self, status: str) -> bool:
        return any(h.status == status for h in self.holders)

    def lock(self, name: str, **kwargs: Any) -> Any:
        kwargs.setdefault("ttl", LONG_TTL)
        return lock(name, backend=self.alias, **kwargs)

    def add(self, holder: Holder) -> None:
        self.holders.append(holder)
        if len(self.holders) > MAX_HOLDERS:
            # Forget the oldest ended holder (or the oldest stale one). A stale reentrant
            # lease stays in the library's registry for this thread: re-entering it later
            # raises LockLost (acquire() accepts that), and teardown() lets it go.
            for status in ("ended", "gone"):
                old = next((h for h in self.holders if h.status == status), None)
                if old is not None:
                    self.holders.remove(old)
                    if self.reentrant.get(old.name) is old:
                        del self.reentrant[old.name]
                    break

    def granted(
        self, name: str, lease: Lease, reentrant: bool, *, may_have_run_out: bool = False
    ) -> Holder:
        """Record a new lease on a name the model says is free (``may_have_run_out``:
        a short lease, which a loaded machine may let run out before this check)."""
        # First: the server counted the name as taken whatever the checks below find
        # (the invariant that a never-taken name has no counter must not fail later).
        self.taken.add(name)
        current = self.owner_of[name]
        assert current is None, f"{name!r} granted to {lease.owner} while {current} holds it"
        assert lease.held() or (may_have_run_out and lease.state == "lost"), lease.state
        assert lease.fencing_token > self.tokens.get(name, 0), (
            f"token {lease.fencing_token} for {name!r} is not above {self.tokens.get(name)}"
        )
        self.tokens[name] = lease.fencing_token
        holder = Holder(lease, name, lease.fencing_token, reentrant)
        self.owner_of[name] = holder
        if reentrant:
            self.reentrant[name] = holder
        self.add(holder)
        return holder

    def dropped(self, holder: Holder, status: str = "gone") -> None:
        """The server no longer has ``holder``'s lock."""
        if self.owner_of[holder.name] is holder:
            self.owner_of[holder.name] = None
        holder.status = status
        if status == "ended" and self.reentrant.get(holder.name) is holder:
            del self.reentrant[holder.name]

    def counter_moved_past(self, name: str, token: int) -> None:
        counter = self.backend.fencing_counter(name)
        assert counter > token, f"counter of {name!r} is {counter}, not above {token}"
        self.tokens[name] = max(self.tokens.get(name, 0), counter)

    # -- rules: acquiring -----------------------------------------------------------

    @rule(
        n=st.integers(0, 4),
        reentrant=st.booleans(),
        auto_renew=st.booleans(),
        wait=st.booleans(),
    )
    def acquire(self, n: int, reentrant: bool, auto_renew: bool, wait: bool) -> None:
        name = self.names[n]
        again = self.reentrant.get(name) if reentrant else None
        # What the library keeps for this thread, read before the call: a re-entry that
        # finds it lost drops it from the registry before raising.
        kept = reentrancy.current(self.alias, name) if reentrant else None
        timeout = WAIT if wait else 0
        started = time.monotonic()
        try:
            lease = self.lock(
                name, timeout=timeout, reentrant=reentrant, auto_renew=auto_renew
            ).acquire()
        except LockNotAcquired:
            waited = time.monotonic() - started
            assert self.owner_of[name] is not None, f"{name!r} refused although free"
            assert again is None or again.status != "held", "re-entry refused"
            assert waited >= timeout, f"gave up after {waited:.3f}s of {timeout}s"
            if again is not None:  # the library noticed the loss (e.g. at a renewal)
                self.dropped(again, "ended")
            return
        except LockLost:
            # Re-entering a lease the server dropped fails loudly: one the model knows
            # is gone, or one the model stopped tracking (a "gone" holder it forgot, see
            # add()) that the library still kept for this thread, never the holder.
            known = again is not None and again.status == "gone"
            current = self.owner_of[name]
            untracked = (
                again is None
                and kept is not None
                and (current is None or current.lease is not kept)
                and not kept.held()
            )
            assert known or untracked, f"LockLost from acquire ({again}, kept {kept!r})"
            if again is not None:
                self.dropped(again, "ended")
            let_go(self.alias, name)
            return
        if again is not None and again.status == "held":
            assert lease is again.lease, "re-entry made a new lease"
            assert lease.fencing_token == again.token
            again.depth += 1
            return
        if again is not None:
            self.dropped(again, "ended")
        self.granted(name, lease, reentrant)

    @precondition(lambda self: any(h.status == "held" and h.depth == 1 for h in self.holders))
    @rule(i=st.integers(0, 99))
    def acquire_while_released(self, i: int) -> None:
        """A waiter is granted the lock when its holder releases it from another thread."""
        holder = self.pick(i, "held")
        if holder.depth != 1:
            return
        releasing = threading.Timer(0.05, holder.lease.release)
        releasing.start()
        try:
            lease = self.lock(holder.name, timeout=PATIENCE).acquire()
        finally:
            releasing.join()
        self.dropped(holder, "ended")
        assert lease.fencing_token > holder.token
        self.granted(holder.name, lease, False)

    @rule(n=st.integers(0, 4), evict=st.booleans())
    def with_block(self, n: int, evict: bool) -> None:
        """A ``with`` block; the lock force-released inside it raises LockLost at exit."""
        name = self.names[n]
        if self.owner_of[name] is not None:
            return
        raises = pytest.raises(LockLost) if evict else contextlib.nullcontext()
        with raises, self.lock(name, timeout=0) as lease:
            holder = self.granted(name, lease, False)
            if evict:
                assert self.backend.force_release(name, lease.fencing_token) is True
                self.dropped(holder)
                self.counter_moved_past(name, lease.fencing_token)
        self.dropped(holder, "ended")
        assert lease.state == ("lost" if evict else "released")

    @precondition(lambda self: self.backend.expires_on_server)
    @rule(n=st.integers(0, 4))
    def expire(self, n: int) -> None:
        """A lease nobody renews runs out; the server frees the lock by itself."""
        name = self.names[n]
        if self.owner_of[name] is not None:
            return
        lease = self.lock(name, ttl=SHORT_TTL, timeout=0, auto_renew=False).acquire()
        holder = self.granted(name, lease, False, may_have_run_out=True)
        wait_for(lambda: self.backend.inspect(name) is None, PATIENCE, f"{name!r} to expire")
        # The local deadline is taken before the request: never later than the server's.
        assert not lease.held() and lease.state == "lost"
        self.dropped(holder)

    # -- rules: the holder's side -------------------------------------------------

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 99))
    def release(self, i: int) -> None:
        holder = self.pick(i)
        freed = holder.lease.release()
        if holder.status == "held" and holder.depth == 1:
            assert freed is True, f"release of the holder {holder} returned False"
            self.dropped(holder, "ended")
            return
        assert freed is False, f"release of {holder} freed something"
        if holder.status != "ended" and holder.depth > 1:
            holder.depth -= 1
        elif holder.status == "gone":
            self.dropped(holder, "ended")

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 99), ttl=st.sampled_from([None, 900.0, LONG_TTL]))
    def extend(self, i: int, ttl: float | None) -> None:
        holder = self.pick(i)
        if holder.status == "held":
            holder.lease.extend(ttl)
            if ttl is not None and self.expires:
                info = self.backend.inspect(holder.name)
                assert info is not None and info.ttl == pytest.approx(ttl)
                assert info.expires_in is not None
                assert info.expires_in.total_seconds() > ttl - PATIENCE
            return
        with pytest.raises(LockLost):
            holder.lease.extend(ttl)
        self.dropped(holder, "ended")

    @precondition(lambda self: self.has("held"))
    @rule(
        i=st.integers(0, 99),
        bad=st.sampled_from(
            [0, -1, float("nan"), float("inf"), MAX_TTL + 1, 10**400, True, "30", None]
        ),
    )
    def extend_with_a_bad_ttl(self, i: int, bad: Any) -> None:
        """A bad ttl is refused before any I/O; the lease is untouched."""
        holder = self.pick(i, "held")
        if bad is None:
            bad = 0.001  # below the 0.01 s minimum
        ttl = holder.lease.ttl
        with pytest.raises((ValueError, TypeError)) as excinfo:
            holder.lease.extend(bad)
        assert str(excinfo.value)
        assert holder.lease.held() and holder.lease.ttl == ttl

    # -- rules: operators and the world -------------------------------------------

    @rule(n=st.integers(0, 4), which=st.sampled_from(["holder", "stale", "next", "any"]))
    def force_release(self, n: int, which: str) -> None:
        """Force release naming the holder's token, an older or a newer one, or none."""
        name = self.names[n]
        current = self.owner_of[name]
        last = self.tokens.get(name, 0)
        if which == "holder":
            token: int | None = current.token if current is not None else last
        elif which == "stale":
            older = [h.token for h in self.holders if h.name == name and h is not current]
            token = max(older) if older else max(last - 1, 0)
        elif which == "next":
            token = (current.token if current is not None else last) + 1
        else:
            token = None
        counter = self.backend.fencing_counter(name)
        evicted = self.backend.force_release(name, token)
        if current is None:
            assert evicted is False, f"force release of free {name!r} evicted something"
            # Nothing written: the counter did not move (and a name never taken has none).
            assert self.backend.fencing_counter(name) == counter
            return
        if token is None or token == current.token:
            assert evicted is True, f"force release ({which}) did not evict {current}"
            self.dropped(current)
            self.counter_moved_past(name, current.token)
        else:
            assert evicted is False, f"force release with token {token} evicted {current}"

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 99), acquire_in_child=st.booleans())
    def fork(self, i: int, acquire_in_child: bool) -> None:
        """A forked child cannot release, extend or use the lease it inherited."""
        holder = self.pick(i)
        probe = acquire_in_child and self.alias in CHILD_IO_ALIASES
        report = run_in_child(lambda: child_probe(holder.lease, self.alias if probe else None))
        assert report["held"] is False
        assert report["release"] is False
        assert report["extend"] == "LockLost", report
        assert report["ensure_held"] == "LockLost", report
        if probe and holder.status == "held":
            assert report["child_acquire"] == "LockNotAcquired", report
        if holder.status == "held":
            assert holder.lease.held()  # the parent's lease is untouched

    @rule()
    def kill_connections(self) -> None:
        """The server ends distlocks' connections; the next calls reconnect."""
        self.servers.kill_connections()

    @precondition(lambda self: self.alias.startswith("pg") and self.has("held"))
    @rule(i=st.integers(0, 99))
    def terminate_holder_session(self, i: int) -> None:
        """PostgreSQL ends the holder's session (a DBA, idle_session_timeout): the lock
        is free at once, and the lease finds out at its next renewal or release."""
        holder = self.pick(i, "held")
        info = self.backend.inspect(holder.name)
        assert info is not None
        _pg_terminate("SELECT pg_terminate_backend(%s, 5000)", [info.extra["backend_pid"]])
        wait_for(lambda: self.backend.inspect(holder.name) is None, PATIENCE, "the session end")
        self.dropped(holder)

    @precondition(lambda self: fuzzing() and self.servers.restart is not None)
    @rule()
    def restart_servers(self) -> None:
        """Every server restarts empty: every lock is gone, tokens still increase."""
        self.servers.restart()
        for holder in self.holders:
            if holder.status == "held":
                self.dropped(holder)

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def server_matches_model(self) -> None:
        for name in self.names:
            info = self.backend.inspect(name)
            holder = self.owner_of[name]
            if holder is None:
                assert info is None, f"{name!r} is free in the model, held on the server: {info}"
                if name not in self.taken:
                    assert self.backend.fencing_counter(name) == 0, f"counter for {name!r}"
                continue
            assert info is not None, f"{holder} is not on the server"
            assert (info.owner, info.fencing_token) == (holder.lease.owner, holder.token)
            assert info.name == name
            assert info.waiters in (0, None), f"a waiter is left on {name!r}: {info}"
            assert holder.lease.held()

    @invariant()
    def listing_matches_model(self) -> None:
        mine = set(self.names)
        listed: list[LockInfo] = [i for i in self.backend.iter_locks() if i.name in mine]
        seen = sorted((i.name, i.owner) for i in listed)
        model = sorted(
            (name, holder.lease.owner) for name, holder in self.owner_of.items() if holder
        )
        assert seen == model

    def teardown(self) -> None:
        # Release what the model holds (every level of a reentrant lease); a step
        # that failed may have left more: give back every lease quietly.
        errors: list[BaseException] = []
        for holder in self.holders:
            for _ in range(holder.depth):
                try:
                    holder.lease.release()
                except LockError as exc:
                    errors.append(exc)
        for name in self.names:
            # The library keeps reentrant leases per thread and name, across examples
            # (the names are the test's): one the model forgot must not be re-entered
            # by the next example, whose model never saw it.
            let_go(self.alias, name)
            with contextlib.suppress(LockError):
                if self.backend.inspect(name) is not None:
                    self.backend.force_release(name)
        assert not errors, errors


def let_go(alias: str, name: str) -> None:
    """Release every level of the reentrant lease the library keeps for this thread on
    ``name``, if any, so that no later step or example re-enters it."""
    lease = reentrancy.current(alias, name)
    if lease is None:
        return
    for _ in range(1000):  # one level per release; a run re-enters far fewer times
        try:
            lease.release()  # the last level frees it or finds it lost: forgotten
        except LockError:
            break  # unreachable server: it ends by expiry
        if reentrancy.current(alias, name) is not lease:
            return
    reentrancy.forget(lease)


# -- forking ----------------------------------------------------------------------------

#: Backends whose client a forked child may use for an acquire of its own: Redlock's
#: per-master thread pools do not exist in a child (a fork copies only the calling
#: thread), and LocMem's locks are not shared between processes.
CHILD_IO_ALIASES = ("sf-redis", "sf-cluster", "pg")


def child_probe(lease: Lease, alias: str | None) -> dict[str, Any]:
    """What a forked child can do with its parent's lease."""
    report: dict[str, Any] = {"held": lease.held(), "release": lease.release()}
    for what, call in (("extend", lease.extend), ("ensure_held", lease.ensure_held)):
        try:
            call()
            report[what] = "returned"
        except LockError as exc:
            report[what] = type(exc).__name__
    if alias is not None:
        try:
            # Given back at once: the child's own lease is not the model's business.
            lock(lease.name, backend=alias, timeout=0).acquire().release()
            report["child_acquire"] = "acquired"
        except LockError as exc:
            report["child_acquire"] = type(exc).__name__
    return report


def run_in_child(func: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``func`` in a forked child; its JSON report through a pipe."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns about forking a process with threads: that is the point.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read)
            try:
                payload = json.dumps(func())
            except BaseException as exc:
                payload = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
            os.write(write, payload.encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    chunks = []
    deadline = time.monotonic() + PATIENCE
    try:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([read], [], [], max(left, 0))
            assert ready, "the forked child did not answer (hung?)"
            chunk = os.read(read, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read)
        if not chunks:  # hung or died: do not leave it behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    report: dict[str, Any] = json.loads(b"".join(chunks) or b'{"error": "no report"}')
    assert "error" not in report, report
    return report


# -- running the machines ---------------------------------------------------------------

PG = pytest.mark.django_db(transaction=True)

MACHINE_ALIASES = [
    pytest.param("sf-locmem", id="locmem"),
    pytest.param("sf-redis", id="redis"),
    pytest.param("sf-cluster", id="cluster"),
    pytest.param("sf-redlock", id="redlock"),
    pytest.param("pg", id="pg-session", marks=PG),
]


def machine_for(alias: str, found: dict[str, Any]) -> type[LockMachine]:
    tag = f"sf-{alias}-{uuid.uuid4().hex[:8]}"
    attrs = {
        "alias": alias,
        "names": machine_names(tag),
        "servers": servers_for(alias, found),
        "tokens": {},
        "taken": set(),
    }
    return type(f"LockMachine_{alias.replace('-', '_')}", (LockMachine,), attrs)


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("machine_alias", MACHINE_ALIASES)
def test_lock_machine(machine_alias: str, stateful_aliases: dict[str, Any]) -> None:
    machine = machine_for(machine_alias, stateful_aliases)
    run_state_machine_as_test(machine, settings=profile())


# -- PostgreSQL transaction mode ----------------------------------------------------------


class OtherTransaction:
    """A holder in another thread (so another Django connection): takes ``name`` in a
    transaction of its own and keeps it until told to commit."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ready = threading.Event()
        self.done = threading.Event()
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(PATIENCE), "the other transaction did not start"

    def _run(self) -> None:
        try:
            with transaction.atomic():
                self.result = lock(self.name, backend="pgx", timeout=0).acquire()
                self.ready.set()
                self.done.wait(PATIENCE * 3)
        except BaseException as exc:
            self.result = exc
        finally:
            self.ready.set()
            connections.close_all()

    def commit(self) -> None:
        self.done.set()
        self.thread.join(PATIENCE)
        assert not self.thread.is_alive()


class TransactionMachine(RuleBasedStateMachine):
    """Transaction-level locks: each step is one transaction of this thread, taking
    and re-taking locks, with another transaction holding some names meanwhile; the
    locks end at COMMIT or ROLLBACK, whatever ``release()`` said."""

    names: ClassVar[list[str]]
    tokens: ClassVar[dict[str, int]]

    def __init__(self) -> None:
        super().__init__()
        self.backend = get_backend("pgx")
        self.others: dict[str, OtherTransaction] = {}

    @rule(n=st.integers(0, 4))
    def other_takes(self, n: int) -> None:
        name = self.names[n]
        if name in self.others:
            return
        other = OtherTransaction(name)
        assert isinstance(other.result, Lease), other.result
        assert other.result.fencing_token > self.tokens.get(name, 0)
        self.tokens[name] = other.result.fencing_token
        self.others[name] = other

    @precondition(lambda self: self.others)
    @rule(n=st.integers(0, 4))
    def other_commits(self, n: int) -> None:
        name = sorted(self.others)[n % len(self.others)]
        self.others.pop(name).commit()

    @rule(
        picks=st.lists(st.integers(0, 4), min_size=1, max_size=4),
        wait=st.booleans(),
        release_early=st.booleans(),
        rollback=st.booleans(),
    )
    def transaction(
        self, picks: list[int], wait: bool, release_early: bool, rollback: bool
    ) -> None:
        names = [self.names[n] for n in picks]
        held: dict[str, Lease] = {}
        with contextlib.suppress(_Rollback), transaction.atomic():
            for name in names:
                try:
                    lease = lock(
                        name, backend="pgx", timeout=WAIT if wait else 0, reentrant=True
                    ).acquire()
                except LockNotAcquired:
                    assert name in self.others, f"{name!r} refused although free"
                    continue
                assert name not in self.others, f"{name!r} granted while another holds it"
                if name in held:
                    assert lease is held[name]
                    continue
                assert lease.fencing_token > self.tokens.get(name, 0)
                self.tokens[name] = lease.fencing_token
                held[name] = lease
            for name, lease in held.items():
                assert lease.held()
                info = self.backend.inspect(name)
                assert info is not None, f"{name!r} held in this transaction, not listed"
                if release_early:
                    # A transaction lock cannot end before the transaction does.
                    lease.release()
                    assert self.backend.inspect(name) is not None
            if rollback:
                raise _Rollback
        for name in held:
            assert self.backend.inspect(name) is None, f"{name!r} outlived its transaction"

    @invariant()
    def only_the_others_hold(self) -> None:
        for name in self.names:
            info = self.backend.inspect(name)
            if name in self.others:
                assert info is not None and info.fencing_token == self.tokens[name], info
            else:
                assert info is None, info

    def teardown(self) -> None:
        for other in self.others.values():
            other.commit()


class _Rollback(Exception):
    pass


@PG
@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("machine_alias", [pytest.param("pgx", id="pg-transaction")])
def test_transaction_machine(machine_alias: str, stateful_aliases: dict[str, Any]) -> None:
    tag = f"sf-pgx-{uuid.uuid4().hex[:8]}"
    machine = type(
        "TransactionMachine_pgx",
        (TransactionMachine,),
        {"names": machine_names(tag), "tokens": {}},
    )
    run_state_machine_as_test(machine, settings=profile())
