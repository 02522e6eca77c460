"""The session: the kazoo client, the session timeout the server grants (read at each
handshake), the connection's states and what a lost session takes with it, waiting for
a connection within ``connect_timeout``, a fork's fresh start, and the translation of
kazoo's errors (an unreachable ensemble is :class:`LockBackendUnavailable`)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, NoReturn

from kazoo.client import KazooClient
from kazoo.exceptions import (
    BadVersionError,
    ConnectionClosedError,
    ConnectionDropped,
    ConnectionLoss,
    KazooException,
    NodeExistsError,
    NoNodeError,
    OperationTimeoutError,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.serialization import Connect
from kazoo.protocol.states import KazooState

from distlocks.backends.zookeeper.config import _TLS_KEYS, DEFAULTS, ZooKeeperConfig
from distlocks.exceptions import LockBackendUnavailable, LockError
from distlocks.redaction import redact

logger = logging.getLogger("distlocks.backends.zookeeper")

#: Errors that mean "the ensemble cannot be reached now" rather than "it said no".
_UNAVAILABLE = (
    ConnectionLoss,
    ConnectionClosedError,
    SessionExpiredError,
    OperationTimeoutError,
    KazooTimeoutError,
)
#: Errors the recipe handles itself; passed through untranslated.
_EXPECTED = (NoNodeError, NodeExistsError, BadVersionError)


class ZooKeeperSession(ZooKeeperConfig):
    """The client and its session: every request of the classes above goes through
    :meth:`_ready` (a connected client) and :meth:`_get` (an answer, errors translated)."""

    @property
    def session_seconds(self) -> float:
        """The session timeout every lease decision counts with: the one the server
        granted at the last handshake, or, before the first, the one asked for."""
        return self._negotiated or self.session_timeout

    def _granted(self, seconds: float) -> None:
        """kazoo's connection thread, at each handshake (before CONNECTED is told):
        the server's answer to the session timeout asked for."""
        self._negotiated = seconds
        if seconds < self.session_timeout and self._warned_grant != seconds:
            self._warned_grant = seconds
            logger.warning(
                "ZooKeeper granted backend %r a %gs session, not the %gs asked for "
                "(OPTIONS['session_timeout']; the server's maxSessionTimeout bounds it): "
                "leases count with %gs, so use ttl <= %g, or raise maxSessionTimeout.",
                self.alias, seconds, self.session_timeout, seconds, seconds,
            )  # fmt: skip

    def _watch_handshake(self, client: KazooClient) -> None:
        """Read the session timeout the server grants at every handshake (connect
        and reconnect). kazoo does not keep it: it is in the answer to the Connect
        request, which its connection handler reads with ``_invoke``."""
        connection = getattr(client, "_connection", None)
        invoke = getattr(connection, "_invoke", None)
        if connection is None or invoke is None:  # pragma: no cover - another kazoo
            logger.warning(
                "Cannot read the session timeout ZooKeeper grants backend %r with this "
                "kazoo version: leases count with the %gs asked for, which is unsafe if "
                "the server grants less (keep session_timeout <= its maxSessionTimeout).",
                self.alias, self.session_timeout,
            )  # fmt: skip
            return

        def handshake(timeout: float, request: Any, xid: int | None = None) -> Any:
            try:
                answer = invoke(timeout, request, xid)
            except ConnectionDropped:
                # Connected, then the connection closed at the handshake: a server
                # refusing the session (or not serving yet).
                if isinstance(request, Connect) and self._client is client:
                    self._refused_since = self._refused_since or time.monotonic()
                raise
            if isinstance(request, Connect) and self._client is client:
                self._refused_since = None
            if isinstance(request, Connect) and isinstance(answer, tuple):
                granted = getattr(answer[0], "time_out", 0)
                if isinstance(granted, int) and granted > 0:
                    self._granted(granted / 1000)
            return answer

        connection._invoke = handshake

    def _on_state(self, state: str) -> None:
        """kazoo's connection thread: never block here."""
        now = time.monotonic()
        if state == KazooState.CONNECTED:
            self._last_ok = max(self._last_ok, now)
            self._connected.set()
            return
        self._connected.clear()
        if state == KazooState.SUSPENDED:
            # kazoo pings every third of the session timeout and suspends when a ping
            # goes unanswered: the server heard from us at most 2/3 of it ago.
            self._last_ok = max(self._last_ok, now - self.session_seconds * 2 / 3)
        if state == KazooState.LOST:
            # The session expired (or was closed): every ephemeral node of it is gone,
            # so every lease of it is lost and every waiter has lost its place.
            with self._state_lock:
                self._generation += 1
                waiting = list(self._waiting)
            for event in waiting:
                event.set()
            logger.warning("ZooKeeper session of backend %r lost", self.alias)
        else:
            logger.info("ZooKeeper connection of backend %r suspended", self.alias)

    def _new_client(self) -> KazooClient:
        opts = {**DEFAULTS, **self.options}
        tls = {key: opts[key] for key in _TLS_KEYS if key in opts}
        client = KazooClient(
            hosts=self.location,
            timeout=self.session_timeout,
            # Keep reconnecting in the background: a session survives a short outage.
            connection_retry={"max_tries": -1, "delay": 0.05, "backoff": 2, "max_delay": 1.0},
            command_retry=None,
            auth_data=[tuple(item) for item in opts.get("auth", [])] or None,
            logger=logging.getLogger("kazoo.client"),
            **tls,
        )
        client.add_listener(self._on_state)
        self._watch_handshake(client)
        return client

    def _ready(self, action: str, name: str, deadline: float | None = None) -> KazooClient:
        """The connected client; LockBackendUnavailable within ``connect_timeout`` (or
        at ``deadline``, monotonic, if that comes first)."""
        if self._pid != os.getpid():
            # A forked child: the parent's session and nodes are not ours to use.
            self._reset_after_fork()
        client = self._client
        if client is not None and self._refused_for_a_session():
            # A server that lost its data (restarted on an empty data directory)
            # refuses for good a client that has seen zxids above its own, and kazoo
            # keeps offering that zxid: only a new client (a new session, from zxid 0)
            # gets in. The old session's leases were already declared lost.
            self._replace(client)
            client = None
        if client is None:
            with self._client_lock:
                client = self._client
                if client is None:
                    client = self._new_client()
                    try:
                        self._probe(client)
                        client.start(timeout=self.connect_timeout)
                    except Exception as exc:
                        with_cause = self._unavailable(action, name, exc)
                        raise with_cause from exc
                    self._client = client
        within = self.connect_timeout
        if deadline is not None:
            within = max(0.0, min(within, deadline - time.monotonic()))
        if not self._connected.wait(within):
            raise LockBackendUnavailable(
                self.alias,
                f"{action} {name!r} failed: no connection to ZooKeeper at "
                f"{redact(self.location)} within {within:g}s",
            )
        return client

    def _replace(self, client: KazooClient) -> None:
        """Drop ``client`` and its session: every lease and place in a queue of it is
        lost, as when a session expires; the next call starts a new client."""
        with self._client_lock:
            if not self._client_is(client):
                return  # another thread did
            self._client = None
        client.remove_listener(self._on_state)
        self._refused_since = None
        self._connected.clear()
        with self._state_lock:
            self._generation += 1
            waiting = list(self._waiting)
        for event in waiting:
            event.set()
        logger.warning(
            "ZooKeeper backend %r: every handshake refused for a session timeout (a server "
            "that lost its data refuses a client that saw later zxids); starting a new "
            "session, its leases are lost",
            self.alias,
        )

        def stop() -> None:
            try:
                client.stop()
                client.close()
            except Exception:
                logger.debug("Error closing a replaced ZooKeeper client", exc_info=True)

        # kazoo's stop waits for its connection thread: not on the caller's time.
        threading.Thread(target=stop, name="distlocks-zk-replaced", daemon=True).start()

    def _refused_for_a_session(self) -> bool:
        """Every handshake for a whole session timeout answered by a closed
        connection, and the session in doubt: a server that answers but will not
        take this session, which has expired if it was ever known there. (A shorter
        refusal, as while a server starts or a proxy drops connections, keeps the
        session: it may live on, with its nodes.)"""
        since = self._refused_since
        return (
            since is not None
            and time.monotonic() - since >= self.session_seconds
            and self._session_doubtful()
        )

    def _client_is(self, client: KazooClient) -> bool:
        return self._client is client

    def _probe(self, client: KazooClient) -> None:
        """Fail at once when no server can be connected to (nothing listens, or the
        name does not resolve), instead of letting kazoo retry for the whole
        ``connect_timeout``: a page that lists the locks of every backend should not
        wait on one that is down. Only this call fails: the next one probes again."""
        failed: OSError | None = None
        for host, port in client.hosts:
            try:
                with socket.create_connection((host, port), timeout=self.connect_timeout):
                    return
            except ConnectionRefusedError as exc:
                failed = exc
            except socket.gaierror as exc:
                # No address for the name (a typo, or a malformed LOCATION kazoo reads
                # as a host name): kazoo could only retry the same lookup.
                failed = failed if isinstance(failed, ConnectionRefusedError) else exc
            except OSError:
                return  # unreachable or slow: kazoo's own timeout decides
        if failed is not None:
            raise failed

    def _reset_after_fork(self) -> None:
        self._pid = os.getpid()
        self._client = None  # the parent's threads are not in this process
        self._client_lock = threading.Lock()
        self._connected = threading.Event()
        self._nodes = {}
        self._permits = {}
        self._waiting = set()
        self._negotiated = None  # the child's session is negotiated anew
        self._refused_since = None
        self._cleaning = set()
        self._unknown = set()
        # A parent thread may have held it at the fork: the child's copy would stay
        # locked for good, and the child's first lost session would deadlock on it.
        self._state_lock = threading.Lock()

    def _unavailable(self, action: str, name: str, exc: BaseException) -> LockBackendUnavailable:
        detail = redact(f"{type(exc).__name__}: {exc}")
        return LockBackendUnavailable(
            self.alias, f"{action} {name!r} on ZooKeeper {redact(self.location)}: {detail}"
        )

    def _fail(self, action: str, name: str, exc: BaseException) -> NoReturn:
        if isinstance(exc, _UNAVAILABLE):
            raise self._unavailable(action, name, exc) from exc
        detail = redact(f"{type(exc).__name__}: {exc}")
        raise LockError(
            f"ZooKeeper error while trying to {action} lock {name!r} on backend "
            f"{self.alias!r}: {detail}"
        ) from exc

    def _get(self, action: str, name: str, result: Any) -> Any:
        """Wait for a kazoo async result, at most ``socket_timeout``; errors wrapped
        (except the few the recipe handles, which pass through)."""
        try:
            return result.get(timeout=self.socket_timeout)
        except _EXPECTED:
            raise
        except (KazooException, KazooTimeoutError) as exc:
            self._fail(action, name, exc)

    def _commit(self, action: str, name: str, txn: Any) -> list[Any]:
        results = self._get(action, name, txn.commit_async())
        return list(results)

    def _delete_quietly(self, client: KazooClient, path: str) -> None:
        try:
            client.delete_async(path).get(timeout=self.socket_timeout)
        except Exception:
            logger.debug("Could not delete %s", path, exc_info=True)

    def close(self) -> None:
        self._closed = True
        client, self._client = self._client, None
        if client is not None and self._pid == os.getpid():
            try:
                client.stop()
                client.close()
            except Exception:
                logger.debug("Error closing ZooKeeper client", exc_info=True)

    def local_lease(self, ttl: float) -> float:
        # A holder paused or cut off past the session the server granted may have lost
        # its node: never trust a lease longer than that session, whatever the ttl.
        return min(ttl, self.session_seconds)

    def _check_ttl(self, client: KazooClient, ttl: float) -> None:
        # Against the session the server granted, which may be shorter than asked.
        session = self.session_seconds
        if ttl > session and self._warned_ttl != session:
            self._warned_ttl = session
            asked = "" if session == self.session_timeout else f"; {self.session_timeout:g}s asked"
            logger.warning(
                "Lock ttl %gs on backend %r is longer than its ZooKeeper session timeout "
                "(%gs%s): a holder paused or cut off from the ensemble may trust its lease "
                "after the server freed the lock. Use ttl <= %g.",
                ttl, self.alias, session, asked, session,
            )  # fmt: skip

    def _session_doubtful(self) -> bool:
        """True when the server may have expired this session: cut off, with no answer
        to a request sent within the last session timeout. A lease is not trusted then,
        even before kazoo hears of the expiry (it does only once it reconnects)."""
        return (
            self._client is not None
            and not self._connected.is_set()
            and time.monotonic() - self._last_ok >= self.session_seconds
        )

    def _outage_pause(self, timeout: float) -> None:
        """A wait that found the ensemble unavailable (an election, a short outage):
        wait for the connection a little, and let the next acquire attempt try again
        within the caller's deadline, or raise."""
        self._connected.wait(max(0.0, min(timeout, self.connect_timeout)))
