"""Semaphores and read-write locks on etcd: the :class:`EtcdPermits` mixin of
:class:`~distlocks.backends.etcd.EtcdBackend`.

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
key: the token is that revision, shifted per name as for locks (``_etcd.token_of``). The
fence key is written only by grants and evictions, so while a writer holds, the fence
key's mod_revision is its grant.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import http.client
import json
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from distlocks.backends.base import (
    READ,
    RWLOCK,
    SEMAPHORE,
    WRITE,
    AcquireResult,
    Holder,
    LockInfo,
    holder_details,
    permit_family,
)
from distlocks.exceptions import LockError

if TYPE_CHECKING:
    from distlocks.backends.etcd import _Endpoint
    from distlocks.exceptions import LockBackendUnavailable

logger = logging.getLogger(__name__)

PERMIT_KINDS = (SEMAPHORE, READ, WRITE)
#: A waiter watches each key that keeps it out, on one stream; past this many (a
#: semaphore of a large limit), it watches every deletion of the name's requests.
MAX_WATCHED = 64
#: Keys read per request when listing every permit.
LIST_PAGE = 1000


@dataclasses.dataclass
class _Permit:
    """This process's request for one (kind, name, owner)."""

    lease: int
    #: Seconds the server granted (whole, at least its minimum).
    lease_ttl: int
    #: The request key's create_revision (0: not put yet, or not known).
    created: int = 0
    granted: bool = False
    #: A revision at which a try-once semaphore request found room (0: none yet).
    counted: int = 0
    #: The short lease a queued request's key lives on until it holds (0: none), and
    #: its seconds: a waiter that dies goes within seconds, whatever its ttl.
    wait_lease: int = 0
    wait_ttl: int = 0

    def leases(self) -> list[int]:
        return [lease for lease in (self.lease, self.wait_lease) if lease]

    @property
    def on(self) -> int:
        """The lease the request key is on now."""
        return self.wait_lease if self.wait_lease and not self.granted else self.lease


def _range(key: str, end: str, **more: Any) -> dict[str, Any]:
    return {"requestRange": {"key": _etcd._b64(key), "range_end": _etcd._b64(end), **more}}


def _end_of(prefix: str) -> str:
    """The key just after every key that starts with ``prefix`` (which ends in "/")."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def _created(key: str, revision: int) -> dict[str, Any]:
    return {
        "target": "CREATE",
        "key": _etcd._b64(key),
        "result": "EQUAL",
        "create_revision": str(revision),
    }


def _on_lease(key: str, lease: int) -> dict[str, Any]:
    return {"target": "LEASE", "key": _etcd._b64(key), "result": "EQUAL", "lease": str(lease)}


def _data(kv: Mapping[str, Any]) -> dict[str, Any]:
    try:
        data = json.loads(_etcd._unb64(kv.get("value")))
    except (ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclasses.dataclass
class _Seen:
    """A request key as read from the server, for listing and eviction."""

    kind: str
    owner: str
    kv: dict[str, Any]
    data: dict[str, Any]
    holds: bool = False

    @property
    def created(self) -> int:
        return _etcd._int(self.kv.get("create_revision"))

    @property
    def limit(self) -> int:
        limit = self.data.get("limit")
        ok = isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
        return limit if ok else 1  # type: ignore[return-value]


def _judge(seen: list[_Seen]) -> None:
    """Mark which of ``seen`` (create_revision order) hold, by the rules above."""
    write_ahead = False
    for index, node in enumerate(seen):
        if node.kind == SEMAPHORE:
            node.holds = index < node.limit
        elif node.kind == READ:
            node.holds = not write_ahead
        else:
            node.holds = index == 0
        write_ahead = write_ahead or node.kind == WRITE


class EtcdPermits:
    """Semaphores and read-write locks for :class:`~distlocks.backends.etcd.EtcdBackend`,
    on its connections, leases and error mapping. The backend's ``iter_locks()`` lists
    the permits (:meth:`iter_permits`) after the plain locks, as on the other backends.
    """

    if TYPE_CHECKING:
        alias: str
        prefix: str
        endpoints: list[_Endpoint]
        connect_timeout: float
        socket_timeout: float
        token_floor: int
        _preferred: int
        WAIT_TTL: float

        def _check_pid(self) -> None: ...

        def _call(
            self, path: str, body: Any, action: str, name: str, *, raw: bool = False
        ) -> Any: ...

        def _txn(
            self,
            action: str,
            name: str,
            compare: list[dict[str, Any]],
            success: list[dict[str, Any]],
            failure: list[dict[str, Any]] | None = None,
        ) -> dict[str, Any]: ...

        def _grant(self, ttl: float, action: str, name: str) -> tuple[int, int]: ...

        def _keepalive(self, leases: Sequence[int], action: str, name: str) -> list[int]: ...

        def _revoke_quietly(self, lease: int) -> None: ...

        def _time_to_live(self, lease: int, action: str, name: str) -> tuple[int, int]: ...

        def _clock_us(self) -> int: ...

        def _fence_at_floor(self, fence: str) -> dict[str, Any]: ...

        def _quoted(self, name: str) -> str: ...

        def _connect(self, endpoint: _Endpoint, timeout: float) -> http.client.HTTPConnection: ...

        def _headers(self) -> dict[str, str]: ...

        def _raise_answer(
            self, status: int, data: bytes, action: str, name: str, path: str, body: Any
        ) -> NoReturn: ...

        def _unavailable(
            self, action: str, name: str, exc: BaseException
        ) -> LockBackendUnavailable: ...

        def check_permit_kind(self, kind: str) -> None: ...

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
        value = _etcd.holder_value(owner, holder, ttl, kind=kind, **more)
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
        except _etcd._LeaseGone:
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
                "key": _etcd._b64(key),
                "value": _etcd._b64(value),
                "lease": str(entry.lease),
            }
        }
        # A request that queues is put on its short lease (moved when it holds).
        queued_put = {"requestPut": {**put["requestPut"], "lease": str(entry.wait_lease)}}
        mine = {"requestRange": {"key": _etcd._b64(key), "keys_only": True}}
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
                        "key": _etcd._b64(family),
                        "range_end": _etcd._b64(_end_of(family)),
                        "result": "LESS",
                        "create_revision": str(counted + 1),
                    }
                ],
                [put],
                [self._room_range(name, limit)],
            )
            if answer.get("succeeded"):
                entry.created = _etcd._revision(answer)
                return AcquireResult(True, 0)
            if len(_etcd._kvs(answer["responses"][0])) >= limit:
                return AcquireResult(False, 0, None)
            entry.counted = _etcd._revision(answer)
            return None  # one came and went meanwhile: again, counted afresh
        # A reader: no write request at all; a writer: no request at all.
        blockers = self._writes_prefix(name) if kind == READ else family
        empty = {
            "target": "CREATE",
            "key": _etcd._b64(blockers),
            "range_end": _etcd._b64(_end_of(blockers)),
            "result": "EQUAL",
            "create_revision": "0",
        }
        compare = [empty]
        success = [put]
        fence = self.rw_fence_key(name)
        if kind == WRITE:
            fence_cmp, fence_put = self._fence_step(name)
            compare.append(fence_cmp)
            success += [fence_put, {"requestRange": {"key": _etcd._b64(fence)}}]
        failure: list[dict[str, Any]]
        if queue:
            failure = [queued_put, mine]
        else:
            failure = [
                _range(blockers, _end_of(blockers), keys_only=True, limit=1),
                {"requestRange": {"key": _etcd._b64(fence)}},
            ]
        answer = self._txn("acquire", name, compare, success, failure)
        if answer.get("succeeded"):
            revision = _etcd._revision(answer)
            entry.created = revision
            entry.granted = True  # on the permit's own lease already
            token = 0
            if kind == WRITE:
                self._fence_written(name)
                token = _etcd.token_of(revision, _etcd._kvs(answer["responses"][-1])[0])
            return AcquireResult(True, token)
        if queue:
            return self._queued(entry, answer, 1)
        held, fences = (_etcd._kvs(r) for r in answer.get("responses", []))
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
        if len(_etcd._kvs(answer["responses"][0])) >= limit:
            return 0
        return _etcd._revision(answer)

    def _queued(
        self, entry: _Permit, answer: Mapping[str, Any], index: int
    ) -> AcquireResult | None:
        """Note the create_revision of the key just put (response ``index``); None: the
        next step judges it."""
        kvs = _etcd._kvs(answer.get("responses", [])[index])
        entry.created = _etcd._int(kvs[0].get("create_revision")) if kvs else 0
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
        blockers = _etcd._kvs(answer["responses"][0])
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
        return {"requestPut": {"key": _etcd._b64(key), "ignore_value": True, "lease": str(lease)}}

    def _grant_write(
        self, name: str, key: str, entry: _Permit, mine: list[dict[str, Any]]
    ) -> AcquireResult | None:
        family = self.family_prefix(WRITE, name)
        fence = self.rw_fence_key(name)
        fence_cmp, fence_put = self._fence_step(name)
        nobody_ahead = {
            "target": "CREATE",
            "key": _etcd._b64(family),
            "range_end": _etcd._b64(_end_of(family)),
            "result": "GREATER",
            "create_revision": str(entry.created - 1),
        }
        answer = self._txn(
            "acquire",
            name,
            [*mine, nobody_ahead, fence_cmp],
            [
                fence_put,
                {"requestRange": {"key": _etcd._b64(fence)}},
                # Granted: the key goes onto the permit's lease in the same step.
                self._onto(key, entry.lease),
            ],
            [
                {"requestRange": {"key": _etcd._b64(key), "keys_only": True}},
                self._blocker_ranges(WRITE, name, entry.created, 1),
            ],
        )
        if answer.get("succeeded"):
            self._fence_written(name)
            revision = _etcd._revision(answer)
            return AcquireResult(
                True, _etcd.token_of(revision, _etcd._kvs(answer["responses"][1])[0])
            )
        own, ahead = (_etcd._kvs(r) for r in answer.get("responses", []))
        if not own or _etcd._int(own[0].get("create_revision")) != entry.created:
            entry.created = 0  # the key went (evicted): queue again, at the back
            return None
        if ahead:
            return AcquireResult(False, 0, None)
        if _etcd._int(own[0].get("lease")) != entry.on:
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
        fence = _etcd._b64(self.rw_fence_key(name))
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
            return first, {"requestPut": {"key": fence, "value": _etcd._b64(value)}}
        return self._fence_at_floor(fence), {"requestPut": {"key": fence, "ignore_value": True}}

    def _fence_written(self, name: str) -> None:
        self.__dict__.get("_fence_new", {}).pop(name, None)

    def _fence_stale(self, name: str, kvs: list[dict[str, Any]] | None = None) -> bool:
        """Whether the fence key (``kvs``: as read, else read now) needs its base written
        (missing, or below the floor); if so, the next grant writes it, conditional on
        the fence as read."""
        if kvs is None:
            answer = self._call(
                "/v3/kv/range", {"key": _etcd._b64(self.rw_fence_key(name))}, "acquire", name
            )
            kvs = answer.get("kvs") or []
        pending: dict[str, tuple[int, str]] = self.__dict__.setdefault("_fence_new", {})
        if not kvs:
            base = max(self._clock_us(), self.token_floor)
            pending[name] = (0, str(base).zfill(_etcd._BASE_DIGITS))
            return True
        if self.token_floor and _etcd._base(kvs[0]) < self.token_floor:
            pending[name] = (
                _etcd._int(kvs[0].get("mod_revision")),
                str(self.token_floor).zfill(_etcd._BASE_DIGITS),
            )
            return True
        pending.pop(name, None)
        return False

    # -- release, leave, extend --------------------------------------------------------

    def _own_kv(self, kind: str, name: str, owner: str, action: str) -> dict[str, Any] | None:
        answer = self._call(
            "/v3/kv/range", {"key": _etcd._b64(self.request_key(kind, name, owner))}, action, name
        )
        kvs = answer.get("kvs") or []
        return kvs[0] if kvs else None

    def permit_release(self, kind: str, name: str, owner: str) -> bool:
        """Delete ``owner``'s request key only if it is still the same one on the same
        lease (one transaction), then revoke the lease."""
        self.check_permit_kind(kind)
        entry = self._permit_table().pop((kind, name, owner), None)
        key = self.request_key(kind, name, owner)
        if entry is not None and entry.created:
            lease, created = entry.on, entry.created
            if entry.wait_lease and lease != entry.wait_lease:
                self._revoke_quietly(entry.wait_lease)
        else:
            if entry is not None:
                for old in entry.leases():
                    self._revoke_quietly(old)
            kv = self._own_kv(kind, name, owner, "release")
            if kv is None:
                return False
            lease, created = _etcd._int(kv.get("lease")), _etcd._int(kv.get("create_revision"))
        answer = self._txn(
            "release",
            name,
            [_created(key, created), _on_lease(key, lease)],
            [{"requestDeleteRange": {"key": _etcd._b64(key)}}],
        )
        self._revoke_quietly(lease)
        if entry is not None and entry.lease != lease:
            self._revoke_quietly(entry.lease)
        return bool(answer.get("succeeded")) and (entry is None or entry.granted)

    def permit_leave(self, kind: str, name: str, owner: str) -> None:
        """A waiter that gives up revokes its lease: its key goes (and a permit that a
        lost reply may have granted on it)."""
        entry = self._permit_table().pop((kind, name, owner), None)
        if entry is not None:
            for lease in entry.leases():
                with contextlib.suppress(_etcd._LeaseGone):
                    self._call("/v3/lease/revoke", {"ID": str(lease)}, "leave the queue of", name)
            return
        self._call(
            "/v3/kv/deleterange",
            {"key": _etcd._b64(self.request_key(kind, name, owner))},
            "leave the queue of",
            name,
        )

    def permit_extend(self, kind: str, name: str, owner: str, ttl: float) -> bool:
        result = self.permit_extend_many([(kind, name, owner, ttl)])[0]
        if isinstance(result, LockError):
            raise result
        return result

    def permit_extend_many(
        self, permits: Sequence[tuple[str, str, str, float]]
    ) -> list[bool | LockError]:
        """Renew several ``(kind, name, owner, ttl)`` permits: one keepalive request for
        every lease, then one transaction checking (and touching, which counts the
        renewal) that each key is still the same one on its lease. A ttl longer than
        the lease moves the key to a new lease."""
        table = self._permit_table()
        results: list[bool | LockError] = [False] * len(permits)
        same: list[tuple[int, str, str, _Permit]] = []
        for index, (kind, name, owner, ttl) in enumerate(permits):
            try:
                self.check_permit_kind(kind)
                entry = self._entry_for(kind, name, owner)
                if entry is None:
                    results[index] = False
                elif _etcd.lease_seconds(ttl) > entry.lease_ttl:
                    results[index] = self._move(kind, name, owner, entry, ttl)
                else:
                    same.append((index, name, self.request_key(kind, name, owner), entry))
            except LockError as exc:
                results[index] = exc
        for start in range(0, len(same), _etcd._TXN_BATCH):
            batch = same[start : start + _etcd._TXN_BATCH]
            what = batch[0][1] if len(batch) == 1 else f"{len(batch)} permits"
            try:
                left = self._keepalive([entry.lease for *_, entry in batch], "extend", what)
                alive = [b for b, secs in zip(batch, left, strict=True) if secs > 0]
                if alive:
                    checks = [
                        {
                            "requestTxn": {
                                "compare": [_created(key, e.created), _on_lease(key, e.lease)],
                                "success": [
                                    {
                                        "requestPut": {
                                            "key": _etcd._b64(key),
                                            "ignore_value": True,
                                            "ignore_lease": True,
                                        }
                                    }
                                ],
                            }
                        }
                        for _, _, key, e in alive
                    ]
                    answer = self._txn("extend", what, [], checks)
                    for (index, *_), response in zip(
                        alive, answer.get("responses", []), strict=True
                    ):
                        results[index] = bool(response.get("response_txn", {}).get("succeeded"))
            except LockError as exc:
                for index, *_ in batch:
                    results[index] = exc
        for index, (kind, name, owner, _) in enumerate(permits):
            if results[index] is False:
                entry = table.pop((kind, name, owner), None)
                if entry is not None:
                    for lease in entry.leases():
                        self._revoke_quietly(lease)
        return results

    def _entry_for(self, kind: str, name: str, owner: str) -> _Permit | None:
        """This process's entry for a held permit, or one rebuilt from the server."""
        table = self._permit_table()
        entry = table.get((kind, name, owner))
        if entry is not None and entry.granted:
            return entry
        kv = self._own_kv(kind, name, owner, "extend")
        if kv is None:
            return None
        lease = _etcd._int(kv.get("lease"))
        _, granted = self._time_to_live(lease, "extend", name)
        entry = _Permit(lease, granted, _etcd._int(kv.get("create_revision")), True)
        table[(kind, name, owner)] = entry
        return entry

    def _move(self, kind: str, name: str, owner: str, entry: _Permit, ttl: float) -> bool:
        """A longer ttl than the lease's: etcd keeps a lease's length for good, so move
        the key to a new lease of that length (checked in the same transaction to be
        the same key on the old lease), then revoke the old one."""
        key = self.request_key(kind, name, owner)
        lease, granted = self._grant(ttl, "extend", name)
        try:
            answer = self._txn(
                "extend",
                name,
                [_created(key, entry.created), _on_lease(key, entry.lease)],
                [
                    {
                        "requestPut": {
                            "key": _etcd._b64(key),
                            "ignore_value": True,
                            "lease": str(lease),
                        }
                    }
                ],
            )
        except LockError:
            self._revoke_quietly(lease)
            raise
        old = entry.lease
        if not answer.get("succeeded"):
            self._revoke_quietly(lease)
            return False
        entry.lease, entry.lease_ttl = lease, granted
        self._revoke_quietly(old)
        return True

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
            revision = _etcd._revision(answer)
            blockers = [
                _etcd._unb64(kv["key"]).decode() for kv in _etcd._kvs(answer["responses"][0])
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
            if seen == _etcd._SEEN:
                return
            if seen == _etcd._ENDED:
                # Look again, but not at once (see EtcdBackend._wait_g).
                pause = min(_etcd.WATCH_RETRY_MAX, max(_etcd.WATCH_RETRY_FIRST, pause * 2))
                time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                return
            if self._keepalive([entry.on], "wait for", name)[0] <= 0:
                return  # the lease ran out: the next attempt queues again

    def _watch_deletes(
        self, watched: list[tuple[str, str | None]], start_revision: int, until: float, name: str
    ) -> str | bool:
        """``_etcd._SEEN`` when one of the keys (or ranges) in ``watched`` has a deletion
        at ``start_revision`` or later (or a compaction past it), ``_etcd._ENDED`` when
        the stream ended without one (look again), False at ``until`` (monotonic).
        One stream for all of them, on a connection of its own, closed after."""
        body = "\n".join(
            json.dumps(
                {
                    "create_request": {
                        "key": _etcd._b64(key),
                        **({"range_end": _etcd._b64(end)} if end else {}),
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
                        refused = _etcd._unavailable_answer(reply.status, data)
                        if refused is None:
                            self._raise_answer(reply.status, data, "wait for", name, "", None)
                        raise refused  # this member cannot serve now: the next one
                    break
                except (OSError, ValueError, http.client.HTTPException, _etcd._ServerSaid) as exc:
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
                    return _etcd._ENDED  # the member went away mid-stream: look again
                except (OSError, ValueError, http.client.HTTPException) as exc:
                    raise self._unavailable("wait for", name, exc) from exc
                if not line:
                    return _etcd._ENDED  # the stream ended: look again
                try:
                    result = _etcd._watch_result(line)
                except ValueError as exc:
                    raise self._unavailable("wait for", name, exc) from exc
                if result.get("canceled") or result.get("compact_revision"):
                    return _etcd._SEEN  # compacted past our revision: look again
                if result.get("events"):
                    return _etcd._SEEN
        finally:
            if conn is not None:
                conn.close()

    # -- inspection, eviction ---------------------------------------------------------

    def _family_state(
        self, kind: str, name: str, action: str
    ) -> tuple[list[_Seen], dict[str, Any] | None]:
        """The requests of ``name``'s family in queue order, each marked holding or not,
        and (for a read-write lock) its fence key; one consistent read."""
        family = self.family_prefix(kind, name)
        answer = self._txn(
            action,
            name,
            [],
            [
                _range(family, _end_of(family), sort_target="CREATE", sort_order="ASCEND"),
                {"requestRange": {"key": _etcd._b64(self.rw_fence_key(name))}},
            ],
        )
        kvs, fences = (_etcd._kvs(r) for r in answer.get("responses", []))
        seen = self._seen(kvs, permit_family(kind))
        fence = fences[0] if fences and permit_family(kind) == RWLOCK else None
        return seen, fence

    def _seen(self, kvs: list[dict[str, Any]], family: str) -> list[_Seen]:
        seen = []
        for kv in sorted(kvs, key=lambda kv: _etcd._int(kv.get("create_revision"))):
            parsed = self._parse(_etcd._unb64(kv["key"]).decode(errors="replace"))
            if parsed is None or permit_family(parsed[0]) != family:
                continue  # not a request key (written by hand?): not judged
            seen.append(_Seen(parsed[0], parsed[2], kv, _data(kv)))
        _judge(seen)
        return seen

    def _infos(
        self, name: str, seen: list[_Seen], fence: Mapping[str, Any] | None, action: str
    ) -> list[LockInfo]:
        waiting = [node.owner for node in seen if not node.holds]
        now = dt.datetime.now(dt.UTC)
        infos = []
        for node in seen:
            if not node.holds:
                continue
            data, kv = node.data, node.kv
            lease = _etcd._int(kv.get("lease"))
            left, granted = self._time_to_live(lease, action, name)
            if left < 0:
                continue  # its lease ended since the read: not a permit any more
            pid, ttl, at = data.get("pid"), data.get("ttl"), data.get("at")
            shown_ttl = float(ttl) if isinstance(ttl, int | float) else None
            if granted and (shown_ttl is None or _etcd.lease_seconds(shown_ttl) < granted):
                shown_ttl = float(granted)  # extended with a longer ttl since
            extra: dict[str, Any] = {**holder_details(data.get("extra")), "kind": node.kind}
            if node.kind == SEMAPHORE:
                extra["limit"] = node.limit
            extra.update(lease=f"{lease:x}", revision=node.created, waiting=waiting)
            token = 0
            if node.kind == WRITE and fence is not None:
                # Only grants and evictions write the fence: it shows the holder's grant.
                token = _etcd.token_of(_etcd._int(fence.get("mod_revision")), fence)
            infos.append(
                LockInfo(
                    name=name,
                    backend=self.alias,
                    owner=node.owner,
                    fencing_token=token,
                    host=str(data.get("host", "")),
                    pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                    thread=str(data.get("thread", "")),
                    # The holder's clock when it asked (etcd keeps no times).
                    acquired_at=(
                        dt.datetime.fromtimestamp(at / 1000, dt.UTC)
                        if isinstance(at, int) and not isinstance(at, bool) and 0 < at < 2**47
                        else None
                    ),
                    expires_at=now + dt.timedelta(seconds=left),
                    ttl=shown_ttl,
                    renewals=max(0, _etcd._int(kv.get("version")) - 1),
                    waiters=len(waiting),
                    extra=extra,
                )
            )
        return infos

    def permit_holders(self, kind: str, name: str) -> list[LockInfo]:
        self.check_permit_kind(kind)
        seen, fence = self._family_state(kind, name, "inspect")
        return self._infos(name, seen, fence, "inspect")

    def iter_permits(self) -> Iterator[LockInfo]:
        """Every live permit: the request keys read in pages at one revision, grouped by
        name, each name's queue judged as a whole."""
        self._check_pid()
        fences: dict[str, dict[str, Any]] = {}
        head = f"{self.prefix}/rwfence/"
        # One revision for every page: a write token shown matches its holder.
        now = self._call("/v3/kv/range", {"key": _etcd._b64(head), "keys_only": True}, "list", "*")
        revision = _etcd._int(now.get("header", {}).get("revision"))
        for kv in self._pages(head, "list", revision):
            fences[urllib.parse.unquote(_etcd._unb64(kv["key"]).decode()[len(head) :])] = kv
        for family, where in ((SEMAPHORE, "sem"), (RWLOCK, "rw")):
            group: list[dict[str, Any]] = []
            current: str | None = None
            for kv in self._pages(f"{self.prefix}/{where}/", "list", revision):
                parsed = self._parse(_etcd._unb64(kv["key"]).decode(errors="replace"))
                if parsed is None:
                    continue
                if parsed[1] != current and group:
                    yield from self._group(family, str(current), group, fences)
                    group = []
                current = parsed[1]
                group.append(kv)
            if group:
                yield from self._group(family, str(current), group, fences)

    def _group(
        self,
        family: str,
        name: str,
        kvs: list[dict[str, Any]],
        fences: Mapping[str, dict[str, Any]],
    ) -> Iterator[LockInfo]:
        fence = fences.get(name) if family == RWLOCK else None
        yield from self._infos(name, self._seen(kvs, family), fence, "list")

    def _pages(self, prefix: str, action: str, revision: int) -> Iterator[dict[str, Any]]:
        """Every key under ``prefix`` in key order, ``LIST_PAGE`` at a time, all read at
        ``revision``."""
        start, end = prefix, _end_of(prefix)
        while True:
            body: dict[str, Any] = {
                "key": _etcd._b64(start),
                "range_end": _etcd._b64(end),
                "limit": LIST_PAGE,
                "revision": str(revision),
            }
            answer = self._call("/v3/kv/range", body, action, "*")
            kvs = answer.get("kvs") or []
            yield from kvs
            if not answer.get("more") or not kvs:
                return
            start = _etcd._unb64(kvs[-1]["key"]).decode(errors="surrogateescape") + "\x00"

    def permit_force_release(self, kind: str, name: str, owner: str | None = None) -> int:
        """Delete the key of ``owner``'s permit (of every permit held when None), in one
        transaction that checks each is still the one judged to hold, and for a
        read-write lock rewrites its fence key: the write counter moves past an evicted
        writer. Waiting requests are left alone; nothing is written when no permit
        matches. The victims' leases are revoked after, so their renewals fail."""
        self.check_permit_kind(kind)
        return self._evict(kind, name, lambda node: owner is None or node.owner == owner)

    def force_release_holder(self, info: LockInfo) -> bool:
        """Evict the holder ``info`` describes: a permit only if its key is still the one
        listed (same owner, same create_revision), a plain lock by its token."""
        kind = info.extra.get("kind")
        if kind not in PERMIT_KINDS:
            return bool(self.force_release(info.name, info.fencing_token))  # type: ignore[attr-defined]
        revision = _etcd._int(info.extra.get("revision"))
        return (
            self._evict(
                str(kind),
                info.name,
                lambda node: (
                    node.owner == info.owner
                    and node.kind == kind
                    and (not revision or node.created == revision)
                ),
            )
            > 0
        )

    def _evict(self, kind: str, name: str, chosen: Callable[[_Seen], bool]) -> int:
        self.check_permit_kind(kind)
        fence_key = _etcd._b64(self.rw_fence_key(name))
        for _ in range(5):
            seen, fence = self._family_state(kind, name, "force-release")
            targets = [node for node in seen if node.holds and chosen(node)]
            if not targets:
                return 0
            evicted = 0
            retry = False
            # etcd takes at most 128 operations per transaction: evict in chunks.
            for start in range(0, len(targets), _etcd._TXN_BATCH // 2):
                chunk = targets[start : start + _etcd._TXN_BATCH // 2]
                compare = [_created(_etcd._unb64(n.kv["key"]).decode(), n.created) for n in chunk]
                success: list[dict[str, Any]] = [
                    {"requestDeleteRange": {"key": n.kv["key"]}} for n in chunk
                ]
                if fence is not None:
                    compare.append(
                        {"target": "VERSION", "key": fence_key, "result": "GREATER", "version": "0"}
                    )
                    success.append({"requestPut": {"key": fence_key, "ignore_value": True}})
                elif permit_family(kind) != SEMAPHORE:
                    # No write grant yet: the eviction creates the fence, so the write
                    # counter moves past 0 as on every backend.
                    base = str(max(self._clock_us(), self.token_floor)).zfill(_etcd._BASE_DIGITS)
                    compare.append(
                        {
                            "target": "CREATE",
                            "key": fence_key,
                            "result": "EQUAL",
                            "create_revision": "0",
                        }
                    )
                    success.append({"requestPut": {"key": fence_key, "value": _etcd._b64(base)}})
                answer = self._txn("force-release", name, compare, success)
                if not answer.get("succeeded"):
                    retry = True  # one went meanwhile: look again
                    break
                evicted += len(chunk)
                if fence is None and permit_family(kind) != SEMAPHORE:
                    fence = {}  # created now: the next chunk rewrites it
                for node in chunk:
                    self._revoke_quietly(_etcd._int(node.kv.get("lease")))
            if not retry:
                return evicted
            if evicted:
                return evicted
        return 0

    def permit_counter(self, name: str) -> int:
        """The last write token of the read-write lock ``name``: its fence key's last
        write (a grant or an eviction); 0 before the first write grant."""
        self.check_permit_kind(WRITE)
        self._check_pid()
        answer = self._call(
            "/v3/kv/range",
            {"key": _etcd._b64(self.rw_fence_key(name))},
            "read the write counter of",
            name,
        )
        kvs = answer.get("kvs") or []
        if not kvs:
            return 0
        return _etcd.token_of(_etcd._int(kvs[0].get("mod_revision")), kvs[0])

    def permit_queue(self, kind: str, name: str) -> list[tuple[str, str]]:
        """(kind, owner) of every request of ``name``'s family in queue order (for tests
        and operations)."""
        seen, _ = self._family_state(kind, name, "inspect")
        return [(node.kind, node.owner) for node in seen]


# At the end: etcd.py imports this module for the mixin, and this one calls etcd.py's
# helpers (looked up when called), whichever of the two is imported first.
from distlocks.backends import etcd as _etcd  # noqa: E402
