"""Semaphores and read-write locks on etcd, held half: release, leave the queue, extend
(moving a request to a longer lease when needed), force release (eviction, which moves
a read-write lock's write counter), the write counter and the queue. The key layout and
the rules: :mod:`.permit_acquire`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from distlocks.backends.base import (
    RWLOCK,
    SEMAPHORE,
    WRITE,
    LockInfo,
    permit_family,
)
from distlocks.backends.etcd import protocol
from distlocks.backends.etcd.permit_acquire import EtcdPermitAcquire
from distlocks.backends.etcd.permit_rules import (
    PERMIT_KINDS,
    _created,
    _data,
    _end_of,
    _judge,
    _on_lease,
    _Permit,
    _range,
    _Seen,
)
from distlocks.exceptions import LockError


class EtcdPermitHeld(EtcdPermitAcquire):
    """Releasing, extending and evicting semaphore permits and read-write locks."""

    # -- release, leave, extend --------------------------------------------------------

    def _own_kv(self, kind: str, name: str, owner: str, action: str) -> dict[str, Any] | None:
        answer = self._call(
            "/v3/kv/range",
            {"key": protocol._b64(self.request_key(kind, name, owner))},
            action,
            name,
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
            lease, created = (
                protocol._int(kv.get("lease")),
                protocol._int(kv.get("create_revision")),
            )
        answer = self._txn(
            "release",
            name,
            [_created(key, created), _on_lease(key, lease)],
            [{"requestDeleteRange": {"key": protocol._b64(key)}}],
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
                with contextlib.suppress(protocol._LeaseGone):
                    self._call("/v3/lease/revoke", {"ID": str(lease)}, "leave the queue of", name)
            return
        self._call(
            "/v3/kv/deleterange",
            {"key": protocol._b64(self.request_key(kind, name, owner))},
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
                elif protocol.lease_seconds(ttl) > entry.lease_ttl:
                    results[index] = self._move(kind, name, owner, entry, ttl)
                else:
                    same.append((index, name, self.request_key(kind, name, owner), entry))
            except LockError as exc:
                results[index] = exc
        for start in range(0, len(same), protocol._TXN_BATCH):
            batch = same[start : start + protocol._TXN_BATCH]
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
                                            "key": protocol._b64(key),
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
        lease = protocol._int(kv.get("lease"))
        _, granted = self._time_to_live(lease, "extend", name)
        entry = _Permit(lease, granted, protocol._int(kv.get("create_revision")), True)
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
                            "key": protocol._b64(key),
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
                {"requestRange": {"key": protocol._b64(self.rw_fence_key(name))}},
            ],
        )
        kvs, fences = (protocol._kvs(r) for r in answer.get("responses", []))
        seen = self._seen(kvs, permit_family(kind))
        fence = fences[0] if fences and permit_family(kind) == RWLOCK else None
        return seen, fence

    def _seen(self, kvs: list[dict[str, Any]], family: str) -> list[_Seen]:
        seen = []
        for kv in sorted(kvs, key=lambda kv: protocol._int(kv.get("create_revision"))):
            parsed = self._parse(protocol._unb64(kv["key"]).decode(errors="replace"))
            if parsed is None or permit_family(parsed[0]) != family:
                continue  # not a request key (written by hand?): not judged
            seen.append(_Seen(parsed[0], parsed[2], kv, _data(kv)))
        _judge(seen)
        return seen

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
            return bool(self.force_release(info.name, info.fencing_token))
        revision = protocol._int(info.extra.get("revision"))
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
        fence_key = protocol._b64(self.rw_fence_key(name))
        for _ in range(5):
            seen, fence = self._family_state(kind, name, "force-release")
            targets = [node for node in seen if node.holds and chosen(node)]
            if not targets:
                return 0
            evicted = 0
            retry = False
            # etcd takes at most 128 operations per transaction: evict in chunks.
            for start in range(0, len(targets), protocol._TXN_BATCH // 2):
                chunk = targets[start : start + protocol._TXN_BATCH // 2]
                compare = [
                    _created(protocol._unb64(n.kv["key"]).decode(), n.created) for n in chunk
                ]
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
                    base = str(max(self._clock_us(), self.token_floor)).zfill(protocol._BASE_DIGITS)
                    compare.append(
                        {
                            "target": "CREATE",
                            "key": fence_key,
                            "result": "EQUAL",
                            "create_revision": "0",
                        }
                    )
                    success.append({"requestPut": {"key": fence_key, "value": protocol._b64(base)}})
                answer = self._txn("force-release", name, compare, success)
                if not answer.get("succeeded"):
                    retry = True  # one went meanwhile: look again
                    break
                evicted += len(chunk)
                if fence is None and permit_family(kind) != SEMAPHORE:
                    fence = {}  # created now: the next chunk rewrites it
                for node in chunk:
                    self._revoke_quietly(protocol._int(node.kv.get("lease")))
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
            {"key": protocol._b64(self.rw_fence_key(name))},
            "read the write counter of",
            name,
        )
        kvs = answer.get("kvs") or []
        if not kvs:
            return 0
        return protocol.token_of(protocol._int(kvs[0].get("mod_revision")), kvs[0])

    def permit_queue(self, kind: str, name: str) -> list[tuple[str, str]]:
        """(kind, owner) of every request of ``name``'s family in queue order (for tests
        and operations)."""
        seen, _ = self._family_state(kind, name, "inspect")
        return [(node.kind, node.owner) for node in seen]
