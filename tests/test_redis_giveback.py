"""A timed-out acquire's give-back must not overtake the acquire it undoes.

An acquire whose reply does not come in time (a stalled server, a slow proxy, a lost
packet being retransmitted) is given back by the client. If that give-back reaches
the server before the late acquire (sent on another connection, which nothing held
up), it finds nothing to release, and the late acquire then grants the lock to an
owner that has already walked away: held by nobody until its ttl.

These tests hold up one connection in a proxy (the one that carries the acquire),
let the caller time out, wait until the give-back was sent, then let the held bytes
go: whatever the client sent, the lock (or permit) must end up free, long before its
ttl. Each path: the sync acquire on a pinned connection, the sync acquire through
the pool (more threads than pinned connections), the wait-and-acquire pipeline, the
asyncio acquire, semaphore and read-write permits, a Redlock master.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django.test import override_settings

from distlocks import alock, get_backend, lock, rwlock, semaphore
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import LockBackendUnavailable, LockNotAcquired
from tests.test_redis_halfwritten import own_prefix

pytestmark = pytest.mark.django_db(transaction=False)


class _Link:
    """One relayed connection: client socket, server socket, what is held back."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.held: list[bytes] | None = None  # chunks kept from the server, in order
        self.client_done = False  # the client closed its side while held
        self.sent: list[tuple[int, bytes]] = []  # (sequence, chunk) the client sent
        self.replies = 0  # chunks the server sent back
        self.swallow = False  # the server's replies are not passed on
        #: The server closed its side: it ran everything the client sent before its
        #: end of stream (Redis reads a connection's commands in order).
        self.server_done = False


class HoldingProxy:
    """Relays 127.0.0.1:``port`` to a Redis server; :meth:`hold` keeps back, from the
    first chunk that matches on, what one connection sends to the server (as a slow
    path or a lost packet would), while every other connection flows."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._match: Callable[[bytes], bool] | None = None
        self._sequence = 0
        #: The sequence number of the chunk that started the hold.
        self.held_at = 0
        self.links: list[_Link] = []
        self._closed = False
        #: New connections to reset as soon as they are accepted.
        self.refuse = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def hold(self, match: Callable[[bytes], bool]) -> None:
        with self._lock:
            self._match = match

    def held_link(self) -> _Link | None:
        with self._lock:
            return next((link for link in self.links if link.held is not None), None)

    def let_go(self) -> _Link:
        with self._lock:
            link = next(link for link in self.links if link.held is not None)
            chunks, link.held = link.held, None
            for chunk in chunks or ():
                link.server.sendall(chunk)
            if link.client_done:
                with contextlib.suppress(OSError):
                    link.server.shutdown(socket.SHUT_WR)
            return link

    def break_held(self, refuse_next: int) -> None:
        """Let the held bytes reach the server, swallow its reply, then reset the
        client's connection (the acquire ran; its connection broke); and reset the next
        ``refuse_next`` connections as soon as they are made (the retry breaks too)."""
        with self._lock:
            link = next(link for link in self.links if link.held is not None)
            chunks, link.held = link.held, None
            link.swallow = True
            self.refuse = refuse_next
            for chunk in chunks:
                link.server.sendall(chunk)
        _settle(lambda: link.replies > 0, "the acquire run")
        _reset(link.client)

    def sent_elsewhere(self, needles: tuple[bytes, ...], but: _Link) -> bool:
        """Another connection than ``but`` sent a chunk with all of ``needles`` since the
        hold began, and had a reply since (a release answered at once)."""
        with self._lock:
            for link in self.links:
                sent = [seq for seq, chunk in link.sent if all(n in chunk for n in needles)]
                if link is not but and sent and max(sent) > self.held_at and link.replies:
                    return True
            return False

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        for link in list(self.links):
            for sock in (link.client, link.server):
                with contextlib.suppress(OSError):
                    sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refused, self.refuse = self.refuse > 0, max(0, self.refuse - 1)
            if refused:
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                return
            link = _Link(client, server)
            with self._lock:
                self.links.append(link)
            threading.Thread(target=self._up, args=(link,), daemon=True).start()
            threading.Thread(target=self._down, args=(link,), daemon=True).start()

    def _up(self, link: _Link) -> None:
        while True:
            try:
                chunk = link.client.recv(65536)
            except OSError:
                chunk = b""
            with self._lock:
                if not chunk:
                    if link.held is not None:
                        link.client_done = True  # the FIN goes after what is held
                    else:
                        with contextlib.suppress(OSError):
                            link.server.shutdown(socket.SHUT_WR)
                    return
                self._sequence += 1
                link.sent.append((self._sequence, chunk))
                if link.held is None and self._match is not None and self._match(chunk):
                    link.held, self._match, self.held_at = [], None, self._sequence
                if link.held is not None:
                    link.held.append(chunk)
                    continue
                try:
                    link.server.sendall(chunk)
                except OSError:
                    return

    def _down(self, link: _Link) -> None:
        while True:
            try:
                chunk = link.server.recv(65536)
            except OSError:
                link.server_done = True
                return
            if not chunk:
                link.server_done = True
                with contextlib.suppress(OSError):
                    link.client.shutdown(socket.SHUT_WR)
                return
            with self._lock:
                link.replies += 1
                if link.swallow:
                    continue
            with contextlib.suppress(OSError):
                link.client.sendall(chunk)


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset, not a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # Wakes the relay thread blocked reading it (a close alone would not, and
        # would send nothing while that read goes on); sends nothing by itself.
        sock.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        sock.close()


def _settle(condition: Callable[[], Any], what: str, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {within} s"
        time.sleep(0.01)


@pytest.fixture
def proxy(settings: Any) -> Iterator[HoldingProxy]:
    port = int(settings.REDIS_URL.rsplit(":", 1)[1].split("/")[0])
    relay = HoldingProxy(port)
    yield relay
    relay.close()


@contextlib.contextmanager
def _alias(settings: Any, url: str, **options: Any) -> Iterator[RedisBackend]:
    with own_prefix(settings, "giveback", url, **{"socket_timeout": 0.5, **options}) as backend:
        yield backend


def _undone(proxy: HoldingProxy, name: str, free: Callable[[], bool]) -> None:
    """The caller has timed out: wait until its give-back was sent (held behind the
    acquire, or answered on another connection), let the held bytes go, wait until the
    server answered them, then the lock must be free (its ttl is a minute)."""
    link = proxy.held_link()
    assert link is not None, "the acquire was not held"
    # A give-back names the release's tombstone key, "<base>:released:<owner>".
    needles = (name.encode(), b"released:")
    _settle(
        lambda: (
            any(all(n in chunk for n in needles) for chunk in link.held or ())
            or proxy.sent_elsewhere(needles, but=link)
        ),
        "the give-back sent",
    )
    replies = link.replies
    proxy.let_go()
    _settle(lambda: link.replies > replies, "the late acquire answered")
    _settle(free, "the lock given back after the late acquire", within=5.0)


def _holds_acquire(needle: str, script: str = "EVALSHA") -> Callable[[bytes], bool]:
    return lambda chunk: needle.encode() in chunk and script.encode() in chunk


def test_sync_acquire_on_a_pinned_connection(settings: Any, proxy: HoldingProxy, name: str) -> None:
    with _alias(settings, proxy.url()) as backend:
        with lock(f"{name}:warm", backend=backend.alias, timeout=0):
            pass
        proxy.hold(_holds_acquire(name))
        with pytest.raises(LockBackendUnavailable):
            lock(name, backend=backend.alias, ttl=60, timeout=0).acquire()
        _undone(proxy, name, lambda: backend.inspect(name) is None)


def test_sync_acquire_through_the_pool(settings: Any, proxy: HoldingProxy, name: str) -> None:
    """A thread beyond the pinned ones acquires through the client's pool."""
    with _alias(settings, proxy.url()) as backend:
        backend.MAX_PINNED = 0  # type: ignore[misc]
        with lock(f"{name}:warm", backend=backend.alias, timeout=0):
            pass
        proxy.hold(_holds_acquire(name))
        with pytest.raises(LockBackendUnavailable):
            lock(name, backend=backend.alias, ttl=60, timeout=0).acquire()
        _undone(proxy, name, lambda: backend.inspect(name) is None)
        # The connection, drained, went back to the pool, once.
        pool = backend.client.connection_pool
        _settle(lambda: not pool._in_use_connections, "every connection back in the pool")
        idle = [id(conn) for conn in pool._available_connections]
        assert len(idle) == len(set(idle))


def test_wait_and_acquire_pipeline(settings: Any, proxy: HoldingProxy, name: str) -> None:
    """A waiter's blocking pop and acquire, pipelined, held up; the holder releases
    before they reach the server, so the late acquire would grant."""
    with _alias(settings, proxy.url()) as backend:
        holder = lock(name, backend=backend.alias, ttl=60, timeout=0).acquire()
        proxy.hold(_holds_acquire(name, "BLPOP"))
        with pytest.raises(LockBackendUnavailable):
            lock(name, backend=backend.alias, ttl=60, timeout=30).acquire()
        holder.release()
        _undone(proxy, name, lambda: backend.inspect(name) is None)


def test_asyncio_acquire(settings: Any, proxy: HoldingProxy, name: str) -> None:
    with _alias(settings, proxy.url()) as backend:

        async def main() -> None:
            async with alock(f"{name}:warm", backend=backend.alias, timeout=0):
                pass
            proxy.hold(_holds_acquire(name))
            with pytest.raises(LockBackendUnavailable):
                await alock(name, backend=backend.alias, ttl=60, timeout=0).acquire()

        asyncio.run(main())
        _undone(proxy, name, lambda: backend.inspect(name) is None)


@pytest.mark.parametrize("kind", ["semaphore", "read", "write"])
def test_permit_acquire(settings: Any, proxy: HoldingProxy, name: str, kind: str) -> None:
    with _alias(settings, proxy.url()) as backend:

        def permit(permit_name: str) -> Any:
            if kind == "semaphore":
                return semaphore(permit_name, backend=backend.alias, limit=1, ttl=60, timeout=0)
            both = rwlock(permit_name, backend=backend.alias)
            return (both.read if kind == "read" else both.write)(ttl=60, timeout=0)

        with permit(f"{name}:warm"):  # the script loaded: the late acquire runs it
            pass
        take = permit(name)
        proxy.hold(_holds_acquire(name))
        with pytest.raises(LockBackendUnavailable):
            take.acquire()
        _undone(proxy, name, lambda: not backend.permit_holders(kind, name))


def test_redlock_master(settings: Any, proxy: HoldingProxy, name: str) -> None:
    """One Redlock master's grant held up: the lease is granted by the other two; the
    held master's late grant is given back by its give-back, sent behind it."""
    port = int(settings.REDLOCK_URLS[0].rsplit(":", 1)[1].split("/")[0])
    relay = HoldingProxy(port)
    try:
        urls = [relay.url(), *settings.REDLOCK_URLS[1:]]
        alias = f"giveback-{uuid.uuid4().hex[:8]}"
        config = {"BACKEND": "distlocks.backends.redlock.RedlockBackend", "LOCATION": urls,
                  "OPTIONS": {"socket_timeout": 0.5, "key_prefix": alias}}  # fmt: skip
        with override_settings(DISTLOCKS_BACKENDS={**settings.DISTLOCKS_BACKENDS, alias: config}):
            backend = get_backend(alias)
            with lock(f"{name}:warm", backend=alias, timeout=0):
                pass
            relay.hold(_holds_acquire(name))
            with lock(name, backend=alias, ttl=60, timeout=0):
                pass
            master = backend.masters[0]  # type: ignore[attr-defined]
            _undone(relay, name, lambda: master.inspect(name) is None)
            backend.close()
    finally:
        relay.close()


@pytest.mark.parametrize("path", ["sync", "asyncio"])
def test_a_connection_broken_after_the_acquire_ran_gives_back_on_a_new_one(
    settings: Any, proxy: HoldingProxy, name: str, path: str
) -> None:
    """The acquire reached the server and ran, then its connection broke, and so did
    the retry's (a reset as soon as it connected): nothing can follow the acquire on
    its connection any more, so the give-back goes on a new one."""
    with _alias(settings, proxy.url(), socket_timeout=10) as backend:
        with lock(f"{name}:warm", backend=backend.alias, timeout=0):
            pass
        proxy.hold(_holds_acquire(name))
        errors: list[BaseException] = []

        def acquire() -> None:
            try:
                if path == "sync":
                    lock(name, backend=backend.alias, ttl=60, timeout=0).acquire()
                else:
                    asyncio.run(alock(name, backend=backend.alias, ttl=60, timeout=0).acquire())
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=acquire)
        thread.start()
        _settle(lambda: proxy.held_link() is not None, "the acquire held")
        proxy.break_held(refuse_next=1)
        thread.join(30)
        assert len(errors) == 1 and isinstance(errors[0], LockBackendUnavailable), errors
        assert isinstance(errors[0].__cause__, redis.ConnectionError), errors[0].__cause__
        _settle(lambda: backend.inspect(name) is None, "given back on a new connection", 10)


def test_a_lock_not_granted_late_is_left_to_its_holder(
    settings: Any, proxy: HoldingProxy, name: str
) -> None:
    """The give-back releases only the caller's own lease: a late acquire refused (the
    lock held by another) leaves the holder's lock alone."""
    with _alias(settings, proxy.url()) as backend:
        holder = lock(name, backend=backend.alias, ttl=60, timeout=0).acquire()
        proxy.hold(_holds_acquire(name))
        with pytest.raises((LockBackendUnavailable, LockNotAcquired)):
            lock(name, backend=backend.alias, ttl=60, timeout=0).acquire()
        link = proxy.held_link()
        assert link is not None
        proxy.let_go()
        _settle(lambda: link.replies > 0, "the late acquire answered")
        info = backend.inspect(name)
        assert info is not None and info.owner == holder.owner
        holder.release()


def _give_back_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("distlocks-give-back"))


def test_a_burst_of_timed_out_acquires_shares_a_few_threads(
    settings: Any, redis_client: redis.Redis, name: str
) -> None:
    """A stalled server times out many acquires at once: their give-backs (sent behind
    each, and once more on another connection) are drained and sent by a bounded set of
    threads, not a thread or two per acquire; queued ones are not lost: once the server
    answers again, every lock is given back."""
    from distlocks.backends.base import Holder
    from distlocks.backends.redis.background import GIVE_BACK_THREADS

    holder = Holder(host="test", pid=1, thread="t", extra={})
    burst = 4 * GIVE_BACK_THREADS
    names = [f"{name}:{i}" for i in range(burst)]
    with _alias(settings, settings.REDIS_URL) as backend:
        assert backend.acquire(f"{name}:warm", "warm", 5, holder).acquired  # scripts loaded
        errors: list[BaseException] = []

        def take(lock_name: str) -> None:
            try:
                backend.acquire(lock_name, "me", 60, holder)
            except BaseException as exc:
                errors.append(exc)

        # Every script waits (a write may follow) until unpaused; the pause is long,
        # and lifted as soon as every acquire has timed out.
        redis_client.execute_command("CLIENT", "PAUSE", 120_000, "WRITE")
        try:
            threads = [threading.Thread(target=take, args=(n,)) for n in names]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert len(errors) == burst, errors
            assert all(isinstance(e, LockBackendUnavailable) for e in errors), errors
            # Drains and give-backs on another connection: one bounded set each.
            assert _give_back_threads() <= 2 * GIVE_BACK_THREADS, _give_back_threads()
        finally:
            redis_client.execute_command("CLIENT", "UNPAUSE")
        _settle(
            lambda: all(backend.inspect(n) is None for n in names),
            "every lock given back",
            within=60.0,
        )


def test_the_give_back_threads_are_bounded_and_lose_no_work() -> None:
    from distlocks.backends.redis.background import GIVE_BACK_THREADS, _Workers

    workers = _Workers("test-bounded")
    gate = threading.Event()
    done: list[int] = []
    lock_done = threading.Lock()

    def job(n: int) -> None:
        gate.wait(30)
        with lock_done:
            done.append(n)

    for n in range(10 * GIVE_BACK_THREADS):
        workers.submit(job, n)
    assert workers.threads == GIVE_BACK_THREADS
    gate.set()
    _settle(lambda: len(done) == 10 * GIVE_BACK_THREADS, "every job run")
    assert sorted(done) == list(range(10 * GIVE_BACK_THREADS))
    # Idle threads take new work: no thread more.
    workers.submit(job, -1)
    _settle(lambda: -1 in done, "the next job run")
    assert workers.threads == GIVE_BACK_THREADS
