"""etcd backend: locks on leases, fenced by the revision of the grant.

It speaks etcd's v3 JSON gateway (``/v3/kv/txn``, ``/v3/lease/*``, ``/v3/watch``): no
driver to install. The protocol is written once, as generators that yield the requests
to make (sans I/O); the blocking API carries them out with the standard library's
``http.client``, the asyncio API with a small HTTP/1.1 client on asyncio streams
(:mod:`.http11`), natively, without worker threads. See
docs/backend-etcd.md for why, and for the measurements.

Keys, under ``OPTIONS["prefix"]`` (default ``distlocks``), the name percent-encoded::

    <prefix>/lock/<name>           the holder: owner and holder metadata (JSON), on its lease
    <prefix>/fence/<name>          the fence key: the name's token base (20 digits), no lease
    <prefix>/wait/<name>/<owner>   one waiter, on a short lease of its own (WAIT_TTL) while it
                                   waits; the queue is create_revision order

* acquire is one transaction on a lease granted for it: put-if-absent of the lock key and
  a rewrite of the fence key (value kept). The token is the revision of that transaction,
  shifted per name to start at the clock (microseconds) at the name's first use, or at
  ``OPTIONS["token_floor"]`` if that is higher (:func:`token_of`).
* a waiter puts its waiter key and watches only the key just before it in the queue (the
  lock key, for the first waiter); only the first waiter may take the lock, checked in
  the same transaction. A caller that waited renews its leases before taking the lock.
  The waiter key is on a short lease, so a waiter that dies frees its place in seconds;
  the lock key goes on the ttl lease only in the granting transaction. The waiters of
  one event loop share one watch stream (:class:`_Hub`); an election is waited out
  within the caller's timeout (:meth:`EtcdBackend._retrying_g`).
* release and force release are compare-and-delete transactions; force release is bound
  to the token shown and rewrites the fence key, so the counter moves past the victim.
* extend renews the lease (keepalive) and checks, in a transaction, that the lock key is
  still this lease's; a different ttl moves the lock key to a new lease.

This module holds the acquire and wait half of the recipe (the :class:`_Entry` of this
process's leases, the granting transaction, the queue, the wait for the key ahead);
:mod:`.lock_held` the release, extend and force-release half.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Generator, Mapping
from typing import Any

from distlocks.backends.base import (
    AcquireResult,
    Holder,
)
from distlocks.backends.etcd import http11
from distlocks.backends.etcd.hub import _AGAIN
from distlocks.backends.etcd.protocol import (
    _BASE_DIGITS,
    _ENDED,
    _SEEN,
    WATCH_RETRY_FIRST,
    WATCH_RETRY_MAX,
    _b64,
    _base,
    _int,
    _kvs,
    _LeaseGone,
    _new_lease_id,
    _Pause,
    _prefix_end,
    _revision,
    _unb64,
    holder_value,
    token_of,
)
from distlocks.backends.etcd.watch import EtcdWatches
from distlocks.exceptions import LockError


@dataclasses.dataclass
class _Entry:
    """This process's lease for one (name, owner): a waiter's, then the holder's."""

    lease: int
    #: Seconds the server granted (whole, at least its minimum).
    lease_ttl: int
    #: The waiter key's create_revision while queued (0: not queued).
    wait_rev: int = 0
    #: The lock key's create_revision once held (0: not held).
    lock_rev: int = 0
    #: The short lease the waiter key lives on while queued (0: none), and its
    #: seconds (0: not known to be granted). A waiter that dies goes with it within
    #: seconds, whatever its ttl; the lock key goes on ``lease`` only when granted.
    wait_lease: int = 0
    wait_ttl: int = 0

    def leases(self) -> list[int]:
        """Every lease of this entry, to renew or revoke."""
        return [lease for lease in (self.lease, self.wait_lease) if lease]


class EtcdLockAcquire(EtcdWatches):
    """Acquiring and waiting for a plain lock."""

    # -- acquire -----------------------------------------------------------------

    def _fence_ready(self, name: str) -> dict[str, Any]:
        """The comparison that the fence key exists with a base at least the floor."""
        return self._fence_at_floor(_b64(self.fence_key(name)))

    def _queue_compares(
        self, name: str, owner: str, entry: _Entry, fair: bool
    ) -> list[dict[str, Any]]:
        """Who may take the lock: a queued waiter only when it is first (no waiter key
        created before its own, which still exists); a newcomer asking for fairness
        only when nobody queues."""
        prefix = self.wait_prefix(name)
        if entry.wait_rev:
            return [
                {
                    "target": "CREATE",
                    "key": _b64(self.wait_key(name, owner)),
                    "result": "EQUAL",
                    "create_revision": str(entry.wait_rev),
                },
                {
                    "target": "CREATE",
                    "key": _b64(prefix),
                    "range_end": _prefix_end(prefix),
                    "result": "GREATER",
                    "create_revision": str(entry.wait_rev - 1),
                },
            ]
        if fair:
            return [
                {
                    "target": "CREATE",
                    "key": _b64(prefix),
                    "range_end": _prefix_end(prefix),
                    "result": "EQUAL",
                    "create_revision": "0",
                }
            ]
        return []

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
        return self._sync(self._acquire_g(name, owner, ttl, holder, wait, fair))

    async def aacquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        wait: float = 0.0,
        fair: bool = False,
    ) -> AcquireResult:
        unanswered: list[http11.Connection] = []
        try:
            return await self._arun(
                self._acquire_g(name, owner, ttl, holder, wait, fair), unanswered
            )
        except asyncio.CancelledError:
            await self._abandon(name, owner, unanswered)
            raise

    async def _abandon(self, name: str, owner: str, unanswered: list[http11.Connection]) -> None:
        """A cancelled acquire: revoke its leases, which takes with them the waiter key
        and a lock key the interrupted transaction may have written. The lease ids are
        known before the grants are sent, so even a grant whose answer never came is
        revoked; the answer of the interrupted request is read first (on its connection,
        within the socket timeout), so that its grant cannot land after the revocation.
        It runs as a task of its own: cancelling the caller again does not stop it."""
        entry = self._entries.pop((name, owner), None)
        leases = entry.leases() if entry is not None else []

        def revoke() -> Generator[Any, Any, None]:
            for lease in leases:
                yield from self._revoke_quietly_g(lease)

        await asyncio.shield(self._clean_up(revoke, unanswered))

    def _acquire_g(
        self, name: str, owner: str, ttl: float, holder: Holder, wait: float, fair: bool
    ) -> Generator[Any, Any, AcquireResult]:
        """One acquisition attempt; an election (a member answering that it has no
        leader, or that the leader changed) is waited out within ``wait`` seconds: every
        step is safe to repeat (the lease ids are the client's, the transaction finds a
        lock its lost reply granted by the owner in the key)."""
        began = time.monotonic()
        last, attempts = began, 0

        def attempt() -> Generator[Any, Any, AcquireResult]:
            nonlocal last, attempts
            last, attempts = time.monotonic(), attempts + 1
            return self._acquire_once_g(name, owner, ttl, holder, wait, fair)

        result = yield from self._retrying_g(began + wait, attempt, "acquire", name)
        if result.acquired and result.remaining is not None and attempts > 1:
            # The caller counts the lease from when it called; the attempt that got it
            # renewed (or granted) the lease only when it began.
            result = dataclasses.replace(result, remaining=result.remaining + (last - began))
        return result

    def _acquire_once_g(
        self, name: str, owner: str, ttl: float, holder: Holder, wait: float, fair: bool
    ) -> Generator[Any, Any, AcquireResult]:
        action = "acquire"
        entry = self._entries.get((name, owner))
        if entry is not None and entry.lease_ttl:
            # Back from a wait (or a retry): renew the leases first and make sure they
            # are still alive, so the lease handed out is good for its whole ttl (a lock
            # granted on a lease that ran out while queued is the bug Jepsen found in
            # etcd 3.4.3's lock).
            leases = entry.leases()
            left = dict(
                zip(leases, (yield from self._keepalive_g(leases, action, name)), strict=True)
            )
            if entry.wait_lease and left[entry.wait_lease] <= 0:
                # The waiter key went with its lease (a pause longer than it): queue again.
                entry.wait_lease = entry.wait_ttl = entry.wait_rev = 0
            if left[entry.lease] <= 0:
                if not entry.wait_lease:
                    self._entries.pop((name, owner), None)
                    entry = None
                else:
                    # The lock's lease ran out during a wait longer than the ttl (no key
                    # is on it): a new one, the place in the queue kept.
                    entry.lease, entry.lease_ttl = _new_lease_id(), 0
                    entry.lease, entry.lease_ttl = yield from self._grant_g(
                        ttl, action, name, entry.lease
                    )
        if entry is None or not entry.lease_ttl:
            # Known (to a cancelled caller's clean-up) before the grant is sent.
            entry = _Entry(_new_lease_id(), 0)
            self._entries[(name, owner)] = entry
            try:
                entry.lease, entry.lease_ttl = yield from self._grant_g(
                    ttl, action, name, entry.lease
                )
            except LockError:
                self._entries.pop((name, owner), None)
                raise
        remaining = min(ttl, float(entry.lease_ttl))
        value = holder_value(owner, holder, ttl)
        try:
            for _ in range(8):
                outcome = yield from self._attempt_g(name, owner, entry, value, wait > 0, fair)
                if outcome is None:
                    continue  # something was set up (fence, floor, queue place): again
                if outcome.acquired:
                    if entry.wait_lease:
                        # The grant deleted the waiter key: its lease has no use left.
                        lease, entry.wait_lease, entry.wait_ttl = entry.wait_lease, 0, 0
                        yield from self._revoke_quietly_g(lease)
                    return AcquireResult(True, outcome.fencing_token, remaining)
                if wait > 0:
                    return outcome
                # Try once: nothing of this attempt stays on the server.
                self._entries.pop((name, owner), None)
                yield from self._revoke_all_g(entry)
                return outcome
        except _LeaseGone:
            # A lease ran out between the renewal and the transaction (a long pause):
            # the next attempt starts afresh.
            self._entries.pop((name, owner), None)
            yield from self._revoke_all_g(entry)
            return AcquireResult(False, 0, None)
        raise LockError(f"Could not take lock {name!r} on backend {self.alias!r}: no progress.")

    def _revoke_all_g(self, entry: _Entry) -> Generator[Any, Any, None]:
        for lease in entry.leases():
            yield from self._revoke_quietly_g(lease)

    def _wait_lease_g(self, name: str, entry: _Entry) -> Generator[Any, Any, None]:
        """Grant the short lease the waiter key will live on (its id known before)."""
        entry.wait_lease, entry.wait_ttl = _new_lease_id(), 0
        entry.wait_lease, entry.wait_ttl = yield from self._grant_g(
            self.WAIT_TTL, "acquire", name, entry.wait_lease
        )

    def _attempt_g(
        self, name: str, owner: str, entry: _Entry, value: str, queue: bool, fair: bool
    ) -> Generator[Any, Any, AcquireResult | None]:
        """One transaction; None when the caller should try again at once."""
        lock, fence = _b64(self.lock_key(name)), _b64(self.fence_key(name))
        wait_key = _b64(self.wait_key(name, owner))
        put_lock = {"requestPut": {"key": lock, "value": _b64(value), "lease": str(entry.lease)}}
        taken = [put_lock, {"requestDeleteRange": {"key": wait_key}}]
        compare = [
            {"target": "CREATE", "key": lock, "result": "EQUAL", "create_revision": "0"},
            self._fence_ready(name),
            *self._queue_compares(name, owner, entry, fair),
        ]
        failure: list[dict[str, Any]] = [
            {"requestRange": {"key": lock}},
            {"requestRange": {"key": fence}},
        ]
        # Queue only on the waiter's own short lease (granted when first needed).
        queued_now = queue and entry.wait_ttl > 0
        if queued_now:
            failure += [
                # Queue (a put keeps the create_revision of a key that exists).
                {
                    "requestPut": {
                        "key": wait_key,
                        "value": _b64(value),
                        "lease": str(entry.wait_lease),
                    }
                },
                self._queue_range(self.wait_prefix(name)),
            ]
        answer = yield from self._txn_g(
            "acquire",
            name,
            compare,
            [
                *taken,
                {"requestPut": {"key": fence, "ignore_value": True}},
                {"requestRange": {"key": fence}},
            ],
            failure,
        )
        revision = _revision(answer)
        responses = answer.get("responses", [])
        if answer.get("succeeded"):
            fence_kv = _kvs(responses[-1])[0]
            entry.wait_rev, entry.lock_rev = 0, revision
            return AcquireResult(True, token_of(revision, fence_kv))
        lock_kvs, fence_kvs = _kvs(responses[0]), _kvs(responses[1])
        if queued_now:
            queued = _kvs(responses[3])
            mine = self.wait_key(name, owner)
            keys = [_unb64(kv["key"]).decode() for kv in queued]
            for kv in queued:
                if _unb64(kv["key"]).decode() == mine:
                    entry.wait_rev = _int(kv.get("create_revision"))
            first = bool(keys) and keys[0] == mine
        else:
            first = False
        if lock_kvs:
            held = lock_kvs[0]
            if self._owner_of(held) == owner:
                # A retried acquire whose first reply was lost: the lock is already ours.
                return (yield from self._adopt_g(name, owner, entry, held, fence_kvs))
            if not fence_kvs:
                yield from self._create_fence_g(name)
            if queue and not queued_now:
                yield from self._wait_lease_g(name, entry)
                return None  # queue, on it
            if queue:
                return AcquireResult(False, 0, None)
            return AcquireResult(False, 0, (yield from self._remaining_of_g(held, name)))
        if not fence_kvs:
            return (yield from self._first_use_g(name, owner, entry, value, fair))
        if self.token_floor and _base(fence_kvs[0]) < self.token_floor:
            yield from self._raise_floor_g(name, fence_kvs[0])
            return None
        # Free, but others queue before this caller.
        if queue and first:
            return None
        if queue and not queued_now:
            yield from self._wait_lease_g(name, entry)
            return None
        return AcquireResult(False, 0, None)

    def _owner_of(self, kv: Mapping[str, Any]) -> str:
        try:
            data = json.loads(_unb64(kv.get("value")))
        except ValueError:
            return ""
        return str(data.get("owner", "")) if isinstance(data, dict) else ""

    def _remaining_of_g(
        self, kv: Mapping[str, Any], name: str
    ) -> Generator[Any, Any, float | None]:
        left, _ = yield from self._time_to_live_g(_int(kv.get("lease")), "acquire", name)
        if left < 0:
            return 0.001  # going, or already gone
        return max(0.001, float(left))

    def _adopt_g(
        self,
        name: str,
        owner: str,
        entry: _Entry,
        held: Mapping[str, Any],
        fence_kvs: list[dict[str, Any]],
    ) -> Generator[Any, Any, AcquireResult]:
        lease = _int(held.get("lease"))
        if lease != entry.lease:
            yield from self._revoke_quietly_g(entry.lease)
            _, granted = yield from self._time_to_live_g(lease, "acquire", name)
            entry.lease, entry.lease_ttl = lease, granted
            yield from self._keepalive_g([lease], "acquire", name)
        entry.wait_rev, entry.lock_rev = 0, _int(held.get("create_revision"))
        token = token_of(entry.lock_rev, fence_kvs[0]) if fence_kvs else 0
        return AcquireResult(True, token)

    def _new_base(self) -> int:
        return max(self._clock_us(), self.token_floor)

    def _first_use_g(
        self, name: str, owner: str, entry: _Entry, value: str, fair: bool
    ) -> Generator[Any, Any, AcquireResult | None]:
        """The name's first lock: create the fence key with its base in the same
        transaction as the lock key."""
        lock, fence = _b64(self.lock_key(name)), _b64(self.fence_key(name))
        base = self._new_base()
        answer = yield from self._txn_g(
            "acquire",
            name,
            [
                {"target": "CREATE", "key": lock, "result": "EQUAL", "create_revision": "0"},
                {"target": "CREATE", "key": fence, "result": "EQUAL", "create_revision": "0"},
                *self._queue_compares(name, owner, entry, fair),
            ],
            [
                {"requestPut": {"key": lock, "value": _b64(value), "lease": str(entry.lease)}},
                {"requestDeleteRange": {"key": _b64(self.wait_key(name, owner))}},
                {"requestPut": {"key": fence, "value": _b64(str(base).zfill(_BASE_DIGITS))}},
            ],
        )
        if not answer.get("succeeded"):
            return None
        entry.wait_rev, entry.lock_rev = 0, _revision(answer)
        return AcquireResult(True, base)

    def _create_fence_g(self, name: str) -> Generator[Any, Any, None]:
        fence = _b64(self.fence_key(name))
        yield from self._txn_g(
            "acquire",
            name,
            [{"target": "CREATE", "key": fence, "result": "EQUAL", "create_revision": "0"}],
            [
                {
                    "requestPut": {
                        "key": fence,
                        "value": _b64(str(self._new_base()).zfill(_BASE_DIGITS)),
                    }
                }
            ],
        )

    def _raise_floor_g(self, name: str, fence_kv: Mapping[str, Any]) -> Generator[Any, Any, None]:
        """Move the name's token base up to ``token_floor``: every later token is above
        it, and above every earlier token (the base only grows, and so does the revision)."""
        fence = _b64(self.fence_key(name))
        yield from self._txn_g(
            "acquire",
            name,
            [
                {
                    "target": "MOD",
                    "key": fence,
                    "result": "EQUAL",
                    "mod_revision": str(fence_kv.get("mod_revision")),
                }
            ],
            [
                {
                    "requestPut": {
                        "key": fence,
                        "value": _b64(str(self.token_floor).zfill(_BASE_DIGITS)),
                    }
                }
            ],
        )

    # -- waiting -----------------------------------------------------------------

    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        self._sync(self._wait_g(name, timeout, owner))

    async def await_release(
        self, name: str, timeout: float, *, owner: str = "", fair: bool = False
    ) -> None:
        if timeout <= 0:
            return
        self._check_pid()
        deadline = time.monotonic() + timeout
        entry = self._entries.get((name, owner)) if owner else None
        hub = self._loop_side().hub
        while True:
            watched, revision = await self._arun(
                self._retrying_g(
                    deadline, lambda: self._ahead_g(name, owner, entry), "wait for", name
                )
            )
            if not watched:
                return
            lease = entry.wait_lease if entry is not None and entry.wait_rev else 0
            outcome = await hub.wait(watched, revision, deadline, lease)
            if outcome != _AGAIN or time.monotonic() >= deadline:
                return  # seen, the deadline, or the waiter's lease gone: acquire says

    def _wait_g(self, name: str, timeout: float, owner: str) -> Generator[Any, Any, None]:
        """Until the key just before ``owner``'s waiter key is deleted (the lock key, for
        the first waiter or a caller not queued), or ``timeout``: a watch from the
        revision of the queue that was read, so no deletion in between is missed. The
        waiter's lease is renewed every third of its length meanwhile."""
        deadline = time.monotonic() + max(0.0, timeout)
        entry = self._entries.get((name, owner)) if owner else None
        if entry is not None and not (entry.wait_rev and entry.wait_ttl):
            entry = None  # not queued: nothing of its own to renew
        renew_every = max(0.2, entry.wait_ttl / 3) if entry is not None else 0.0
        renew_at = time.monotonic() + renew_every
        pause = 0.0  # before watching again after a stream that ended without an event
        while True:
            watched, revision = yield from self._retrying_g(
                deadline, lambda: self._ahead_g(name, owner, entry), "wait for", name
            )
            if not watched:
                return
            slice_end = min(deadline, renew_at) if entry is not None else deadline
            seen = yield from self._watch_delete_g(watched, revision + 1, slice_end, name)
            if seen == _SEEN:
                return
            if seen == _ENDED:
                # Nothing seen: look again, but not at once (a member, or something in
                # front of it, that ends every stream would make a busy loop). A
                # deletion meanwhile is not missed: the next watch starts at the
                # revision the queue is read at.
                pause = min(WATCH_RETRY_MAX, max(WATCH_RETRY_FIRST, pause * 2))
                yield _Pause(max(0.0, min(pause, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                return
            if entry is not None and time.monotonic() >= renew_at:
                left = yield from self._keepalive_g([entry.wait_lease], "wait for", name)
                if left[0] <= 0:
                    return  # the waiter's lease ran out: acquire queues it again
                renew_at = time.monotonic() + renew_every

    def _ahead_g(
        self, name: str, owner: str, entry: _Entry | None
    ) -> Generator[Any, Any, tuple[str, int]]:
        """The key to watch ("" to try again at once) and the revision it was read at."""
        lock = self.lock_key(name)
        answer = yield from self._txn_g(
            "wait for",
            name,
            [],
            [
                {"requestRange": {"key": _b64(lock)}},
                self._queue_range(self.wait_prefix(name)),
            ],
        )
        revision = _revision(answer)
        responses = answer.get("responses", [])
        holders = _kvs(responses[0])
        if owner and holders and self._owner_of(holders[0]) == owner:
            # Ours already: an acquire whose outcome was unknown (a timeout during an
            # election) was applied after all. Acquire again at once: it adopts it.
            return "", revision
        held = bool(holders)
        queue = [_unb64(kv["key"]).decode() for kv in _kvs(responses[1])]
        mine = self.wait_key(name, owner) if owner else ""
        if entry is None or not entry.wait_rev or mine not in queue:
            return (lock if held else ""), revision
        position = queue.index(mine)
        if position == 0:
            return (lock if held else ""), revision
        return queue[position - 1], revision
