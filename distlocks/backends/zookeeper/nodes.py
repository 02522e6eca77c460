"""The layout of the nodes, free of I/O: what a node's name says (its kind, owner and
place in the queue), which nodes decide whether a request holds, and the fencing token
of a zxid. Every other module of the package reads the nodes through these."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import threading
import urllib.parse
from typing import Any

from kazoo.protocol.states import ZnodeStat

from distlocks.backends.base import READ, RWLOCK, SEMAPHORE, WRITE
from distlocks.exceptions import LockError

_CONTENDER = "c-"
#: The kind in the (kind, name, owner) keys of locks (permits use theirs).
_LOCK = "lock"
_SEQ_DIGITS = 10


@dataclasses.dataclass(eq=False)
class _Node:
    """This process's contender node for one (name, owner), or permit node for one
    (kind, name, owner)."""

    path: str
    token: int
    #: Session generation it was created in; a lost session took the node with it.
    generation: int
    #: Set by the watches of a waiting permit request (one per node, so re-arming a
    #: watch on a node already watched adds nothing on the client or the server).
    wake: threading.Event = dataclasses.field(default_factory=threading.Event)
    #: A waiting lock contender: the node just ahead of it at its last listing (the
    #: one to watch, so waiting needs no listing of its own), and whether that node
    #: was the first, the holder's, then.
    ahead: str | None = None
    ahead_holds: bool = False

    def watch(self, _event: object) -> None:
        self.wake.set()


def _seq(child: str) -> int:
    try:
        return int(child[-_SEQ_DIGITS:])
    except ValueError:
        return -1


def _owner_of(child: str) -> str:
    return urllib.parse.unquote(child[len(_CONTENDER) : -_SEQ_DIGITS - 1])


def _contenders(children: list[str]) -> list[str]:
    """Contender nodes in queue order (the holder first)."""
    return sorted((c for c in children if c.startswith(_CONTENDER)), key=_seq)


#: The node name prefix of each permit kind. A semaphore's permits live in a
#: directory of their own; the read and write nodes of a read-write lock share one,
#: and so one sequence: their order is the order of arrival.
_PERMIT_NODE = {SEMAPHORE: "permit-", READ: "read-", WRITE: "write-"}
_FAMILY_KINDS = {SEMAPHORE: (SEMAPHORE,), RWLOCK: (READ, WRITE)}


def _permit_kind(child: str) -> str | None:
    for kind, prefix in _PERMIT_NODE.items():
        if child.startswith(prefix):
            return kind
    return None


def _permit_owner(child: str) -> str:
    prefix = _PERMIT_NODE.get(_permit_kind(child) or "", "")
    return urllib.parse.unquote(child[len(prefix) : -_SEQ_DIGITS - 1])


def _permit_nodes(children: list[str], family: str) -> list[str]:
    """The permit nodes of one semaphore or read-write lock, in arrival order."""
    kinds = _FAMILY_KINDS[family]
    return sorted((c for c in children if _permit_kind(c) in kinds), key=_seq)


def _blockers(kind: str, children: list[str], index: int, limit: int) -> list[str]:
    """The nodes ahead of position ``index`` of ``children`` (arrival order) that keep a
    request of ``kind`` there from holding, and so the ones it watches; none when it
    holds.

    * a semaphore request holds when fewer than its ``limit`` nodes precede it. Held
      permits go back in any order, so any node ahead may be the one whose going lets
      it in: it watches the ``limit`` nodes just ahead of it. While all of them are
      there, at least ``limit`` nodes precede it; once one goes, its watch fires and
      it looks again. (Watching only one node, its predecessor or the node ``limit``
      places ahead, would sleep through the going of another.)
    * a reader holds when no write node precedes it: it watches the nearest one.
    * a writer holds when it is first: it watches its predecessor.
    """
    ahead = children[:index]
    if kind == SEMAPHORE:
        return ahead[-limit:] if len(ahead) >= limit else []
    if kind == READ:
        return [c for c in ahead if c.startswith(_PERMIT_NODE[WRITE])][-1:]
    return ahead[-1:]


@dataclasses.dataclass
class _Seen:
    """A permit node as read from the server, for listing and eviction."""

    child: str
    data: dict[str, Any]
    stat: ZnodeStat
    holds: bool = False

    @property
    def kind(self) -> str:
        return _permit_kind(self.child) or SEMAPHORE

    @property
    def limit(self) -> int:
        limit = self.data.get("limit")
        return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else 1


def _judge(seen: list[_Seen]) -> None:
    """Mark which of ``seen`` (arrival order) hold, by the rules of
    :func:`_blockers` (in one pass: a listing may be long)."""
    write_ahead = False
    for index, node in enumerate(seen):
        kind = node.kind
        if kind == SEMAPHORE:
            node.holds = index < node.limit
        elif kind == READ:
            node.holds = not write_ahead
        else:
            node.holds = index == 0
        write_ahead = write_ahead or kind == WRITE


def token_of(version: int, fence: ZnodeStat, base: int = 0) -> int:
    """The fencing token of the grant that wrote version ``version`` of the fence node
    ``fence`` of a name: the version, shifted per name so that it starts from the
    server's clock (in microseconds) at the name's first use, plus the node's ``base``
    (:func:`fence_base`; 0 but for a node the zxid-token release wrote). Every grant
    writes the fence node, at the version its caller read (so it knows its token before
    the write and stores it in its own node, where anyone reads it). Versions only grow,
    one per write, and do not jump at elections as zxids do (by 2**32 each), so tokens
    run ahead of the clock only past a million grants a second: after the loss of all
    data, the fence node is made again with a later ctime, and tokens start above the
    old ones (see docs/backend-zookeeper.md)."""
    return int(fence.ctime) * 1000 + int(base) + (int(version) & _VERSION_MASK)


#: A node's version is a Java int, incremented with no check: after 2**31 - 1 comes
#: -2**31. Read unsigned, versions grow through that wrap up to -1 (2**32 - 1); and -1
#: is where they must stop: a write conditional on version -1 is no condition (-1 means
#: any version), and the write after it would make 0.
_VERSION_MASK = 2**32 - 1
VERSION_EXHAUSTED = -1


def exhausted(kind: str, name: str, alias: str, path: str) -> LockError:
    """The error of a fence node whose versions are all used (see _VERSION_MASK)."""
    return LockError(
        f"The fence node of {kind} {name!r} on backend {alias!r} has been written 2**32 - 1 "
        f"times, the most a ZooKeeper node's version counts: no token can follow. While "
        f"nobody holds or waits for it, delete the node {path} (for example with "
        f"zkCli.sh: delete {path}); it is made again at the next acquire, with tokens "
        f"from the server's clock, above the old ones."
    )


#: The data of a fence node whose base is 0 (nearly all): one byte, so that its stat
#: (dataLength), which every listing returns, tells the base with no read of the data.
_BASE_ZERO = b"0"


def fence_data(base: int) -> bytes:
    """The data every write of a fence node by this release stores: its base. Written
    even when 0, as the mark of a node this release has written; any other base is a
    JSON object, longer than one byte."""
    if base == 0:
        return _BASE_ZERO
    return json.dumps({"base": int(base)}, separators=(",", ":")).encode()


def base_in_stat(fence: ZnodeStat) -> int | None:
    """The base of a fence node told by its stat alone, or None when its data must be
    read (:func:`fence_base`). A node made and never written has issued nothing (base
    0); one written by this release with base 0 holds one byte. One written with no data
    (version above 0, data empty) is a release before's, whose tokens this release takes
    over by writing the base :func:`legacy_base` (see :meth:`ZooKeeperLock._fence_base`)."""
    if fence.version == 0 or fence.dataLength == len(_BASE_ZERO):
        return 0
    return None


def fence_base(raw: bytes | None, fence: ZnodeStat) -> int | None:
    """The base of a fence node as read (data ``raw``, stat ``fence``), or None for a
    node whose tokens this release has not taken over yet: one written (version above
    0) with no base in its data, by a release before. Those issued, for a write with
    zxid ``z``, ``ctime * 1000 + (z - czxid)`` (the zxid release), or ``ctime * 1000 +
    version`` (the first version release), both at most ``ctime * 1000 + (mzxid -
    czxid)``: its last write's zxid (each write is a transaction)."""
    known = base_in_stat(fence)
    if known is not None:
        return known
    base = node_data(raw).get("base")
    if isinstance(base, int) and not isinstance(base, bool) and base >= 0:
        return base
    return None


def legacy_base(fence: ZnodeStat) -> int:
    """The base that takes over the tokens of a node written by a release before:
    ``mzxid - czxid`` of its last write, so the next write's token, ``ctime * 1000 +
    base + version``, is above every token it issued (see :func:`fence_base`)."""
    return int(fence.mzxid) - int(fence.czxid)


def fence_counter(raw: bytes | None, fence: ZnodeStat) -> int:
    """The token of the fence node's last write (0 when none), read without writing:
    for a node not taken over yet, the last token the release before issued."""
    if fence.version == 0:
        return 0
    base = fence_base(raw, fence)
    if base is None:
        return int(fence.ctime) * 1000 + legacy_base(fence)
    return token_of(fence.version, fence, base)


def token_in(data: Any) -> int:
    """The token a contender or write node stores in its data (0 if none)."""
    token = data.get("token") if isinstance(data, dict) else None
    return token if isinstance(token, int) and not isinstance(token, bool) else 0


def node_data(raw: bytes | None) -> dict[str, Any]:
    """A node's JSON data as a dict (empty when it is not one)."""
    try:
        data = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _epoch_ms(milliseconds: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(milliseconds / 1000, dt.UTC)
