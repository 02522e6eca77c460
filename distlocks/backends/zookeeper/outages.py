"""Outages: what an acquire does while the ensemble cannot be reached (tries again
within the caller's deadline), and the nodes left behind by a request without an
answer, deleted in the background once the ensemble answers again. A contender node
lives as long as the session, which outlives short outages: nobody else would delete
it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from distlocks.backends.base import AcquireResult
from distlocks.backends.zookeeper.nodes import _LOCK, _Node
from distlocks.backends.zookeeper.session import ZooKeeperSession, logger
from distlocks.exceptions import LockBackendUnavailable, LockError

if TYPE_CHECKING:
    from kazoo.client import KazooClient

#: Pause before trying again a call that found the ensemble unavailable (doubling).
_RETRY_FIRST, _RETRY_MAX = 0.05, 1.0
#: How long an acquire with no deadline (``timeout=None``) waits out an unavailable
#: ensemble, at least; it waits three session timeouts if that is longer. A caller
#: with a timeout waits it out until its own deadline.
_OUTAGE_WAIT = 30.0


class ZooKeeperOutages(ZooKeeperSession):
    """Acquires through an outage, and the background deletes of nodes left behind."""

    if TYPE_CHECKING:
        # The lock recipe's (:mod:`.lock`): the default way to delete a lock's node.
        def _leave(self, name: str, owner: str, deadline: float | None = None) -> None: ...

    def _cleanup_later(
        self,
        name: str,
        owner: str,
        leave: Callable[[], None] | None = None,
        kind: str = _LOCK,
    ) -> None:
        """Delete ``owner``'s node once the ensemble answers again (``leave`` does it;
        by default, the lock's). A contender node lives as long as the session, and
        the session outlives short outages: a node that a failed release or leave left
        behind, or the node of a lease declared lost while the session may still be
        alive, would block the lock (or hold a permit) for good."""
        generation = self._generation
        key = (kind, name, owner)
        with self._state_lock:
            if key in self._cleaning:
                return  # a thread is already at it
            self._cleaning.add(key)
        if leave is None:

            def leave() -> None:
                self._leave(name, owner)

        def clean() -> None:
            delay = _RETRY_FIRST
            try:
                # Until it is gone, or the session is (taking the node with it).
                while not self._closed and self._generation == generation:
                    try:
                        leave()
                        return
                    except LockError:
                        time.sleep(delay)
                        delay = min(delay * 2, _RETRY_MAX)
            finally:
                with self._state_lock:
                    self._cleaning.discard(key)

        threading.Thread(target=clean, name="distlocks-zk-cleanup", daemon=True).start()

    def _give_up(self, key: tuple[str, str, str], leave: Callable[[], None]) -> None:
        """An acquire that failed on an unavailable ensemble: a node it may have made
        (a create without an answer, or one made before a later request failed) is
        deleted once the ensemble answers (the caller may never leave the queue: a
        try-once call has no queue to leave)."""
        kind, name, owner = key
        made = (name, owner) in self._nodes if kind == _LOCK else key in self._permits
        if key in self._unknown or made:
            self._unknown.discard(key)
            self._cleanup_later(name, owner, leave, kind)

    def _through_outage(
        self,
        key: tuple[str, str, str],
        wait: float,
        attempt: Callable[[float | None], AcquireResult],
        leave: Callable[[], None],
    ) -> AcquireResult:
        """Run ``attempt`` (given its deadline); while the ensemble is unavailable (a
        leader election, a short outage), run it again until the caller's deadline, at
        most ``_OUTAGE_WAIT`` or three session timeouts when it has none. A try-once
        call (``wait`` 0) tries once. A create left without an answer is looked for by
        the next attempt (the node's name carries the owner); a caller who gives up
        has it deleted once the ensemble answers again."""
        if wait <= 0:
            try:
                return attempt(None)
            except LockBackendUnavailable:
                self._give_up(key, leave)
                raise
        started = time.monotonic()
        deadline = started + min(wait, max(_OUTAGE_WAIT, 3 * self.session_seconds))
        delay = _RETRY_FIRST
        while True:
            try:
                return attempt(deadline)
            except LockBackendUnavailable as exc:
                if time.monotonic() + delay >= deadline:
                    self._give_up(key, leave)
                    raise
                logger.info(
                    "ZooKeeper unavailable to %s %r on backend %r; trying again within "
                    "the caller's timeout: %s",
                    "acquire" if key[0] == _LOCK else f"a {key[0]} permit of", key[1],
                    self.alias, exc,
                )  # fmt: skip
            time.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX)

    def _confirm(
        self,
        key: tuple[str, str, str],
        entry: _Node | None,
        find: Callable[[KazooClient], str | None],
        forget: Callable[[], object],
        leave: Callable[[], None],
    ) -> bool:
        """Whether the node of a lease or permit (``entry``, else the path ``find``
        gives) still exists in the live session; ``forget`` drops the entry when not.

        A lease is declared lost when the session may have expired; but the session
        may also have survived (the connection comes back in time), keeping the node,
        which nobody else would delete: then ``leave`` deletes it in the background,
        once the ensemble answers, unless the session turns out to have expired."""
        kind, name, owner = key
        if entry is not None and entry.generation != self._generation:
            forget()
            return False  # the session that held it is gone
        if self._session_doubtful():
            self._cleanup_later(name, owner, leave, kind)
            return False
        try:
            client = self._ready("extend", name)
        except LockBackendUnavailable:
            if self._session_doubtful():
                self._cleanup_later(name, owner, leave, kind)
                return False
            raise
        if entry is not None and entry.generation != self._generation:
            return False  # lost while reconnecting
        path = entry.path if entry is not None else find(client)
        if path is None:
            return False
        sent = time.monotonic()
        stat = self._get("extend", name, client.exists_async(path))
        if stat is None:
            forget()
            return False
        self._last_ok = max(self._last_ok, sent)
        return True
