"""The lock recipe: one contender node a caller, the lowest holds, each waiter watching
only the one just before it.

* acquire lists the contenders, then is one multi-op: create this caller's contender
  node and write the fence node at the version listed; the new version makes the
  token (:func:`token_of`), stored in the contender's data. A write raced by another
  contender's fails as a whole, and the caller lists again. A try-once call on a busy
  lock is refused without writing anything.
* a create left without an answer is looked for by the next attempt (the node's name
  carries the owner) and taken over; one node per owner is kept.
* a waiter watches the node just ahead of it as its acquire listed it (no listing of
  its own); when that node was the holder's, its deletion is the grant (no request),
  and otherwise the watch's callback sends the next listing (:meth:`wait_and_acquire`).
* release deletes the caller's own node (version 0: never another's); a waiter that
  gives up deletes its node too.
* extend confirms the node still exists in the live session (nothing is written).
* force release is one multi-op deleting the holder's node (only if its token is the
  one given) and writing the fence node, so the counter moves past the victim.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
import urllib.parse
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError
from kazoo.protocol.states import EventType, WatchedEvent, ZnodeStat

from distlocks.backends.base import AcquireResult, Holder
from distlocks.backends.zookeeper.nodes import (
    _CONTENDER,
    _LOCK,
    VERSION_EXHAUSTED,
    _contenders,
    _Node,
    base_in_stat,
    exhausted,
    fence_base,
    fence_counter,
    fence_data,
    legacy_base,
    node_data,
    token_in,
    token_of,
)
from distlocks.backends.zookeeper.outages import ZooKeeperOutages
from distlocks.exceptions import LockBackendUnavailable, LockError

#: Fence node bases kept per process before the cache is emptied (one get each to
#: read again): enough for the names in use, bounded for per-call names.
_BASES_KEPT = 4096

#: Multi-ops raced by other contenders' in a row before an acquire gives up (each
#: failure is another contender's success, so this is never met in practice).
_ENQUEUE_ATTEMPTS = 1000


class ZooKeeperLock(ZooKeeperOutages):
    """The lock recipe: acquire, wait, release, extend, force release, the counter."""

    def lock_path(self, name: str) -> str:
        """The fence node of ``name`` (its children are the contenders)."""
        return f"{self._locks_path}/n{urllib.parse.quote(name, safe='')}"

    def _make_fence(self, client: KazooClient, action: str, name: str, path: str) -> None:
        """Create the fence node ``path`` (first use of a name). Made empty, at version
        0: base 0 (:func:`base_in_stat`)."""
        with contextlib.suppress(NodeExistsError):
            self._get(action, name, client.ensure_path_async(path))

    def _keep_base(self, path: str, fence: ZnodeStat, base: int) -> None:
        if len(self._bases) >= _BASES_KEPT:
            self._bases.clear()
        self._bases[(path, int(fence.czxid), int(fence.ctime))] = base

    def _fence_base(
        self, client: KazooClient, action: str, name: str, path: str, fence: ZnodeStat
    ) -> int | None:
        """The base of the fence node ``path`` as listed (stat ``fence``): from the
        stat alone for nearly every node (:func:`base_in_stat`), else read once per
        process. None when the caller must list again: the node changed since, or it
        was just taken over from a release before, whose node has no base (a write, so
        the listed version is past). Taking over is one write at the version listed: a
        grant in between fails it."""
        base = base_in_stat(fence)
        if base is not None:
            return base
        stat = fence
        if fence.dataLength > 0:
            base = self._bases.get((path, int(fence.czxid), int(fence.ctime)))
            if base is not None:
                return base
            try:
                raw, stat = self._get(action, name, client.get_async(path))
            except NoNodeError:
                return None
            if stat.czxid != fence.czxid:
                return None
            base = fence_base(raw, stat)
            if base is not None:
                self._keep_base(path, stat, base)
                return base
        if stat.version == VERSION_EXHAUSTED:
            return None  # no write can be conditional here: the caller lists, and stops
        # Written with no base (by a client of a release before), or with data that is
        # none (by hand): taken over now, whatever this process saw before; the base,
        # from a later mzxid, is above every token issued. Raced (a grant, an eviction,
        # another taker-over): listed again all the same.
        with contextlib.suppress(BadVersionError, NoNodeError):
            self._get(
                action,
                name,
                client.set_async(path, fence_data(legacy_base(stat)), version=stat.version),
            )
        return None

    def _counter(self, client: KazooClient, action: str, name: str, path: str) -> int:
        """The token of the last write of the fence node ``path`` (0 if none): its
        stat, and its data only for a base the stat does not tell."""
        stat = self._get(action, name, client.exists_async(path))
        if stat is None:
            return 0
        raw = None
        if base_in_stat(stat) is None and stat.dataLength > 0:
            try:
                raw, stat = self._get(action, name, client.get_async(path))
            except NoNodeError:
                return 0
        return fence_counter(raw, stat)

    def _children(self, client: KazooClient, action: str, name: str) -> list[str]:
        return self._queue(client, action, name)[0]

    def _queue(
        self, client: KazooClient, action: str, name: str
    ) -> tuple[list[str], ZnodeStat | None]:
        """The contenders of ``name`` in queue order, and its fence node's stat."""
        try:
            children, stat = self._get(
                action, name, client.get_children_async(self.lock_path(name), include_data=True)
            )
        except NoNodeError:
            return [], None
        return _contenders(children), stat

    def _find_own(self, children: list[str], owner: str) -> list[str]:
        prefix = f"{_CONTENDER}{urllib.parse.quote(owner, safe='')}-"
        return [c for c in children if c.startswith(prefix) and len(c) == len(prefix) + 10]

    def _entry(self, name: str, owner: str) -> _Node | None:
        """This process's node for (name, owner), if it belongs to the live session."""
        entry = self._nodes.get((name, owner))
        if entry is not None and entry.generation != self._generation:
            self._nodes.pop((name, owner), None)
            return None
        return entry

    def _enqueue(
        self, client: KazooClient, name: str, owner: str, about: dict[str, Any], fence: ZnodeStat
    ) -> _Node | None:
        """One multi-op: create the contender node and write the fence node, at the
        version ``fence`` (as listed) has. Every contender is created in a multi-op
        that writes the fence node, so an unchanged version means none was created
        since the listing; and the write makes version + 1, whose token the node
        carries in its data. A changed version (or a fence node made anew) fails the
        whole multi-op, writing nothing: None, list again."""
        parent = self.lock_path(name)
        node_prefix = f"{parent}/{_CONTENDER}{urllib.parse.quote(owner, safe='')}-"
        generation = self._generation
        if fence.version == VERSION_EXHAUSTED:
            raise exhausted("lock", name, self.alias, parent)
        base = self._fence_base(client, "acquire", name, parent, fence)
        if base is None:
            return None
        token = token_of(fence.version + 1, fence, base)
        data = json.dumps({**about, "token": token}, separators=(",", ":")).encode()
        sent = time.monotonic()
        txn = client.transaction()
        txn.create(node_prefix, data, ephemeral=True, sequence=True)
        txn.set_data(parent, fence_data(base), version=fence.version)
        try:
            results = self._commit("acquire", name, txn)
        except LockBackendUnavailable:
            # The transaction may have been applied with only the reply lost: a
            # retry looks for the node first, and a caller who gives up has it
            # deleted once the connection returns (see _through_outage).
            self._unknown.add((_LOCK, name, owner))
            raise
        created, written = results
        if isinstance(created, str) and isinstance(written, ZnodeStat):
            self._last_ok = max(self._last_ok, sent)
            if written.czxid != fence.czxid:
                # The fence node was deleted and made again since the listing (by
                # hand), at the same version: the token counted from the old node.
                self._delete_quietly(client, created)
                return None
            return _Node(created, token, generation)
        if isinstance(written, BadVersionError | NoNodeError) or isinstance(created, NoNodeError):
            return None
        error = next(r for r in results if isinstance(r, Exception))
        self._fail("acquire", name, error)

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
        return self._through_outage(
            (_LOCK, name, owner),
            wait,
            lambda deadline: self._acquire(name, owner, ttl, holder, wait, deadline),
            lambda: self._leave(name, owner),
        )

    def _acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        wait: float,
        deadline: float | None,
        listed: list[str] | None = None,
    ) -> AcquireResult:
        """One attempt; ``listed``: the contenders as listed for this caller's node
        when its watch fired (see :meth:`wait_and_acquire`), so as not to list again."""
        client = self._ready("acquire", name, deadline)
        self._check_ttl(client, ttl)
        entry = self._entry(name, owner)
        children = listed if entry is not None else None
        if entry is None:
            about = {
                "owner": owner,
                "host": holder.host,
                "pid": holder.pid,
                "thread": holder.thread,
                "extra": dict(holder.extra),
                "ttl": ttl,
            }
            for attempt in itertools.count():
                # Listed first: a busy lock is refused to a try-once caller without
                # writing anything, the node of a create left without an answer is
                # found by its owner's name (and taken over), and the fence node's
                # version is the one the multi-op writes at.
                children, fence = self._queue(client, "acquire", name)
                own = self._find_own(children, owner)
                if own:
                    entry = self._adopt(client, name, owner, own[0])
                    break
                if wait <= 0 and children:
                    self._unknown.discard((_LOCK, name, owner))
                    return AcquireResult(False, 0, None)
                if fence is None:
                    # First use of this name: create the fence node, then list again.
                    self._make_fence(client, "acquire", name, self.lock_path(name))
                    continue
                queued = self._enqueue(client, name, owner, about, fence)
                if queued is not None:
                    entry = queued
                    self._nodes[(name, owner)] = entry
                    # Nobody queued since the listing (the version was unchanged): the
                    # listed contenders, less any gone since, then this one.
                    children = [*children, entry.path.rsplit("/", 1)[1]]
                    break
                # Someone queued (or evicted) since the listing: nothing was written.
                if wait <= 0 or (deadline is not None and time.monotonic() >= deadline):
                    self._unknown.discard((_LOCK, name, owner))
                    return AcquireResult(False, 0, None)
                if attempt >= _ENQUEUE_ATTEMPTS:
                    raise LockError(
                        f"Could not queue for lock {name!r} on backend {self.alias!r}: the "
                        f"name's fence node changed under {attempt} attempts in a row."
                    )
            self._unknown.discard((_LOCK, name, owner))
        assert entry is not None  # the loop above ends only with a node (or returns)
        if children is None or entry.path.rsplit("/", 1)[1] not in children:
            children = self._children(client, "acquire", name)
        mine = entry.path.rsplit("/", 1)[1]
        if mine not in children:
            # Deleted under us (forced out while queued, or the session changed).
            self._nodes.pop((name, owner), None)
            return AcquireResult(False, 0, None)
        own = self._find_own(children, owner)
        if own[0] != mine:
            # A retried acquire found an older node of this owner: keep that one.
            self._delete_quietly(client, entry.path)
            entry = self._adopt(client, name, owner, own[0])
            mine = own[0]
        for extra in own[1:]:
            # A create answered late (after a retry made another): one node per owner.
            if extra != mine:
                self._delete_quietly(client, f"{self.lock_path(name)}/{extra}")
        if children[0] == mine:
            return AcquireResult(True, entry.token, self.local_lease(ttl))
        if wait <= 0:
            self.leave_queue(name, owner)
        else:
            # What to watch while waiting: no second listing for the wait.
            index = children.index(mine)
            entry.ahead, entry.ahead_holds = children[index - 1], index == 1
        return AcquireResult(False, 0, None)

    def _adopt(self, client: KazooClient, name: str, owner: str, child: str) -> _Node:
        """Take over this owner's node found on the server (a retried acquire)."""
        path = f"{self.lock_path(name)}/{child}"
        try:
            raw, _stat = self._get("acquire", name, client.get_async(path))
        except NoNodeError:
            raw = None  # gone meanwhile: the caller finds it missing from the listing
        entry = _Node(path, token_in(node_data(raw)), self._generation)
        self._nodes[(name, owner)] = entry
        return entry

    def _own_path(self, client: KazooClient, action: str, name: str, owner: str) -> str | None:
        entry = self._entry(name, owner)
        if entry is not None:
            return entry.path
        own = self._find_own(self._children(client, action, name), owner)
        return f"{self.lock_path(name)}/{own[0]}" if own else None

    def release(self, name: str, owner: str) -> bool:
        try:
            return self._release(name, owner)
        except LockBackendUnavailable:
            self._cleanup_later(name, owner)
            raise

    def _release(self, name: str, owner: str) -> bool:
        entry = self._nodes.get((name, owner))
        if entry is not None and entry.generation != self._generation:
            # Its session expired, taking the node with it: nothing to ask the server
            # (which may be unreachable now).
            self._nodes.pop((name, owner), None)
            return False
        client = self._ready("release", name)
        path = self._own_path(client, "release", name, owner)
        self._nodes.pop((name, owner), None)
        if path is None:
            return False
        try:
            # Version 0: the contender node is never rewritten, so anything else is
            # not the node this owner created.
            self._get("release", name, client.delete_async(path, version=0))
        except (NoNodeError, BadVersionError):
            return False
        return True

    def leave_queue(self, name: str, owner: str) -> None:
        """A waiter that gives up deletes its node. Not connected now (the acquire
        that gave up has just met the outage): no second wait for the connection; the
        node is deleted in the background once the ensemble answers (and the outage
        raised, for the caller to log)."""
        try:
            self._leave(name, owner, time.monotonic())
        except LockBackendUnavailable:
            self._cleanup_later(name, owner)
            raise

    def _leave(self, name: str, owner: str, deadline: float | None = None) -> None:
        client = self._ready("leave the queue of", name, deadline)
        path = self._own_path(client, "leave the queue of", name, owner)
        self._nodes.pop((name, owner), None)
        if path is not None:
            with contextlib.suppress(NoNodeError, BadVersionError):
                self._get("leave the queue of", name, client.delete_async(path, version=0))

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        """Confirm the lease: its node still exists in the live session. Nothing is
        written (the server keeps the node for as long as the session lives)."""
        return self._confirm(
            (_LOCK, name, owner),
            self._nodes.get((name, owner)),
            lambda client: self._own_path(client, "extend", name, owner),
            lambda: self._nodes.pop((name, owner), None),
            lambda: self._leave(name, owner),
        )

    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        """Block until the contender just before ``owner``'s node goes (or the holder,
        for a caller with no node), or ``timeout``: a watch, no polling."""
        try:
            self._wait(name, timeout, owner)
        except LockBackendUnavailable:
            self._outage_pause(timeout)

    def _wait(self, name: str, timeout: float, owner: str) -> None:
        client = self._ready("wait for", name)
        entry = self._entry(name, owner) if owner else None
        if entry is not None and entry.ahead is not None:
            # The node just ahead at this caller's last listing (its acquire's): if it
            # went since, the watch finds it gone and the next acquire lists again.
            watched, entry.ahead = entry.ahead, None
        else:
            children = self._children(client, "wait for", name)
            if not children:
                return
            if entry is None:
                watched = children[0]
            else:
                mine = entry.path.rsplit("/", 1)[1]
                if mine not in children or children[0] == mine:
                    return
                watched = children[children.index(mine) - 1]
        event = threading.Event()
        with self._state_lock:
            self._waiting.add(event)
        try:
            stat = self._get(
                "wait for",
                name,
                client.exists_async(
                    f"{self.lock_path(name)}/{watched}", watch=lambda _: event.set()
                ),
            )
            if stat is not None:
                event.wait(max(0.0, timeout))
        finally:
            with self._state_lock:
                self._waiting.discard(event)

    def wait_and_acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        seconds: float,
        *,
        wait: float,
        fair: bool,
    ) -> AcquireResult | None:
        """:meth:`wait` then :meth:`acquire` for a caller queued behind another node,
        with no listing of its own for the wait and, at the hand-off, none or one
        sent ahead of the waiting thread:

        * it watches the node just ahead of it as its acquire listed it (one
          ``exists``, the only request of the wait);
        * when that node was the holder's then and its deletion is told in the live
          session, this caller holds: sequence numbers only grow, so no node can have
          queued ahead of it since that listing, and the session that told it is the
          one its own node lives in. kazoo tells every watch an event with no type at
          any connection loss and never sets them again (tests/test_reviewzk_handoff.py
          checks it), so the deletion was told on the connection the watch was set on,
          in zxid order with the watch on this caller's own node. No request: the
          lease is granted as the watch fires;
        * when it was a waiter's (which got the lock and released it, or gave up), the
          watch's callback lists the contenders on kazoo's event thread at once, and
          the waiting thread takes that listing as its acquire's.

        Anything else (a timeout, another event, an outage, a lost session) ends in a
        plain :meth:`acquire`, which lists. None (the caller waits and acquires itself)
        when this caller has no node queued, or no listing said what to watch."""
        entry = self._entry(name, owner)
        if entry is None or entry.ahead is None:
            return None
        watched, entry.ahead = entry.ahead, None
        turn = _Turn(self, name, entry.ahead_holds)
        with self._state_lock:
            self._waiting.add(turn.wake)
        try:
            client = self._ready("wait for", name)
            turn.client = client
            ahead = client.exists_async(f"{self.lock_path(name)}/{watched}", watch=turn.watch)
            # Where the watch may grant the lock, a watch on this caller's own node too,
            # sent without waiting for the first's answer: were the node deleted by
            # anyone (by hand), its watch would fire before the one of any later
            # deletion (a session is told in zxid order), and nothing is granted.
            own = client.exists_async(entry.path, watch=turn.watch_own) if turn.was_first else None
            stat = self._get("wait for", name, ahead)
            if own is not None and self._get("wait for", name, own) is None:
                turn.own_gone = True
            if stat is None:
                # Gone already. If it was the holder's, this caller's node was found
                # there after it (answered in that order): nothing is ahead of it now.
                turn.holds = turn.was_first and not turn.own_gone
            elif not turn.own_gone:
                turn.wake.wait(max(0.0, seconds))
        except LockBackendUnavailable:
            self._outage_pause(seconds)
        finally:
            turn.active = False
            with self._state_lock:
                self._waiting.discard(turn.wake)
        if turn.generation == self._generation and self._entry(name, owner) is entry:
            if turn.holds and not turn.own_gone:
                return AcquireResult(True, entry.token, self.local_lease(ttl))
            listed = turn.listed()
        else:
            listed = None
        return self._through_outage(
            (_LOCK, name, owner),
            wait,
            lambda deadline: self._acquire(name, owner, ttl, holder, wait, deadline, listed),
            lambda: self._leave(name, owner),
        )

    def force_release(self, name: str, token: int | None = None) -> bool:
        client = self._ready("force-release", name)
        parent = self.lock_path(name)
        for _ in range(5):
            children, fence = self._queue(client, "force-release", name)
            if not children or fence is None:
                return False  # a free name: nothing is written
            path = f"{parent}/{children[0]}"
            try:
                raw, stat = self._get("force-release", name, client.get_async(path))
            except NoNodeError:
                continue  # released meanwhile: look again
            if token is not None and token_in(node_data(raw)) != token:
                return False  # the lock changed hands: leave the new holder alone
            txn = client.transaction()
            txn.delete(path, version=stat.version)
            if fence.version != VERSION_EXHAUSTED:
                # (At the last version, writing would make version 0 and lower the
                # counter: the victim is deleted alone. No grant can follow but a
                # waiter's, queued with a token above the victim's already.)
                base = self._fence_base(client, "force-release", name, parent, fence)
                if base is None:
                    continue  # the fence node changed, or was just taken over: look again
                txn.set_data(parent, fence_data(base))
            results = self._commit("force-release", name, txn)
            if not any(isinstance(r, Exception) for r in results):
                return True
            if token is not None:
                return False  # the holder went meanwhile: not this call's eviction
        return False

    def fencing_counter(self, name: str) -> int:
        client = self._ready("read the fencing counter of", name)
        return self._counter(client, "read the fencing counter of", name, self.lock_path(name))


class _Turn:
    """One wait of a queued lock contender for the node just ahead of it to go (see
    :meth:`ZooKeeperLock.wait_and_acquire`). :meth:`watch` runs on kazoo's event thread."""

    __slots__ = ("active", "backend", "client", "generation", "holds", "listing", "name",
                 "own_gone", "wake", "was_first")  # fmt: skip

    def __init__(self, backend: ZooKeeperLock, name: str, was_first: bool) -> None:
        self.backend = backend
        self.name = name
        #: The watched node was the holder's when this caller listed the contenders.
        self.was_first = was_first
        self.generation = backend._generation
        self.client: KazooClient | None = None
        self.wake = threading.Event()
        #: Still waited for: a watch firing after the wait ended lists nothing.
        self.active = True
        #: The node ahead went, told in the session this caller's node lives in.
        self.holds = False
        #: This caller's own node was deleted (by hand: nothing in distlocks deletes a
        #: waiter's node but the waiter), or found gone.
        self.own_gone = False
        self.listing: Any = None

    def watch(self, event: WatchedEvent) -> None:
        gone = event.type == EventType.DELETED and self.generation == self.backend._generation
        if gone and self.was_first:
            self.holds = not self.own_gone
        elif gone and self.active and self.client is not None:
            # Sent now, from the event thread: the listing is on its way while the
            # waiting thread wakes up.
            self.listing = self.client.get_children_async(
                self.backend.lock_path(self.name), include_data=True
            )
        self.wake.set()

    def watch_own(self, event: WatchedEvent) -> None:
        if event.type == EventType.DELETED:
            self.own_gone = True
            self.wake.set()  # its acquire lists, finds the node gone, and queues again

    def listed(self) -> list[str] | None:
        """The contenders as listed when the watch fired, queue order; None if not sent
        or if it failed (the acquire that follows lists, and meets the error itself)."""
        if self.listing is None:
            return None
        try:
            children, _ = self.listing.get(timeout=self.backend.socket_timeout)
        except Exception:
            return None
        return _contenders(children)
