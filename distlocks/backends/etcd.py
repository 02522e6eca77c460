"""etcd backend: locks on leases, fenced by the revision of the grant.

It speaks etcd's v3 JSON gateway (``/v3/kv/txn``, ``/v3/lease/*``, ``/v3/watch``): no
driver to install. The protocol is written once, as generators that yield the requests
to make (sans I/O); the blocking API carries them out with the standard library's
``http.client``, the asyncio API with a small HTTP/1.1 client on asyncio streams
(:mod:`distlocks.backends._etcd_http`), natively, without worker threads. See
docs/backend-etcd.md for why, and for the measurements.

Keys, under ``OPTIONS["prefix"]`` (default ``distlocks``), the name percent-encoded::

    <prefix>/lock/<name>           the holder: owner and holder metadata (JSON), on its lease
    <prefix>/fence/<name>          the fence key: the name's token base (20 digits), no lease
    <prefix>/wait/<name>/<owner>   one waiter, on a short lease of its own (WAIT_TTL) while it
                                   waits; the queue is create_revision order

* acquire is one transaction on a lease granted for it: put-if-absent of the lock key and
  a rewrite of the fence key (value kept). The token is the revision of that transaction,
  shifted per name to start at the clock (microseconds) at the name's first use, or at
  ``OPTIONS["token_floor"]`` if that is higher (:func:`token_of`).
* a waiter puts its waiter key and watches only the key just before it in the queue (the
  lock key, for the first waiter); only the first waiter may take the lock, checked in
  the same transaction. A caller that waited renews its leases before taking the lock.
  The waiter key is on a short lease, so a waiter that dies frees its place in seconds;
  the lock key goes on the ttl lease only in the granting transaction. The waiters of
  one event loop share one watch stream (:class:`_Hub`); an election is waited out
  within the caller's timeout (:meth:`EtcdBackend._retrying_g`).
* release and force release are compare-and-delete transactions; force release is bound
  to the token shown and rewrites the fence key, so the counter moves past the victim.
* extend renews the lease (keepalive) and checks, in a transaction, that the lock key is
  still this lease's; a different ttl moves the lock key to a new lease.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import datetime as dt
import http.client
import json
import logging
import math
import os
import secrets
import socket
import ssl
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, ClassVar, NoReturn, TypeVar

from django.core.exceptions import ImproperlyConfigured

from distlocks.backends import _etcd_http
from distlocks.backends.base import (
    AcquireResult,
    BaseBackend,
    Holder,
    LockInfo,
    holder_details,
)
from distlocks.backends.etcd_primitives import EtcdPermits
from distlocks.exceptions import LockBackendUnavailable, LockError
from distlocks.redaction import redact

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULTS: dict[str, Any] = {
    "prefix": "distlocks",
    "connect_timeout": 3.0,
    "socket_timeout": 5.0,
    "token_floor": 0,
}
_TLS_KEYS = ("ca_file", "cert_file", "key_file", "verify")
_OPTION_KEYS = frozenset(DEFAULTS) | {"user", "password"} | set(_TLS_KEYS)
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


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Mark a clean-up task's outcome as seen (its caller may have been cancelled)."""
    if not task.cancelled():
        task.exception()


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


@dataclasses.dataclass
class _Entry:
    """This process's lease for one (name, owner): a waiter's, then the holder's."""

    lease: int
    #: Seconds the server granted (whole, at least its minimum).
    lease_ttl: int
    #: The waiter key's create_revision while queued (0: not queued).
    wait_rev: int = 0
    #: The lock key's create_revision once held (0: not held).
    lock_rev: int = 0
    #: The short lease the waiter key lives on while queued (0: none), and its
    #: seconds (0: not known to be granted). A waiter that dies goes with it within
    #: seconds, whatever its ttl; the lock key goes on ``lease`` only when granted.
    wait_lease: int = 0
    wait_ttl: int = 0

    def leases(self) -> list[int]:
        """Every lease of this entry, to renew or revoke."""
        return [lease for lease in (self.lease, self.wait_lease) if lease]


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


@dataclasses.dataclass
class _LoopSide:
    """One event loop's connections: those kept alive (most recently used last) and
    the limit on requests in flight, the waiters' shared watch and running clean-ups."""

    calls: asyncio.Semaphore
    hub: _Hub
    idle: list[_etcd_http.Connection] = dataclasses.field(default_factory=list)
    #: Clean-ups running as tasks of their own (kept here until done).
    cleanups: set[asyncio.Task[None]] = dataclasses.field(default_factory=set)


#: A hub's wake-up when the waiter must read the queue again before it watches (its
#: revision is older than the hub's stream covers, or the history was compacted); and
#: when the waiter's own lease is gone.
_AGAIN, _GONE = "again", "gone"


@dataclasses.dataclass(eq=False)
class _Waiter:
    """One caller waiting, in a hub, for the deletion of a key after ``revision``."""

    future: asyncio.Future[str]
    revision: int
    #: Its waiter key's lease, renewed by the hub while it waits (0: none).
    lease: int


class _Hub:
    """One event loop's waiters share one watch stream: every deletion under the
    backend's lock and waiter keys (with the permit keys between them) from the
    revision the first waiter read, dispatched to the waiters of each key. So a loop
    needs one connection for any number of waiters, not one each. The stream runs
    while anyone waits, and is opened again from the last revision seen when it ends.

    A waiter registers with the revision it read its queue at: the deletions after it
    are either still to come on the stream, or among the ones seen already, which the
    hub remembers (the last :attr:`RECENT` keys). The waiters' own leases are renewed
    together, one request for all, every third of their length."""

    RECENT = 8192

    def __init__(self, backend: EtcdBackend) -> None:
        self.backend = backend
        self.waiters: dict[str, list[_Waiter]] = {}
        self.leases: dict[int, _Waiter] = {}
        #: Revision of the last deletion seen of each key (oldest first).
        self.recent: dict[str, int] = {}
        #: Every deletion after ``floor`` is in ``recent`` or still to come.
        self.floor = 0
        #: The revision the next stream starts at.
        self.resume = 0
        self.stream: asyncio.Task[None] | None = None
        self.renewer: asyncio.Task[None] | None = None
        #: The pause after streams that ended without a word (doubling), and when the
        #: next may open: kept across streams, which stop whenever nobody waits.
        self.pause = 0.0
        self.not_before = 0.0

    async def wait(self, key: str, revision: int, until: float, lease: int) -> str | bool:
        """:data:`_SEEN` once ``key`` is deleted after ``revision``, :data:`_AGAIN` (read
        the queue again, then wait), :data:`_GONE` (the waiter's lease ran out), False
        at ``until`` (monotonic); LockBackendUnavailable when no member serves."""
        loop = asyncio.get_running_loop()
        if self.stream is None:
            self.floor, self.resume = revision, revision + 1
            self.recent.clear()
            self.stream = loop.create_task(self._run())
        elif revision < self.floor:
            return _AGAIN
        seen = self.recent.get(key, 0)
        if seen > revision:
            return _SEEN
        waiter = _Waiter(loop.create_future(), revision, lease)
        self.waiters.setdefault(key, []).append(waiter)
        if lease:
            self.leases[lease] = waiter
            if self.renewer is None:
                self.renewer = loop.create_task(self._renew())
        try:
            async with asyncio.timeout(max(0.0, until - time.monotonic())):
                return await waiter.future
        except TimeoutError:
            return False
        finally:
            self._forget(key, waiter)

    def _forget(self, key: str, waiter: _Waiter) -> None:
        waiters = self.waiters.get(key, [])
        with contextlib.suppress(ValueError):
            waiters.remove(waiter)
        if not waiters:
            self.waiters.pop(key, None)
        if waiter.lease and self.leases.get(waiter.lease) is waiter:
            del self.leases[waiter.lease]
        if not self.leases and self.renewer is not None:
            self.renewer.cancel()
            self.renewer = None
        if not self.waiters and self.stream is not None:
            # Nobody waits: the stream closes (its connection with it).
            self.stream.cancel()
            self.stream = None

    def _wake(self, waiter: _Waiter, outcome: str | BaseException) -> None:
        if waiter.future.done():
            return
        if isinstance(outcome, BaseException):
            waiter.future.set_exception(outcome)
        else:
            waiter.future.set_result(outcome)

    def _wake_all(self, outcome: str | BaseException) -> None:
        for waiters in list(self.waiters.values()):
            for waiter in waiters:
                self._wake(waiter, outcome)

    def deliver(self, events: list[dict[str, Any]]) -> None:
        """Deletions seen on the stream (in revision order)."""
        for event in events:
            kv = event.get("kv") or {}
            key = _unb64(kv.get("key")).decode(errors="replace")
            revision = _int(kv.get("mod_revision"))
            self.recent.pop(key, None)
            self.recent[key] = revision
            self.resume = max(self.resume, revision + 1)
            for waiter in self.waiters.get(key, ()):
                if revision > waiter.revision:
                    self._wake(waiter, _SEEN)
        while len(self.recent) > self.RECENT:
            oldest = next(iter(self.recent))
            self.floor = max(self.floor, self.recent.pop(oldest))

    async def _run(self) -> None:
        backend = self.backend
        try:
            while True:
                await asyncio.sleep(max(0.0, self.not_before - time.monotonic()))
                opened = time.monotonic()
                try:
                    outcome = await backend._arun(backend._watch_all_g(self.resume, self))
                except LockBackendUnavailable as exc:
                    if not getattr(exc, "election", False):
                        raise
                    outcome = _ENDED  # no member has a leader now: again, after a pause
                if isinstance(outcome, int):
                    # Compacted past the revision asked for: what was missed is unknown,
                    # so every waiter reads its queue again.
                    self.floor, self.resume = outcome - 1, outcome
                    self.recent.clear()
                    self._wake_all(_AGAIN)
                    continue
                # Ended without a word: it is opened again from the last revision seen,
                # after a pause (a member, or something in front of it, that ends every
                # stream must not make a busy loop); the waiters meanwhile read their
                # queues once more, so that a stream that never delivers strands none.
                if time.monotonic() - opened > WATCH_RETRY_MAX:
                    self.pause = 0.0  # it served a while: not one that ends at once
                self.pause = min(WATCH_RETRY_MAX, max(WATCH_RETRY_FIRST, self.pause * 2))
                self.not_before = time.monotonic() + self.pause
                self._wake_all(_AGAIN)
        except LockError as exc:
            self._wake_all(exc)
        finally:
            if self.stream is asyncio.current_task():
                self.stream = None

    async def _renew(self) -> None:
        backend = self.backend
        while True:
            await asyncio.sleep(max(0.2, backend.WAIT_TTL / 3))
            leases = list(self.leases)
            if not leases:
                continue
            try:
                left = await backend._arun(backend._keepalive_g(leases, "wait for", "*"))
            except LockError:
                # Retried at the next turn; a lease that runs out meanwhile only costs
                # its waiter its place.
                logger.debug("Could not renew the etcd waiters' leases", exc_info=True)
                continue
            for lease, seconds in zip(leases, left, strict=True):
                waiter = self.leases.get(lease)
                if seconds <= 0 and waiter is not None:
                    self._wake(waiter, _GONE)


@dataclasses.dataclass(frozen=True)
class _Endpoint:
    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


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


def _parse_endpoints(location: Any) -> list[_Endpoint]:
    """Endpoints of ``LOCATION`` (a URL, several separated by commas, or a list);
    ValueError saying what is wrong. Messages never quote the user information."""
    items = location if isinstance(location, list | tuple) else str(location).split(",")
    endpoints = []
    for raw in items:
        if not isinstance(raw, str) or not raw.strip():
            raise ValueError("LOCATION must name etcd endpoints such as 'http://127.0.0.1:2379'")
        text = raw.strip()
        if "://" not in text:
            text = f"http://{text}"
        parts = urllib.parse.urlsplit(text)
        if parts.scheme not in ("http", "https"):
            raise ValueError(
                f"LOCATION endpoint {redact(text)!r} must be http:// or https:// (the gateway)"
            )
        try:
            port = parts.port or 2379
        except ValueError:
            raise ValueError(
                f"LOCATION endpoint {parts.scheme}://{parts.hostname or ''} has a bad port "
                f"(percent-encode special characters of a password)"
            ) from None
        if not parts.hostname:
            raise ValueError(f"LOCATION endpoint {redact(text)!r} names no host")
        endpoints.append(_Endpoint(parts.scheme, parts.hostname, port))
    return endpoints


def _credentials(location: Any) -> tuple[str, str] | None:
    items = location if isinstance(location, list | tuple) else str(location).split(",")
    for raw in items:
        text = str(raw).strip()
        parts = urllib.parse.urlsplit(text if "://" in text else f"http://{text}")
        if parts.username:
            return urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or "")
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


class EtcdBackend(EtcdPermits, BaseBackend):
    """Locks on an etcd v3 cluster, through its JSON gateway.

    ``LOCATION``: an endpoint URL (``"http://etcd1:2379"``), several separated by commas,
    or a list of them; ``https://`` for TLS; ``user:password@`` for etcd's own auth.
    ``OPTIONS``: ``connect_timeout`` and ``socket_timeout`` (seconds), ``prefix`` (of
    every key), ``user`` and ``password`` (instead of the URL), ``ca_file``,
    ``cert_file``, ``key_file``, ``verify`` (TLS), ``token_floor`` (the least base of a
    name's tokens; see docs/backend-etcd.md).
    """

    config_keys: ClassVar[frozenset[str]] = frozenset({"LOCATION", "OPTIONS"})
    wakes_on_release: ClassVar[bool] = True
    expires_on_server: ClassVar[bool] = True

    def __init__(self, alias: str, config: Mapping[str, Any]) -> None:
        super().__init__(alias, config)
        problems = self.validate_config(alias, config)
        if problems:
            raise ImproperlyConfigured(f"DISTLOCKS_BACKENDS[{alias!r}]: {'; '.join(problems)}.")
        opts = {**DEFAULTS, **self.options}
        self.endpoints = _parse_endpoints(config["LOCATION"])
        self.location = ",".join(map(str, self.endpoints))  # never the credentials
        self.prefix = str(opts["prefix"]).strip("/")
        self.connect_timeout = float(opts["connect_timeout"])
        self.socket_timeout = float(opts["socket_timeout"])
        self.token_floor = int(opts["token_floor"])
        creds = _credentials(config["LOCATION"])
        if "user" in opts:
            creds = (str(opts["user"]), str(opts.get("password", "")))
        self._creds = creds
        self._auth_token = ""
        self._ssl = self._ssl_context(opts) if self._needs_tls(opts) else None
        self._pid = os.getpid()
        self._local = threading.local()
        self._conns: set[http.client.HTTPConnection] = set()
        self._conns_lock = threading.Lock()
        #: Each event loop's connections (asyncio connections belong to one loop).
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopSide] = (
            weakref.WeakKeyDictionary()
        )
        self._entries: dict[tuple[str, str], _Entry] = {}
        #: The endpoint that answered last: tried first by the next connection.
        self._preferred = 0
        self._closed = False

    @classmethod
    def validate_config(cls, alias: str, config: Mapping[str, Any]) -> list[str]:
        problems = super().validate_config(alias, config)
        location = config.get("LOCATION")
        try:
            if location is None:
                raise ValueError(
                    "LOCATION must name etcd endpoints such as 'http://127.0.0.1:2379'"
                )
            _parse_endpoints(location)
        except ValueError as exc:
            problems.append(str(exc))
        options = config.get("OPTIONS") or {}
        if isinstance(options, Mapping):
            unknown = set(options) - _OPTION_KEYS
            if unknown:
                problems.append(
                    f"unknown OPTIONS key(s) {', '.join(sorted(map(str, unknown)))}; "
                    f"EtcdBackend accepts {', '.join(sorted(_OPTION_KEYS))}"
                )
            for key in ("connect_timeout", "socket_timeout"):
                value = options.get(key, DEFAULTS[key])
                if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                    problems.append(f"OPTIONS[{key!r}] must be a positive number of seconds")
            prefix = options.get("prefix", DEFAULTS["prefix"])
            if not isinstance(prefix, str) or not prefix.strip("/"):
                problems.append("OPTIONS['prefix'] must be a key prefix such as 'distlocks'")
            floor = options.get("token_floor", 0)
            if isinstance(floor, bool) or not isinstance(floor, int) or not 0 <= floor < 2**52:
                problems.append(
                    "OPTIONS['token_floor'] must be an int from 0 to 2**52 (tokens stay "
                    "below 2**53)"
                )
            for key in ("user", "password", "ca_file", "cert_file", "key_file"):
                if key in options and not isinstance(options[key], str):
                    problems.append(f"OPTIONS[{key!r}] must be a str")
            if "password" in options and "user" not in options:
                problems.append("OPTIONS['password'] needs OPTIONS['user']")
        return problems

    # -- HTTP ----------------------------------------------------------------------
    # The protocol (which member to ask, what to retry, what an answer means, every
    # lock recipe) is written once, as generators that yield transport steps (_Post,
    # _Discard, _OpenWatch, _NextLine) and get their outcomes back. Two drivers carry
    # the steps out: _sync on http.client (a kept-alive connection per thread), _arun on
    # asyncio streams (kept-alive connections per event loop). Every blocking method is
    # `self._sync(self._<name>_g(...))`, every asyncio one `await self._arun(...)`.

    def _needs_tls(self, opts: Mapping[str, Any]) -> bool:
        return any(e.scheme == "https" for e in self.endpoints) or any(
            key in opts for key in ("ca_file", "cert_file")
        )

    def _ssl_context(self, opts: Mapping[str, Any]) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=opts.get("ca_file"))
        if opts.get("cert_file"):
            context.load_cert_chain(opts["cert_file"], opts.get("key_file"))
        if opts.get("verify") is False:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    def _connect(self, endpoint: _Endpoint, timeout: float) -> http.client.HTTPConnection:
        if endpoint.scheme == "https":
            return http.client.HTTPSConnection(
                endpoint.host, endpoint.port, timeout=timeout, context=self._ssl
            )
        return http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout)

    def _open(self, endpoint: _Endpoint) -> http.client.HTTPConnection:
        conn = self._connect(endpoint, self.connect_timeout)
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(self.socket_timeout)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._conns_lock:
            self._conns.add(conn)
        return conn

    def _drop(self, conn: http.client.HTTPConnection | None) -> None:
        if conn is None:
            return
        with self._conns_lock:
            self._conns.discard(conn)
        with contextlib.suppress(Exception):
            conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None

    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            # A forked child: the parent's connections and leases are not ours to use
            # (the lease objects refuse too; this keeps the child off the parent's
            # sockets, the asyncio ones included: they are left open, not closed).
            self._pid = os.getpid()
            self._local = threading.local()
            self._conns = set()
            self._conns_lock = threading.Lock()
            self._entries = {}
            self._loops = weakref.WeakKeyDictionary()

    def _headers(self) -> dict[str, str]:
        # etcd's "require leader" metadata: a member without a leader (an election)
        # refuses at once with gRPC UNAVAILABLE "no leader", which the caller waits out
        # within its timeout, instead of holding the request until its own timeout.
        headers = {"Content-Type": "application/json", "Grpc-Metadata-Hasleader": "true"}
        if self._auth_token:
            headers["Authorization"] = self._auth_token
        return headers

    # -- the blocking driver ---------------------------------------------------------

    def _sync(self, steps: Generator[Any, Any, T]) -> T:
        """Run a protocol generator on http.client: this thread's kept-alive connection
        for requests, a connection of its own for a watch (closed at the end)."""
        self._check_pid()
        watch: tuple[http.client.HTTPConnection, http.client.HTTPResponse] | None = None
        value: Any = None
        try:
            while True:
                try:
                    step = steps.send(value)
                except StopIteration as stop:
                    return stop.value
                kind = type(step)
                if kind is _Post:
                    value = self._sync_post(step)
                elif kind is _Discard:
                    self._drop(step.conn)
                    value = None
                elif kind is _OpenWatch:
                    if watch is not None:
                        watch[0].close()
                    value, watch = self._sync_open_watch(step)
                elif kind is _Pause:
                    time.sleep(step.seconds)
                    value = None
                else:
                    assert kind is _NextLine
                    assert watch is not None
                    value = self._sync_next_line(watch, step.timeout)
        finally:
            steps.close()
            if watch is not None:
                watch[0].close()

    def _sync_post(self, step: _Post) -> _Reply | None:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if step.index is None:
            if conn is None:
                return None
            index, reused = getattr(self._local, "index", self._preferred), True
        else:
            if conn is not None:
                self._drop(conn)
            conn, index, reused = None, step.index, False
        try:
            if conn is None:
                conn = self._open(self.endpoints[index])
                self._local.conn, self._local.index = conn, index
            conn.request("POST", step.path, step.payload, step.headers)
            reply = conn.getresponse()
            return _Reply(reply.status, reply.read(), index, reused, conn=conn)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            self._drop(conn)
            return _Reply(0, b"", index, reused, exc)

    def _sync_open_watch(
        self, step: _OpenWatch
    ) -> tuple[_Reply, tuple[http.client.HTTPConnection, http.client.HTTPResponse] | None]:
        conn: http.client.HTTPConnection | None = None
        try:
            conn = self._connect(self.endpoints[step.index], self.connect_timeout)
            conn.request("POST", step.path, step.payload, step.headers)
            assert conn.sock is not None
            conn.sock.settimeout(self.socket_timeout)
            reply = conn.getresponse()
            if reply.status != 200:
                data = reply.read()
                conn.close()
                return _Reply(reply.status, data, step.index, False), None
            return _Reply(200, b"", step.index, False), (conn, reply)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            if conn is not None:
                conn.close()
            return _Reply(0, b"", step.index, False, exc), None

    @staticmethod
    def _sync_next_line(
        watch: tuple[http.client.HTTPConnection, http.client.HTTPResponse], timeout: float
    ) -> tuple[bytes | None, BaseException | None]:
        conn, reply = watch
        try:
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            return reply.readline(), None
        except TimeoutError:
            return None, None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            return None, exc

    # -- the asyncio driver ------------------------------------------------------------

    #: Requests one event loop has in flight at most (each on a connection of its own);
    #: more wait for one to finish, up to ASYNC_QUEUE_TIMEOUT.
    ASYNC_CALLS = 64
    #: Seconds of the lease a waiter key lives on while queued (renewed every third of
    #: it): how long a waiter that died holds up the ones behind it.
    WAIT_TTL = 3.0
    ASYNC_QUEUE_TIMEOUT = 30.0

    def _loop_side(self) -> _LoopSide:
        """The running event loop's connections (a connection is bound to its loop)."""
        loop = asyncio.get_running_loop()
        side = self._loops.get(loop)
        if side is None:
            side = self._loops[loop] = _LoopSide(asyncio.Semaphore(self.ASYNC_CALLS), _Hub(self))
        return side

    async def _arun(
        self,
        steps: Generator[Any, Any, T],
        unanswered: list[_etcd_http.Connection] | None = None,
    ) -> T:
        """:meth:`_sync` on asyncio: kept-alive connections of the running loop for
        requests, a connection of its own for a watch. Cancelled mid-request, the
        connection is closed (its answer would be unread), or, given ``unanswered``,
        added to it, for the caller to read that answer before it cleans up."""
        self._check_pid()
        side = self._loop_side()
        watch: _etcd_http.Connection | None = None
        value: Any = None
        try:
            while True:
                try:
                    step = steps.send(value)
                except StopIteration as stop:
                    return stop.value
                kind = type(step)
                if kind is _Post:
                    value = await self._apost(side, step, unanswered)
                elif kind is _Discard:
                    step.conn.close()
                    with contextlib.suppress(ValueError):
                        side.idle.remove(step.conn)
                    value = None
                elif kind is _OpenWatch:
                    if watch is not None:
                        watch.close()
                        watch = None
                    value, watch = await self._aopen_watch(step)
                elif kind is _Pause:
                    await asyncio.sleep(step.seconds)
                    value = None
                else:
                    assert kind is _NextLine
                    assert watch is not None
                    value = await self._anext_line(watch, step.timeout)
        finally:
            steps.close()
            if watch is not None:
                watch.close()

    async def _aconnect(self, index: int) -> _etcd_http.Connection:
        endpoint = self.endpoints[index]
        context = self._ssl if endpoint.scheme == "https" else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                return await _etcd_http.connect(endpoint.host, endpoint.port, context, index)
        except TimeoutError:
            raise TimeoutError(f"no connection within {self.connect_timeout:g} s") from None

    async def _apost(
        self,
        side: _LoopSide,
        step: _Post,
        unanswered: list[_etcd_http.Connection] | None = None,
    ) -> _Reply | None:
        if side.calls.locked():
            try:
                async with asyncio.timeout(self.ASYNC_QUEUE_TIMEOUT):
                    await side.calls.acquire()
            except TimeoutError:
                raise LockBackendUnavailable(
                    self.alias,
                    f"no free connection within {self.ASYNC_QUEUE_TIMEOUT:g} s: "
                    f"{self.ASYNC_CALLS} requests of this event loop were in flight the "
                    f"whole time",
                ) from None
        else:
            await side.calls.acquire()
        conn: _etcd_http.Connection | None = None
        try:
            if step.index is None:
                while side.idle and conn is None:
                    conn = side.idle.pop()
                    if not conn.idle_and_open():
                        conn.close()
                        conn = None
                if conn is None:
                    return None
                index, reused = conn.index, True
            else:
                index, reused = step.index, False
                conn = await self._aconnect(index)
            try:
                async with asyncio.timeout(self.socket_timeout):
                    status, data = await conn.post(step.path, step.payload, step.headers)
            except TimeoutError:
                raise TimeoutError(f"no answer within {self.socket_timeout:g} s") from None
        except (OSError, EOFError, ValueError, http.client.HTTPException) as exc:
            if conn is not None:
                conn.close()
            return _Reply(0, b"", index, reused, exc)
        except BaseException:
            if conn is not None:
                if unanswered is not None and conn.pending:
                    unanswered.append(conn)
                else:
                    conn.close()
            raise
        finally:
            side.calls.release()
        if conn.usable and len(side.idle) < self.ASYNC_CALLS:
            side.idle.append(conn)
        else:
            conn.close()
        return _Reply(status, data, index, reused, conn=conn)

    async def _aopen_watch(self, step: _OpenWatch) -> tuple[_Reply, _etcd_http.Connection | None]:
        conn: _etcd_http.Connection | None = None
        try:
            conn = await self._aconnect(step.index)
            try:
                async with asyncio.timeout(self.socket_timeout):
                    status, data = await conn.open_stream(step.path, step.payload, step.headers)
            except TimeoutError:
                raise TimeoutError(f"no answer within {self.socket_timeout:g} s") from None
        except (OSError, EOFError, ValueError, http.client.HTTPException) as exc:
            if conn is not None:
                conn.close()
            return _Reply(0, b"", step.index, False, exc), None
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        if status != 200:
            conn.close()
            return _Reply(status, data, step.index, False), None
        return _Reply(200, b"", step.index, False), conn

    @staticmethod
    async def _anext_line(
        conn: _etcd_http.Connection, timeout: float
    ) -> tuple[bytes | None, BaseException | None]:
        try:
            async with asyncio.timeout(timeout):
                return await conn.next_line(), None
        except TimeoutError:
            return None, None
        except (OSError, EOFError, ValueError, http.client.HTTPException) as exc:
            return None, exc

    # -- requests ------------------------------------------------------------------------

    def _call(self, path: str, body: Any, action: str, name: str, *, raw: bool = False) -> Any:
        """POST ``body`` to the gateway; the decoded answer (see :meth:`_call_g`)."""
        return self._sync(self._call_g(path, body, action, name, raw=raw))

    def _call_g(
        self, path: str, body: Any, action: str, name: str, *, raw: bool = False
    ) -> Generator[Any, Any, Any]:
        """POST ``body`` to the gateway; the decoded answer. A kept-alive connection is
        used first; one that the server closed while it was idle is replaced once,
        transparently (the request never reached the server). A member that cannot be
        reached, or answers UNAVAILABLE (no leader, leader changed: an election in
        progress; a learner), is passed over for the next endpoint, each tried once;
        LockBackendUnavailable once none answers."""
        if self._creds and not self._auth_token and not path.startswith("/v3/auth/"):
            yield from self._authenticate_g(action, name)
        text = body if raw else json.dumps(body, separators=(",", ":"))
        payload = text.encode()
        headers = self._headers()
        last: BaseException | None = None
        count = len(self.endpoints)
        tried: set[int] = set()
        fresh = False
        answered = False  # a member answered that it cannot serve now (an election)
        while True:
            index: int | None = None
            if fresh:
                order = ((self._preferred + k) % count for k in range(count))
                index = next((i for i in order if i not in tried), None)
                if index is None:
                    break
                tried.add(index)
            reply = yield _Post(path, payload, headers, index)
            if reply is None:
                fresh = True  # no kept-alive connection: a new one
                continue
            if reply.error is not None:
                last, fresh = reply.error, True
                if reply.reused and not isinstance(reply.error, _IDLE_DEATHS):
                    tried.add(reply.index)
                # else: a kept-alive connection the server had closed: once more
                continue
            if not reply.reused:
                self._preferred = reply.index
            status, data = reply.status, reply.data
            if status != 200:
                refused = _unavailable_answer(status, data)
                if refused is not None:
                    # This member cannot serve now: the next one may (the request was
                    # not applied, or is retry-safe like a timeout: see docs).
                    yield _Discard(reply.conn)
                    tried.add(reply.index)
                    last, fresh, answered = refused, True, True
                    continue
                try:
                    self._raise_answer(status, data, action, name, path, body)
                except _ReAuth:
                    return (yield from self._call_g(path, body, action, name, raw=raw))
            if raw:
                return data
            try:
                answer = json.loads(data)
                if not isinstance(answer, dict):
                    raise ValueError("not a JSON object")
                header = answer.get("header")
                if path.startswith("/v3/kv/") and not (
                    isinstance(header, dict) and _int(header.get("revision")) > 0
                ):
                    raise ValueError("no header revision")
            except ValueError as exc:
                raise self._unavailable(
                    action,
                    name,
                    ValueError(
                        f"backend answered something that is not etcd's JSON gateway ({exc})"
                    ),
                ) from exc
            return answer
        assert last is not None
        error = self._unavailable(action, name, last)
        error.election = answered  # type: ignore[attr-defined]
        raise error from last

    def _raise_answer(
        self, status: int, data: bytes, action: str, name: str, path: str, body: Any
    ) -> NoReturn:
        try:
            answer = json.loads(data)
            code, message = int(answer.get("code", 0)), str(answer.get("message", ""))
        except (ValueError, AttributeError, TypeError):
            code, message = 0, data[:200].decode(errors="replace")
        if code == _NOT_FOUND and "lease not found" in message:
            raise _LeaseGone(message)
        if code == _UNAUTHENTICATED and self._creds and "invalid auth token" in message:
            self._auth_token = ""
            raise _ReAuth(message)
        if code in _UNAVAILABLE_CODES or status in (502, 503, 504):
            exc = _ServerSaid(code, message)
            raise self._unavailable(action, name, exc) from exc
        raise LockError(
            f"etcd refused to {action} {name!r} on backend {self.alias!r} "
            f"(HTTP {status}, code {code}): {redact(message)}"
        ) from _ServerSaid(code, message)

    def _authenticate_g(self, action: str, name: str) -> Generator[Any, Any, None]:
        assert self._creds is not None
        user, password = self._creds
        try:
            answer = yield from self._call_g(
                "/v3/auth/authenticate", {"name": user, "password": password}, action, name
            )
        except LockBackendUnavailable:
            raise
        except LockError as exc:
            # etcd's message names neither the password nor the user; keep it so.
            raise LockError(
                f"etcd refused the credentials of backend {self.alias!r} (to {action} "
                f"{name!r}): check OPTIONS['user'] / ['password'] or the LOCATION's user"
            ) from exc.__cause__
        self._auth_token = str(answer.get("token", ""))

    def _retrying_g(
        self,
        deadline: float,
        make: Callable[[], Generator[Any, Any, T]],
        action: str,
        name: str,
    ) -> Generator[Any, Any, T]:
        """Run the steps ``make()`` builds, again after a pause (0.1 s doubling to 1 s)
        while the cluster is electing a leader (a member answered that it cannot serve
        now) and ``deadline`` (monotonic) leaves time for it; the steps must be safe to
        repeat. A cluster nobody answers for fails at once, as before."""
        pause = ELECTION_RETRY_FIRST
        while True:
            try:
                return (yield from make())
            except LockBackendUnavailable as exc:
                if not getattr(exc, "election", False) or time.monotonic() + pause >= deadline:
                    raise
                logger.info(
                    "etcd %s has no leader now (%s %r); trying again within the timeout",
                    self.location,
                    action,
                    name,
                )
            yield _Pause(pause)
            pause = min(ELECTION_RETRY_MAX, pause * 2)

    def _unavailable(self, action: str, name: str, exc: BaseException) -> LockBackendUnavailable:
        detail = redact(f"{type(exc).__name__}: {exc}")
        return LockBackendUnavailable(
            self.alias, f"{action} {name!r} on etcd {self.location}: {detail}"
        )

    def close(self) -> None:
        self._closed = True
        if self._pid != os.getpid():
            return  # the parent's sockets: leave them to the parent
        with self._conns_lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.close()
        self._local = threading.local()
        loops, self._loops = list(self._loops.items()), weakref.WeakKeyDictionary()
        for loop, side in loops:
            idle, side.idle = side.idle, []
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            for aconn in idle:
                # A transport is closed on its own loop's thread; a closed loop's
                # sockets go with its transports.
                if loop is running or not (loop.is_running() or loop.is_closed()):
                    aconn.close()
                elif not loop.is_closed():
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(aconn.close)

    # -- keys and small requests ---------------------------------------------------

    def _quoted(self, name: str) -> str:
        return urllib.parse.quote(name, safe="")

    def lock_key(self, name: str) -> str:
        return f"{self.prefix}/lock/{self._quoted(name)}"

    def fence_key(self, name: str) -> str:
        return f"{self.prefix}/fence/{self._quoted(name)}"

    def wait_prefix(self, name: str) -> str:
        return f"{self.prefix}/wait/{self._quoted(name)}/"

    def wait_key(self, name: str, owner: str) -> str:
        return self.wait_prefix(name) + urllib.parse.quote(owner, safe="")

    def _txn(
        self,
        action: str,
        name: str,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        return self._sync(self._txn_g(action, name, compare, success, failure))

    def _txn_g(
        self,
        action: str,
        name: str,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]] | None = None,
    ) -> Generator[Any, Any, dict[str, Any]]:
        body: dict[str, Any] = {"compare": compare, "success": success}
        if failure:
            body["failure"] = failure
        return dict((yield from self._call_g("/v3/kv/txn", body, action, name)))

    def _grant(self, ttl: float, action: str, name: str) -> tuple[int, int]:
        """A new lease of at least ``ttl`` seconds: (id, seconds granted)."""
        return self._sync(self._grant_g(ttl, action, name))

    def _grant_g(
        self, ttl: float, action: str, name: str, lease: int = 0
    ) -> Generator[Any, Any, tuple[int, int]]:
        """:meth:`_grant` of the lease id ``lease`` (a new random one when 0). The id is
        chosen here, not by the server, so that a caller interrupted before the answer
        still knows which lease to revoke; a grant repeated after a lost answer finds
        its own lease there."""
        lease = lease or _new_lease_id()
        try:
            answer = yield from self._call_g(
                "/v3/lease/grant", {"TTL": lease_seconds(ttl), "ID": str(lease)}, action, name
            )
        except LockError as exc:
            said = exc.__cause__
            if not (isinstance(said, _ServerSaid) and "lease already exists" in str(said)):
                raise
            # Ours, granted by an attempt whose answer was lost (or, once in 2**62, a
            # lease of somebody else's id: its time to live says it is live either way).
            left, granted = yield from self._time_to_live_g(lease, action, name)
            if left <= 0:
                raise
            return lease, granted
        return _int(answer.get("ID")), _int(answer.get("TTL"))

    def _keepalive(self, leases: Sequence[int], action: str, name: str) -> list[int]:
        """Renew each lease (one request for all); the seconds each now has, 0 if gone."""
        return self._sync(self._keepalive_g(leases, action, name))

    def _keepalive_g(
        self, leases: Sequence[int], action: str, name: str
    ) -> Generator[Any, Any, list[int]]:
        if not leases:
            return []
        body = "\n".join(json.dumps({"ID": str(lease)}) for lease in leases)
        data = yield from self._call_g("/v3/lease/keepalive", body, action, name, raw=True)
        ttls: dict[int, int] = {}
        for line in data.splitlines():
            if not line.strip():
                continue
            try:
                result = _watch_result(line)
            except ValueError as exc:
                raise self._unavailable(action, name, exc) from exc
            ttls[_int(result.get("ID"))] = _int(result.get("TTL"))
        return [ttls.get(lease, 0) for lease in leases]

    def _revoke_quietly(self, lease: int) -> None:
        """Revoke a lease this process no longer needs: a failure is harmless (it
        expires by itself within its ttl)."""
        self._sync(self._revoke_quietly_g(lease))

    def _revoke_quietly_g(self, lease: int) -> Generator[Any, Any, None]:
        try:
            yield from self._call_g(
                "/v3/lease/revoke", {"ID": str(lease)}, "revoke the lease of", ""
            )
        except LockError:
            logger.debug("Could not revoke etcd lease %x", lease, exc_info=True)

    def _time_to_live(self, lease: int, action: str, name: str) -> tuple[int, int]:
        """(seconds left, seconds granted) of ``lease``; (-1, 0) if it is gone."""
        return self._sync(self._time_to_live_g(lease, action, name))

    def _time_to_live_g(
        self, lease: int, action: str, name: str
    ) -> Generator[Any, Any, tuple[int, int]]:
        if not lease:
            return -1, 0
        answer = yield from self._call_g("/v3/lease/timetolive", {"ID": str(lease)}, action, name)
        return _int(answer.get("TTL")), _int(answer.get("grantedTTL"))

    def _clock_us(self) -> int:
        """The clock for a new fence's base: this host's, in microseconds."""
        return time.time_ns() // 1000

    # -- acquire -----------------------------------------------------------------

    def _fence_ready(self, name: str) -> dict[str, Any]:
        """The comparison that the fence key exists with a base at least the floor."""
        return self._fence_at_floor(_b64(self.fence_key(name)))

    def _fence_at_floor(self, fence: str) -> dict[str, Any]:
        """The comparison that the fence key ``fence`` (base64) exists with a base at
        least the floor (a lock's, or a read-write lock's write fence)."""
        fence_cmp: dict[str, Any] = {
            "target": "VERSION",
            "key": fence,
            "result": "GREATER",
            "version": "0",
        }
        if self.token_floor > 0:
            # Fixed-width digits compare as numbers, byte by byte.
            fence_cmp = {
                "target": "VALUE",
                "key": fence,
                "result": "GREATER",
                "value": _b64(str(self.token_floor - 1).zfill(_BASE_DIGITS)),
            }
        return fence_cmp

    def _queue_compares(
        self, name: str, owner: str, entry: _Entry, fair: bool
    ) -> list[dict[str, Any]]:
        """Who may take the lock: a queued waiter only when it is first (no waiter key
        created before its own, which still exists); a newcomer asking for fairness
        only when nobody queues."""
        prefix = self.wait_prefix(name)
        if entry.wait_rev:
            return [
                {
                    "target": "CREATE",
                    "key": _b64(self.wait_key(name, owner)),
                    "result": "EQUAL",
                    "create_revision": str(entry.wait_rev),
                },
                {
                    "target": "CREATE",
                    "key": _b64(prefix),
                    "range_end": _prefix_end(prefix),
                    "result": "GREATER",
                    "create_revision": str(entry.wait_rev - 1),
                },
            ]
        if fair:
            return [
                {
                    "target": "CREATE",
                    "key": _b64(prefix),
                    "range_end": _prefix_end(prefix),
                    "result": "EQUAL",
                    "create_revision": "0",
                }
            ]
        return []

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
        return self._sync(self._acquire_g(name, owner, ttl, holder, wait, fair))

    async def aacquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        wait: float = 0.0,
        fair: bool = False,
    ) -> AcquireResult:
        unanswered: list[_etcd_http.Connection] = []
        try:
            return await self._arun(
                self._acquire_g(name, owner, ttl, holder, wait, fair), unanswered
            )
        except asyncio.CancelledError:
            await self._abandon(name, owner, unanswered)
            raise

    async def _abandon(
        self, name: str, owner: str, unanswered: list[_etcd_http.Connection]
    ) -> None:
        """A cancelled acquire: revoke its leases, which takes with them the waiter key
        and a lock key the interrupted transaction may have written. The lease ids are
        known before the grants are sent, so even a grant whose answer never came is
        revoked; the answer of the interrupted request is read first (on its connection,
        within the socket timeout), so that its grant cannot land after the revocation.
        It runs as a task of its own: cancelling the caller again does not stop it."""
        entry = self._entries.pop((name, owner), None)
        leases = entry.leases() if entry is not None else []

        def revoke() -> Generator[Any, Any, None]:
            for lease in leases:
                yield from self._revoke_quietly_g(lease)

        await asyncio.shield(self._clean_up(revoke, unanswered))

    def _clean_up(
        self,
        steps: Callable[[], Generator[Any, Any, None]],
        unanswered: Sequence[_etcd_http.Connection] = (),
    ) -> asyncio.Task[None]:
        """Run the clean-up ``steps`` (a protocol generator, made anew if it has to be
        run again) as a task of its own, kept by the loop's side until done: a caller
        cancelled while it runs leaves it running, bounded by :meth:`_clean_up_deadline`.
        If the task itself is cancelled (the loop is going away), a thread finishes it."""
        side = self._loop_side()
        task = asyncio.get_running_loop().create_task(self._clean_up_task(steps, list(unanswered)))
        side.cleanups.add(task)
        task.add_done_callback(side.cleanups.discard)
        task.add_done_callback(_retrieved)
        return task

    def _clean_up_deadline(self) -> float:
        """Seconds a clean-up may take: a connection and two answers per endpoint."""
        return (self.connect_timeout + 2 * self.socket_timeout) * len(self.endpoints)

    async def _clean_up_task(
        self,
        steps: Callable[[], Generator[Any, Any, None]],
        unanswered: list[_etcd_http.Connection],
    ) -> None:
        seconds = self._clean_up_deadline()
        try:
            async with asyncio.timeout(seconds):
                for conn in unanswered:
                    try:
                        async with asyncio.timeout(self.socket_timeout):
                            await conn.finish()
                    except (OSError, EOFError, ValueError, http.client.HTTPException):
                        pass  # not answered: a lease it granted runs out by itself
                    except TimeoutError:
                        pass
                    finally:
                        conn.close()
                await self._arun(steps())
        except asyncio.CancelledError:
            # Only the loop going away cancels this task: finish it off the loop.
            for conn in unanswered:
                conn.close()
            threading.Thread(target=self._sync_quietly, args=(steps,), daemon=True).start()
            raise
        except TimeoutError:
            raise LockBackendUnavailable(
                self.alias,
                f"clean-up not finished within {seconds:g} s on etcd {self.location}; "
                f"its leases end by themselves",
            ) from None

    def _sync_quietly(self, steps: Callable[[], Generator[Any, Any, None]]) -> None:
        try:
            self._sync(steps())
        except Exception:
            logger.warning("An etcd clean-up failed (its leases end by themselves)", exc_info=True)

    def _acquire_g(
        self, name: str, owner: str, ttl: float, holder: Holder, wait: float, fair: bool
    ) -> Generator[Any, Any, AcquireResult]:
        """One acquisition attempt; an election (a member answering that it has no
        leader, or that the leader changed) is waited out within ``wait`` seconds: every
        step is safe to repeat (the lease ids are the client's, the transaction finds a
        lock its lost reply granted by the owner in the key)."""
        began = time.monotonic()
        last, attempts = began, 0

        def attempt() -> Generator[Any, Any, AcquireResult]:
            nonlocal last, attempts
            last, attempts = time.monotonic(), attempts + 1
            return self._acquire_once_g(name, owner, ttl, holder, wait, fair)

        result = yield from self._retrying_g(began + wait, attempt, "acquire", name)
        if result.acquired and result.remaining is not None and attempts > 1:
            # The caller counts the lease from when it called; the attempt that got it
            # renewed (or granted) the lease only when it began.
            result = dataclasses.replace(result, remaining=result.remaining + (last - began))
        return result

    def _acquire_once_g(
        self, name: str, owner: str, ttl: float, holder: Holder, wait: float, fair: bool
    ) -> Generator[Any, Any, AcquireResult]:
        action = "acquire"
        entry = self._entries.get((name, owner))
        if entry is not None and entry.lease_ttl:
            # Back from a wait (or a retry): renew the leases first and make sure they
            # are still alive, so the lease handed out is good for its whole ttl (a lock
            # granted on a lease that ran out while queued is the bug Jepsen found in
            # etcd 3.4.3's lock).
            leases = entry.leases()
            left = dict(
                zip(leases, (yield from self._keepalive_g(leases, action, name)), strict=True)
            )
            if entry.wait_lease and left[entry.wait_lease] <= 0:
                # The waiter key went with its lease (a pause longer than it): queue again.
                entry.wait_lease = entry.wait_ttl = entry.wait_rev = 0
            if left[entry.lease] <= 0:
                if not entry.wait_lease:
                    self._entries.pop((name, owner), None)
                    entry = None
                else:
                    # The lock's lease ran out during a wait longer than the ttl (no key
                    # is on it): a new one, the place in the queue kept.
                    entry.lease, entry.lease_ttl = _new_lease_id(), 0
                    entry.lease, entry.lease_ttl = yield from self._grant_g(
                        ttl, action, name, entry.lease
                    )
        if entry is None or not entry.lease_ttl:
            # Known (to a cancelled caller's clean-up) before the grant is sent.
            entry = _Entry(_new_lease_id(), 0)
            self._entries[(name, owner)] = entry
            try:
                entry.lease, entry.lease_ttl = yield from self._grant_g(
                    ttl, action, name, entry.lease
                )
            except LockError:
                self._entries.pop((name, owner), None)
                raise
        remaining = min(ttl, float(entry.lease_ttl))
        value = holder_value(owner, holder, ttl)
        try:
            for _ in range(8):
                outcome = yield from self._attempt_g(name, owner, entry, value, wait > 0, fair)
                if outcome is None:
                    continue  # something was set up (fence, floor, queue place): again
                if outcome.acquired:
                    if entry.wait_lease:
                        # The grant deleted the waiter key: its lease has no use left.
                        lease, entry.wait_lease, entry.wait_ttl = entry.wait_lease, 0, 0
                        yield from self._revoke_quietly_g(lease)
                    return AcquireResult(True, outcome.fencing_token, remaining)
                if wait > 0:
                    return outcome
                # Try once: nothing of this attempt stays on the server.
                self._entries.pop((name, owner), None)
                yield from self._revoke_all_g(entry)
                return outcome
        except _LeaseGone:
            # A lease ran out between the renewal and the transaction (a long pause):
            # the next attempt starts afresh.
            self._entries.pop((name, owner), None)
            yield from self._revoke_all_g(entry)
            return AcquireResult(False, 0, None)
        raise LockError(f"Could not take lock {name!r} on backend {self.alias!r}: no progress.")

    def _revoke_all_g(self, entry: _Entry) -> Generator[Any, Any, None]:
        for lease in entry.leases():
            yield from self._revoke_quietly_g(lease)

    def _wait_lease_g(self, name: str, entry: _Entry) -> Generator[Any, Any, None]:
        """Grant the short lease the waiter key will live on (its id known before)."""
        entry.wait_lease, entry.wait_ttl = _new_lease_id(), 0
        entry.wait_lease, entry.wait_ttl = yield from self._grant_g(
            self.WAIT_TTL, "acquire", name, entry.wait_lease
        )

    def _attempt_g(
        self, name: str, owner: str, entry: _Entry, value: str, queue: bool, fair: bool
    ) -> Generator[Any, Any, AcquireResult | None]:
        """One transaction; None when the caller should try again at once."""
        lock, fence = _b64(self.lock_key(name)), _b64(self.fence_key(name))
        wait_key = _b64(self.wait_key(name, owner))
        put_lock = {"requestPut": {"key": lock, "value": _b64(value), "lease": str(entry.lease)}}
        taken = [put_lock, {"requestDeleteRange": {"key": wait_key}}]
        compare = [
            {"target": "CREATE", "key": lock, "result": "EQUAL", "create_revision": "0"},
            self._fence_ready(name),
            *self._queue_compares(name, owner, entry, fair),
        ]
        failure: list[dict[str, Any]] = [
            {"requestRange": {"key": lock}},
            {"requestRange": {"key": fence}},
        ]
        # Queue only on the waiter's own short lease (granted when first needed).
        queued_now = queue and entry.wait_ttl > 0
        if queued_now:
            failure += [
                # Queue (a put keeps the create_revision of a key that exists).
                {
                    "requestPut": {
                        "key": wait_key,
                        "value": _b64(value),
                        "lease": str(entry.wait_lease),
                    }
                },
                self._queue_range(self.wait_prefix(name)),
            ]
        answer = yield from self._txn_g(
            "acquire",
            name,
            compare,
            [
                *taken,
                {"requestPut": {"key": fence, "ignore_value": True}},
                {"requestRange": {"key": fence}},
            ],
            failure,
        )
        revision = _revision(answer)
        responses = answer.get("responses", [])
        if answer.get("succeeded"):
            fence_kv = _kvs(responses[-1])[0]
            entry.wait_rev, entry.lock_rev = 0, revision
            return AcquireResult(True, token_of(revision, fence_kv))
        lock_kvs, fence_kvs = _kvs(responses[0]), _kvs(responses[1])
        if queued_now:
            queued = _kvs(responses[3])
            mine = self.wait_key(name, owner)
            keys = [_unb64(kv["key"]).decode() for kv in queued]
            for kv in queued:
                if _unb64(kv["key"]).decode() == mine:
                    entry.wait_rev = _int(kv.get("create_revision"))
            first = bool(keys) and keys[0] == mine
        else:
            first = False
        if lock_kvs:
            held = lock_kvs[0]
            if self._owner_of(held) == owner:
                # A retried acquire whose first reply was lost: the lock is already ours.
                return (yield from self._adopt_g(name, owner, entry, held, fence_kvs))
            if not fence_kvs:
                yield from self._create_fence_g(name)
            if queue and not queued_now:
                yield from self._wait_lease_g(name, entry)
                return None  # queue, on it
            if queue:
                return AcquireResult(False, 0, None)
            return AcquireResult(False, 0, (yield from self._remaining_of_g(held, name)))
        if not fence_kvs:
            return (yield from self._first_use_g(name, owner, entry, value, fair))
        if self.token_floor and _base(fence_kvs[0]) < self.token_floor:
            yield from self._raise_floor_g(name, fence_kvs[0])
            return None
        # Free, but others queue before this caller.
        if queue and first:
            return None
        if queue and not queued_now:
            yield from self._wait_lease_g(name, entry)
            return None
        return AcquireResult(False, 0, None)

    def _owner_of(self, kv: Mapping[str, Any]) -> str:
        try:
            data = json.loads(_unb64(kv.get("value")))
        except ValueError:
            return ""
        return str(data.get("owner", "")) if isinstance(data, dict) else ""

    def _remaining_of_g(
        self, kv: Mapping[str, Any], name: str
    ) -> Generator[Any, Any, float | None]:
        left, _ = yield from self._time_to_live_g(_int(kv.get("lease")), "acquire", name)
        if left < 0:
            return 0.001  # going, or already gone
        return max(0.001, float(left))

    def _adopt_g(
        self,
        name: str,
        owner: str,
        entry: _Entry,
        held: Mapping[str, Any],
        fence_kvs: list[dict[str, Any]],
    ) -> Generator[Any, Any, AcquireResult]:
        lease = _int(held.get("lease"))
        if lease != entry.lease:
            yield from self._revoke_quietly_g(entry.lease)
            _, granted = yield from self._time_to_live_g(lease, "acquire", name)
            entry.lease, entry.lease_ttl = lease, granted
            yield from self._keepalive_g([lease], "acquire", name)
        entry.wait_rev, entry.lock_rev = 0, _int(held.get("create_revision"))
        token = token_of(entry.lock_rev, fence_kvs[0]) if fence_kvs else 0
        return AcquireResult(True, token)

    def _new_base(self) -> int:
        return max(self._clock_us(), self.token_floor)

    def _first_use_g(
        self, name: str, owner: str, entry: _Entry, value: str, fair: bool
    ) -> Generator[Any, Any, AcquireResult | None]:
        """The name's first lock: create the fence key with its base in the same
        transaction as the lock key."""
        lock, fence = _b64(self.lock_key(name)), _b64(self.fence_key(name))
        base = self._new_base()
        answer = yield from self._txn_g(
            "acquire",
            name,
            [
                {"target": "CREATE", "key": lock, "result": "EQUAL", "create_revision": "0"},
                {"target": "CREATE", "key": fence, "result": "EQUAL", "create_revision": "0"},
                *self._queue_compares(name, owner, entry, fair),
            ],
            [
                {"requestPut": {"key": lock, "value": _b64(value), "lease": str(entry.lease)}},
                {"requestDeleteRange": {"key": _b64(self.wait_key(name, owner))}},
                {"requestPut": {"key": fence, "value": _b64(str(base).zfill(_BASE_DIGITS))}},
            ],
        )
        if not answer.get("succeeded"):
            return None
        entry.wait_rev, entry.lock_rev = 0, _revision(answer)
        return AcquireResult(True, base)

    def _create_fence_g(self, name: str) -> Generator[Any, Any, None]:
        fence = _b64(self.fence_key(name))
        yield from self._txn_g(
            "acquire",
            name,
            [{"target": "CREATE", "key": fence, "result": "EQUAL", "create_revision": "0"}],
            [
                {
                    "requestPut": {
                        "key": fence,
                        "value": _b64(str(self._new_base()).zfill(_BASE_DIGITS)),
                    }
                }
            ],
        )

    def _raise_floor_g(self, name: str, fence_kv: Mapping[str, Any]) -> Generator[Any, Any, None]:
        """Move the name's token base up to ``token_floor``: every later token is above
        it, and above every earlier token (the base only grows, and so does the revision)."""
        fence = _b64(self.fence_key(name))
        yield from self._txn_g(
            "acquire",
            name,
            [
                {
                    "target": "MOD",
                    "key": fence,
                    "result": "EQUAL",
                    "mod_revision": str(fence_kv.get("mod_revision")),
                }
            ],
            [
                {
                    "requestPut": {
                        "key": fence,
                        "value": _b64(str(self.token_floor).zfill(_BASE_DIGITS)),
                    }
                }
            ],
        )

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

    # -- waiting -----------------------------------------------------------------

    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        self._sync(self._wait_g(name, timeout, owner))

    async def await_release(
        self, name: str, timeout: float, *, owner: str = "", fair: bool = False
    ) -> None:
        if timeout <= 0:
            return
        self._check_pid()
        deadline = time.monotonic() + timeout
        entry = self._entries.get((name, owner)) if owner else None
        hub = self._loop_side().hub
        while True:
            watched, revision = await self._arun(
                self._retrying_g(
                    deadline, lambda: self._ahead_g(name, owner, entry), "wait for", name
                )
            )
            if not watched:
                return
            lease = entry.wait_lease if entry is not None and entry.wait_rev else 0
            outcome = await hub.wait(watched, revision, deadline, lease)
            if outcome != _AGAIN or time.monotonic() >= deadline:
                return  # seen, the deadline, or the waiter's lease gone: acquire says

    def _wait_g(self, name: str, timeout: float, owner: str) -> Generator[Any, Any, None]:
        """Until the key just before ``owner``'s waiter key is deleted (the lock key, for
        the first waiter or a caller not queued), or ``timeout``: a watch from the
        revision of the queue that was read, so no deletion in between is missed. The
        waiter's lease is renewed every third of its length meanwhile."""
        deadline = time.monotonic() + max(0.0, timeout)
        entry = self._entries.get((name, owner)) if owner else None
        if entry is not None and not (entry.wait_rev and entry.wait_ttl):
            entry = None  # not queued: nothing of its own to renew
        renew_every = max(0.2, entry.wait_ttl / 3) if entry is not None else 0.0
        renew_at = time.monotonic() + renew_every
        pause = 0.0  # before watching again after a stream that ended without an event
        while True:
            watched, revision = yield from self._retrying_g(
                deadline, lambda: self._ahead_g(name, owner, entry), "wait for", name
            )
            if not watched:
                return
            slice_end = min(deadline, renew_at) if entry is not None else deadline
            seen = yield from self._watch_delete_g(watched, revision + 1, slice_end, name)
            if seen == _SEEN:
                return
            if seen == _ENDED:
                # Nothing seen: look again, but not at once (a member, or something in
                # front of it, that ends every stream would make a busy loop). A
                # deletion meanwhile is not missed: the next watch starts at the
                # revision the queue is read at.
                pause = min(WATCH_RETRY_MAX, max(WATCH_RETRY_FIRST, pause * 2))
                yield _Pause(max(0.0, min(pause, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                return
            if entry is not None and time.monotonic() >= renew_at:
                left = yield from self._keepalive_g([entry.wait_lease], "wait for", name)
                if left[0] <= 0:
                    return  # the waiter's lease ran out: acquire queues it again
                renew_at = time.monotonic() + renew_every

    def _ahead_g(
        self, name: str, owner: str, entry: _Entry | None
    ) -> Generator[Any, Any, tuple[str, int]]:
        """The key to watch ("" to try again at once) and the revision it was read at."""
        lock = self.lock_key(name)
        answer = yield from self._txn_g(
            "wait for",
            name,
            [],
            [
                {"requestRange": {"key": _b64(lock)}},
                self._queue_range(self.wait_prefix(name)),
            ],
        )
        revision = _revision(answer)
        responses = answer.get("responses", [])
        holders = _kvs(responses[0])
        if owner and holders and self._owner_of(holders[0]) == owner:
            # Ours already: an acquire whose outcome was unknown (a timeout during an
            # election) was applied after all. Acquire again at once: it adopts it.
            return "", revision
        held = bool(holders)
        queue = [_unb64(kv["key"]).decode() for kv in _kvs(responses[1])]
        mine = self.wait_key(name, owner) if owner else ""
        if entry is None or not entry.wait_rev or mine not in queue:
            return (lock if held else ""), revision
        position = queue.index(mine)
        if position == 0:
            return (lock if held else ""), revision
        return queue[position - 1], revision

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

    def _queue_range(self, prefix: str) -> dict[str, Any]:
        return {
            "requestRange": {
                "key": _b64(prefix),
                "range_end": _prefix_end(prefix),
                "sort_order": "ASCEND",
                "sort_target": "CREATE",
                "keys_only": True,
            }
        }

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
