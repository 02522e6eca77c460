"""A TCP proxy that loses a reply: the request reaches the server, which runs it,
and the connection is reset before its answer gets back to the client.

That is the fault a client cannot tell from "the request never arrived": redis-py
sees the connection broken, reconnects and sends the same request again. Tests arm
the proxy with a byte string found in the request (a script's SHA-1, an owner id);
the first connection that forwards it to the server has the server's next reply
swallowed, then both of its sockets are reset. ``before_reset`` runs in between, with
the first request already applied on the server: the place for another client to act
before the retry arrives.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

#: SO_LINGER on with a zero timeout: close() sends a reset instead of a FIN.
_RESET_LINGER = struct.pack("ii", 1, 0)


class LostReplyProxy:
    """Relays 127.0.0.1:``port`` to 127.0.0.1:``upstream_port``, one thread pair per
    connection; :meth:`lose_reply_to` loses the reply to one request."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        #: The database :meth:`url` names unless told another.
        self.db = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._needle: bytes | None = None
        self._before_reset: Callable[[], None] | None = None
        #: Replies swallowed so far, and connections accepted.
        self.lost = 0
        self.accepted = 0
        self._sockets: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="lost-reply-proxy").start()

    @classmethod
    def to(cls, url: str) -> LostReplyProxy:
        """A proxy to the Redis server of ``url`` whose :meth:`url` names the same
        database by default."""
        parts = urlsplit(url)
        if parts.port is None:
            raise ValueError(f"no port in {url!r}")
        relay = cls(parts.port)
        relay.db = int(parts.path.strip("/") or 0)
        return relay

    def url(self, db: int | None = None) -> str:
        return f"redis://127.0.0.1:{self.port}/{self.db if db is None else db}"

    def lose_reply_to(self, needle: bytes, before_reset: Callable[[], None] | None = None) -> None:
        """Lose the reply to the next request that contains ``needle``."""
        with self._lock:
            self._needle, self._before_reset = needle, before_reset

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._sockets |= {client, server}
            link = _Link()
            threading.Thread(target=self._up, args=(client, server, link), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, link), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, link: _Link) -> None:
        with contextlib.suppress(OSError):
            while chunk := client.recv(65536):
                with self._lock:
                    if self._needle is not None and self._needle in chunk:
                        # Marked before it is sent: the reply cannot come back first.
                        link.losing, link.before_reset = True, self._before_reset
                        self._needle = self._before_reset = None
                server.sendall(chunk)
        _reset(server)

    def _down(self, server: socket.socket, client: socket.socket, link: _Link) -> None:
        with contextlib.suppress(OSError):
            while chunk := server.recv(65536):
                if link.losing:
                    # The server ran the request; its answer goes nowhere.
                    self.lost += 1
                    if link.before_reset is not None:
                        link.before_reset()
                    break
                client.sendall(chunk)
        _reset(client)
        _reset(server)


class _Link:
    losing = False
    before_reset: Callable[[], None] | None = None


def _reset(sock: socket.socket) -> None:
    """End the connection at once. The shutdown also wakes the thread of the other
    direction blocked reading it (a close alone would wait for that read to end);
    the close that follows sends a reset."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_LINGER)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
