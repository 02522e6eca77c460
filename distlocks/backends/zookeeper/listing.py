"""Listing: what inspect, the admin page and the live-locks listing show of locks and
permits (read from the server: the holder's node data, its session, the waiters)."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import ZnodeStat

from distlocks.backends.base import SEMAPHORE, WRITE, LockInfo, holder_details, permit_family
from distlocks.backends.zookeeper.nodes import _epoch_ms, _owner_of, _permit_owner, token_in
from distlocks.backends.zookeeper.permits import ZooKeeperPermits


class ZooKeeperListing(ZooKeeperPermits):
    """Inspect and list locks and permits; the contenders and session id, for tests and
    operations."""

    def _describe(self, client: KazooClient, name: str) -> LockInfo | None:
        for _ in range(5):
            children, fence = self._queue(client, "inspect", name)
            if not children or fence is None:
                return None
            try:
                raw, stat = self._get(
                    "inspect", name, client.get_async(f"{self.lock_path(name)}/{children[0]}")
                )
            except NoNodeError:
                continue  # released meanwhile: the next contender holds
            return self._info(name, children, raw, stat, fence)
        return None

    def _info(
        self, name: str, children: list[str], raw: bytes, stat: ZnodeStat, fence: ZnodeStat
    ) -> LockInfo:
        try:
            data = json.loads(raw or b"{}")
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        pid = data.get("pid")
        ttl = data.get("ttl")
        return LockInfo(
            name=name,
            backend=self.alias,
            owner=str(data.get("owner") or _owner_of(children[0])),
            fencing_token=token_in(data),
            host=str(data.get("host", "")),
            pid=pid if isinstance(pid, int) else None,
            thread=str(data.get("thread", "")),
            # When the contender queued (server clock); there is no server-side expiry.
            acquired_at=_epoch_ms(stat.ctime),
            expires_at=None,
            ttl=float(ttl) if isinstance(ttl, int | float) else None,
            waiters=len(children) - 1,
            extra={
                **holder_details(data.get("extra")),
                "session": f"0x{stat.ephemeralOwner:x}",
                "waiting": [_owner_of(child) for child in children[1:]],
            },
        )

    def inspect(self, name: str) -> LockInfo | None:
        return self._describe(self._ready("inspect", name), name)

    def _names_under(self, client: KazooClient, path: str) -> list[str]:
        """The names that have a node under ``path`` (locks, semaphores or
        read-write locks), sorted."""
        try:
            children = self._get("list", "*", client.get_children_async(path))
        except NoNodeError:
            return []
        return [urllib.parse.unquote(child[1:]) for child in sorted(children) if child[:1] == "n"]

    def iter_locks(self) -> Iterator[LockInfo]:
        """Every lock, then every semaphore permit and read-write lease."""
        client = self._ready("list", "*")
        for name in self._names_under(client, self._locks_path):
            info = self._describe(client, name)
            if info is not None:
                yield info
        yield from self.iter_permits()

    def _permit_infos(self, client: KazooClient, family: str, name: str) -> list[LockInfo]:
        seen, _fence = self._permit_state(client, "inspect", family, name)
        waiting = [_permit_owner(node.child) for node in seen if not node.holds]
        infos = []
        for node in seen:
            if not node.holds:
                continue
            data, stat, kind = node.data, node.stat, node.kind
            pid, ttl = data.get("pid"), data.get("ttl")
            extra: dict[str, Any] = {**holder_details(data.get("extra")), "kind": kind}
            if kind == SEMAPHORE:
                extra["limit"] = node.limit
            extra["session"] = f"0x{stat.ephemeralOwner:x}"
            extra["waiting"] = waiting
            infos.append(
                LockInfo(
                    name=name,
                    backend=self.alias,
                    # The owner named by the node, which release and eviction go by.
                    owner=_permit_owner(node.child),
                    fencing_token=token_in(data) if kind == WRITE else 0,
                    host=str(data.get("host", "")),
                    pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                    thread=str(data.get("thread", "")),
                    # When the request queued (server clock); nothing expires there.
                    acquired_at=_epoch_ms(stat.ctime),
                    expires_at=None,
                    ttl=float(ttl) if isinstance(ttl, int | float) else None,
                    waiters=len(waiting),
                    extra=extra,
                )
            )
        return infos

    def permit_holders(self, kind: str, name: str) -> list[LockInfo]:
        self.check_permit_kind(kind)
        return self._permit_infos(self._ready("inspect", name), permit_family(kind), name)

    def iter_permits(self) -> Iterator[LockInfo]:
        client = self._ready("list", "*")
        for family, path in self._family_paths.items():
            for name in self._names_under(client, path):
                yield from self._permit_infos(client, family, name)

    def contenders(self, name: str) -> list[str]:
        """Owners of the contender nodes of ``name`` in queue order (holder first)."""
        client = self._ready("inspect", name)
        return [_owner_of(child) for child in self._children(client, "inspect", name)]

    def session_id(self) -> int | None:
        """The id of this process's current session (None before the first call)."""
        client = self._client
        return client.client_id[0] if client is not None and client.client_id else None
