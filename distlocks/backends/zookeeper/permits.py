"""Semaphores and read-write locks, with the standard recipes::

    <prefix>/semaphores/n<quoted name>                       persistent: the directory
    <prefix>/semaphores/n<quoted name>/permit-<owner>-<seq>  ephemeral sequential
    <prefix>/rwlocks/n<quoted name>                          persistent: the write fence
    <prefix>/rwlocks/n<quoted name>/read-<owner>-<seq>       ephemeral sequential
    <prefix>/rwlocks/n<quoted name>/write-<owner>-<seq>      ephemeral sequential

Each request is one node, queued in arrival order; whether it holds is decided by the
nodes ahead of it (see :func:`.nodes._blockers`), and a waiter watches only the ones
that decide it. A write node is created in one multi-op with a write of the fence
node at the version listed: its token is the new version, shifted per name as for
locks, and stored in the node's data.
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoNodeError
from kazoo.protocol.states import ZnodeStat

from distlocks.backends.base import (
    READ,
    RWLOCK,
    SEMAPHORE,
    WRITE,
    AcquireResult,
    Holder,
    permit_family,
)
from distlocks.backends.zookeeper.lock import _ENQUEUE_ATTEMPTS, ZooKeeperLock
from distlocks.backends.zookeeper.nodes import (
    _PERMIT_NODE,
    VERSION_EXHAUSTED,
    _blockers,
    _judge,
    _Node,
    _permit_nodes,
    _permit_owner,
    _Seen,
    exhausted,
    fence_data,
    node_data,
    token_in,
    token_of,
)
from distlocks.exceptions import LockBackendUnavailable, LockError


class ZooKeeperPermits(ZooKeeperLock):
    """Permits of semaphores and read-write locks: acquire, wait, release, extend,
    eviction, the write counter."""

    permit_kinds: frozenset[str] = frozenset({SEMAPHORE, READ, WRITE})

    def permit_dir(self, kind: str, name: str) -> str:
        """The directory of the semaphore or read-write lock ``name`` (for a
        read-write lock also its write fence node)."""
        return f"{self._family_paths[permit_family(kind)]}/n{urllib.parse.quote(name, safe='')}"

    def _permit_entry(self, kind: str, name: str, owner: str) -> _Node | None:
        """This process's node for the permit, if it belongs to the live session."""
        entry = self._permits.get((kind, name, owner))
        if entry is not None and entry.generation != self._generation:
            self._permits.pop((kind, name, owner), None)
            return None
        return entry

    def _permit_queue(
        self, client: KazooClient, action: str, kind: str, name: str
    ) -> tuple[list[str], ZnodeStat | None]:
        """The permit nodes of ``name``'s family in arrival order, and the stat of
        their directory (None when it does not exist)."""
        try:
            children, stat = self._get(
                action,
                name,
                client.get_children_async(self.permit_dir(kind, name), include_data=True),
            )
        except NoNodeError:
            return [], None
        return _permit_nodes(children, permit_family(kind)), stat

    def _find_own_permit(self, children: list[str], kind: str, owner: str) -> list[str]:
        prefix = f"{_PERMIT_NODE[kind]}{urllib.parse.quote(owner, safe='')}-"
        return [c for c in children if c.startswith(prefix) and len(c) == len(prefix) + 10]

    def _own_permit_path(
        self, client: KazooClient, action: str, kind: str, name: str, owner: str
    ) -> str | None:
        entry = self._permit_entry(kind, name, owner)
        if entry is not None:
            return entry.path
        own = self._find_own_permit(self._permit_queue(client, action, kind, name)[0], kind, owner)
        return f"{self.permit_dir(kind, name)}/{own[0]}" if own else None

    def _permit_enqueue(
        self,
        client: KazooClient,
        kind: str,
        name: str,
        owner: str,
        about: dict[str, Any],
        fence: ZnodeStat | None,
    ) -> _Node | None:
        """Create the request's node; for a writer, in one multi-op with the write of
        the fence node at the version ``fence`` (as listed) has, whose new version
        makes the token the node carries. None when nothing was written: the
        directory is missing (made now), or, for a writer, the fence node changed
        since the listing (another writer queued, or an eviction): list again."""
        parent = self.permit_dir(kind, name)
        if fence is None:
            # First use of this name: create the directory, then list again.
            self._make_fence(client, "acquire", name, parent)
            return None
        node_prefix = f"{parent}/{_PERMIT_NODE[kind]}{urllib.parse.quote(owner, safe='')}-"
        generation = self._generation
        if kind == WRITE and fence.version == VERSION_EXHAUSTED:
            raise exhausted("read-write lock", name, self.alias, parent)
        base = self._fence_base(client, "acquire", name, parent, fence) if kind == WRITE else 0
        if base is None:
            return None
        token = token_of(fence.version + 1, fence, base) if kind == WRITE else 0
        data = json.dumps({**about, "token": token} if token else about, separators=(",", ":"))
        sent = time.monotonic()
        txn = client.transaction()
        txn.create(node_prefix, data.encode(), ephemeral=True, sequence=True)
        if kind == WRITE:
            txn.set_data(parent, fence_data(base), version=fence.version)
        try:
            results = self._commit("acquire", name, txn)
        except LockBackendUnavailable:
            # Maybe applied with only the reply lost: looked for before a retry,
            # deleted later if the caller gives up (see _through_outage).
            self._unknown.add((kind, name, owner))
            raise
        if not any(isinstance(r, Exception) for r in results):
            self._last_ok = max(self._last_ok, sent)
            if kind == WRITE and results[1].czxid != fence.czxid:
                # The directory was deleted and made again since the listing (by
                # hand), at the same version: the token counted from the old ctime.
                self._delete_quietly(client, results[0])
                return None
            return _Node(results[0], token, generation)
        if any(isinstance(r, NoNodeError | BadVersionError) for r in results):
            return None
        self._fail("acquire", name, next(r for r in results if isinstance(r, Exception)))

    def _permit_adopt(
        self, client: KazooClient, kind: str, name: str, owner: str, child: str
    ) -> _Node:
        """Take over this owner's node found on the server (a retried acquire)."""
        path = f"{self.permit_dir(kind, name)}/{child}"
        token = 0
        if kind == WRITE:
            try:
                raw, _stat = self._get("acquire", name, client.get_async(path))
            except NoNodeError:
                raw = None  # gone meanwhile: the caller finds it missing from the listing
            token = token_in(node_data(raw))
        entry = _Node(path, token, self._generation)
        self._permits[(kind, name, owner)] = entry
        return entry

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
        return self._through_outage(
            (kind, name, owner),
            wait,
            lambda deadline: self._permit_acquire(
                kind, name, owner, ttl, holder, limit, wait, deadline
            ),
            self._permit_leaver(kind, name, owner),
        )

    def _permit_acquire(
        self,
        kind: str,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        limit: int,
        wait: float,
        deadline: float | None,
    ) -> AcquireResult:
        client = self._ready("acquire", name, deadline)
        self._check_ttl(client, ttl)
        entry = self._permit_entry(kind, name, owner)
        children: list[str] | None = None
        for attempt in itertools.count():
            if entry is not None:
                break
            # Always listed first: the node of a create left without an answer is
            # found here by its owner's name, and taken over.
            children, fence = self._permit_queue(client, "acquire", kind, name)
            own = self._find_own_permit(children, kind, owner)
            if own:
                entry = self._permit_adopt(client, kind, name, owner, own[0])
            elif wait <= 0 and _blockers(kind, children, len(children), limit):
                # Try once with no room: refused without writing anything.
                self._unknown.discard((kind, name, owner))
                return AcquireResult(False, 0, None)
            else:
                about: dict[str, Any] = {
                    "owner": owner,
                    "host": holder.host,
                    "pid": holder.pid,
                    "thread": holder.thread,
                    "extra": dict(holder.extra),
                    "ttl": ttl,
                    "kind": kind,
                }
                if kind == SEMAPHORE:
                    about["limit"] = limit
                entry = self._permit_enqueue(client, kind, name, owner, about, fence)
                if entry is None:
                    # Nothing written: list again (each failed write of the fence node
                    # is another writer's success, so this ends).
                    if deadline is not None and time.monotonic() >= deadline:
                        self._unknown.discard((kind, name, owner))
                        return AcquireResult(False, 0, None)
                    if attempt >= _ENQUEUE_ATTEMPTS:
                        raise LockError(
                            f"Could not queue for {kind} {name!r} on backend {self.alias!r}: "
                            f"its fence node changed under {attempt} attempts in a row."
                        )
                    continue
                self._permits[(kind, name, owner)] = entry
                children = None
            self._unknown.discard((kind, name, owner))
        assert entry is not None  # the loop above ends only with a node (or returns)
        mine = entry.path.rsplit("/", 1)[1]
        if children is None or mine not in children:
            children = self._permit_queue(client, "acquire", kind, name)[0]
        if mine not in children:
            # Deleted under us (evicted, or the session changed): the next call queues
            # it again.
            self._permits.pop((kind, name, owner), None)
            return AcquireResult(False, 0, None)
        own = self._find_own_permit(children, kind, owner)
        if own[0] != mine:
            # A retried acquire found an older node of this owner: keep that one.
            self._delete_quietly(client, entry.path)
            entry = self._permit_adopt(client, kind, name, owner, own[0])
            mine = own[0]
        for extra in own[1:]:
            # A create answered late (after a retry made another): one node per owner.
            if extra != mine:
                self._delete_quietly(client, f"{self.permit_dir(kind, name)}/{extra}")
        if not _blockers(kind, children, children.index(mine), limit):
            return AcquireResult(True, entry.token, self.local_lease(ttl))
        if wait <= 0:
            self.permit_leave(kind, name, owner)
        return AcquireResult(False, 0, None)

    def _permit_leaver(self, kind: str, name: str, owner: str) -> Callable[[], None]:
        def leave() -> None:
            self._permit_delete("leave the queue of", kind, name, owner)

        return leave

    def _permit_delete(
        self, action: str, kind: str, name: str, owner: str, deadline: float | None = None
    ) -> bool:
        """Delete ``owner``'s own node of ``kind`` (never another's); True if this
        call deleted it."""
        entry = self._permits.get((kind, name, owner))
        if entry is not None and entry.generation != self._generation:
            self._permits.pop((kind, name, owner), None)
            return False  # gone with its session: nothing to ask the server
        client = self._ready(action, name, deadline)
        path = self._own_permit_path(client, action, kind, name, owner)
        self._permits.pop((kind, name, owner), None)
        if path is None:
            return False
        try:
            # Version 0: a permit node is never rewritten.
            self._get(action, name, client.delete_async(path, version=0))
        except (NoNodeError, BadVersionError):
            return False
        return True

    def permit_release(self, kind: str, name: str, owner: str) -> bool:
        self.check_permit_kind(kind)
        try:
            return self._permit_delete("release", kind, name, owner)
        except LockBackendUnavailable:
            self._cleanup_later(name, owner, self._permit_leaver(kind, name, owner), kind)
            raise

    def permit_leave(self, kind: str, name: str, owner: str) -> None:
        """A waiter that gives up deletes its node (the ones behind it watch it)."""
        try:
            self._permit_delete("leave the queue of", kind, name, owner, time.monotonic())
        except LockBackendUnavailable:
            self._cleanup_later(name, owner, self._permit_leaver(kind, name, owner), kind)
            raise

    def permit_extend(self, kind: str, name: str, owner: str, ttl: float) -> bool:
        """Confirm the permit, as :meth:`extend` does a lock (nothing is written)."""
        self.check_permit_kind(kind)
        return self._confirm(
            (kind, name, owner),
            self._permits.get((kind, name, owner)),
            lambda client: self._own_permit_path(client, "extend", kind, name, owner),
            lambda: self._permits.pop((kind, name, owner), None),
            self._permit_leaver(kind, name, owner),
        )

    def permit_wait(
        self, kind: str, name: str, timeout: float, *, owner: str = "", limit: int = 1
    ) -> None:
        """Block until a node that keeps ``owner``'s request from holding goes (see
        :func:`_blockers`), or ``timeout``: watches, no polling."""
        self.check_permit_kind(kind)
        try:
            self._permit_wait(kind, name, timeout, owner, limit)
        except LockBackendUnavailable:
            self._outage_pause(timeout)

    def _permit_wait(self, kind: str, name: str, timeout: float, owner: str, limit: int) -> None:
        client = self._ready("wait for", name)
        entry = self._permit_entry(kind, name, owner) if owner else None
        if entry is None:
            return  # no node of its own (gone with its session): the next call queues
        wake = entry.wake
        # Cleared before looking: a watch that fires from here on is not missed.
        wake.clear()
        with self._state_lock:
            self._waiting.add(wake)
        try:
            if entry.generation != self._generation:
                return  # the session went meanwhile
            children = self._permit_queue(client, "wait for", kind, name)[0]
            mine = entry.path.rsplit("/", 1)[1]
            if mine not in children:
                return
            watched = _blockers(kind, children, children.index(mine), limit)
            if not watched:
                return
            parent = self.permit_dir(kind, name)
            # Sent together, answered together: one round trip for all the watches.
            pending = [
                client.exists_async(f"{parent}/{child}", watch=entry.watch) for child in watched
            ]
            stats = [self._get("wait for", name, result) for result in pending]
            if all(stat is not None for stat in stats):
                wake.wait(max(0.0, timeout))
        finally:
            with self._state_lock:
                self._waiting.discard(wake)

    def _permit_state(
        self, client: KazooClient, action: str, kind: str, name: str
    ) -> tuple[list[_Seen], ZnodeStat | None]:
        """The permit nodes of ``name``'s family with their data, each marked holding
        or waiting, and the directory's stat."""
        children, fence = self._permit_queue(client, action, kind, name)
        parent = self.permit_dir(kind, name)
        pending = [(child, client.get_async(f"{parent}/{child}")) for child in children]
        seen = []
        for child, result in pending:
            try:
                raw, stat = self._get(action, name, result)
            except NoNodeError:
                continue  # gone meanwhile: judged without it
            try:
                data = json.loads(raw or b"{}")
            except ValueError:
                data = {}
            seen.append(_Seen(child, data if isinstance(data, dict) else {}, stat))
        _judge(seen)
        return seen, fence

    def permit_force_release(self, kind: str, name: str, owner: str | None = None) -> int:
        """Delete the node of ``owner``'s permit (of every permit held when None), in
        one multi-op that, for a read-write lock, also writes the fence node: the
        write counter moves past an evicted writer (and moves when no permit matches,
        too). Waiting requests are left alone; nothing else is written when no permit
        matches."""
        self.check_permit_kind(kind)
        client = self._ready("force-release", name)
        parent = self.permit_dir(kind, name)
        for _ in range(5):
            seen, fence = self._permit_state(client, "force-release", kind, name)
            targets = [
                node
                for node in seen
                if node.holds and (owner is None or _permit_owner(node.child) == owner)
            ]
            if fence is None:
                return 0
            # At the last version a write would make version 0 and lower the counter:
            # the nodes are deleted alone (no writer can queue any more).
            fenced = permit_family(kind) == RWLOCK and fence.version != VERSION_EXHAUSTED
            base = 0
            if fenced:
                found = self._fence_base(client, "force-release", name, parent, fence)
                if found is None:
                    continue  # changed, or just taken over from a release before
                base = found
            if not targets:
                if fenced:
                    # Outdate every write token issued so far all the same (as the
                    # other backends do): a writer that lost its node unseen may still
                    # believe it holds.
                    self._get("force-release", name, client.set_async(parent, fence_data(base)))
                return 0
            txn = client.transaction()
            for node in targets:
                txn.delete(f"{parent}/{node.child}", version=node.stat.version)
            if fenced:
                txn.set_data(parent, fence_data(base))
            results = self._commit("force-release", name, txn)
            if not any(isinstance(r, Exception) for r in results):
                return len(targets)
            # One of them went meanwhile: look again.
        return 0

    def permit_counter(self, name: str) -> int:
        self.check_permit_kind(WRITE)
        client = self._ready("read the write counter of", name)
        return self._counter(
            client, "read the write counter of", name, self.permit_dir(WRITE, name)
        )
