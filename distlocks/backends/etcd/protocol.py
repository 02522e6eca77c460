"""What the etcd backend's requests mean, free of I/O: the steps a protocol generator
yields to a driver (:class:`_Post`, :class:`_Discard`, :class:`_OpenWatch`,
:class:`_NextLine`, :class:`_Pause`) and the :class:`_Reply` it gets back, the errors an
answer maps to, the encodings of the JSON gateway (base64 keys, string numbers, range
ends) and the token arithmetic (:func:`token_of`). Nothing here opens a socket or
sleeps: the drivers of :mod:`.transport` do, as h11 leaves I/O to its caller.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import math
import secrets
import time
from collections.abc import Mapping
from typing import Any

from distlocks.backends.base import (
    Holder,
)
from distlocks.exceptions import LockError

#: Tokens stay exact in doubles and JSON numbers, like every backend's.
MAX_TOKEN = 2**53
_BASE_DIGITS = 20
#: gRPC status codes the gateway returns that mean "try again later / elsewhere".
_UNAVAILABLE_CODES = {4, 14}  # DEADLINE_EXCEEDED, UNAVAILABLE
_NOT_FOUND = 5
_UNAUTHENTICATED = 16
#: Most operations etcd takes in one transaction (its --max-txn-ops default is 128).
_TXN_BATCH = 100
#: Errors of a kept-alive connection that the server closed while it was idle: the
#: request never reached the server, so it is sent once more on a new connection.
_IDLE_DEATHS = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


def _new_lease_id() -> int:
    """A lease id for a grant (etcd takes the client's): random, positive, 62 bits."""
    return secrets.randbits(62) or 1


class _LeaseGone(LockError):
    """The lease named in a request no longer exists on the server (expired or revoked)."""


class _ReAuth(LockError):
    """The auth token expired: authenticate again and repeat the request."""


class _ServerSaid(LockError):
    """An error answer of the gateway: gRPC ``code`` and etcd's message."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(message)


# -- transport steps: what the protocol generators yield to a driver -------------------


@dataclasses.dataclass(slots=True)
class _Post:
    """POST ``payload`` to ``path``: on a kept-alive connection when ``index`` is None
    (the driver answers None when it has none), else on a new connection to endpoint
    ``index``. Answered with a :class:`_Reply`."""

    path: str
    payload: bytes
    headers: dict[str, str]
    index: int | None


@dataclasses.dataclass(slots=True)
class _Reply:
    """The outcome of a :class:`_Post` or :class:`_OpenWatch`: an HTTP answer, or the
    transport ``error`` met (nothing was answered)."""

    status: int
    data: bytes
    #: The endpoint it went to, and whether the connection was a kept-alive one.
    index: int
    reused: bool
    error: BaseException | None = None
    #: The driver's connection, for a :class:`_Discard`.
    conn: Any = None


@dataclasses.dataclass(slots=True)
class _Discard:
    """Close the connection of a reply (its member cannot serve now)."""

    conn: Any


@dataclasses.dataclass(slots=True)
class _OpenWatch:
    """Open a streamed request on a connection of its own to endpoint ``index``
    (closed when the protocol generator ends). Answered with a :class:`_Reply`."""

    path: str
    payload: bytes
    headers: dict[str, str]
    index: int


@dataclasses.dataclass(slots=True)
class _NextLine:
    """The next line of the open stream within ``timeout`` seconds. Answered with
    ``(line, error)``: ``(None, None)`` at the timeout, ``b""`` when it ended."""

    timeout: float


@dataclasses.dataclass(slots=True)
class _Pause:
    """Wait ``seconds`` (time.sleep or asyncio.sleep). Answered with None."""

    seconds: float


#: Watch outcomes besides False (the deadline): a deletion (or a compaction) was seen,
#: or the stream ended without one (look again, after a pause: see ``_wait_g``).
_SEEN, _ENDED = "seen", "ended"
#: The first and the longest pause before watching again after a stream that ended
#: at once without an event (doubled each time in between).
WATCH_RETRY_FIRST, WATCH_RETRY_MAX = 0.05, 1.0
#: The first and the longest pause before a step is repeated during an election.
ELECTION_RETRY_FIRST, ELECTION_RETRY_MAX = 0.1, 1.0


def _b64(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")


def _prefix_end(prefix: str) -> str:
    """The key just after every key that starts with ``prefix`` (its range end)."""
    raw = prefix.encode()
    return _b64(raw[:-1] + bytes([raw[-1] + 1]))


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def lease_seconds(ttl: float) -> int:
    """The lease to ask etcd for: whole seconds, at least the ttl (the server raises it
    to its own minimum, 2 s with the default election timeout)."""
    return max(1, math.ceil(ttl))


def token_of(revision: int, fence: Mapping[str, Any]) -> int:
    """The fencing token of the transaction at ``revision`` on the name whose fence key
    is ``fence``: the revision, shifted per name so that it starts at the base written
    in the fence key (the clock in microseconds at the name's first use, or the
    configured floor). Strictly increasing with the revision for each name, and above
    every earlier token even when the cluster is rebuilt from nothing and revisions
    start again from 1 (see docs/backend-etcd.md)."""
    return _base(fence) + (int(revision) - _int(fence.get("create_revision")))


def _base(fence: Mapping[str, Any]) -> int:
    try:
        return int(_unb64(fence.get("value")).decode() or 0)
    except (ValueError, UnicodeDecodeError):
        return 0


def _kvs(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The key-values of one range answer inside a transaction answer."""
    return list(response.get("response_range", {}).get("kvs", []))


def _revision(answer: Mapping[str, Any]) -> int:
    """The revision in the header of an answer (checked by ``_call_g``); 0 if none."""
    header = answer.get("header")
    return _int(header.get("revision")) if isinstance(header, dict) else 0


def _watch_result(line: bytes) -> dict[str, Any]:
    """The ``result`` of one line of a watch stream; ValueError when the line is not
    what etcd's gateway sends (a JSON object whose result, if any, is an object)."""
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError(f"watch line is not a JSON object: {line[:80]!r}")
    result = message.get("result") or {}
    if not isinstance(result, dict):
        raise ValueError(f"watch result is not a JSON object: {line[:80]!r}")
    return result


def _unavailable_answer(status: int, data: bytes) -> _ServerSaid | None:
    """The error of an answer that means "this member cannot serve now, another may"
    (gRPC UNAVAILABLE or DEADLINE_EXCEEDED, or a gateway 502/503/504); None otherwise."""
    try:
        answer = json.loads(data)
        code, message = int(answer.get("code", 0)), str(answer.get("message", ""))
    except (ValueError, AttributeError, TypeError):
        code, message = 0, data[:200].decode(errors="replace")
    if code in _UNAVAILABLE_CODES or status in (502, 503, 504):
        return _ServerSaid(code, message)
    return None


def holder_value(owner: str, holder: Holder, ttl: float, **more: Any) -> str:
    """The JSON value of a lock or permit key: who holds it, for how long, since when."""
    return json.dumps(
        {
            "owner": owner,
            **more,
            "host": holder.host,
            "pid": holder.pid,
            "thread": holder.thread,
            "extra": dict(holder.extra),
            "ttl": ttl,
            "at": time.time_ns() // 1_000_000,
        },
        separators=(",", ":"),
    )
