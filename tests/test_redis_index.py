"""The Redis backend's listing index: one hash per key prefix that the lock scripts
keep in the same step as the locks, read by a listing instead of every lock.

The property checked throughout: a listing read from the index shows exactly what a
listing that walks every key (``SCAN``) shows, the same locks, holders, tokens and
statuses, whatever happened before (acquire, extend, release, force release, expiry,
permits), and no entry outlives its lock once a listing has seen it expired.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.test import override_settings
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from distlocks import get_backend, livelocks
from distlocks.backends.base import READ, SEMAPHORE, WRITE, Holder
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import LockError
from tests.waiting import wait_for

HOST = socket.gethostname()
#: A pid no process can have: a lock of it on this host is listed as orphaned.
GONE_PID = 2**31 - 7
NAMES = ["a", "b{x}", "#c", "d:e"]
LONG = 600.0


def _config(prefix: str, index: bool | None = None, location: str = "") -> dict[str, Any]:
    options: dict[str, Any] = {"key_prefix": prefix}
    if index is not None:
        options["listing_index"] = index
    return {
        "BACKEND": "distlocks.backends.redis.RedisBackend",
        "LOCATION": location or django_settings.REDIS_URL,
        "OPTIONS": options,
    }


@pytest.fixture
def pair() -> Iterator[tuple[RedisBackend, RedisBackend]]:
    """Two aliases on one prefix of their own: ``indexed`` (the index on, by default)
    and ``scanned`` (``listing_index`` off: it lists by SCAN, and is only read here)."""
    prefix = f"distlocks-index-{uuid.uuid4().hex[:8]}"
    backends = {
        **django_settings.DISTLOCKS_BACKENDS,
        "indexed": _config(prefix),
        "scanned": _config(prefix, index=False),
    }
    with override_settings(DISTLOCKS_BACKENDS=backends):
        indexed, scanned = get_backend("indexed"), get_backend("scanned")
        assert isinstance(indexed, RedisBackend) and isinstance(scanned, RedisBackend)
        assert indexed.listing_index and not scanned.listing_index
        try:
            yield indexed, scanned
        finally:
            keys = list(indexed.client.scan_iter(match=f"{prefix}:*", count=1000))
            if keys:
                indexed.client.delete(*keys)


def listed(alias: str) -> list[tuple[Any, ...]]:
    """What the live-locks listing of ``alias`` shows of each lock."""
    snapshot = livelocks.collect([alias])
    assert not snapshot.errors, snapshot.errors
    return sorted(
        (item.name, item.info.owner, item.info.fencing_token, item.status, item.kind,
         item.info.ttl, item.info.renewals, item.info.thread)
        for item in snapshot.locks
    )  # fmt: skip


def holder(pid: int = 0, thread: str = "worker") -> Holder:
    return Holder(host=HOST, pid=pid or os.getpid(), thread=thread, extra={"job": "x"})


def gone(backend: RedisBackend, name: str) -> bool:
    return not backend.client.exists(backend.all_keys(name).lock)


class IndexMachine(RuleBasedStateMachine):
    """Random lock and permit operations on a few names; after each, the index-based
    listing equals the SCAN-based one and the model of what is held."""

    backends: tuple[RedisBackend, RedisBackend]

    def __init__(self) -> None:
        super().__init__()
        self.indexed, self.scanned = self.backends
        self.held: dict[str, tuple[str, int]] = {}  # name -> owner, token
        self.permits: dict[tuple[str, str], str] = {}  # (kind, owner) -> name

    @rule(name=st.sampled_from(NAMES), orphan=st.booleans(), thread=st.sampled_from(["t", "a\0b"]))
    def acquire(self, name: str, orphan: bool, thread: str) -> None:
        owner = uuid.uuid4().hex
        got = self.indexed.acquire(name, owner, LONG, holder(GONE_PID if orphan else 0, thread))
        assert got.acquired == (name not in self.held)
        if got.acquired:
            self.held[name] = (owner, got.fencing_token)

    @rule(name=st.sampled_from(NAMES))
    def expire(self, name: str) -> None:
        """A lock taken with a short lease, left to expire on the server."""
        if name in self.held:
            return
        owner = uuid.uuid4().hex
        assert self.indexed.acquire(name, owner, 0.05, holder()).acquired
        wait_for(lambda: gone(self.indexed, name), what=f"{name!r} expired")

    @precondition(lambda self: self.held)
    @rule(data=st.data(), many=st.booleans())
    def extend(self, data: st.DataObject, many: bool) -> None:
        names = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, unique=True))
        ttl = data.draw(st.sampled_from([LONG, LONG + 60]))
        if many:
            leases = [(name, self.held[name][0], ttl) for name in names]
            stranger = (names[0], "not-the-owner", ttl)
            assert self.indexed.extend_many([*leases, stranger]) == [True] * len(names) + [False]
        else:
            assert all(self.indexed.extend(name, self.held[name][0], ttl) for name in names)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), stranger=st.booleans())
    def release(self, data: st.DataObject, stranger: bool) -> None:
        name = data.draw(st.sampled_from(sorted(self.held)))
        if stranger:
            assert not self.indexed.release(name, "not-the-owner")
            return
        assert self.indexed.release(name, self.held.pop(name)[0])

    @precondition(lambda self: self.held)
    @rule(data=st.data(), stale=st.booleans())
    def force_release(self, data: st.DataObject, stale: bool) -> None:
        """A force release bound to the token shown, or to an outdated one."""
        name = data.draw(st.sampled_from(sorted(self.held)))
        token = self.held[name][1]
        if stale:
            assert not self.indexed.force_release(name, token - 1)
            return
        assert self.indexed.force_release(name, token)
        del self.held[name]

    @rule(name=st.sampled_from(NAMES[:2]), kind=st.sampled_from([SEMAPHORE, READ, WRITE]))
    def take_permit(self, name: str, kind: str) -> None:
        owner = uuid.uuid4().hex
        got = self.indexed.permit_acquire(kind, f"p:{name}", owner, LONG, holder(), limit=2)
        if got.acquired:
            self.permits[kind, owner] = f"p:{name}"

    @precondition(lambda self: self.permits)
    @rule(data=st.data())
    def give_back_permit(self, data: st.DataObject) -> None:
        kind, owner = data.draw(st.sampled_from(sorted(self.permits)))
        assert self.indexed.permit_release(kind, self.permits.pop((kind, owner)), owner)

    @rule()
    def permit_expires(self) -> None:
        """A semaphore whose only permit ran out on the server."""
        owner = uuid.uuid4().hex
        name = "p:short"
        assert self.indexed.permit_acquire(SEMAPHORE, name, owner, 0.05, holder()).acquired
        info = self.indexed.all_keys(name).lock.removesuffix(":lock") + ":sem:info"
        wait_for(lambda: not self.indexed.client.exists(info), what="the permit expired")

    @rule(what=st.sampled_from(["hash", "marker", "permits", "hash, then an acquire"]))
    def lose_index(self, what: str) -> None:
        """The index loses a key (DEL, or eviction under an ``allkeys-*`` policy): the
        next listing finds out, says so and lists every lock all the same."""
        listed("indexed")  # built and whole before the loss
        client = self.indexed.client
        if what == "marker":
            client.delete(self.indexed.index_marker_key)
        elif what == "permits":
            client.delete(self.indexed.index_permits_key)
        else:
            client.delete(self.indexed.index_key)
            if what == "hash, then an acquire":
                self.acquire("e", orphan=False, thread="t")  # the hash comes back, partly
        self.lost = True

    def teardown(self) -> None:
        """The next example starts from an empty prefix (and builds its index again)."""
        client = self.indexed.client
        keys = list(client.scan_iter(match=f"{self.indexed.key_prefix}:*", count=1000))
        if keys:
            client.delete(*keys)

    lost = False

    @invariant()
    def listings_agree(self) -> None:
        snapshot = livelocks.collect(["indexed"])
        # A listing that found its index lost says so; one that did not says nothing.
        assert bool(snapshot.notes.get("indexed")) == self.lost, snapshot.notes
        self.lost = False
        from_index = listed("indexed")
        assert not livelocks.collect(["indexed"]).notes  # rebuilt: whole again
        assert from_index == listed("scanned")
        locks = sorted((n, o, t) for n, o, t, _, kind, *_ in from_index if kind == "lock")
        assert locks == sorted((n, o, t) for n, (o, t) in self.held.items())
        permits = sorted((kind, o) for _, o, _, _, kind, *_ in from_index if kind != "lock")
        assert permits == sorted(self.permits)
        # Every entry of an expired or released lock was dropped: one per held lock
        # (and the index's epoch field).
        assert self.indexed.client.hlen(self.indexed.index_key) == len(self.held) + 1
        statuses = {n: s for n, _, _, s, kind, *_ in from_index if kind == "lock"}
        assert set(statuses.values()) <= {livelocks.OK, livelocks.ORPHANED}


def test_index_listing_equals_scan_listing(pair: tuple[RedisBackend, RedisBackend]) -> None:
    IndexMachine.backends = pair
    machine = IndexMachine.TestCase
    machine.settings = settings(
        max_examples=15,
        stateful_step_count=15,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    machine().runTest()


def test_locks_taken_before_the_index_are_listed(pair: tuple[RedisBackend, RedisBackend]) -> None:
    """An upgrade: locks and permits taken without the index (by the scripts as a
    version without it runs them), and an index that lost its marker with an entry of
    a lock long gone: the first listing builds the index from a SCAN pass."""
    indexed, scanned = pair
    owners = {name: uuid.uuid4().hex for name in NAMES}
    for name, owner in owners.items():
        assert scanned.acquire(name, owner, LONG, holder()).acquired
    assert scanned.permit_acquire(SEMAPHORE, "p", "permit-owner", LONG, holder()).acquired
    assert not indexed.client.exists(indexed.index_key, indexed.index_permits_key)
    indexed.client.hset(indexed.index_key, "ghost", "x\0" * 9 + "{}")
    assert not indexed.client.exists(indexed.index_marker_key)

    shown = listed("indexed")
    assert sorted((n, o) for n, o, _, _, kind, *_ in shown if kind == "lock") == sorted(
        owners.items()
    )
    assert [(n, o) for n, o, _, _, kind, *_ in shown if kind != "lock"] == [("p", "permit-owner")]
    assert shown == listed("scanned")
    assert indexed.client.exists(indexed.index_marker_key)
    # The ghost was dropped; the index's epoch field came with the build.
    assert indexed.client.hlen(indexed.index_key) == len(NAMES) + 1
    # From now on the scripts keep it: a release drops the entry.
    assert indexed.release("a", owners["a"])
    assert indexed.client.hlen(indexed.index_key) == len(NAMES)
    assert listed("indexed") == listed("scanned")


def test_an_entry_past_its_expiry_is_corrected_when_the_lock_is_held(
    pair: tuple[RedisBackend, RedisBackend],
) -> None:
    """A lock extended by a process that does not write the index (an older version
    during an upgrade): once its entry's expiry is past, the listing checks the lock,
    finds it held and rewrites the entry instead of leaving it out."""
    indexed, scanned = pair
    listed("indexed")  # builds the (empty) index
    assert indexed.acquire("a", "me", 0.3, holder()).acquired
    assert scanned.extend("a", "me", LONG)
    raw = indexed.client.hget(indexed.index_key, "a")
    expiry = int(raw.split(b"\0")[6])

    def past() -> bool:
        seconds, micros = indexed.client.time()
        return seconds * 1000 + micros // 1000 > expiry + indexed.INDEX_MARGIN_MS

    wait_for(past, what="the entry's expiry passed")
    assert [(n, o) for n, o, *_ in listed("indexed")] == [("a", "me")]
    assert int(indexed.client.hget(indexed.index_key, "a").split(b"\0")[6]) > expiry
    assert listed("indexed") == listed("scanned")


def test_the_index_can_be_turned_off(pair: tuple[RedisBackend, RedisBackend]) -> None:
    _, scanned = pair
    assert scanned.acquire("a", "me", LONG, holder()).acquired
    assert scanned.extend_many([("a", "me", LONG)]) == [True]
    assert scanned.permit_acquire(WRITE, "w", "me", LONG, holder()).acquired
    assert listed("scanned")
    assert scanned.client.exists(scanned.index_key, scanned.index_permits_key) == 0
    with pytest.raises(LockError, match="keeps no listing index"):
        scanned.rebuild_listing_index()


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_listing_index_must_be_a_bool(value: object) -> None:
    problems = RedisBackend.validate_config(
        "x", {"LOCATION": "redis://localhost/0", "OPTIONS": {"listing_index": value}}
    )
    assert any("OPTIONS['listing_index'] must be True or False" in p for p in problems)
    assert not RedisBackend.validate_config(
        "x", {"LOCATION": "redis://localhost/0", "OPTIONS": {"listing_index": False}}
    )


def test_no_index_on_a_cluster(redis_cluster: Any) -> None:
    """A script cannot touch the index and a lock's slot together: a cluster client
    keeps none and lists by SCAN."""
    prefix = f"distlocks-index-{uuid.uuid4().hex[:8]}"
    backends = {**django_settings.DISTLOCKS_BACKENDS, "c": _config(prefix, True, redis_cluster.url)}
    with override_settings(DISTLOCKS_BACKENDS=backends):
        backend = get_backend("c")
        assert isinstance(backend, RedisBackend) and not backend.listing_index
        names = [f"n{i}" for i in range(6)]
        for name in names:
            assert backend.acquire(name, f"o-{name}", LONG, holder()).acquired
        assert backend.extend_many([(name, f"o-{name}", LONG) for name in names]) == [True] * 6
        assert backend.permit_acquire(SEMAPHORE, "s", "o-s", LONG, holder()).acquired
        try:
            shown = listed("c")
            assert [(n, o) for n, o, *_ in shown] == sorted(
                [(name, f"o-{name}") for name in names] + [("s", "o-s")]
            )
            assert backend.force_release("n0")
            assert backend.release("n1", "o-n1")
            assert [n for n, *_ in listed("c")] == ["n2", "n3", "n4", "n5", "s"]
            assert not backend.client.exists(backend.index_key)
        finally:
            for name in names:
                backend.force_release(name)
            backend.permit_force_release(SEMAPHORE, "s")


def test_the_rows_shown_get_their_waiters(pair: tuple[RedisBackend, RedisBackend]) -> None:
    """The index holds no waiter counts: the page's rows get theirs in one round trip."""
    indexed, _ = pair
    listed("indexed")  # builds the index (the first listing reads every key)
    assert indexed.acquire("a", "me", LONG, holder()).acquired
    assert indexed.acquire("b{x}", "me", LONG, holder()).acquired
    # Another owner tries "a" while waiting: it registers as a waiter.
    assert not indexed.acquire("a", "other", LONG, holder(), wait=30.0).acquired
    rows = sorted(livelocks.collect(["indexed"]).locks, key=lambda item: item.name)
    assert [item.info.waiters for item in rows] == [None, None]
    assert [item.info.waiters for item in livelocks.complete(rows)] == [1, 0]
    scanned = sorted(livelocks.collect(["scanned"]).locks, key=lambda item: item.name)
    assert [item.info.waiters for item in scanned] == [1, 0]
