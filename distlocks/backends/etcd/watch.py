"""Watches as protocol generators: open a stream through the first member that serves
it, then wait for the deletion of one key (a waiter's), or follow every deletion under
the backend's keys for an event loop's :class:`~.hub._Hub`.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Generator
from typing import Any

from distlocks.backends.etcd.gateway import EtcdGateway
from distlocks.backends.etcd.hub import _Hub
from distlocks.backends.etcd.protocol import (
    _ENDED,
    _SEEN,
    _b64,
    _int,
    _NextLine,
    _OpenWatch,
    _prefix_end,
    _unavailable_answer,
    _watch_result,
)
from distlocks.exceptions import LockBackendUnavailable


class EtcdWatches(EtcdGateway):
    """Watch streams, above the gateway's requests."""

    def _watch_delete(self, key: str, start_revision: int, until: float, name: str) -> bool:
        """True when ``key`` is deleted at ``start_revision`` or later, before ``until``
        (monotonic), or the stream ended (look again); False at ``until``. A connection
        of its own, closed after."""
        return bool(self._sync(self._watch_delete_g(key, start_revision, until, name)))

    def _open_watch_g(self, payload: bytes, name: str) -> Generator[Any, Any, None]:
        """Open a watch stream through the first member that serves it (the driver keeps
        it for the _NextLine steps that follow); LockBackendUnavailable when none does,
        marked ``election`` when one answered that it cannot serve now."""
        last: BaseException | None = None
        answered = False
        count = len(self.endpoints)
        for offset in range(count):
            index = (self._preferred + offset) % count
            reply = yield _OpenWatch("/v3/watch", payload, self._headers(), index)
            if reply.error is not None:
                last = reply.error
                continue
            if reply.status != 200:
                refused = _unavailable_answer(reply.status, reply.data)
                if refused is None:
                    self._raise_answer(reply.status, reply.data, "wait for", name, "", None)
                last, answered = refused, True  # this member cannot serve now: the next
                continue
            return
        assert last is not None
        error = self._unavailable("wait for", name, last)
        error.election = answered  # type: ignore[attr-defined]
        raise error from last

    def _watch_all_g(self, start_revision: int, hub: _Hub) -> Generator[Any, Any, str | int]:
        """The hub's stream: every deletion under the lock and waiter keys from
        ``start_revision`` on, handed to ``hub.deliver``, until the stream ends
        (:data:`_ENDED`) or the history was compacted (the revision it starts at now)."""
        first = f"{self.prefix}/lock/"
        payload = json.dumps(
            {
                "create_request": {
                    "key": _b64(first),
                    "range_end": _prefix_end(f"{self.prefix}/wait/"),
                    "start_revision": str(start_revision),
                    "filters": ["NOPUT"],
                }
            }
        ).encode()
        yield from self._open_watch_g(payload, "*")
        while True:
            line, error = yield _NextLine(3600.0)
            if error is not None:
                if isinstance(error, ConnectionError | http.client.IncompleteRead):
                    return _ENDED
                raise self._unavailable("wait for", "*", error) from error
            if line is None:
                continue  # quiet for an hour: keep listening
            if not line:
                return _ENDED
            try:
                result = _watch_result(line)
            except ValueError as exc:
                raise self._unavailable("wait for", "*", exc) from exc
            compacted = _int(result.get("compact_revision"))
            if compacted:
                return compacted
            if result.get("canceled"):
                return _ENDED  # the member dropped it (lost its leader): open it again
            events = result.get("events")
            if isinstance(events, list) and events:
                hub.deliver(events)

    def _watch_delete_g(
        self, key: str, start_revision: int, until: float, name: str
    ) -> Generator[Any, Any, str | bool]:
        """:data:`_SEEN` (a deletion of ``key`` at ``start_revision`` or later, or a
        compaction past it), :data:`_ENDED` (the stream ended without one: look again),
        False at ``until``."""
        payload = json.dumps(
            {
                "create_request": {
                    "key": _b64(key),
                    "start_revision": str(start_revision),
                    "filters": ["NOPUT"],
                }
            }
        ).encode()
        try:
            yield from self._open_watch_g(payload, name)
        except LockBackendUnavailable as exc:
            if getattr(exc, "election", False):
                return _ENDED  # no member has a leader now: look again, after a pause
            raise
        while True:
            left = until - time.monotonic()
            if left <= 0:
                return False
            line, error = yield _NextLine(left)
            if error is not None:
                if isinstance(error, ConnectionError | http.client.IncompleteRead):
                    # The member went away mid-stream (killed: a reset): look again,
                    # through a member that answers.
                    return _ENDED
                raise self._unavailable("wait for", name, error) from error
            if line is None:
                return False  # the deadline
            if not line:
                # The stream ended (the member went away): let the caller look again.
                return _ENDED
            try:
                result = _watch_result(line)
            except ValueError as exc:
                raise self._unavailable("wait for", name, exc) from exc
            if result.get("canceled") or result.get("compact_revision"):
                return _SEEN  # compacted past our revision: look again
            if result.get("events"):
                return _SEEN
