"""A TCP proxy for the fault scenarios: loopback only, with network faults on demand.

Clients connect to :attr:`FaultProxy.port` instead of the server; every connection
is relayed to the upstream address, and the test can at any moment:

* :meth:`~FaultProxy.set_latency` delay every chunk, in both directions, by that
  many seconds (order is kept: a chunk never overtakes an earlier one);
* :meth:`~FaultProxy.blackhole` swallow every chunk in both directions while the
  connections stay open (a partition: the peers hear nothing, not even a reset);
* :meth:`~FaultProxy.reset` abort every open connection with a TCP reset;
* :meth:`~FaultProxy.drop` reset every new connection as soon as it is accepted.

It runs an asyncio loop in a thread of the test process. The counters tell a test,
without sleeping, when a fault has bitten: a request sitting in the proxy, a
delayed request delivered, a reply read back.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections import Counter
from typing import Any

#: SO_LINGER on with a zero timeout: close() sends a reset instead of a FIN.
_RESET_LINGER = struct.pack("ii", 1, 0)
_CHUNK = 65536


class FaultProxy:
    """Relays 127.0.0.1:``port`` to ``upstream_host``:``upstream_port``."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        if upstream_host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("The fault proxy relays to loopback addresses only.")
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.latency = 0.0
        self.blackholed = False
        self.dropping = False
        #: accepted, dropped, resets; bytes read from clients (up_in) and written to the
        #: server (up_out), read from the server (down_in) and written to clients
        #: (down_out); bytes swallowed by the blackhole.
        self.stats: Counter[str] = Counter()
        #: Monotonic time of the last chunk written to the server, and read from it.
        self.last_up_write = 0.0
        self.last_down_read = 0.0
        #: Byte strings to look for in what clients send -> how many chunks had them.
        self.seen: Counter[bytes] = Counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy")
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()

    # -- life cycle -----------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread.start()
        self._call(self._listen())
        return self

    def close(self) -> None:
        """Stop listening and abort every connection."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def url(self, scheme: str = "redis", path: str = "/0") -> str:
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    # -- faults ---------------------------------------------------------------

    def set_latency(self, seconds: float) -> None:
        """Delay chunks read from now on by ``seconds`` (0 to stop)."""
        self.latency = max(0.0, float(seconds))

    def blackhole(self, on: bool = True) -> None:
        """Swallow everything in both directions (False: relay again)."""
        self.blackholed = on

    def drop(self, on: bool = True) -> None:
        """Reset new connections at once (False: accept them again)."""
        self.dropping = on

    def reset(self) -> int:
        """Abort every open connection with a TCP reset; how many there were."""
        return int(self._call(self._reset_all()))

    def watch(self, needle: bytes) -> None:
        """Count the client chunks that contain ``needle`` (in :attr:`seen`), e.g. the
        name of a command, to know that a given request is inside the proxy."""
        self.seen[needle] += 0

    def heal(self) -> None:
        """No latency, no blackhole, no dropping."""
        self.set_latency(0)
        self.blackhole(False)
        self.drop(False)

    # -- internals --------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._reset_all()

    async def _reset_all(self) -> int:
        links = list(self._links)
        for link in links:
            link.abort()
        self.stats["resets"] += len(links)
        return len(links)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats["accepted"] += 1
        if self.dropping:
            self.stats["dropped"] += 1
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            _abort(writer)
            return
        link = _Link(writer, up_writer)
        self._links.add(link)
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, "up"),
                self._pipe(up_reader, writer, "down"),
            )
        finally:
            self._links.discard(link)
            link.close()

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str
    ) -> None:
        """Relay one direction: a reader that stamps each chunk with its due time, and
        a sender that writes the chunks in order when due."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                while chunk := await src.read(_CHUNK):
                    self.stats[f"{direction}_in"] += len(chunk)
                    if direction == "up":
                        for needle in [n for n in self.seen if n in chunk]:
                            self.seen[needle] += 1
                    else:
                        self.last_down_read = time.monotonic()
                    if self.blackholed:
                        self.stats["swallowed"] += len(chunk)
                        continue
                    queue.put_nowait((time.monotonic() + self.latency, chunk))
            except OSError:
                pass
            finally:
                queue.put_nowait(None)

        async def send() -> None:
            try:
                while (item := await queue.get()) is not None:
                    due, chunk = item
                    delay = due - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    dst.write(chunk)
                    await dst.drain()
                    self.stats[f"{direction}_out"] += len(chunk)
                    if direction == "up":
                        self.last_up_write = time.monotonic()
                # The source closed: pass the half-close on once its data went through.
                if dst.can_write_eof() and not dst.is_closing():
                    dst.write_eof()
            except OSError:
                pass

        await asyncio.gather(read(), send())


class _Link:
    """The two sockets of one relayed connection."""

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.writers = (client, upstream)

    def abort(self) -> None:
        for writer in self.writers:
            _abort(writer)

    def close(self) -> None:
        for writer in self.writers:
            if not writer.is_closing():
                writer.close()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a reset rather than a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_LINGER)
    writer.transport.abort()
