"""A small HTTP/1.1 client on asyncio streams: the transport of the etcd backend's
asyncio path (:mod:`.protocol` and :mod:`.gateway` hold everything the requests mean).

Only what etcd's JSON gateway needs: POST with a JSON body, answers framed by
Content-Length or chunked, kept-alive connections, and one streamed answer per
connection for a watch (chunked JSON objects, one per line). Errors are those of
``http.client`` (``RemoteDisconnected``, ``IncompleteRead``, ``BadStatusLine``) or
``OSError``, so the protocol code treats both transports alike. Nothing here bounds
time: the caller wraps each exchange in its own deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import ssl
from collections.abc import Mapping

#: Longest status line, header line or chunk-size line accepted.
_MAX_LINE = 16 * 1024
_MAX_HEADERS = 100
# Where the reading of an answer stands.
_IDLE, _STATUS, _HEADERS, _BODY, _CHUNK_SIZE, _CHUNK, _CHUNK_END, _TRAILERS, _TO_EOF, _DONE = range(
    10
)


def _is_digits(text: str) -> bool:
    """ASCII digits only (str.isdigit also accepts '²' and other digits int() refuses)."""
    return text.isascii() and text.isdigit()


def _status_of(line: bytes) -> int:
    parts = line.decode("latin-1").split(None, 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not _is_digits(parts[1]):
        raise http.client.BadStatusLine(line[:100].decode("latin-1"))
    return int(parts[1])


def _field(line: bytes) -> tuple[str, str]:
    key, sep, value = line.decode("latin-1").partition(":")
    if not sep:
        raise http.client.HTTPException(f"bad header line {line[:100]!r}")
    return key.strip().lower(), value.strip()


async def connect(host: str, port: int, context: ssl.SSLContext | None, index: int) -> Connection:
    """A new connection to ``host:port`` (TLS with ``context`` when given)."""
    if context is None:
        reader, writer = await asyncio.open_connection(host, port, limit=_MAX_LINE)
    else:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=context, server_hostname=host, limit=_MAX_LINE
        )
    default = 443 if context is not None else 80
    return Connection(reader, writer, index, host if port == default else f"{host}:{port}")


class Connection:
    """One HTTP/1.1 connection: requests one after another (no pipelining).

    Reading an answer can be resumed: every read consumes the stream only when it
    completes, and the progress is kept here, so an exchange interrupted by a
    cancellation can be finished later (:meth:`finish`), on the same connection."""

    __slots__ = (
        "_chunk_left",
        "_ended",
        "_fields",
        "_parts",
        "_phase",
        "_size",
        "_status",
        "_stream",
        "host",
        "index",
        "reader",
        "usable",
        "writer",
    )

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int, host: str
    ) -> None:
        self.reader = reader
        self.writer = writer
        #: The endpoint it goes to (the backend's index).
        self.index = index
        self.host = host
        #: False once it cannot carry another request (closed, streamed, or told so).
        self.usable = True
        self._stream = b""
        self._chunk_left = 0
        self._ended = False
        self._phase = _IDLE
        self._status = 0
        self._fields: dict[str, str] = {}
        self._parts: list[bytes] = []
        self._size = 0

    @property
    def pending(self) -> bool:
        """A request was sent whose answer is not read yet."""
        return self._phase != _IDLE

    def idle_and_open(self) -> bool:
        """Still open as far as can be told without I/O (the server may have closed it
        since: the first request then fails with RemoteDisconnected)."""
        return self.usable and not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.usable = False
        with contextlib.suppress(Exception):  # a loop already closed, a transport gone
            self.writer.close()

    def _send(self, path: str, payload: bytes, headers: Mapping[str, str]) -> None:
        head = [f"POST {path} HTTP/1.1", f"Host: {self.host}", f"Content-Length: {len(payload)}"]
        head += [f"{key}: {value}" for key, value in headers.items()]
        self.writer.write("\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + payload)

    async def post(
        self, path: str, payload: bytes, headers: Mapping[str, str]
    ) -> tuple[int, bytes]:
        """Send one request and read its whole answer: (status, body)."""
        self.usable = False  # until the answer has been read to its end
        self._send(path, payload, headers)
        self._phase = _STATUS
        await self.writer.drain()
        return await self.finish()

    async def finish(self) -> tuple[int, bytes]:
        """Read the answer of the request sent last, from where reading it stopped."""
        while True:
            phase = self._phase
            if phase == _STATUS:
                self._status = _status_of(await self._line())
                self._fields = {}
                self._phase = _HEADERS
            elif phase == _HEADERS:
                line = await self._line()
                if line not in (b"\r\n", b"\n"):
                    if len(self._fields) >= _MAX_HEADERS:
                        raise http.client.HTTPException("too many headers")
                    key, value = _field(line)
                    self._fields[key] = value
                    continue
                self._parts = []
                self._phase = self._body_phase()
            elif phase == _BODY:
                self._parts.append(await self._exactly(self._size))
                self._phase = _DONE
            elif phase == _CHUNK_SIZE:
                self._size = await self._chunk_size()
                self._phase = _CHUNK if self._size else _TRAILERS
            elif phase == _CHUNK:
                self._parts.append(await self._exactly(self._size))
                self._phase = _CHUNK_END
            elif phase == _CHUNK_END:
                await self._exactly(2)
                self._phase = _CHUNK_SIZE
            elif phase == _TRAILERS:
                if await self._line() in (b"\r\n", b"\n"):
                    self._phase = _DONE
            elif phase == _TO_EOF:
                # Framed by the end of the connection: read it all, then it is done.
                self._parts.append(await self.reader.read())
                self.writer.close()
                self._phase = _DONE
            else:
                assert phase == _DONE, phase
                self._phase = _IDLE
                if (
                    self._fields.get("connection", "").lower() != "close"
                    and not self.writer.is_closing()
                ):
                    self.usable = True
                return self._status, b"".join(self._parts)

    def _body_phase(self) -> int:
        status, fields = self._status, self._fields
        if 100 <= status < 200:
            return _STATUS  # an interim answer: the real one follows
        if fields.get("transfer-encoding", "").lower() == "chunked":
            return _CHUNK_SIZE
        length = fields.get("content-length")
        if length is not None:
            if not _is_digits(length):
                raise http.client.HTTPException(f"bad Content-Length {length[:40]!r}")
            self._size = int(length)
            return _BODY
        if status in (204, 304):
            return _DONE
        return _TO_EOF

    async def open_stream(
        self, path: str, payload: bytes, headers: Mapping[str, str]
    ) -> tuple[int, bytes]:
        """Send a request whose answer is a stream: (status, b"") once a 200's head is
        read (then :meth:`next_line` reads it), or (status, body) for any other status."""
        self.usable = False  # a streamed connection is never reused
        self._send(path, payload, headers)
        await self.writer.drain()
        while True:
            status = _status_of(await self._line())
            fields: dict[str, str] = {}
            while (line := await self._line()) not in (b"\r\n", b"\n"):
                if len(fields) >= _MAX_HEADERS:
                    raise http.client.HTTPException("too many headers")
                key, value = _field(line)
                fields[key] = value
            if not 100 <= status < 200:
                break
        if status != 200:
            self._status, self._fields, self._parts = status, fields, []
            self._phase = self._body_phase()
            return await self.finish()
        if fields.get("transfer-encoding", "").lower() != "chunked":
            raise http.client.HTTPException("a streamed answer that is not chunked")
        return status, b""

    async def next_line(self) -> bytes:
        """The next line of a streamed answer (with its newline); b"" when it ended."""
        while b"\n" not in self._stream:
            if self._ended:
                line, self._stream = self._stream, b""
                return line
            size = await self._chunk_size()
            if size == 0:
                await self._trailers()
                self._ended = True
                continue
            self._stream += await self._exactly(size)
            await self._exactly(2)
        line, _, self._stream = self._stream.partition(b"\n")
        return line + b"\n"

    # -- reading -------------------------------------------------------------------

    async def _line(self) -> bytes:
        try:
            line = await self.reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                raise http.client.RemoteDisconnected(
                    "Remote end closed connection without response"
                ) from None
            raise http.client.IncompleteRead(exc.partial) from None
        except asyncio.LimitOverrunError:
            raise http.client.LineTooLong("header line") from None
        return line

    async def _exactly(self, size: int) -> bytes:
        try:
            return await self.reader.readexactly(size)
        except asyncio.IncompleteReadError as exc:
            raise http.client.IncompleteRead(exc.partial, size - len(exc.partial)) from None

    async def _chunk_size(self) -> int:
        line = await self._line()
        text = line.split(b";", 1)[0].strip()
        try:
            if not text.isalnum():  # no sign, no '_', no spaces: hex digits only
                raise ValueError(text)
            return int(text, 16)
        except ValueError:
            raise http.client.HTTPException(f"bad chunk size {line[:40]!r}") from None

    async def _trailers(self) -> None:
        for _ in range(_MAX_HEADERS):
            if await self._line() in (b"\r\n", b"\n"):
                return
        raise http.client.HTTPException("too many trailer lines")
