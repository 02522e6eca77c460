"""The etcd backend's asyncio path with h11 doing the HTTP/1.1 framing, for the
comparison of issue 28 (item 3): the bench row ``distlocks-etcd-async-h11`` runs the same
``alock`` cycle as ``distlocks-etcd-async`` through :class:`H11EtcdBackend`, whose
asyncio connections are :class:`H11Connection`; every other line of the backend is the
same. h11 is not a dependency of distlocks: the row needs ``pip install h11`` and is
left out of a run without it. See docs/benchmarks.md, "etcd HTTP/1.1: own framing or h11".

:class:`H11Connection` has the interface and the errors of
:class:`distlocks.backends.etcd.http11.Connection` (``http.client``'s), so the backend's
asyncio driver takes it unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import ssl
from collections.abc import Mapping
from typing import Any

import h11

from distlocks.backends.etcd import EtcdBackend

#: Longest head (status line and header lines) accepted, as the hand-written framing's
#: longest line.
_MAX_HEAD = 16 * 1024
_READ = 64 * 1024


async def connect(
    host: str, port: int, context: ssl.SSLContext | None, index: int
) -> H11Connection:
    """A new connection to ``host:port`` (TLS with ``context`` when given)."""
    if context is None:
        reader, writer = await asyncio.open_connection(host, port, limit=_MAX_HEAD)
    else:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=context, server_hostname=host, limit=_MAX_HEAD
        )
    default = 443 if context is not None else 80
    return H11Connection(reader, writer, index, host if port == default else f"{host}:{port}")


class H11Connection:
    """One HTTP/1.1 connection framed by h11: requests one after another. Reading an
    answer can be resumed after a cancellation (:meth:`finish`): h11 keeps the parse
    state, and a read consumes the stream only when it completes."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int, host: str
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.index = index
        self.host = host
        self.usable = True
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_HEAD)
        self._pending = False
        self._status = 0
        self._headers: dict[str, str] = {}
        self._parts: list[bytes] = []
        self._received = False  # any byte of the current answer
        self._stream = b""
        self._ended = False

    @property
    def pending(self) -> bool:
        return self._pending

    def idle_and_open(self) -> bool:
        return self.usable and not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.usable = False
        with contextlib.suppress(Exception):
            self.writer.close()

    def _send(self, path: str, payload: bytes, headers: Mapping[str, str]) -> None:
        fields = [("Host", self.host), ("Content-Length", str(len(payload)))]
        fields += list(headers.items())
        try:
            data = self._h11.send(h11.Request(method="POST", target=path, headers=fields))
            data += self._h11.send(h11.Data(data=payload))
            data += self._h11.send(h11.EndOfMessage())
        except h11.LocalProtocolError as exc:
            raise http.client.HTTPException(f"request not sent: {exc}") from None
        self.writer.write(data)
        self._pending, self._status, self._headers = True, 0, {}
        self._parts, self._received = [], False

    async def _event(self) -> Any:
        """The next h11 event of the answer, reading as much as it needs; the errors
        of ``http.client`` for a connection that ends early or a malformed answer."""
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                if self._h11.their_state is h11.ERROR and self.reader.at_eof():
                    if not self._received:
                        raise http.client.RemoteDisconnected(
                            "Remote end closed connection without response"
                        ) from None
                    raise http.client.IncompleteRead(b"".join(self._parts)) from None
                raise http.client.HTTPException(f"bad answer: {exc}") from None
            if event is not h11.NEED_DATA:
                return event
            data = await self.reader.read(_READ)
            if data:
                self._received = True
            self._h11.receive_data(data)

    async def post(
        self, path: str, payload: bytes, headers: Mapping[str, str]
    ) -> tuple[int, bytes]:
        self.usable = False
        self._send(path, payload, headers)
        await self.writer.drain()
        return await self.finish()

    async def finish(self) -> tuple[int, bytes]:
        while True:
            event = await self._event()
            if isinstance(event, h11.Response):
                self._status = event.status_code
                self._headers = {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                self._parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self._pending = False
                if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
                    self._h11.start_next_cycle()
                    self.usable = not self.writer.is_closing()
                else:
                    self.writer.close()
                return self._status, b"".join(self._parts)
            elif isinstance(event, h11.ConnectionClosed):
                raise http.client.IncompleteRead(b"".join(self._parts))
            # h11.InformationalResponse: the real answer follows

    async def open_stream(
        self, path: str, payload: bytes, headers: Mapping[str, str]
    ) -> tuple[int, bytes]:
        self.usable = False
        self._send(path, payload, headers)
        await self.writer.drain()
        while True:
            event = await self._event()
            if isinstance(event, h11.Response):
                break
        status = event.status_code
        fields = {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
        if status != 200:
            self._status, self._headers = status, fields
            return await self.finish()
        if fields.get("transfer-encoding", "").lower() != "chunked":
            raise http.client.HTTPException("a streamed answer that is not chunked")
        return status, b""

    async def next_line(self) -> bytes:
        while b"\n" not in self._stream:
            if self._ended:
                line, self._stream = self._stream, b""
                return line
            event = await self._event()
            if isinstance(event, h11.Data):
                self._stream += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                self._ended = True
        line, _, self._stream = self._stream.partition(b"\n")
        return line + b"\n"


class H11EtcdBackend(EtcdBackend):
    """:class:`~distlocks.backends.etcd.EtcdBackend` whose asyncio connections are framed
    by h11 (the blocking path, on ``http.client``, is the same)."""

    async def _aconnect(self, index: int) -> Any:
        endpoint = self.endpoints[index]
        context = self._ssl if endpoint.scheme == "https" else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                return await connect(endpoint.host, endpoint.port, context, index)
        except TimeoutError:
            raise TimeoutError(f"no connection within {self.connect_timeout:g} s") from None
