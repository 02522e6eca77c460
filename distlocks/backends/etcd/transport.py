"""The etcd backend's transport: the state of its connections and the two drivers that
carry out the steps the protocol generators yield (:mod:`.protocol`). ``_sync`` runs
them on ``http.client`` (a kept-alive connection per thread), ``_arun`` on asyncio
streams (:mod:`.http11`; kept-alive connections per event loop); clean-ups of a
cancelled caller run as tasks of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.base import (
    BaseBackend,
)
from distlocks.backends.capabilities import Listing, Permits, Waiting
from distlocks.backends.etcd import http11
from distlocks.backends.etcd.config import (
    DEFAULTS,
    _credentials,
    _Endpoint,
    _parse_endpoints,
    needs_tls,
    ssl_context,
)
from distlocks.backends.etcd.hub import _Hub
from distlocks.backends.etcd.protocol import (
    _Discard,
    _NextLine,
    _OpenWatch,
    _Pause,
    _Post,
    _Reply,
)
from distlocks.exceptions import LockBackendUnavailable

#: The backend's one logger, whichever module logs.
logger = logging.getLogger("distlocks.backends.etcd")

if TYPE_CHECKING:
    from distlocks.backends.etcd.lock_acquire import _Entry
    from distlocks.backends.etcd.watch import EtcdWatches

T = TypeVar("T")


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Mark a clean-up task's outcome as seen (its caller may have been cancelled)."""
    if not task.cancelled():
        task.exception()


@dataclasses.dataclass
class _LoopSide:
    """One event loop's connections: those kept alive (most recently used last) and
    the limit on requests in flight, the waiters' shared watch and running clean-ups."""

    calls: asyncio.Semaphore
    hub: _Hub
    idle: list[http11.Connection] = dataclasses.field(default_factory=list)
    #: Clean-ups running as tasks of their own (kept here until done).
    cleanups: set[asyncio.Task[None]] = dataclasses.field(default_factory=set)


class EtcdTransport(Listing, Waiting, Permits, BaseBackend):
    """Connections and drivers of :class:`~distlocks.backends.etcd.EtcdBackend`."""

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
        self._ssl = ssl_context(opts) if needs_tls(self.endpoints, opts) else None
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

    # -- HTTP ----------------------------------------------------------------------
    # The protocol (which member to ask, what to retry, what an answer means, every
    # lock recipe) is written once, as generators that yield transport steps (_Post,
    # _Discard, _OpenWatch, _NextLine) and get their outcomes back. Two drivers carry
    # the steps out: _sync on http.client (a kept-alive connection per thread), _arun on
    # asyncio streams (kept-alive connections per event loop). Every blocking method is
    # `self._sync(self._<name>_g(...))`, every asyncio one `await self._arun(...)`.

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
            side = self._loops[loop] = _LoopSide(
                asyncio.Semaphore(self.ASYNC_CALLS), _Hub(cast("EtcdWatches", self))
            )
        return side

    async def _arun(
        self,
        steps: Generator[Any, Any, T],
        unanswered: list[http11.Connection] | None = None,
    ) -> T:
        """:meth:`_sync` on asyncio: kept-alive connections of the running loop for
        requests, a connection of its own for a watch. Cancelled mid-request, the
        connection is closed (its answer would be unread), or, given ``unanswered``,
        added to it, for the caller to read that answer before it cleans up."""
        self._check_pid()
        side = self._loop_side()
        watch: http11.Connection | None = None
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

    async def _aconnect(self, index: int) -> http11.Connection:
        endpoint = self.endpoints[index]
        context = self._ssl if endpoint.scheme == "https" else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                return await http11.connect(endpoint.host, endpoint.port, context, index)
        except TimeoutError:
            raise TimeoutError(f"no connection within {self.connect_timeout:g} s") from None

    async def _apost(
        self,
        side: _LoopSide,
        step: _Post,
        unanswered: list[http11.Connection] | None = None,
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
        conn: http11.Connection | None = None
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

    async def _aopen_watch(self, step: _OpenWatch) -> tuple[_Reply, http11.Connection | None]:
        conn: http11.Connection | None = None
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
        conn: http11.Connection, timeout: float
    ) -> tuple[bytes | None, BaseException | None]:
        try:
            async with asyncio.timeout(timeout):
                return await conn.next_line(), None
        except TimeoutError:
            return None, None
        except (OSError, EOFError, ValueError, http.client.HTTPException) as exc:
            return None, exc

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

    def _clean_up(
        self,
        steps: Callable[[], Generator[Any, Any, None]],
        unanswered: Sequence[http11.Connection] = (),
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
        unanswered: list[http11.Connection],
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
