"""The etcd lock recipe, held half: release (revoke the lock's own lease), leave the
queue, extend (keepalive, then a transaction that checks the lock key is still on the
lease; a longer ttl moves the key to a new lease), force release bound to a token,
and the fencing counter. The acquire half and the key layout: :mod:`.lock_acquire`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Generator, Sequence
from typing import Any

from distlocks.backends.etcd.lock_acquire import EtcdLockAcquire, _Entry
from distlocks.backends.etcd.protocol import (
    _TXN_BATCH,
    _b64,
    _int,
    _kvs,
    _LeaseGone,
    lease_seconds,
    token_of,
)
from distlocks.exceptions import LockError


class EtcdLockHeld(EtcdLockAcquire):
    """Releasing, extending and force-releasing a plain lock."""

    # -- release, extend -----------------------------------------------------------

    def release(self, name: str, owner: str) -> bool:
        return self._sync(self._release_g(name, owner))

    async def arelease(self, name: str, owner: str) -> bool:
        return await self._arun(self._release_g(name, owner))

    def _release_g(self, name: str, owner: str) -> Generator[Any, Any, bool]:
        """Revoke the lease of ``owner``'s lock: etcd deletes the lock key with it, in
        one step, and nothing else (the lease is this acquisition's own). A lease that
        is gone (expired, or revoked by a force release) means the lock was not ours
        any more: False."""
        entry = self._entries.pop((name, owner), None)
        if entry is not None and entry.lock_rev:
            if entry.wait_lease:
                yield from self._revoke_quietly_g(entry.wait_lease)
            try:
                yield from self._call_g(
                    "/v3/lease/revoke", {"ID": str(entry.lease)}, "release", name
                )
            except _LeaseGone:
                return False
            return True
        if entry is not None:
            yield from self._revoke_all_g(entry)
        # Not this process's (or forgotten): find the owner's lock on the server and
        # delete it only if it is still that incarnation on that lease.
        lock = _b64(self.lock_key(name))
        answer = yield from self._call_g("/v3/kv/range", {"key": lock}, "release", name)
        held = answer.get("kvs") or []
        if not held or self._owner_of(held[0]) != owner:
            return False
        lease, created = _int(held[0].get("lease")), _int(held[0].get("create_revision"))
        answer = yield from self._txn_g(
            "release",
            name,
            [
                {"target": "LEASE", "key": lock, "result": "EQUAL", "lease": str(lease)},
                {
                    "target": "CREATE",
                    "key": lock,
                    "result": "EQUAL",
                    "create_revision": str(created),
                },
            ],
            [{"requestDeleteRange": {"key": lock}}],
        )
        if answer.get("succeeded"):
            yield from self._revoke_quietly_g(lease)
        return bool(answer.get("succeeded"))

    def leave_queue(self, name: str, owner: str) -> None:
        self._sync(self._leave_queue_g(name, owner))

    async def aleave_queue(self, name: str, owner: str) -> None:
        entry = self._entries.pop((name, owner), None)
        # A task of its own, so that cancelling the caller (again) cannot interrupt it.
        await asyncio.shield(self._clean_up(lambda: self._leave_g(name, owner, entry)))

    def _leave_queue_g(self, name: str, owner: str) -> Generator[Any, Any, None]:
        entry = self._entries.pop((name, owner), None)
        yield from self._leave_g(name, owner, entry)

    def _leave_g(self, name: str, owner: str, entry: _Entry | None) -> Generator[Any, Any, None]:
        """Leave the queue of ``name``: revoke ``entry``'s leases, or delete ``owner``'s
        waiter key when this process knows none. Safe to repeat."""
        if entry is not None:
            # Revoking the leases deletes the waiter key, and a lock key a lost reply
            # may have granted: nothing of this attempt stays.
            for lease in entry.leases():
                with contextlib.suppress(_LeaseGone):
                    yield from self._call_g(
                        "/v3/lease/revoke", {"ID": str(lease)}, "leave the queue of", name
                    )
            return
        yield from self._call_g(
            "/v3/kv/deleterange",
            {"key": _b64(self.wait_key(name, owner))},
            "leave the queue of",
            name,
        )

    def _entry_for_g(
        self, name: str, owner: str, action: str
    ) -> Generator[Any, Any, _Entry | None]:
        """This process's entry for a held lock, or one rebuilt from the server."""
        entry = self._entries.get((name, owner))
        if entry is not None and entry.lock_rev:
            return entry
        answer = yield from self._call_g(
            "/v3/kv/range", {"key": _b64(self.lock_key(name))}, action, name
        )
        held = _kvs({"response_range": answer})
        if not held or self._owner_of(held[0]) != owner:
            return None
        lease = _int(held[0].get("lease"))
        _, granted = yield from self._time_to_live_g(lease, action, name)
        entry = _Entry(lease, granted, lock_rev=_int(held[0].get("create_revision")))
        self._entries[(name, owner)] = entry
        return entry

    def _still_mine(self, name: str, entry: _Entry) -> dict[str, Any]:
        """A nested transaction: the lock key is still on ``entry``'s lease (same
        incarnation); if so, touch it (value and lease kept), which counts a renewal
        in its version."""
        lock = _b64(self.lock_key(name))
        return {
            "requestTxn": {
                "compare": [
                    {"target": "LEASE", "key": lock, "result": "EQUAL", "lease": str(entry.lease)},
                    {
                        "target": "CREATE",
                        "key": lock,
                        "result": "EQUAL",
                        "create_revision": str(entry.lock_rev),
                    },
                ],
                "success": [
                    {"requestPut": {"key": lock, "ignore_value": True, "ignore_lease": True}}
                ],
            }
        }

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        result = self.extend_many([(name, owner, ttl)])[0]
        if isinstance(result, LockError):
            raise result
        return result

    async def aextend(self, name: str, owner: str, ttl: float) -> bool:
        result = (await self._arun(self._extend_many_g([(name, owner, ttl)])))[0]
        if isinstance(result, LockError):
            raise result
        return result

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool | LockError]:
        return self._sync(self._extend_many_g(leases))

    def _extend_many_g(
        self, leases: Sequence[tuple[str, str, float]]
    ) -> Generator[Any, Any, list[bool | LockError]]:
        """Renew every lease with one keepalive request, then confirm each lock key is
        still on its lease with one transaction (a nested one per lock). Order matters:
        the check comes after the renewal, so a True means the lock was there, on a
        lease just renewed. A ttl that needs another lease length moves the lock."""
        results: list[bool | LockError] = [False] * len(leases)
        same: list[tuple[int, str, _Entry]] = []
        for index, (name, owner, ttl) in enumerate(leases):
            try:
                entry = yield from self._entry_for_g(name, owner, "extend")
                if entry is None:
                    results[index] = False
                elif lease_seconds(ttl) != lease_seconds(entry.lease_ttl) and (
                    lease_seconds(ttl) > entry.lease_ttl
                ):
                    results[index] = yield from self._move_g(name, owner, entry, ttl)
                else:
                    same.append((index, name, entry))
            except LockError as exc:
                results[index] = exc
        for start in range(0, len(same), _TXN_BATCH):
            batch = same[start : start + _TXN_BATCH]
            try:
                yield from self._renew_g(batch, results)
            except LockError as exc:
                for index, _, _ in batch:
                    results[index] = exc
        return results

    def _renew_g(
        self, batch: list[tuple[int, str, _Entry]], results: list[bool | LockError]
    ) -> Generator[Any, Any, None]:
        what = batch[0][1] if len(batch) == 1 else f"{len(batch)} locks"
        left = yield from self._keepalive_g([entry.lease for _, _, entry in batch], "extend", what)
        checks = [(i, n, e) for (i, n, e), secs in zip(batch, left, strict=True) if secs > 0]
        if checks:
            answer = yield from self._txn_g(
                "extend", what, [], [self._still_mine(n, e) for _, n, e in checks]
            )
            for (index, _, _), response in zip(checks, answer.get("responses", []), strict=True):
                results[index] = bool(response.get("response_txn", {}).get("succeeded"))
        for index, name, entry in batch:
            if results[index] is not True:
                yield from self._forget_g(name, entry)

    def _forget_g(self, name: str, entry: _Entry) -> Generator[Any, Any, None]:
        for key, value in list(self._entries.items()):
            if value is entry:
                self._entries.pop(key, None)
        yield from self._revoke_all_g(entry)

    def _move_g(
        self, name: str, owner: str, entry: _Entry, ttl: float
    ) -> Generator[Any, Any, bool]:
        """A longer ttl than the lease's: etcd keeps a lease's length for good, so grant
        a lease of the new length and move the lock key onto it in one transaction that
        checks the key is still on the old lease; then revoke the old one. A shorter
        ttl keeps the longer lease (the local lease is what shortens; the server keeps
        the lock a little longer after a crash)."""
        lease, granted = yield from self._grant_g(ttl, "extend", name)
        lock = _b64(self.lock_key(name))
        try:
            answer = yield from self._txn_g(
                "extend",
                name,
                [
                    {"target": "LEASE", "key": lock, "result": "EQUAL", "lease": str(entry.lease)},
                    {
                        "target": "CREATE",
                        "key": lock,
                        "result": "EQUAL",
                        "create_revision": str(entry.lock_rev),
                    },
                ],
                [{"requestPut": {"key": lock, "ignore_value": True, "lease": str(lease)}}],
            )
        except LockError:
            yield from self._revoke_quietly_g(lease)
            raise
        old = entry.lease
        if not answer.get("succeeded"):
            yield from self._revoke_quietly_g(lease)
            yield from self._forget_g(name, entry)
            return False
        entry.lease, entry.lease_ttl = lease, granted
        self._entries[(name, owner)] = entry
        yield from self._revoke_quietly_g(old)
        return True

    # -- force release, counters ---------------------------------------------------

    def force_release(self, name: str, token: int | None = None) -> bool:
        self._check_pid()
        lock, fence = _b64(self.lock_key(name)), _b64(self.fence_key(name))
        for _ in range(5):
            answer = self._txn(
                "force-release",
                name,
                [],
                [{"requestRange": {"key": lock}}, {"requestRange": {"key": fence}}],
            )
            responses = answer.get("responses", [])
            held, fences = _kvs(responses[0]), _kvs(responses[1])
            if not held:
                return False  # a free name: nothing is written
            created = _int(held[0].get("create_revision"))
            if token is not None and token_of(created, fences[0] if fences else {}) != token:
                return False  # the lock changed hands: leave the new holder alone
            compare = [
                {
                    "target": "CREATE",
                    "key": lock,
                    "result": "EQUAL",
                    "create_revision": str(created),
                }
            ]
            success: list[dict[str, Any]] = [{"requestDeleteRange": {"key": lock}}]
            if fences:
                compare.append(
                    {"target": "VERSION", "key": fence, "result": "GREATER", "version": "0"}
                )
                success.append({"requestPut": {"key": fence, "ignore_value": True}})
            answer = self._txn("force-release", name, compare, success)
            if answer.get("succeeded"):
                # Its holder learns at its next renewal, which finds its lease gone.
                self._revoke_quietly(_int(held[0].get("lease")))
                return True
            if token is not None:
                return False
        return False

    def fencing_counter(self, name: str) -> int:
        self._check_pid()
        answer = self._call(
            "/v3/kv/range",
            {"key": _b64(self.fence_key(name))},
            "read the fencing counter of",
            name,
        )
        kvs = answer.get("kvs") or []
        if not kvs:
            return 0
        return token_of(_int(kvs[0].get("mod_revision")), kvs[0])
