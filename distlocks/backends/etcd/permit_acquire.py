"""Semaphores and read-write locks on etcd: the acquire and wait half of the
recipe (:mod:`.permit_held`: release, extend, eviction).

Why this is one module of about 600 lines (issue 28's size rule): the queue rules of
both primitives below decide one thing, whether a request holds, for the blocking and
the asyncio path alike; split, each path would lose the rules it follows.

Keys, under the backend's prefix, the name and the owner percent-encoded::

    <prefix>/sem/<name>/<owner>      one semaphore request (holder JSON), on its own lease
    <prefix>/rw/<name>/r/<owner>     one read request, on its own lease
    <prefix>/rw/<name>/w/<owner>     one write request, on its own lease
    <prefix>/rwfence/<name>          the read-write lock's write fence: its token base

Requests of one name queue in the order of their keys' create_revision, which nothing
can reorder: a request can only ever gain ground (the requests ahead of it go), never
lose it. Whether a request holds is decided by the ones ahead of it, as on ZooKeeper:

* a semaphore request holds when fewer than its ``limit`` requests are ahead of it;
* a read request holds when no write request is ahead of it;
* a write request holds when it is first.

Since the ones ahead only go, a request judged to hold on a consistent read of the
queue holds until its own key goes. A request that cannot hold at once (and may wait)
puts its key and watches only the keys that keep it out: the ``limit`` requests just
ahead of a semaphore request, the nearest write ahead of a reader, the request just
ahead of a writer. A request that queues is put on a short waiter lease of its own and
moved onto its ttl lease once it holds (checked to be the same key on the waiter lease),
so a waiter that dies frees its place within seconds. A try-once request writes nothing
unless it is granted: its put is conditional, in one transaction, on the queue it was
judged by.

A write is granted by a transaction that checks, on the server, that its key is still
the same one on the same lease and that nothing is ahead of it, and rewrites the fence
key: the token is that revision, shifted per name as for locks (``protocol.token_of``). The
fence key is written only by grants and evictions, so while a writer holds, the fence
key's mod_revision is its grant.

A little over 600 lines: the acquire and the wait of a request share its queue state
(which keys keep it out, its waiter lease), and split apart they would call each other
back and forth.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

from distlocks.backends.base import (
    READ,
    SEMAPHORE,
    WRITE,
    AcquireResult,
    Holder,
    permit_family,
)
from distlocks.backends.etcd import protocol
from distlocks.backends.etcd.gateway import EtcdGateway
from distlocks.backends.etcd.permit_rules import (
    MAX_WATCHED,
    _created,
    _end_of,
    _on_lease,
    _Permit,
    _range,
)
from distlocks.exceptions import LockError


class EtcdPermitAcquire(EtcdGateway):
    """Acquiring and waiting for a semaphore permit or a read-write lock."""

    permit_kinds = frozenset({SEMAPHORE, READ, WRITE})

    # -- keys and bookkeeping -------------------------------------------------------

    def family_prefix(self, kind: str, name: str) -> str:
        """The prefix of every request key of the semaphore or read-write lock ``name``."""
        where = "sem" if permit_family(kind) == SEMAPHORE else "rw"
        return f"{self.prefix}/{where}/{self._quoted(name)}/"

    def _writes_prefix(self, name: str) -> str:
        return f"{self.family_prefix(WRITE, name)}w/"

    def request_key(self, kind: str, name: str, owner: str) -> str:
        """The key of ``owner``'s request of ``kind`` on ``name``."""
        quoted = urllib.parse.quote(owner, safe="")
        if kind == SEMAPHORE:
            return f"{self.family_prefix(kind, name)}{quoted}"
        return f"{self.family_prefix(kind, name)}{'w' if kind == WRITE else 'r'}/{quoted}"

    def rw_fence_key(self, name: str) -> str:
        """The write fence of the read-write lock ``name`` (apart from the lock's)."""
        return f"{self.prefix}/rwfence/{self._quoted(name)}"

    def _parse(self, key: str) -> tuple[str, str, str] | None:
        """(kind, name, owner) of a request key; None for a key of no request."""
        for where in ("sem", "rw"):
            head = f"{self.prefix}/{where}/"
            if not key.startswith(head):
                continue
            parts = key[len(head) :].split("/")
            if where == "sem" and len(parts) == 2:
                kind, (name, owner) = SEMAPHORE, parts
            elif where == "rw" and len(parts) == 3 and parts[1] in ("r", "w"):
                kind = WRITE if parts[1] == "w" else READ
                name, owner = parts[0], parts[2]
            else:
                return None
            return kind, urllib.parse.unquote(name), urllib.parse.unquote(owner)
        return None

    def _permit_table(self) -> dict[tuple[str, str, str], _Permit]:
        """This process's requests; a forked child starts with none (the parent's
        leases are not its own)."""
        self._check_pid()
        state = self.__dict__.get("_permit_state")
        if state is None or state[0] != os.getpid():
            state = (os.getpid(), {})
            self.__dict__["_permit_state"] = state
        table: dict[tuple[str, str, str], _Permit] = state[1]
        return table

    # -- acquire ------------------------------------------------------------------------

    def permit_acquire(
        self,
        kind: str,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        limit: int = 1,
        wait: float = 0.0,
    ) -> AcquireResult:
        self.check_permit_kind(kind)
        table = self._permit_table()
        slot = (kind, name, owner)
        entry = table.get(slot)
        # Back from a wait (or a retry): renew the lease first and make sure it is still
        # alive, so a permit granted now is good for its whole ttl (granting on a lease
        # that ran out while queued is the bug Jepsen found in etcd 3.4.3's lock). A
        # lease gone took the request key with it: queue again.
        if entry is not None:
            leases = entry.leases()
            left = dict(zip(leases, self._keepalive(leases, "acquire", name), strict=True))
            if entry.wait_lease and left[entry.wait_lease] <= 0:
                entry.wait_lease = entry.wait_ttl = entry.created = 0  # its key went
            if left[entry.lease] <= 0:
                if entry.wait_lease:
                    # The permit's lease ran out during a wait longer than its ttl (no
                    # key is on it): a new one, the place in the queue kept.
                    entry.lease, entry.lease_ttl = self._grant(ttl, "acquire", name)
                else:
                    table.pop(slot, None)
                    entry = None
        counted = 0
        if entry is None and kind == SEMAPHORE and wait <= 0:
            # Tried once: count first, so a full semaphore costs one read, no lease.
            counted = self._count_room(name, limit)
            if not counted:
                return AcquireResult(False, 0, None)
        if entry is None:
            lease, granted = self._grant(ttl, "acquire", name)
            entry = _Permit(lease, granted, counted=counted)
            table[slot] = entry
        more: dict[str, Any] = {"limit": limit} if kind == SEMAPHORE else {}
        value = protocol.holder_value(owner, holder, ttl, kind=kind, **more)
        remaining = min(ttl, float(entry.lease_ttl))
        try:
            for _ in range(16):
                if entry.created:
                    outcome = self._judge_own(kind, name, owner, entry, limit)
                else:
                    # Queued only on the short lease; until there is one, tried once.
                    queue = wait > 0 and entry.wait_lease != 0
                    outcome = self._first_try(kind, name, owner, entry, value, limit, queue)
                if outcome is None:
                    continue  # something changed (queue, fence): look again at once
                if outcome.acquired:
                    entry.granted = True
                    if entry.wait_lease:
                        # The key moved to the permit's lease: the short one is done.
                        self._revoke_quietly(entry.wait_lease)
                        entry.wait_lease = entry.wait_ttl = 0
                    return AcquireResult(True, outcome.fencing_token, remaining)
                if wait > 0 and not entry.created and not entry.wait_lease:
                    # Not granted at once: queue, on a short lease of its own.
                    entry.wait_lease, entry.wait_ttl = self._grant(self.WAIT_TTL, "acquire", name)
                    continue
                if wait <= 0:
                    # Tried once: nothing of this attempt stays on the server.
                    table.pop(slot, None)
                    for lease in entry.leases():
                        self._revoke_quietly(lease)
                return outcome
        except protocol._LeaseGone:
            # A lease ran out between the renewal and the transaction (a long pause):
            # the next attempt starts afresh.
            table.pop(slot, None)
            for lease in entry.leases():
                self._revoke_quietly(lease)
            return AcquireResult(False, 0, None)
        except LockError:
            if wait <= 0:
                # Maybe applied with only the reply lost: let nothing stay.
                table.pop(slot, None)
                for lease in entry.leases():
                    threading.Thread(
                        target=self._revoke_quietly, args=(lease,), daemon=True
                    ).start()
            raise
        raise LockError(
            f"Could not take a {kind} permit of {name!r} on backend {self.alias!r}: "
            f"the queue kept changing."
        )

    def _first_try(
        self,
        kind: str,
        name: str,
        owner: str,
        entry: _Permit,
        value: str,
        limit: int,
        queue: bool,
    ) -> AcquireResult | None:
        """Put the request key: granted in the same transaction when there is room; when
        not, queued (``queue``) or nothing written. None: look again at once."""
        key = self.request_key(kind, name, owner)
        family = self.family_prefix(kind, name)
        put = {
            "requestPut": {
                "key": protocol._b64(key),
                "value": protocol._b64(value),
                "lease": str(entry.lease),
            }
        }
        # A request that queues is put on its short lease (moved when it holds).
        queued_put = {"requestPut": {**put["requestPut"], "lease": str(entry.wait_lease)}}
        mine = {"requestRange": {"key": protocol._b64(key), "keys_only": True}}
        if kind == SEMAPHORE and queue:
            # Put unconditionally; the queue then decides (judged at once).
            answer = self._txn("acquire", name, [], [queued_put, mine])
            return self._queued(entry, answer, 1)
        if kind == SEMAPHORE:
            # Room: fewer than ``limit`` requests, none created since they were counted.
            counted = entry.counted or self._count_room(name, limit)
            entry.counted = 0
            if not counted:
                return AcquireResult(False, 0, None)
            answer = self._txn(
                "acquire",
                name,
                [
                    {
                        "target": "CREATE",
                        "key": protocol._b64(family),
                        "range_end": protocol._b64(_end_of(family)),
                        "result": "LESS",
                        "create_revision": str(counted + 1),
                    }
                ],
                [put],
                [self._room_range(name, limit)],
            )
            if answer.get("succeeded"):
                entry.created = protocol._revision(answer)
                return AcquireResult(True, 0)
            if len(protocol._kvs(answer["responses"][0])) >= limit:
                return AcquireResult(False, 0, None)
            entry.counted = protocol._revision(answer)
            return None  # one came and went meanwhile: again, counted afresh
        # A reader: no write request at all; a writer: no request at all.
        blockers = self._writes_prefix(name) if kind == READ else family
        empty = {
            "target": "CREATE",
            "key": protocol._b64(blockers),
            "range_end": protocol._b64(_end_of(blockers)),
            "result": "EQUAL",
            "create_revision": "0",
        }
        compare = [empty]
        success = [put]
        fence = self.rw_fence_key(name)
        if kind == WRITE:
            fence_cmp, fence_put = self._fence_step(name)
            compare.append(fence_cmp)
            success += [fence_put, {"requestRange": {"key": protocol._b64(fence)}}]
        failure: list[dict[str, Any]]
        if queue:
            failure = [queued_put, mine]
        else:
            failure = [
                _range(blockers, _end_of(blockers), keys_only=True, limit=1),
                {"requestRange": {"key": protocol._b64(fence)}},
            ]
        answer = self._txn("acquire", name, compare, success, failure)
        if answer.get("succeeded"):
            revision = protocol._revision(answer)
            entry.created = revision
            entry.granted = True  # on the permit's own lease already
            token = 0
            if kind == WRITE:
                self._fence_written(name)
                token = protocol.token_of(revision, protocol._kvs(answer["responses"][-1])[0])
            return AcquireResult(True, token)
        if queue:
            return self._queued(entry, answer, 1)
        held, fences = (protocol._kvs(r) for r in answer.get("responses", []))
        if not held and kind == WRITE:
            # Refused only for the fence (first use, floor raised, or it changed since
            # it was read): write it as read now, with the grant.
            self._fence_stale(name, fences)
            return None
        return AcquireResult(False, 0, None)

    def _room_range(self, name: str, limit: int) -> dict[str, Any]:
        family = self.family_prefix(SEMAPHORE, name)
        return _range(family, _end_of(family), keys_only=True, limit=limit)

    def _count_room(self, name: str, limit: int) -> int:
        """The revision at which fewer than ``limit`` requests of the semaphore ``name``
        were counted; 0 when there were ``limit`` or more."""
        answer = self._txn("acquire", name, [], [self._room_range(name, limit)])
        if len(protocol._kvs(answer["responses"][0])) >= limit:
            return 0
        return protocol._revision(answer)

    def _queued(
        self, entry: _Permit, answer: Mapping[str, Any], index: int
    ) -> AcquireResult | None:
        """Note the create_revision of the key just put (response ``index``); None: the
        next step judges it."""
        kvs = protocol._kvs(answer.get("responses", [])[index])
        entry.created = protocol._int(kvs[0].get("create_revision")) if kvs else 0
        return None

    def _blocker_ranges(self, kind: str, name: str, created: int, limit: int) -> dict[str, Any]:
        """The range of the keys that keep a request created at ``created`` out: newest
        first, at most as many as decide it."""
        family = self.family_prefix(kind, name)
        start, count = family, 1
        if kind == SEMAPHORE:
            count = limit
        elif kind == READ:
            start = self._writes_prefix(name)
        return _range(
            start,
            _end_of(start),
            keys_only=True,
            sort_target="CREATE",
            sort_order="DESCEND",
            max_create_revision=str(created - 1),
            limit=count,
        )

    def _judge_own(
        self, kind: str, name: str, owner: str, entry: _Permit, limit: int
    ) -> AcquireResult | None:
        """Judge a queued request; a writer with nothing ahead is granted here."""
        key = self.request_key(kind, name, owner)
        mine = [_created(key, entry.created), _on_lease(key, entry.on)]
        if kind == WRITE:
            return self._grant_write(name, key, entry, mine)
        answer = self._txn(
            "acquire", name, mine, [self._blocker_ranges(kind, name, entry.created, limit)]
        )
        if not answer.get("succeeded"):
            entry.created = 0  # the key went (evicted): queue again, at the back
            return None
        blockers = protocol._kvs(answer["responses"][0])
        if len(blockers) >= (limit if kind == SEMAPHORE else 1):
            return AcquireResult(False, 0, None)
        if entry.on != entry.lease:
            # It holds: move the key onto the permit's lease, if it is still the same.
            moved = self._txn("acquire", name, mine, [self._onto(key, entry.lease)])
            if not moved.get("succeeded"):
                entry.created = 0
                return None
        return AcquireResult(True, 0)

    @staticmethod
    def _onto(key: str, lease: int) -> dict[str, Any]:
        """Put ``key`` on ``lease``, its value and create_revision kept."""
        return {
            "requestPut": {"key": protocol._b64(key), "ignore_value": True, "lease": str(lease)}
        }

    def _grant_write(
        self, name: str, key: str, entry: _Permit, mine: list[dict[str, Any]]
    ) -> AcquireResult | None:
        family = self.family_prefix(WRITE, name)
        fence = self.rw_fence_key(name)
        fence_cmp, fence_put = self._fence_step(name)
        nobody_ahead = {
            "target": "CREATE",
            "key": protocol._b64(family),
            "range_end": protocol._b64(_end_of(family)),
            "result": "GREATER",
            "create_revision": str(entry.created - 1),
        }
        answer = self._txn(
            "acquire",
            name,
            [*mine, nobody_ahead, fence_cmp],
            [
                fence_put,
                {"requestRange": {"key": protocol._b64(fence)}},
                # Granted: the key goes onto the permit's lease in the same step.
                self._onto(key, entry.lease),
            ],
            [
                {"requestRange": {"key": protocol._b64(key), "keys_only": True}},
                self._blocker_ranges(WRITE, name, entry.created, 1),
            ],
        )
        if answer.get("succeeded"):
            self._fence_written(name)
            revision = protocol._revision(answer)
            return AcquireResult(
                True, protocol.token_of(revision, protocol._kvs(answer["responses"][1])[0])
            )
        own, ahead = (protocol._kvs(r) for r in answer.get("responses", []))
        if not own or protocol._int(own[0].get("create_revision")) != entry.created:
            entry.created = 0  # the key went (evicted): queue again, at the back
            return None
        if ahead:
            return AcquireResult(False, 0, None)
        if protocol._int(own[0].get("lease")) != entry.on:
            # On another lease (an earlier attempt's): putting the key again moves it to
            # this one, in its place.
            entry.created = 0
        else:
            self._fence_stale(name)  # refused for the fence: write it as read now
        return None

    # -- the write fence -----------------------------------------------------------------

    def _fence_step(self, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The comparison and the put of a write grant on the fence key: it exists with a
        base at least the floor, and is rewritten (value kept); or, the first time, it is
        created with its base (see :meth:`_fence_stale`)."""
        fence = protocol._b64(self.rw_fence_key(name))
        pending = self.__dict__.get("_fence_new", {}).get(name)
        if pending is not None:
            created, value = pending
            first = (
                {"target": "CREATE", "key": fence, "result": "EQUAL", "create_revision": "0"}
                if created == 0
                else {
                    "target": "MOD",
                    "key": fence,
                    "result": "EQUAL",
                    "mod_revision": str(created),
                }
            )
            return first, {"requestPut": {"key": fence, "value": protocol._b64(value)}}
        return self._fence_at_floor(fence), {"requestPut": {"key": fence, "ignore_value": True}}

    def _fence_written(self, name: str) -> None:
        self.__dict__.get("_fence_new", {}).pop(name, None)

    def _fence_stale(self, name: str, kvs: list[dict[str, Any]] | None = None) -> bool:
        """Whether the fence key (``kvs``: as read, else read now) needs its base written
        (missing, or below the floor); if so, the next grant writes it, conditional on
        the fence as read."""
        if kvs is None:
            answer = self._call(
                "/v3/kv/range", {"key": protocol._b64(self.rw_fence_key(name))}, "acquire", name
            )
            kvs = answer.get("kvs") or []
        pending: dict[str, tuple[int, str]] = self.__dict__.setdefault("_fence_new", {})
        if not kvs:
            base = max(self._clock_us(), self.token_floor)
            pending[name] = (0, str(base).zfill(protocol._BASE_DIGITS))
            return True
        if self.token_floor and protocol._base(kvs[0]) < self.token_floor:
            pending[name] = (
                protocol._int(kvs[0].get("mod_revision")),
                str(self.token_floor).zfill(protocol._BASE_DIGITS),
            )
            return True
        pending.pop(name, None)
        return False

    # -- waiting ------------------------------------------------------------------------

    def permit_wait(
        self, kind: str, name: str, timeout: float, *, owner: str = "", limit: int = 1
    ) -> None:
        """Block until a key that keeps ``owner``'s request out is deleted, or
        ``timeout``: a watch from the revision the queue was read at, so no deletion in
        between is missed. The waiter's lease is renewed every third of its length."""
        self.check_permit_kind(kind)
        deadline = time.monotonic() + max(0.0, timeout)
        entry = self._permit_table().get((kind, name, owner)) if owner else None
        if entry is None or not entry.created:
            return  # nothing queued: the next attempt queues
        key = self.request_key(kind, name, owner)
        pause = 0.0  # before watching again after a stream that ended without an event
        while True:
            answer = self._txn(
                "wait for",
                name,
                [_created(key, entry.created)],
                [self._blocker_ranges(kind, name, entry.created, limit)],
            )
            if not answer.get("succeeded"):
                return  # the request key went: the next attempt says what happened
            revision = protocol._revision(answer)
            blockers = [
                protocol._unb64(kv["key"]).decode() for kv in protocol._kvs(answer["responses"][0])
            ]
            if len(blockers) < (limit if kind == SEMAPHORE else 1):
                return  # it holds now
            renew_every = max(0.2, (entry.wait_ttl or entry.lease_ttl) / 3)
            slice_end = min(deadline, time.monotonic() + renew_every)
            watched: list[tuple[str, str | None]] = [(k, None) for k in blockers]
            if len(blockers) > MAX_WATCHED:
                family = self.family_prefix(kind, name)
                watched = [(family, _end_of(family))]
            seen = self._watch_deletes(watched, revision + 1, slice_end, name)
            if seen == protocol._SEEN:
                return
            if seen == protocol._ENDED:
                # Look again, but not at once (see EtcdBackend._wait_g).
                pause = min(protocol.WATCH_RETRY_MAX, max(protocol.WATCH_RETRY_FIRST, pause * 2))
                time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                return
            if self._keepalive([entry.on], "wait for", name)[0] <= 0:
                return  # the lease ran out: the next attempt queues again

    def _watch_deletes(
        self, watched: list[tuple[str, str | None]], start_revision: int, until: float, name: str
    ) -> str | bool:
        """``protocol._SEEN`` when one of the keys (or ranges) in ``watched`` has a deletion
        at ``start_revision`` or later (or a compaction past it), ``protocol._ENDED`` when
        the stream ended without one (look again), False at ``until`` (monotonic).
        One stream for all of them, on a connection of its own, closed after."""
        body = "\n".join(
            json.dumps(
                {
                    "create_request": {
                        "key": protocol._b64(key),
                        **({"range_end": protocol._b64(end)} if end else {}),
                        "start_revision": str(start_revision),
                        "filters": ["NOPUT"],
                    }
                }
            )
            for key, end in watched
        )
        conn: http.client.HTTPConnection | None = None
        last: BaseException | None = None
        try:
            for offset in range(len(self.endpoints)):
                endpoint = self.endpoints[(self._preferred + offset) % len(self.endpoints)]
                try:
                    conn = self._connect(endpoint, self.connect_timeout)
                    conn.request("POST", "/v3/watch", body, self._headers())
                    assert conn.sock is not None
                    conn.sock.settimeout(self.socket_timeout)
                    reply = conn.getresponse()
                    if reply.status != 200:
                        data = reply.read()
                        refused = protocol._unavailable_answer(reply.status, data)
                        if refused is None:
                            self._raise_answer(reply.status, data, "wait for", name, "", None)
                        raise refused  # this member cannot serve now: the next one
                    break
                except (
                    OSError,
                    ValueError,
                    http.client.HTTPException,
                    protocol._ServerSaid,
                ) as exc:
                    last = exc
                    if conn is not None:
                        conn.close()
                    conn = None
            if conn is None:
                assert last is not None
                raise self._unavailable("wait for", name, last) from last
            while True:
                left = until - time.monotonic()
                if left <= 0:
                    return False
                assert conn.sock is not None
                conn.sock.settimeout(left)
                try:
                    line = reply.readline()
                except TimeoutError:
                    return False
                except (ConnectionError, http.client.IncompleteRead):
                    return protocol._ENDED  # the member went away mid-stream: look again
                except (OSError, ValueError, http.client.HTTPException) as exc:
                    raise self._unavailable("wait for", name, exc) from exc
                if not line:
                    return protocol._ENDED  # the stream ended: look again
                try:
                    result = protocol._watch_result(line)
                except ValueError as exc:
                    raise self._unavailable("wait for", name, exc) from exc
                if result.get("canceled") or result.get("compact_revision"):
                    return protocol._SEEN  # compacted past our revision: look again
                if result.get("events"):
                    return protocol._SEEN
        finally:
            if conn is not None:
                conn.close()
