"""Listing what etcd holds: one lock (:meth:`inspect`), every lock then every permit
(:meth:`iter_locks`, the permit keys read in pages of :data:`LIST_PAGE` at one
revision), the holders of one semaphore or read-write lock, and a lock's queue.
"""

from __future__ import annotations

import datetime as dt
import json
import urllib.parse
from collections.abc import Iterator, Mapping
from typing import Any

from distlocks.backends.base import (
    RWLOCK,
    SEMAPHORE,
    WRITE,
    LockInfo,
    holder_details,
)
from distlocks.backends.etcd import protocol
from distlocks.backends.etcd.lock_held import EtcdLockHeld
from distlocks.backends.etcd.permit_held import EtcdPermitHeld
from distlocks.backends.etcd.permit_rules import _end_of, _Seen
from distlocks.backends.etcd.protocol import (
    _TXN_BATCH,
    _b64,
    _int,
    _kvs,
    _unb64,
    lease_seconds,
    token_of,
)

#: Keys read per request when listing every permit.
LIST_PAGE = 1000


class EtcdListing(EtcdPermitHeld, EtcdLockHeld):
    """Inspection and listing of locks and permits. ``iter_locks()`` lists the permits
    (:meth:`iter_permits`) after the plain locks, as on the other backends."""

    # -- inspection ---------------------------------------------------------------

    def _info(
        self,
        name: str,
        held: Mapping[str, Any],
        fence: Mapping[str, Any] | None,
        queue: list[dict[str, Any]],
        action: str,
    ) -> LockInfo:
        try:
            data = json.loads(_unb64(held.get("value")))
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        lease = _int(held.get("lease"))
        left, granted = self._time_to_live(lease, action, name)
        now = dt.datetime.now(dt.UTC)
        pid, ttl, at = data.get("pid"), data.get("ttl"), data.get("at")
        shown_ttl: float | None = float(ttl) if isinstance(ttl, int | float) else None
        if granted and (shown_ttl is None or lease_seconds(shown_ttl) < granted):
            shown_ttl = float(granted)  # extended with a longer ttl since
        waiting = [
            urllib.parse.unquote(_unb64(kv["key"]).decode().rsplit("/", 1)[1]) for kv in queue
        ]
        return LockInfo(
            name=name,
            backend=self.alias,
            owner=str(data.get("owner", "")),
            fencing_token=token_of(_int(held.get("create_revision")), fence or {}),
            host=str(data.get("host", "")),
            pid=pid if isinstance(pid, int) else None,
            thread=str(data.get("thread", "")),
            # The holder's clock when it asked (etcd keeps no times).
            acquired_at=(
                dt.datetime.fromtimestamp(at / 1000, dt.UTC) if isinstance(at, int) else None
            ),
            expires_at=now + dt.timedelta(seconds=left) if left >= 0 else now,
            ttl=shown_ttl,
            # Each renewal touches the lock key once.
            renewals=max(0, _int(held.get("version")) - 1),
            waiters=len(waiting),
            extra={**holder_details(data.get("extra")), "lease": f"{lease:x}", "waiting": waiting},
        )

    def inspect(self, name: str) -> LockInfo | None:
        self._check_pid()
        answer = self._txn(
            "inspect",
            name,
            [],
            [
                {"requestRange": {"key": _b64(self.lock_key(name))}},
                {"requestRange": {"key": _b64(self.fence_key(name))}},
                self._queue_range(self.wait_prefix(name)),
            ],
        )
        responses = answer.get("responses", [])
        held, fences, queue = (_kvs(r) for r in responses)
        if not held:
            return None
        return self._info(name, held[0], fences[0] if fences else None, queue, "inspect")

    def iter_locks(self) -> Iterator[LockInfo]:
        self._check_pid()
        answer = self._txn(
            "list",
            "*",
            [],
            [
                self._queue_range(f"{self.prefix}/lock/"),
                self._queue_range(f"{self.prefix}/wait/"),
            ],
        )
        responses = answer.get("responses", [])
        names = sorted(
            urllib.parse.unquote(_unb64(kv["key"]).decode().rsplit("/", 1)[1])
            for kv in _kvs(responses[0])
        )
        queues: dict[str, list[dict[str, Any]]] = {}
        for kv in _kvs(responses[1]):
            quoted = _unb64(kv["key"]).decode()[len(f"{self.prefix}/wait/") :].split("/", 1)[0]
            queues.setdefault(urllib.parse.unquote(quoted), []).append(kv)
        for start in range(0, len(names), _TXN_BATCH // 2):
            batch = names[start : start + _TXN_BATCH // 2]
            ops = []
            for name in batch:
                ops += [
                    {"requestRange": {"key": _b64(self.lock_key(name))}},
                    {"requestRange": {"key": _b64(self.fence_key(name))}},
                ]
            got = self._txn("list", "*", [], ops).get("responses", [])
            for offset, name in enumerate(batch):
                held, fences = _kvs(got[2 * offset]), _kvs(got[2 * offset + 1])
                if held:
                    yield self._info(
                        name, held[0], fences[0] if fences else None, queues.get(name, []), "list"
                    )
        yield from self.iter_permits()

    # -- for tests and operations -------------------------------------------------

    def queue(self, name: str) -> list[str]:
        """Owners of the waiter keys of ``name`` in queue order."""
        answer = self._txn("inspect", name, [], [self._queue_range(self.wait_prefix(name))])
        return [
            urllib.parse.unquote(_unb64(kv["key"]).decode().rsplit("/", 1)[1])
            for kv in _kvs(answer.get("responses", [{}])[0])
        ]

    # -- permits

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
            lease = protocol._int(kv.get("lease"))
            left, granted = self._time_to_live(lease, action, name)
            if left < 0:
                continue  # its lease ended since the read: not a permit any more
            pid, ttl, at = data.get("pid"), data.get("ttl"), data.get("at")
            shown_ttl = float(ttl) if isinstance(ttl, int | float) else None
            if granted and (shown_ttl is None or protocol.lease_seconds(shown_ttl) < granted):
                shown_ttl = float(granted)  # extended with a longer ttl since
            extra: dict[str, Any] = {**holder_details(data.get("extra")), "kind": node.kind}
            if node.kind == SEMAPHORE:
                extra["limit"] = node.limit
            extra.update(lease=f"{lease:x}", revision=node.created, waiting=waiting)
            token = 0
            if node.kind == WRITE and fence is not None:
                # Only grants and evictions write the fence: it shows the holder's grant.
                token = protocol.token_of(protocol._int(fence.get("mod_revision")), fence)
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
                    renewals=max(0, protocol._int(kv.get("version")) - 1),
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
        now = self._call(
            "/v3/kv/range", {"key": protocol._b64(head), "keys_only": True}, "list", "*"
        )
        revision = protocol._int(now.get("header", {}).get("revision"))
        for kv in self._pages(head, "list", revision):
            fences[urllib.parse.unquote(protocol._unb64(kv["key"]).decode()[len(head) :])] = kv
        for family, where in ((SEMAPHORE, "sem"), (RWLOCK, "rw")):
            group: list[dict[str, Any]] = []
            current: str | None = None
            for kv in self._pages(f"{self.prefix}/{where}/", "list", revision):
                parsed = self._parse(protocol._unb64(kv["key"]).decode(errors="replace"))
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
                "key": protocol._b64(start),
                "range_end": protocol._b64(end),
                "limit": LIST_PAGE,
                "revision": str(revision),
            }
            answer = self._call("/v3/kv/range", body, action, "*")
            kvs = answer.get("kvs") or []
            yield from kvs
            if not answer.get("more") or not kvs:
                return
            start = protocol._unb64(kvs[-1]["key"]).decode(errors="surrogateescape") + "\x00"
