"""The PostgreSQL backend's transport: its own pool of lock connections, and the
reply watchdog that bounds every wait for the server's answer.

Kept apart from Django's connections: a session-mode lock is pinned to one of these
until release, so Django closing or reusing its own connections never drops a lock.
The fork rule for these connections (a child never uses its parent's) is
:mod:`.fork`'s.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import psycopg
import psycopg.errors
from psycopg import pq

from distlocks.backends.postgres.wire import Statement, values


class NoAnswer(psycopg.OperationalError):
    """The server did not answer a request in time; the connection was cut."""


class Watchdog:
    """Cuts the connections whose server stopped answering.

    libpq waits for a reply as long as the TCP connection lives, and a server that is
    stopped, frozen or behind a silent network keeps it alive (its kernel, or a proxy
    in between, still acknowledges): keepalives and ``tcp_user_timeout`` never fire.
    Each request registers its deadline here; one thread shuts down the socket of a
    request still unanswered at its deadline, which ends libpq's wait at once with an
    error. The connection is then unusable, and the server frees its locks when it
    sees it closed."""

    TICK = 0.1

    def __init__(self) -> None:
        self._watched: dict[int, tuple[float, Connection]] = {}
        self._wake = threading.Event()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # True while the thread sleeps with no timeout (nothing watched for a tick):
        # only then does a new request wake it. While it ticks, it finds the request
        # at its next tick, within TICK of any deadline, and a busy client does not
        # pay a thread wake-up (two switches of the interpreter lock) per statement.
        self._asleep = True
        # Requests registered since the thread last looked: a quiet tick first.
        self._requests = 0

    def watch(self, conn: Connection, deadline: float) -> None:
        self._watched[id(conn)] = (deadline, conn)
        self._requests += 1
        if self._asleep:  # also before the thread is started (it ticks once it runs)
            if self._thread is None:
                self._start()
            self._wake.set()

    def unwatch(self, conn: Connection) -> None:
        self._watched.pop(id(conn), None)

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="distlocks-pg-watchdog")
                thread.daemon = True
                thread.start()
                self._thread = thread

    def _run(self) -> None:
        # Ticking from the start: a request registered from now on is found at the next
        # tick, and sets no event (``_asleep`` was True until the first quiet tick, so a
        # client that never paused paid an event set per request for as long as it ran).
        self._asleep = False
        seen = -1
        while True:
            if not self._watched and self._requests == seen:
                # A whole tick without a request: sleep until the next one. Cleared
                # and marked before looking again, so that a request registered in
                # between either is seen here or sets the event.
                self._wake.clear()
                self._asleep = True
                if not self._watched:
                    self._wake.wait()
                self._asleep = False
            seen = self._requests
            now = time.monotonic()
            for key, entry in list(self._watched.items()):
                # The same registration still (not the connection's next request).
                if entry[0] <= now and self._watched.get(key) is entry:
                    self._watched.pop(key, None)
                    entry[1].cut()
            time.sleep(self.TICK)

    def after_fork(self) -> None:
        self._watched = {}
        self._wake = threading.Event()
        self._start_lock = threading.Lock()
        self._thread = None
        self._asleep = True
        self._requests = 0


watchdog = Watchdog()


class Connection(psycopg.Connection[Any]):
    """A connection whose every request waits at most ``reply_timeout`` seconds for
    the server (plus ``lock_wait`` while a lock wait is under way): see
    :class:`Watchdog`."""

    reply_timeout: float | None = None
    lock_wait: float = 0.0
    _cut = False
    #: The pool that counts this connection (None: made outside any pool).
    _pool: Pool | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Held around each blocking libpq call of the fast path: close() must not free
        # the PGconn under one (libpq would read freed memory).
        self._in_libpq = threading.Lock()
        # The cursor of fetchone(), and the lock that keeps its result to the caller
        # whose statement made it.
        self._cursor: psycopg.Cursor[Any] | None = None
        self._cursor_lock = threading.Lock()
        # The fast path's statements prepared on this connection's server session
        # (a new connection starts with none), and the client encoding they use:
        # psycopg's name for it (set once connected; nothing here changes it).
        self._fast_statements: set[bytes] = set()
        self._fast_encoding: str = self.info.encoding
        #: Whether values encoded ahead in UTF-8 (:meth:`value_encoded`) may be sent.
        self.utf8 = self._fast_encoding == "utf-8"
        # ended_while_idle()'s probe of the socket: a poll object registered once
        # costs half a select() per checkout.
        self._idle_probe = select.poll()
        self._idle_probe.register(self.pgconn.socket, select.POLLIN)
        # A descriptor of our own for the socket, to shut it down from another thread
        # (the watchdog, a release: see interrupt()). libpq closes its own descriptor
        # when a request fails, and its number may then be reused by any new socket of
        # the process: shutting down "libpq's socket" by number could cut another one.
        # Ours names this socket until close() closes it, under _shutdown_lock.
        self._own_socket: socket.socket | None = None
        self._shutdown_lock = threading.Lock()
        try:
            fd = os.dup(self.pgconn.socket)
            try:
                self._own_socket = socket.socket(fileno=fd)
            except BaseException:
                os.close(fd)  # not a socket object's yet: nothing else would close it
                raise
        except BaseException:
            # No descriptor left for the duplicate (EMFILE), or interrupted: the
            # connection is made and nobody else will ever close it (the pool counts
            # only what this returns), so its socket and server session end here.
            self.close()
            raise

    def fetchone(self, query: str, params: Any) -> Any:
        """The first row of ``query`` (None if it has none), on this connection's own
        cursor: ``execute()`` builds a new cursor each time, and with it new adapters
        that look up how to send each parameter again (about 20 us of client CPU per
        lock cycle). Not for pipelines, whose results are read later."""
        with self._cursor_lock:
            cursor = self._cursor
            if cursor is None:
                cursor = self._cursor = self.cursor()
            return cursor.execute(query, params).fetchone()

    def value(self, statement: Statement, params: Mapping[str, Any]) -> Any:
        """The first value of the first row of ``statement`` (read by its ``load``;
        None with no row), sent on the fast path (:mod:`.wire`): prepared once on this
        connection, then one ``PQexecPrepared`` per call, under the reply watchdog,
        its failures raised as psycopg raises them. About a third of a cursor's
        client CPU per statement."""
        return self.value_encoded(statement, values(statement, params, self._fast_encoding))

    def value_encoded(self, statement: Statement, args: list[bytes | None]) -> Any:
        """:meth:`value` with the parameters already encoded (by
        :func:`.wire.encode`, in this connection's encoding), in ``$n`` order."""
        with self.lock:
            name = statement.name
            if name not in self._fast_statements:
                self._prepare(statement)
            result = self._request(self.pgconn.exec_prepared, name, args)
            if result is None:
                # Not prepared any more (DISCARD ALL or DEALLOCATE ALL ran on this
                # session): prepared again and sent again; nothing ran.
                self._fast_statements.discard(name)
                self._prepare(statement)
                result = self._request(self.pgconn.exec_prepared, name, args)
                if result is None:
                    raise psycopg.errors.InvalidSqlStatementName(
                        f"prepared statement {name.decode()!r} vanished again"
                    )
        return statement.load(result.get_value(0, 0) if result.ntuples else None)

    def _prepare(self, statement: Statement) -> None:
        # Recorded before it is sent: an exception raised asynchronously (Ctrl-C, a
        # Celery soft time limit) just after the server prepared it must not leave a
        # statement the session has and this set lacks (every later PREPARE of it
        # would fail with "already exists", and a lease's renewal would report its
        # lock lost). One recorded but never sent is harmless: the next
        # exec_prepared finds it missing ("does not exist") and prepares it then.
        self._fast_statements.add(statement.name)
        try:
            result = self._request(self.pgconn.prepare, statement.name, statement.query,
                                   statement.types)  # fmt: skip
        except psycopg.Error:
            self._fast_statements.discard(statement.name)  # refused, or no answer
            raise
        if result is None:  # pragma: no cover - never expected from a PREPARE
            self._fast_statements.discard(statement.name)
            raise psycopg.InternalError(f"could not prepare {statement.name.decode()!r}")

    def _request(self, send: Any, *args: Any) -> Any:
        """One blocking libpq request (``send(*args)``, which releases the GIL), under
        the reply watchdog: the watchdog's shutdown of the socket ends libpq's wait
        with an error, raised as :class:`NoAnswer`. Returns the PGresult; None if the
        statement named is not prepared on the session (and the session still idle,
        so it can be prepared and sent again). Errors as a cursor raises them: the
        server's as their ``psycopg.errors`` class, a lost connection as
        OperationalError. A Ctrl-C during the call takes effect when it returns
        (libpq resumes its wait on EINTR): at the latest at the watchdog's deadline,
        for statements that answer in microseconds."""
        pgconn = self.pgconn
        reply_timeout = self.reply_timeout
        try:
            # Registered inside the try: an exception raised asynchronously as it
            # registers must not leave a deadline that cuts the connection later.
            if reply_timeout is not None:
                watchdog.watch(self, time.monotonic() + reply_timeout + self.lock_wait)
            with self._in_libpq:
                if pgconn.status != _OK:  # closed, or broken by an earlier request
                    raise psycopg.OperationalError("the connection is closed")
                result = send(*args)
        except psycopg.OperationalError as exc:  # no result at all (libpq's NULL)
            if self._cut:
                raise self._no_answer() from exc
            raise
        finally:
            if reply_timeout is not None:
                watchdog._watched.pop(id(self), None)  # unwatch(), without the call
        if self._cut:  # cut just as the answer came: the connection is gone all the same
            raise self._no_answer()
        status = result.status
        if status in (_TUPLES_OK, _COMMAND_OK):
            return result
        if status != _FATAL_ERROR:
            raise psycopg.InternalError(
                f"unexpected result status from query: {pq.ExecStatus(status).name}"
            )
        state = result.error_field(_SQLSTATE)
        if state is None and pgconn.status == _BAD:
            # libpq's own error (no SQLSTATE): the connection broke under the request,
            # which psycopg's wait raises as OperationalError.
            raise psycopg.OperationalError(result.get_error_message(self._fast_encoding))
        if state == b"26000" and pgconn.transaction_status == _IDLE:
            return None
        raise psycopg.errors.error_from_result(result, encoding=self._fast_encoding)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        reply_timeout = self.reply_timeout
        if reply_timeout is None:
            return psycopg.Connection.wait(self, *args, **kwargs)
        try:
            watchdog.watch(self, time.monotonic() + reply_timeout + self.lock_wait)
            result = psycopg.Connection.wait(self, *args, **kwargs)
        except psycopg.OperationalError as exc:
            if self._cut:
                raise self._no_answer() from exc
            raise
        finally:
            watchdog._watched.pop(id(self), None)  # unwatch(), without the call
        if self._cut:  # cut just as the answer came: the connection is gone all the same
            raise self._no_answer()
        return result

    def close(self) -> None:
        """Close the connection; a fast-path request blocked in libpq on another
        thread is ended first (its socket shut down: it fails as a lost connection),
        and the connection freed only once that call has returned."""
        if not self._in_libpq.acquire(blocking=False):
            self._shut_down()
            self._in_libpq.acquire()
        try:
            super().close()
        finally:
            self._in_libpq.release()
            with self._shutdown_lock:
                own, self._own_socket = self._own_socket, None
            if own is not None:
                own.close()

    def interrupt(self) -> None:
        """End this connection's session from any thread: a request waiting in libpq
        fails at once (as a lost connection), and the server ends the session, freeing
        its locks, as soon as it sees the connection end. The connection is unusable
        afterwards; whoever uses it closes it."""
        self._shut_down()

    def _no_answer(self) -> NoAnswer:
        return NoAnswer(
            f"no answer from the server within {self.reply_timeout:g} s "
            f"(OPTIONS['socket_timeout']); the connection was closed"
        )

    def cut(self) -> None:
        """Shut the socket down under libpq's wait (from the watchdog thread)."""
        self._cut = True
        self._shut_down()

    def _shut_down(self) -> None:
        """End any wait on this connection's socket at once (libpq's, or psycopg's)."""
        with self._shutdown_lock:
            own = self._own_socket
            if own is None:
                return  # closed: the wait has ended anyway
            # Not connected any more (OSError): the wait has ended anyway.
            with contextlib.suppress(OSError):
                own.shutdown(socket.SHUT_RDWR)


class Pool:
    """A small LIFO pool of autocommit connections, connected in the caller's thread
    so that a connection failure surfaces at once, with its cause."""

    def __init__(
        self,
        kwargs: dict[str, Any],
        max_size: int,
        timeout: float,
        reply_timeout: float | None = None,
    ) -> None:
        self.kwargs = kwargs
        self.max_size = max_size
        self.timeout = timeout
        self.reply_timeout = reply_timeout
        self._idle: list[Connection] = []
        self._count = 0
        # The condition's own lock, taken directly on the hot path (a Condition's
        # __enter__ and notify() are Python code); notify() only when someone waits.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0
        self._closed = False

    def get(self, timeout: float | None = None) -> Connection:
        """An idle connection, a new one, or one given back within ``timeout`` seconds
        (default: ``OPTIONS['pool_timeout']``); :class:`PoolExhausted` after that."""
        deadline = None
        while True:
            with self._lock:
                if self._idle:
                    conn = self._idle.pop()
                elif self._count < self.max_size:
                    self._count += 1
                    break
                else:
                    now = time.monotonic()
                    if deadline is None:
                        deadline = now + (self.timeout if timeout is None else timeout)
                    left = deadline - now
                    if left <= 0:
                        raise PoolExhausted
                    self._waiting += 1
                    try:
                        self._cond.wait(left)
                    finally:
                        self._waiting -= 1
                    continue
            # ended_while_idle(), inlined, and outside the pool's lock: its probe is a
            # system call, and other threads check out and give back meanwhile.
            try:
                if conn.pgconn.status != _BAD and not conn._idle_probe.poll(0):
                    return conn
            except (OSError, ValueError, psycopg.Error):
                pass
            except BaseException:
                # Interrupted (a signal's handler: Ctrl-C, a Celery soft time limit)
                # with the connection off the idle list and in no caller's hands: its
                # slot must not go with it, or the pool stays short of one for good.
                self._drop(conn)
                raise
            self._drop(conn)
        try:
            conn = Connection.connect(**self.kwargs)
            conn.reply_timeout = self.reply_timeout
            conn._pool = self
            return conn
        except BaseException:
            with self._lock:
                self._count -= 1
                if self._waiting:
                    self._cond.notify()
            raise

    def _drop(self, conn: Connection) -> None:
        """Close a connection checked out of the idle list and give back its slot (even
        if the close is interrupted)."""
        try:
            conn.close()
        finally:
            with self._lock:
                self._count -= 1
                if self._waiting:
                    self._cond.notify()

    def put(self, conn: Connection) -> None:
        owner = conn._pool
        if owner is not self and owner is not None:
            # Checked out before its backend closed that pool and made this one (a
            # settings change): it is counted there, and closed there.
            owner.put(conn)
            return
        pgconn = conn.pgconn
        with self._lock:
            if self._closed or pgconn.status == _BAD or pgconn.transaction_status != _IDLE:
                self._count -= 1
                if not conn.closed:
                    conn.close()
            else:
                self._idle.append(conn)
            if self._waiting:
                self._cond.notify()

    def close(self) -> None:
        """Close the idle connections; those checked out are closed as they come back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for conn in idle:
            conn.close()


_OK = pq.ConnStatus.OK
_BAD = pq.ConnStatus.BAD
_IDLE = pq.TransactionStatus.IDLE
_TUPLES_OK = int(pq.ExecStatus.TUPLES_OK)
_COMMAND_OK = int(pq.ExecStatus.COMMAND_OK)
_FATAL_ERROR = int(pq.ExecStatus.FATAL_ERROR)
_SQLSTATE = pq.DiagnosticField.SQLSTATE


class PoolExhausted(Exception):
    """Every connection of the pool stayed in use for the whole timeout."""


def ended_while_idle(conn: Connection) -> bool:
    """Whether an idle pooled connection is closed, or was ended by the server (a
    DBA's pg_terminate_backend, ``idle_session_timeout``, a restart or failover).

    An idle connection of ours expects nothing from the server: anything to read on
    its socket (the server's last words, or the end of the stream) means it is gone,
    and it is replaced before a lock statement is sent on it. One poll, no round trip.
    """
    if conn.closed:
        return True
    try:
        return bool(conn._idle_probe.poll(0))  # readable, hung up, or not a socket any more
    except (OSError, ValueError, psycopg.Error):
        return True
