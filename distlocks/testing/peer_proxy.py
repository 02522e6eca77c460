"""Network partitions between the members of an etcd test cluster, without root.

Each member advertises a proxy's address as its peer URL and listens on a port of its
own; every connection one member opens to another goes through the other's proxy,
which knows who opened it. :meth:`PeerNetwork.partition` then cuts chosen pairs of
members apart in both directions: the open connections between them are reset, and
new ones are reset as soon as they are accepted, while their client ports stay
reachable (a true partition, unlike a stopped process).

Who opened a connection is read from the kernel, not from the request: the proxy
looks up the socket at the other end of the accepted connection (with sock_diag, as
``ss`` does, or in ``/proc/net/tcp``) and the member process that has it open
(``/proc/<pid>/fd``), which works for any process of the same user. Raft's own
requests name their sender in an ``X-Server-From`` header, but a member also reaches
the others without it (a follower forwards lease renewals and time-to-live queries
to the leader with ``POST /leases``; version and membership checks, probes), so a
proxy going by the header would let a partitioned follower keep renewing leases
through the leader.

Linux only (``/proc``); :func:`partition_missing` says why it cannot run elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

#: SO_LINGER on with a zero timeout: close() sends a reset instead of a FIN.
_RESET_LINGER = struct.pack("ii", 1, 0)
_CHUNK = 65536
_TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def partition_missing() -> str:
    """Why partitions cannot be made here ("" when they can)."""
    if not _TCP_TABLES[0].exists() or not Path("/proc/self/fd").is_dir():
        return "partitions need Linux's /proc (to tell which member opened a connection)"
    return ""


def _socket_inode(local_port: int, remote_port: int) -> int | None:
    """The inode of the loopback socket bound to ``local_port`` and connected to
    ``remote_port`` (the far end of a connection this process accepted)."""
    try:
        return _diag_inode(local_port, remote_port)
    except OSError:
        return _table_inode(local_port, remote_port)


#: sock_diag (the netlink interface ``ss`` uses): one socket looked up by its ports.
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NO_COOKIE = 0xFFFFFFFF
_ANY_STATE = 0xFFFFFFFF
#: Where the inode sits in the answer: after the netlink header (16 bytes), the
#: family, state, timer and retransmits (4), the socket's id (48), and the expiry,
#: queues and uid (16).
_INODE_AT = 16 + 4 + 48 + 16


def _diag_inode(local_port: int, remote_port: int) -> int | None:
    """:func:`_socket_inode` by an exact sock_diag lookup: microseconds, where reading
    ``/proc/net/tcp`` costs milliseconds on a machine with thousands of sockets."""
    loopback = socket.inet_aton("127.0.0.1") + bytes(12)
    sock_id = (
        struct.pack("!HH", local_port, remote_port)
        + loopback
        + loopback
        + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)
    )
    request = struct.pack("=BBBBI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0, _ANY_STATE)
    body = request + sock_id
    header = struct.pack("=IHHII", 16 + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as link:
        link.settimeout(1.0)
        link.send(header + body)
        answer = link.recv(8192)
    kind = struct.unpack_from("=H", answer, 4)[0]
    if kind == _NLMSG_ERROR or len(answer) < _INODE_AT + 4:
        return None  # no such socket (any more)
    return int(struct.unpack_from("=I", answer, _INODE_AT)[0]) or None


def _table_inode(local_port: int, remote_port: int) -> int | None:
    """:func:`_socket_inode` from ``/proc/net/tcp``, where sock_diag is not allowed."""
    row = re.compile(
        rf"^\s*\d+: [0-9A-F]+:{local_port:04X} [0-9A-F]+:{remote_port:04X}(?: +\S+){{6}} +(\d+)",
        re.MULTILINE,
    )
    for table in _TCP_TABLES:
        with contextlib.suppress(OSError):
            for match in row.finditer(table.read_text()):
                # Inode 0: a socket no process holds any more, such as an earlier
                # connection between the same ports in TIME_WAIT (loopback reuses them).
                if inode := int(match.group(1)):
                    return inode
    return None


def _holder(inode: int, processes: dict[int, str]) -> str | None:
    """Which of ``processes`` (pid -> name) has the socket ``inode`` open."""
    target = f"socket:[{inode}]"
    for pid, name in processes.items():
        fds = Path(f"/proc/{pid}/fd")
        with contextlib.suppress(OSError):
            for fd in os.listdir(fds):
                with contextlib.suppress(OSError):
                    if os.readlink(fds / fd) == target:
                        return name
    return None


class _Link:
    """One relayed connection: who opened it, to whom, and its sockets."""

    def __init__(self, source: str | None, target: str, client: asyncio.StreamWriter) -> None:
        self.source = source
        self.target = target
        self.writers = [client]

    def abort(self) -> None:
        for writer in self.writers:
            _abort(writer)


class PeerNetwork:
    """Proxies in front of the peer ports of a cluster's members, in one thread::

        network = PeerNetwork(processes=lambda: {pid: "m1", ...}).start()
        port = network.add("m1", upstream=lambda: m1_peer_port)  # advertise this port
        network.partition(["m1"])   # m1 cut off from every other member
        network.heal()

    ``processes`` names the running members by pid (called on every new connection,
    so a restarted member is recognised). A connection that no member holds is
    relayed, and counted as ``unknown`` in :attr:`stats`: it comes from another process
    (the test itself), or its client closed it before the proxy looked, and then
    nothing crosses it.
    """

    def __init__(self, processes: Callable[[], dict[int, str]]) -> None:
        self.processes = processes
        #: Pairs (from, to) whose connections are refused.
        self.blocked: set[tuple[str, str]] = set()
        #: relayed, refused, cut (open connections reset by a partition), unknown.
        self.stats: Counter[str] = Counter()
        self._upstreams: dict[str, Callable[[], int]] = {}
        self._sockets: dict[str, socket.socket] = {}
        self._servers: list[asyncio.Server] = []
        self._links: set[_Link] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="etcd-peer-proxies", daemon=True
        )

    def start(self) -> PeerNetwork:
        self._thread.start()
        return self

    def add(self, name: str, upstream: Callable[[], int]) -> int:
        """Put a proxy in front of member ``name`` (its real peer port is what
        ``upstream`` returns when a connection comes); the proxy's port."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        sock.setblocking(False)
        self._sockets[name] = sock
        self._upstreams[name] = upstream
        self._call(self._listen(name, sock))
        return int(sock.getsockname()[1])

    def port(self, name: str) -> int:
        return int(self._sockets[name].getsockname()[1])

    # -- partitions -------------------------------------------------------------

    def partition(self, side: Iterable[str]) -> int:
        """Cut the members of ``side`` off from every other member, both ways (on top
        of any partition already made); how many open connections were reset."""
        inside = set(side)
        unknown = inside - set(self._upstreams)
        if unknown:
            raise ValueError(f"No proxy fronts {sorted(unknown)}.")
        outside = set(self._upstreams) - inside
        pairs = {(a, b) for a in inside for b in outside}
        return int(self._call(self._block(pairs | {(b, a) for a, b in pairs})))

    def heal(self) -> None:
        """Let every member reach every other again."""
        self._call(self._block(set(), replace=True))

    def cut_off(self, a: str, b: str) -> bool:
        """Whether ``a`` and ``b`` are partitioned apart."""
        return (a, b) in self.blocked

    def close(self) -> None:
        """Stop the proxies and reset every connection (idempotent)."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        with contextlib.suppress(RuntimeError):
            self._loop.close()
        for sock in self._sockets.values():
            sock.close()

    # -- internals ----------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _listen(self, name: str, sock: socket.socket) -> None:
        server = await asyncio.start_server(lambda r, w: self._accept(name, r, w), sock=sock)
        self._servers.append(server)

    async def _block(self, pairs: set[tuple[str, str]], *, replace: bool = False) -> int:
        # The set changes and the links are cut in one step of the loop, so a
        # connection accepted meanwhile is either cut here or refused when checked.
        self.blocked = pairs if replace else self.blocked | pairs
        doomed = [link for link in self._links if (link.source, link.target) in self.blocked]
        for link in doomed:
            link.abort()
        self.stats["cut"] += len(doomed)
        return len(doomed)

    async def _shutdown(self) -> None:
        for server in self._servers:
            server.close()
        for link in list(self._links):
            link.abort()
        # Let the relays see their sockets go, so that no task outlives the loop.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:
            await asyncio.wait(others, timeout=5)

    def _source(self, writer: asyncio.StreamWriter, port: int) -> str | None:
        peer = writer.get_extra_info("peername")
        if not peer:
            return None
        inode = _socket_inode(int(peer[1]), port)
        return _holder(inode, self.processes()) if inode is not None else None

    async def _accept(
        self, target: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        source = self._source(writer, self.port(target))
        if source is None:
            self.stats["unknown"] += 1
        link = _Link(source, target, writer)
        if (source, target) in self.blocked:
            self.stats["refused"] += 1
            link.abort()
            return
        self._links.add(link)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(
                    "127.0.0.1", self._upstreams[target]()
                )
            except OSError:
                link.abort()  # the member is down: the peer sees a refusal
                return
            link.writers.append(up_writer)
            if (source, target) in self.blocked:  # partitioned while connecting
                self.stats["refused"] += 1
                link.abort()
                return
            self.stats["relayed"] += 1
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self._links.discard(link)
            for each in link.writers:
                if not each.is_closing():
                    each.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Relay one direction until its source closes, then pass the half-close on."""
    with contextlib.suppress(OSError):
        while chunk := await src.read(_CHUNK):
            dst.write(chunk)
            await dst.drain()
        if dst.can_write_eof() and not dst.is_closing():
            dst.write_eof()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a reset rather than a FIN, as a refused or broken link looks."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_LINGER)
    writer.transport.abort()
