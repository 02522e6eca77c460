"""ZooKeeper backend: the classic lock recipe, fenced by zxid.

Layout, under ``OPTIONS["prefix"]`` (default ``/distlocks``) below the chroot of
``LOCATION``::

    <prefix>/locks/n<quoted name>                 persistent: the fence node
    <prefix>/locks/n<quoted name>/c-<owner>-<seq> ephemeral sequential: one contender
    <prefix>/semaphores/n<quoted name>/permit-<owner>-<seq>    one permit request
    <prefix>/rwlocks/n<quoted name>                            the write fence node
    <prefix>/rwlocks/n<quoted name>/read-<owner>-<seq>         one read request
    <prefix>/rwlocks/n<quoted name>/write-<owner>-<seq>        one write request

* acquire is one multi-op: create this caller's contender node and write the fence
  node. Both get the zxid of that transaction (the contender's czxid, the fence
  node's mzxid), which makes the fencing token: zxids only grow, on every server of
  the ensemble, across restarts and leader changes. The token is that zxid shifted
  per name to start at the server's clock (microseconds) at the name's first use
  (:func:`token_of`), so tokens stay above the clock floor the other backends keep.
* the contender with the lowest sequence number holds the lock; the others wait,
  each watching only the contender just before it (no herd, first come first served).
* release deletes the caller's own node; a waiter that gives up deletes its node too.
* force release is one multi-op deleting the holder's node (only if its czxid is the
  token given) and writing the fence node, so the counter moves past the victim.

Semaphores and read-write locks queue their requests the same way, each holding by
the rule of its kind over the nodes ahead of it and watching only the nodes that
decide it (see :func:`_blockers`); a write request is one multi-op with a write of
the read-write lock's fence node, and its token comes from that zxid as above.

The nodes are ephemeral: ZooKeeper deletes them when the client's session ends. A
lock therefore lives as long as the holder's session, not for ``ttl``; ``ttl`` is the
local lease and renewal period (see docs/backend-zookeeper.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, NoReturn

from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.base import (
    READ,
    RWLOCK,
    SEMAPHORE,
    WRITE,
    AcquireResult,
    BaseBackend,
    Holder,
    LockInfo,
    holder_details,
    permit_family,
)
from distlocks.exceptions import LockBackendUnavailable, LockError
from distlocks.redaction import redact

try:
    from kazoo.client import KazooClient
    from kazoo.exceptions import (
        BadVersionError,
        ConnectionClosedError,
        ConnectionLoss,
        KazooException,
        NodeExistsError,
        NoNodeError,
        OperationTimeoutError,
        SessionExpiredError,
    )
    from kazoo.handlers.threading import KazooTimeoutError
    from kazoo.hosts import collect_hosts
    from kazoo.protocol.serialization import Connect
    from kazoo.protocol.states import KazooState, ZnodeStat
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImproperlyConfigured(
        "distlocks.backends.zookeeper.ZooKeeperBackend needs kazoo: "
        "pip install 'distlocks[zookeeper]'."
    ) from exc

logger = logging.getLogger(__name__)

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
_CONTENDER = "c-"
#: The kind in the (kind, name, owner) keys of locks (permits use theirs).
_LOCK = "lock"
_SEQ_DIGITS = 10
#: Pause before trying again a call that found the ensemble unavailable (doubling).
_RETRY_FIRST, _RETRY_MAX = 0.05, 1.0
#: How long an acquire with no deadline (``timeout=None``) waits out an unavailable
#: ensemble, at least; it waits three session timeouts if that is longer. A caller
#: with a timeout waits it out until its own deadline.
_OUTAGE_WAIT = 30.0

DEFAULTS: dict[str, Any] = {
    "prefix": "/distlocks",
    "session_timeout": 10.0,
    "connect_timeout": 3.0,
    "socket_timeout": 5.0,
}
_TLS_KEYS = (
    "use_ssl",
    "verify_certs",
    "check_hostname",
    "ca",
    "certfile",
    "keyfile",
    "keyfile_password",
)
_OPTION_KEYS = frozenset(DEFAULTS) | {"auth"} | set(_TLS_KEYS)


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


def token_of(zxid: int, fence: ZnodeStat) -> int:
    """The fencing token of the transaction ``zxid`` on the name whose fence node is
    ``fence``: the zxid, shifted per name so that it starts from the server's clock
    (in microseconds) at the name's first use. A strictly increasing function of the
    zxid for each name, and above every earlier token even if the ensemble's data is
    lost and the zxids start again from 0 (see docs/backend-zookeeper.md)."""
    return int(fence.ctime) * 1000 + (int(zxid) - int(fence.czxid))


def _location_problems(location: str) -> list[str]:
    """What is wrong with a connection string, never quoting a piece of it (a
    careless one may hold a password)."""
    hosts = location.partition("/")[0]
    if "@" in hosts or "://" in hosts:
        # kazoo reads "user:password@host" as the host alone and connects without
        # credentials: refuse it rather than drop them silently.
        return [
            "LOCATION must be a plain 'host:port,host:port/chroot' connection string: "
            "it has a URL scheme or user information, which ZooKeeper connection "
            "strings do not carry (the client would connect without them). Put "
            "credentials in OPTIONS['auth'], e.g. [('digest', 'user:password')]"
        ]
    try:
        collect_hosts(location)
    except ValueError:
        return [
            "LOCATION has a host that is not 'host' or 'host:port' with a numeric "
            "port (e.g. 'zk1:2181,zk2:2181/chroot')"
        ]
    return []


def _epoch_ms(milliseconds: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(milliseconds / 1000, dt.UTC)


class ZooKeeperBackend(BaseBackend):
    """Locks as ephemeral sequential nodes on a ZooKeeper ensemble (kazoo).

    ``LOCATION`` is a ZooKeeper connection string, ``"host:port,host:port/chroot"``.
    ``OPTIONS``: ``session_timeout`` (seconds asked for; the server bounds it),
    ``connect_timeout`` (how long a call waits for a connection before
    :class:`LockBackendUnavailable`), ``socket_timeout`` (bound of each request),
    ``prefix`` (the znode under which locks live), ``auth`` (a list of
    ``(scheme, credential)`` pairs, e.g. ``[("digest", "user:password")]``), and the
    TLS keys ``use_ssl``, ``verify_certs``, ``check_hostname``, ``ca``, ``certfile``, ``keyfile``,
    ``keyfile_password``.
    """

    config_keys: ClassVar[frozenset[str]] = frozenset({"LOCATION", "OPTIONS"})
    wakes_on_release: ClassVar[bool] = True
    expires_on_server: ClassVar[bool] = False  # held until released or the session ends

    def __init__(self, alias: str, config: Mapping[str, Any]) -> None:
        super().__init__(alias, config)
        problems = self.validate_config(alias, config)
        if problems:
            raise ImproperlyConfigured(f"DISTLOCKS_BACKENDS[{alias!r}]: {'; '.join(problems)}.")
        self.location: str = config["LOCATION"]
        opts = {**DEFAULTS, **self.options}
        self.prefix = "/" + str(opts["prefix"]).strip("/")
        self.session_timeout = float(opts["session_timeout"])
        self.connect_timeout = float(opts["connect_timeout"])
        self.socket_timeout = float(opts["socket_timeout"])
        self._locks_path = f"{self.prefix}/locks"
        self._family_paths = {
            SEMAPHORE: f"{self.prefix}/semaphores",
            RWLOCK: f"{self.prefix}/rwlocks",
        }
        self._client: KazooClient | None = None
        self._pid = os.getpid()
        self._client_lock = threading.Lock()
        self._connected = threading.Event()
        #: Bumped each time a session is lost: nodes of older generations are gone.
        self._generation = 0
        self._nodes: dict[tuple[str, str], _Node] = {}
        #: This process's permit nodes, by (kind, name, owner).
        self._permits: dict[tuple[str, str, str], _Node] = {}
        self._waiting: set[threading.Event] = set()
        self._state_lock = threading.Lock()
        #: The session timeout the server granted at the last handshake (seconds),
        #: None before the first: it may be shorter than the one asked for (the
        #: server's maxSessionTimeout), and a reconnect to another server may change it.
        self._negotiated: float | None = None
        #: The session timeouts already warned about (a grant shorter than asked, a
        #: ttl longer than the session), so each warning is logged once per value.
        self._warned_grant: float | None = None
        self._warned_ttl: float | None = None
        #: (kind, name, owner) of the nodes a background thread is deleting.
        self._cleaning: set[tuple[str, str, str]] = set()
        #: (kind, name, owner) whose create went out without an answer: the node may
        #: exist, so the next attempt looks for it before creating another.
        self._unknown: set[tuple[str, str, str]] = set()
        self._closed = False
        #: Monotonic time before the last request that got an answer: the server heard
        #: from this session then at the earliest, so it keeps it a session timeout more.
        self._last_ok = time.monotonic()

    @classmethod
    def validate_config(cls, alias: str, config: Mapping[str, Any]) -> list[str]:
        problems = super().validate_config(alias, config)
        location = config.get("LOCATION")
        if not isinstance(location, str) or not location.strip():
            problems.append(
                "LOCATION must be a ZooKeeper connection string such as "
                "'zk1:2181,zk2:2181,zk3:2181/chroot'"
            )
        else:
            problems.extend(_location_problems(location))
        options = config.get("OPTIONS") or {}
        if isinstance(options, Mapping):
            unknown = set(options) - _OPTION_KEYS
            if unknown:
                problems.append(
                    f"unknown OPTIONS key(s) {', '.join(sorted(map(str, unknown)))}; "
                    f"ZooKeeperBackend accepts {', '.join(sorted(_OPTION_KEYS))}"
                )
            for key in ("session_timeout", "connect_timeout", "socket_timeout"):
                value = options.get(key, DEFAULTS[key])
                if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                    problems.append(f"OPTIONS[{key!r}] must be a positive number of seconds")
            prefix = options.get("prefix", DEFAULTS["prefix"])
            if not isinstance(prefix, str) or not prefix.strip("/"):
                problems.append("OPTIONS['prefix'] must be a znode path such as '/distlocks'")
            for key in ("use_ssl", "verify_certs", "check_hostname"):
                if key in options and not isinstance(options[key], bool):
                    # kazoo takes any truthy value: "false" would turn TLS on.
                    problems.append(
                        f"OPTIONS[{key!r}] must be True or False, not {type(options[key]).__name__}"
                    )
            auth = options.get("auth", [])
            if not isinstance(auth, list | tuple) or not all(
                isinstance(item, list | tuple) and len(item) == 2 for item in auth
            ):
                problems.append(
                    "OPTIONS['auth'] must be a list of (scheme, credential) pairs, "
                    "e.g. [('digest', 'user:password')]"
                )
        return problems

    # -- session ------------------------------------------------------------------

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
            answer = invoke(timeout, request, xid)
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

    def _probe(self, client: KazooClient) -> None:
        """Fail at once when every server refuses the connection (nothing listens),
        instead of letting kazoo retry for the whole ``connect_timeout``: a page that
        lists the locks of every backend should not wait on one that is down."""
        refused: OSError | None = None
        for host, port in client.hosts:
            try:
                with socket.create_connection((host, port), timeout=self.connect_timeout):
                    return
            except ConnectionRefusedError as exc:
                refused = exc
            except OSError:
                return  # unreachable or slow: kazoo's own timeout decides
        if refused is not None:
            raise refused

    def _reset_after_fork(self) -> None:
        self._pid = os.getpid()
        self._client = None  # the parent's threads are not in this process
        self._client_lock = threading.Lock()
        self._connected = threading.Event()
        self._nodes = {}
        self._permits = {}
        self._waiting = set()
        self._negotiated = None  # the child's session is negotiated anew
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

    def close(self) -> None:
        self._closed = True
        client, self._client = self._client, None
        if client is not None and self._pid == os.getpid():
            try:
                client.stop()
                client.close()
            except Exception:
                logger.debug("Error closing ZooKeeper client", exc_info=True)

    # -- paths --------------------------------------------------------------------

    def lock_path(self, name: str) -> str:
        """The fence node of ``name`` (its children are the contenders)."""
        return f"{self._locks_path}/n{urllib.parse.quote(name, safe='')}"

    def _children(self, client: KazooClient, action: str, name: str) -> list[str]:
        return self._queue(client, action, name)[0]

    def _queue(
        self, client: KazooClient, action: str, name: str
    ) -> tuple[list[str], ZnodeStat | None]:
        """The contenders of ``name`` in queue order, and its fence node's stat."""
        try:
            children, stat = self._get(
                action, name, client.get_children_async(self.lock_path(name), include_data=True)
            )
        except NoNodeError:
            return [], None
        return _contenders(children), stat

    def _commit(self, action: str, name: str, txn: Any) -> list[Any]:
        results = self._get(action, name, txn.commit_async())
        return list(results)

    def _find_own(self, children: list[str], owner: str) -> list[str]:
        prefix = f"{_CONTENDER}{urllib.parse.quote(owner, safe='')}-"
        return [c for c in children if c.startswith(prefix) and len(c) == len(prefix) + 10]

    def _entry(self, name: str, owner: str) -> _Node | None:
        """This process's node for (name, owner), if it belongs to the live session."""
        entry = self._nodes.get((name, owner))
        if entry is not None and entry.generation != self._generation:
            self._nodes.pop((name, owner), None)
            return None
        return entry

    # -- the recipe ---------------------------------------------------------------

    def _enqueue(self, client: KazooClient, name: str, owner: str, data: bytes) -> _Node:
        """One multi-op: create the contender node and write the fence node."""
        parent = self.lock_path(name)
        node_prefix = f"{parent}/{_CONTENDER}{urllib.parse.quote(owner, safe='')}-"
        generation = self._generation
        for _ in range(3):
            sent = time.monotonic()
            txn = client.transaction()
            txn.create(node_prefix, data, ephemeral=True, sequence=True)
            txn.set_data(parent, b"")
            try:
                results = self._commit("acquire", name, txn)
            except LockBackendUnavailable:
                # The transaction may have been applied with only the reply lost: a
                # retry looks for the node first, and a caller who gives up has it
                # deleted once the connection returns (see _through_outage).
                self._unknown.add((_LOCK, name, owner))
                raise
            created, fence = results
            if isinstance(created, str) and isinstance(fence, ZnodeStat):
                self._last_ok = max(self._last_ok, sent)
                return _Node(created, token_of(fence.mzxid, fence), generation)
            if isinstance(created, NoNodeError) or isinstance(fence, NoNodeError):
                # First use of this name: create the fence node, then try again.
                with contextlib.suppress(NodeExistsError):
                    self._get("acquire", name, client.ensure_path_async(parent))
                continue
            error = next(r for r in results if isinstance(r, Exception))
            self._fail("acquire", name, error)
        raise LockError(f"Could not create the lock node of {name!r} on backend {self.alias!r}.")

    def _cleanup_later(
        self,
        name: str,
        owner: str,
        leave: Callable[[], None] | None = None,
        kind: str = _LOCK,
    ) -> None:
        """Delete ``owner``'s node once the ensemble answers again (``leave`` does it;
        by default, the lock's). A contender node lives as long as the session, and
        the session outlives short outages: a node that a failed release or leave left
        behind, or the node of a lease declared lost while the session may still be
        alive, would block the lock (or hold a permit) for good."""
        generation = self._generation
        key = (kind, name, owner)
        with self._state_lock:
            if key in self._cleaning:
                return  # a thread is already at it
            self._cleaning.add(key)
        if leave is None:

            def leave() -> None:
                self._leave(name, owner)

        def clean() -> None:
            delay = _RETRY_FIRST
            try:
                # Until it is gone, or the session is (taking the node with it).
                while not self._closed and self._generation == generation:
                    try:
                        leave()
                        return
                    except LockError:
                        time.sleep(delay)
                        delay = min(delay * 2, _RETRY_MAX)
            finally:
                with self._state_lock:
                    self._cleaning.discard(key)

        threading.Thread(target=clean, name="distlocks-zk-cleanup", daemon=True).start()

    def _give_up(self, key: tuple[str, str, str], leave: Callable[[], None]) -> None:
        """An acquire that failed on an unavailable ensemble: a node it may have made
        (a create without an answer, or one made before a later request failed) is
        deleted once the ensemble answers (the caller may never leave the queue: a
        try-once call has no queue to leave)."""
        kind, name, owner = key
        made = (name, owner) in self._nodes if kind == _LOCK else key in self._permits
        if key in self._unknown or made:
            self._unknown.discard(key)
            self._cleanup_later(name, owner, leave, kind)

    def _through_outage(
        self,
        key: tuple[str, str, str],
        wait: float,
        attempt: Callable[[float | None], AcquireResult],
        leave: Callable[[], None],
    ) -> AcquireResult:
        """Run ``attempt`` (given its deadline); while the ensemble is unavailable (a
        leader election, a short outage), run it again until the caller's deadline, at
        most ``_OUTAGE_WAIT`` or three session timeouts when it has none. A try-once
        call (``wait`` 0) tries once. A create left without an answer is looked for by
        the next attempt (the node's name carries the owner); a caller who gives up
        has it deleted once the ensemble answers again."""
        if wait <= 0:
            try:
                return attempt(None)
            except LockBackendUnavailable:
                self._give_up(key, leave)
                raise
        started = time.monotonic()
        deadline = started + min(wait, max(_OUTAGE_WAIT, 3 * self.session_seconds))
        delay = _RETRY_FIRST
        while True:
            try:
                return attempt(deadline)
            except LockBackendUnavailable as exc:
                if time.monotonic() + delay >= deadline:
                    self._give_up(key, leave)
                    raise
                logger.info(
                    "ZooKeeper unavailable to %s %r on backend %r; trying again within "
                    "the caller's timeout: %s",
                    "acquire" if key[0] == _LOCK else f"a {key[0]} permit of", key[1],
                    self.alias, exc,
                )  # fmt: skip
            time.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX)

    def acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        wait: float = 0.0,
        fair: bool = False,
    ) -> AcquireResult:
        return self._through_outage(
            (_LOCK, name, owner),
            wait,
            lambda deadline: self._acquire(name, owner, ttl, holder, wait, deadline),
            lambda: self._leave(name, owner),
        )

    def _acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        wait: float,
        deadline: float | None,
    ) -> AcquireResult:
        client = self._ready("acquire", name, deadline)
        self._check_ttl(client, ttl)
        entry = self._entry(name, owner)
        children: list[str] | None = None
        if entry is None:
            unknown = (_LOCK, name, owner) in self._unknown
            if wait <= 0 or unknown:
                # Try once: a busy lock is refused without writing anything. After a
                # create left without an answer: its node may be there, to take over.
                children = self._children(client, "acquire", name)
                own = self._find_own(children, owner)
                if own:
                    entry = self._adopt(client, name, owner, own[0])
                elif wait <= 0 and children:
                    self._unknown.discard((_LOCK, name, owner))
                    return AcquireResult(False, 0, None)
            if entry is None:
                data = json.dumps(
                    {
                        "owner": owner,
                        "host": holder.host,
                        "pid": holder.pid,
                        "thread": holder.thread,
                        "extra": dict(holder.extra),
                        "ttl": ttl,
                    },
                    separators=(",", ":"),
                ).encode()
                entry = self._enqueue(client, name, owner, data)
                self._nodes[(name, owner)] = entry
                children = None
            self._unknown.discard((_LOCK, name, owner))
        if children is None or entry.path.rsplit("/", 1)[1] not in children:
            children = self._children(client, "acquire", name)
        mine = entry.path.rsplit("/", 1)[1]
        if mine not in children:
            # Deleted under us (forced out while queued, or the session changed).
            self._nodes.pop((name, owner), None)
            return AcquireResult(False, 0, None)
        own = self._find_own(children, owner)
        if own[0] != mine:
            # A retried acquire found an older node of this owner: keep that one.
            self._delete_quietly(client, entry.path)
            entry = self._adopt(client, name, owner, own[0])
            mine = own[0]
        for extra in own[1:]:
            # A create answered late (after a retry made another): one node per owner.
            if extra != mine:
                self._delete_quietly(client, f"{self.lock_path(name)}/{extra}")
        if children[0] == mine:
            return AcquireResult(True, entry.token, self.local_lease(ttl))
        if wait <= 0:
            self.leave_queue(name, owner)
        return AcquireResult(False, 0, None)

    def _adopt(self, client: KazooClient, name: str, owner: str, child: str) -> _Node:
        """Take over this owner's node found on the server (a retried acquire)."""
        path = f"{self.lock_path(name)}/{child}"
        stat = self._get("acquire", name, client.exists_async(path))
        fence = self._queue(client, "acquire", name)[1]
        token = token_of(stat.czxid, fence) if stat is not None and fence is not None else 0
        entry = _Node(path, token, self._generation)
        self._nodes[(name, owner)] = entry
        return entry

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

    def _delete_quietly(self, client: KazooClient, path: str) -> None:
        try:
            client.delete_async(path).get(timeout=self.socket_timeout)
        except Exception:
            logger.debug("Could not delete %s", path, exc_info=True)

    def _own_path(self, client: KazooClient, action: str, name: str, owner: str) -> str | None:
        entry = self._entry(name, owner)
        if entry is not None:
            return entry.path
        own = self._find_own(self._children(client, action, name), owner)
        return f"{self.lock_path(name)}/{own[0]}" if own else None

    def release(self, name: str, owner: str) -> bool:
        try:
            return self._release(name, owner)
        except LockBackendUnavailable:
            self._cleanup_later(name, owner)
            raise

    def _release(self, name: str, owner: str) -> bool:
        entry = self._nodes.get((name, owner))
        if entry is not None and entry.generation != self._generation:
            # Its session expired, taking the node with it: nothing to ask the server
            # (which may be unreachable now).
            self._nodes.pop((name, owner), None)
            return False
        client = self._ready("release", name)
        path = self._own_path(client, "release", name, owner)
        self._nodes.pop((name, owner), None)
        if path is None:
            return False
        try:
            # Version 0: the contender node is never rewritten, so anything else is
            # not the node this owner created.
            self._get("release", name, client.delete_async(path, version=0))
        except (NoNodeError, BadVersionError):
            return False
        return True

    def leave_queue(self, name: str, owner: str) -> None:
        """A waiter that gives up deletes its node. Not connected now (the acquire
        that gave up has just met the outage): no second wait for the connection; the
        node is deleted in the background once the ensemble answers (and the outage
        raised, for the caller to log)."""
        try:
            self._leave(name, owner, time.monotonic())
        except LockBackendUnavailable:
            self._cleanup_later(name, owner)
            raise

    def _leave(self, name: str, owner: str, deadline: float | None = None) -> None:
        client = self._ready("leave the queue of", name, deadline)
        path = self._own_path(client, "leave the queue of", name, owner)
        self._nodes.pop((name, owner), None)
        if path is not None:
            with contextlib.suppress(NoNodeError, BadVersionError):
                self._get("leave the queue of", name, client.delete_async(path, version=0))

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        """Confirm the lease: its node still exists in the live session. Nothing is
        written (the server keeps the node for as long as the session lives)."""
        return self._confirm(
            (_LOCK, name, owner),
            self._nodes.get((name, owner)),
            lambda client: self._own_path(client, "extend", name, owner),
            lambda: self._nodes.pop((name, owner), None),
            lambda: self._leave(name, owner),
        )

    def _confirm(
        self,
        key: tuple[str, str, str],
        entry: _Node | None,
        find: Callable[[KazooClient], str | None],
        forget: Callable[[], object],
        leave: Callable[[], None],
    ) -> bool:
        """Whether the node of a lease or permit (``entry``, else the path ``find``
        gives) still exists in the live session; ``forget`` drops the entry when not.

        A lease is declared lost when the session may have expired; but the session
        may also have survived (the connection comes back in time), keeping the node,
        which nobody else would delete: then ``leave`` deletes it in the background,
        once the ensemble answers, unless the session turns out to have expired."""
        kind, name, owner = key
        if entry is not None and entry.generation != self._generation:
            forget()
            return False  # the session that held it is gone
        if self._session_doubtful():
            self._cleanup_later(name, owner, leave, kind)
            return False
        try:
            client = self._ready("extend", name)
        except LockBackendUnavailable:
            if self._session_doubtful():
                self._cleanup_later(name, owner, leave, kind)
                return False
            raise
        if entry is not None and entry.generation != self._generation:
            return False  # lost while reconnecting
        path = entry.path if entry is not None else find(client)
        if path is None:
            return False
        sent = time.monotonic()
        stat = self._get("extend", name, client.exists_async(path))
        if stat is None:
            forget()
            return False
        self._last_ok = max(self._last_ok, sent)
        return True

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

    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        """Block until the contender just before ``owner``'s node goes (or the holder,
        for a caller with no node), or ``timeout``: a watch, no polling."""
        try:
            self._wait(name, timeout, owner)
        except LockBackendUnavailable:
            self._outage_pause(timeout)

    def _wait(self, name: str, timeout: float, owner: str) -> None:
        client = self._ready("wait for", name)
        entry = self._entry(name, owner) if owner else None
        children = self._children(client, "wait for", name)
        if not children:
            return
        if entry is None:
            watched = children[0]
        else:
            mine = entry.path.rsplit("/", 1)[1]
            if mine not in children or children[0] == mine:
                return
            watched = children[children.index(mine) - 1]
        event = threading.Event()
        with self._state_lock:
            self._waiting.add(event)
        try:
            stat = self._get(
                "wait for",
                name,
                client.exists_async(
                    f"{self.lock_path(name)}/{watched}", watch=lambda _: event.set()
                ),
            )
            if stat is not None:
                event.wait(max(0.0, timeout))
        finally:
            with self._state_lock:
                self._waiting.discard(event)

    def force_release(self, name: str, token: int | None = None) -> bool:
        client = self._ready("force-release", name)
        parent = self.lock_path(name)
        for _ in range(5):
            children, fence = self._queue(client, "force-release", name)
            if not children or fence is None:
                return False  # a free name: nothing is written
            path = f"{parent}/{children[0]}"
            stat = self._get("force-release", name, client.exists_async(path))
            if stat is None:
                continue  # released meanwhile: look again
            if token is not None and token_of(stat.czxid, fence) != token:
                return False  # the lock changed hands: leave the new holder alone
            txn = client.transaction()
            txn.delete(path, version=stat.version)
            txn.set_data(parent, b"")
            results = self._commit("force-release", name, txn)
            if not any(isinstance(r, Exception) for r in results):
                return True
            if token is not None:
                return False  # the holder went meanwhile: not this call's eviction
        return False

    def fencing_counter(self, name: str) -> int:
        client = self._ready("read the fencing counter of", name)
        stat = self._get(
            "read the fencing counter of", name, client.exists_async(self.lock_path(name))
        )
        # version 0: the fence node was created but no token was issued yet.
        if stat is None or stat.version == 0:
            return 0
        return token_of(stat.mzxid, stat)

    # -- inspection ---------------------------------------------------------------

    def _describe(self, client: KazooClient, name: str) -> LockInfo | None:
        for _ in range(5):
            children, fence = self._queue(client, "inspect", name)
            if not children or fence is None:
                return None
            try:
                raw, stat = self._get(
                    "inspect", name, client.get_async(f"{self.lock_path(name)}/{children[0]}")
                )
            except NoNodeError:
                continue  # released meanwhile: the next contender holds
            return self._info(name, children, raw, stat, fence)
        return None

    def _info(
        self, name: str, children: list[str], raw: bytes, stat: ZnodeStat, fence: ZnodeStat
    ) -> LockInfo:
        try:
            data = json.loads(raw or b"{}")
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        pid = data.get("pid")
        ttl = data.get("ttl")
        return LockInfo(
            name=name,
            backend=self.alias,
            owner=str(data.get("owner") or _owner_of(children[0])),
            fencing_token=token_of(stat.czxid, fence),
            host=str(data.get("host", "")),
            pid=pid if isinstance(pid, int) else None,
            thread=str(data.get("thread", "")),
            # When the contender queued (server clock); there is no server-side expiry.
            acquired_at=_epoch_ms(stat.ctime),
            expires_at=None,
            ttl=float(ttl) if isinstance(ttl, int | float) else None,
            waiters=len(children) - 1,
            extra={
                **holder_details(data.get("extra")),
                "session": f"0x{stat.ephemeralOwner:x}",
                "waiting": [_owner_of(child) for child in children[1:]],
            },
        )

    def inspect(self, name: str) -> LockInfo | None:
        return self._describe(self._ready("inspect", name), name)

    def _names_under(self, client: KazooClient, path: str) -> list[str]:
        """The names that have a node under ``path`` (locks, semaphores or
        read-write locks), sorted."""
        try:
            children = self._get("list", "*", client.get_children_async(path))
        except NoNodeError:
            return []
        return [urllib.parse.unquote(child[1:]) for child in sorted(children) if child[:1] == "n"]

    def iter_locks(self) -> Iterator[LockInfo]:
        """Every lock, then every semaphore permit and read-write lease."""
        client = self._ready("list", "*")
        for name in self._names_under(client, self._locks_path):
            info = self._describe(client, name)
            if info is not None:
                yield info
        yield from self.iter_permits()

    # -- semaphores and read-write locks ---------------------------------------------
    #
    #   <prefix>/semaphores/n<quoted name>                       persistent: the directory
    #   <prefix>/semaphores/n<quoted name>/permit-<owner>-<seq>  ephemeral sequential
    #   <prefix>/rwlocks/n<quoted name>                          persistent: the write fence
    #   <prefix>/rwlocks/n<quoted name>/read-<owner>-<seq>       ephemeral sequential
    #   <prefix>/rwlocks/n<quoted name>/write-<owner>-<seq>      ephemeral sequential
    #
    # Each request is one node, queued in arrival order; whether it holds is decided
    # by the nodes ahead of it (see _blockers), and a waiter watches only the ones
    # that decide it. A write node is created in one multi-op with a write of the
    # fence node: its token is that zxid, shifted per name as for locks.

    permit_kinds: frozenset[str] = frozenset({SEMAPHORE, READ, WRITE})

    def permit_dir(self, kind: str, name: str) -> str:
        """The directory of the semaphore or read-write lock ``name`` (for a
        read-write lock also its write fence node)."""
        return f"{self._family_paths[permit_family(kind)]}/n{urllib.parse.quote(name, safe='')}"

    def _permit_entry(self, kind: str, name: str, owner: str) -> _Node | None:
        """This process's node for the permit, if it belongs to the live session."""
        entry = self._permits.get((kind, name, owner))
        if entry is not None and entry.generation != self._generation:
            self._permits.pop((kind, name, owner), None)
            return None
        return entry

    def _permit_queue(
        self, client: KazooClient, action: str, kind: str, name: str
    ) -> tuple[list[str], ZnodeStat | None]:
        """The permit nodes of ``name``'s family in arrival order, and the stat of
        their directory (None when it does not exist)."""
        try:
            children, stat = self._get(
                action,
                name,
                client.get_children_async(self.permit_dir(kind, name), include_data=True),
            )
        except NoNodeError:
            return [], None
        return _permit_nodes(children, permit_family(kind)), stat

    def _find_own_permit(self, children: list[str], kind: str, owner: str) -> list[str]:
        prefix = f"{_PERMIT_NODE[kind]}{urllib.parse.quote(owner, safe='')}-"
        return [c for c in children if c.startswith(prefix) and len(c) == len(prefix) + 10]

    def _own_permit_path(
        self, client: KazooClient, action: str, kind: str, name: str, owner: str
    ) -> str | None:
        entry = self._permit_entry(kind, name, owner)
        if entry is not None:
            return entry.path
        own = self._find_own_permit(self._permit_queue(client, action, kind, name)[0], kind, owner)
        return f"{self.permit_dir(kind, name)}/{own[0]}" if own else None

    def _permit_enqueue(
        self, client: KazooClient, kind: str, name: str, owner: str, data: bytes
    ) -> _Node:
        """Create the request's node (for a writer, in one multi-op with the write of
        the fence node, whose zxid makes the token)."""
        parent = self.permit_dir(kind, name)
        node_prefix = f"{parent}/{_PERMIT_NODE[kind]}{urllib.parse.quote(owner, safe='')}-"
        generation = self._generation
        for _ in range(3):
            sent = time.monotonic()
            txn = client.transaction()
            txn.create(node_prefix, data, ephemeral=True, sequence=True)
            if kind == WRITE:
                txn.set_data(parent, b"")
            try:
                results = self._commit("acquire", name, txn)
            except LockBackendUnavailable:
                # Maybe applied with only the reply lost: looked for before a retry,
                # deleted later if the caller gives up (see _through_outage).
                self._unknown.add((kind, name, owner))
                raise
            if not any(isinstance(r, Exception) for r in results):
                self._last_ok = max(self._last_ok, sent)
                token = token_of(results[1].mzxid, results[1]) if kind == WRITE else 0
                return _Node(results[0], token, generation)
            if any(isinstance(r, NoNodeError) for r in results):
                # First use of this name: create the directory, then try again.
                with contextlib.suppress(NodeExistsError):
                    self._get("acquire", name, client.ensure_path_async(parent))
                continue
            self._fail("acquire", name, next(r for r in results if isinstance(r, Exception)))
        raise LockError(f"Could not create the permit node of {name!r} on backend {self.alias!r}.")

    def _permit_adopt(
        self, client: KazooClient, kind: str, name: str, owner: str, child: str
    ) -> _Node:
        """Take over this owner's node found on the server (a retried acquire)."""
        path = f"{self.permit_dir(kind, name)}/{child}"
        token = 0
        if kind == WRITE:
            stat = self._get("acquire", name, client.exists_async(path))
            fence = self._permit_queue(client, "acquire", kind, name)[1]
            token = token_of(stat.czxid, fence) if stat is not None and fence is not None else 0
        entry = _Node(path, token, self._generation)
        self._permits[(kind, name, owner)] = entry
        return entry

    def permit_acquire(
        self,
        kind: str,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        limit: int = 1,
        wait: float = 0.0,
    ) -> AcquireResult:
        self.check_permit_kind(kind)
        return self._through_outage(
            (kind, name, owner),
            wait,
            lambda deadline: self._permit_acquire(
                kind, name, owner, ttl, holder, limit, wait, deadline
            ),
            self._permit_leaver(kind, name, owner),
        )

    def _permit_acquire(
        self,
        kind: str,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        limit: int,
        wait: float,
        deadline: float | None,
    ) -> AcquireResult:
        client = self._ready("acquire", name, deadline)
        self._check_ttl(client, ttl)
        entry = self._permit_entry(kind, name, owner)
        children: list[str] | None = None
        if entry is None:
            # Always listed first: the node of a create left without an answer is
            # found here by its owner's name, and taken over.
            children = self._permit_queue(client, "acquire", kind, name)[0]
            own = self._find_own_permit(children, kind, owner)
            if own:
                entry = self._permit_adopt(client, kind, name, owner, own[0])
            elif wait <= 0 and _blockers(kind, children, len(children), limit):
                # Try once with no room: refused without writing anything.
                self._unknown.discard((kind, name, owner))
                return AcquireResult(False, 0, None)
            else:
                about: dict[str, Any] = {
                    "owner": owner,
                    "host": holder.host,
                    "pid": holder.pid,
                    "thread": holder.thread,
                    "extra": dict(holder.extra),
                    "ttl": ttl,
                    "kind": kind,
                }
                if kind == SEMAPHORE:
                    about["limit"] = limit
                data = json.dumps(about, separators=(",", ":")).encode()
                entry = self._permit_enqueue(client, kind, name, owner, data)
                self._permits[(kind, name, owner)] = entry
                children = None
            self._unknown.discard((kind, name, owner))
        mine = entry.path.rsplit("/", 1)[1]
        if children is None or mine not in children:
            children = self._permit_queue(client, "acquire", kind, name)[0]
        if mine not in children:
            # Deleted under us (evicted, or the session changed): the next call queues
            # it again.
            self._permits.pop((kind, name, owner), None)
            return AcquireResult(False, 0, None)
        own = self._find_own_permit(children, kind, owner)
        if own[0] != mine:
            # A retried acquire found an older node of this owner: keep that one.
            self._delete_quietly(client, entry.path)
            entry = self._permit_adopt(client, kind, name, owner, own[0])
            mine = own[0]
        for extra in own[1:]:
            # A create answered late (after a retry made another): one node per owner.
            if extra != mine:
                self._delete_quietly(client, f"{self.permit_dir(kind, name)}/{extra}")
        if not _blockers(kind, children, children.index(mine), limit):
            return AcquireResult(True, entry.token, self.local_lease(ttl))
        if wait <= 0:
            self.permit_leave(kind, name, owner)
        return AcquireResult(False, 0, None)

    def _permit_leaver(self, kind: str, name: str, owner: str) -> Callable[[], None]:
        def leave() -> None:
            self._permit_delete("leave the queue of", kind, name, owner)

        return leave

    def _permit_delete(
        self, action: str, kind: str, name: str, owner: str, deadline: float | None = None
    ) -> bool:
        """Delete ``owner``'s own node of ``kind`` (never another's); True if this
        call deleted it."""
        entry = self._permits.get((kind, name, owner))
        if entry is not None and entry.generation != self._generation:
            self._permits.pop((kind, name, owner), None)
            return False  # gone with its session: nothing to ask the server
        client = self._ready(action, name, deadline)
        path = self._own_permit_path(client, action, kind, name, owner)
        self._permits.pop((kind, name, owner), None)
        if path is None:
            return False
        try:
            # Version 0: a permit node is never rewritten.
            self._get(action, name, client.delete_async(path, version=0))
        except (NoNodeError, BadVersionError):
            return False
        return True

    def permit_release(self, kind: str, name: str, owner: str) -> bool:
        self.check_permit_kind(kind)
        try:
            return self._permit_delete("release", kind, name, owner)
        except LockBackendUnavailable:
            self._cleanup_later(name, owner, self._permit_leaver(kind, name, owner), kind)
            raise

    def permit_leave(self, kind: str, name: str, owner: str) -> None:
        """A waiter that gives up deletes its node (the ones behind it watch it)."""
        try:
            self._permit_delete("leave the queue of", kind, name, owner, time.monotonic())
        except LockBackendUnavailable:
            self._cleanup_later(name, owner, self._permit_leaver(kind, name, owner), kind)
            raise

    def permit_extend(self, kind: str, name: str, owner: str, ttl: float) -> bool:
        """Confirm the permit, as :meth:`extend` does a lock (nothing is written)."""
        self.check_permit_kind(kind)
        return self._confirm(
            (kind, name, owner),
            self._permits.get((kind, name, owner)),
            lambda client: self._own_permit_path(client, "extend", kind, name, owner),
            lambda: self._permits.pop((kind, name, owner), None),
            self._permit_leaver(kind, name, owner),
        )

    def permit_wait(
        self, kind: str, name: str, timeout: float, *, owner: str = "", limit: int = 1
    ) -> None:
        """Block until a node that keeps ``owner``'s request from holding goes (see
        :func:`_blockers`), or ``timeout``: watches, no polling."""
        self.check_permit_kind(kind)
        try:
            self._permit_wait(kind, name, timeout, owner, limit)
        except LockBackendUnavailable:
            self._outage_pause(timeout)

    def _permit_wait(self, kind: str, name: str, timeout: float, owner: str, limit: int) -> None:
        client = self._ready("wait for", name)
        entry = self._permit_entry(kind, name, owner) if owner else None
        if entry is None:
            return  # no node of its own (gone with its session): the next call queues
        wake = entry.wake
        # Cleared before looking: a watch that fires from here on is not missed.
        wake.clear()
        with self._state_lock:
            self._waiting.add(wake)
        try:
            if entry.generation != self._generation:
                return  # the session went meanwhile
            children = self._permit_queue(client, "wait for", kind, name)[0]
            mine = entry.path.rsplit("/", 1)[1]
            if mine not in children:
                return
            watched = _blockers(kind, children, children.index(mine), limit)
            if not watched:
                return
            parent = self.permit_dir(kind, name)
            # Sent together, answered together: one round trip for all the watches.
            pending = [
                client.exists_async(f"{parent}/{child}", watch=entry.watch) for child in watched
            ]
            stats = [self._get("wait for", name, result) for result in pending]
            if all(stat is not None for stat in stats):
                wake.wait(max(0.0, timeout))
        finally:
            with self._state_lock:
                self._waiting.discard(wake)

    def _permit_state(
        self, client: KazooClient, action: str, kind: str, name: str
    ) -> tuple[list[_Seen], ZnodeStat | None]:
        """The permit nodes of ``name``'s family with their data, each marked holding
        or waiting, and the directory's stat."""
        children, fence = self._permit_queue(client, action, kind, name)
        parent = self.permit_dir(kind, name)
        pending = [(child, client.get_async(f"{parent}/{child}")) for child in children]
        seen = []
        for child, result in pending:
            try:
                raw, stat = self._get(action, name, result)
            except NoNodeError:
                continue  # gone meanwhile: judged without it
            try:
                data = json.loads(raw or b"{}")
            except ValueError:
                data = {}
            seen.append(_Seen(child, data if isinstance(data, dict) else {}, stat))
        _judge(seen)
        return seen, fence

    def _permit_infos(self, client: KazooClient, family: str, name: str) -> list[LockInfo]:
        seen, fence = self._permit_state(client, "inspect", family, name)
        waiting = [_permit_owner(node.child) for node in seen if not node.holds]
        infos = []
        for node in seen:
            if not node.holds:
                continue
            data, stat, kind = node.data, node.stat, node.kind
            pid, ttl = data.get("pid"), data.get("ttl")
            extra: dict[str, Any] = {**holder_details(data.get("extra")), "kind": kind}
            if kind == SEMAPHORE:
                extra["limit"] = node.limit
            extra["session"] = f"0x{stat.ephemeralOwner:x}"
            extra["waiting"] = waiting
            infos.append(
                LockInfo(
                    name=name,
                    backend=self.alias,
                    # The owner named by the node, which release and eviction go by.
                    owner=_permit_owner(node.child),
                    fencing_token=(
                        token_of(stat.czxid, fence) if kind == WRITE and fence is not None else 0
                    ),
                    host=str(data.get("host", "")),
                    pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                    thread=str(data.get("thread", "")),
                    # When the request queued (server clock); nothing expires there.
                    acquired_at=_epoch_ms(stat.ctime),
                    expires_at=None,
                    ttl=float(ttl) if isinstance(ttl, int | float) else None,
                    waiters=len(waiting),
                    extra=extra,
                )
            )
        return infos

    def permit_holders(self, kind: str, name: str) -> list[LockInfo]:
        self.check_permit_kind(kind)
        return self._permit_infos(self._ready("inspect", name), permit_family(kind), name)

    def iter_permits(self) -> Iterator[LockInfo]:
        client = self._ready("list", "*")
        for family, path in self._family_paths.items():
            for name in self._names_under(client, path):
                yield from self._permit_infos(client, family, name)

    def permit_force_release(self, kind: str, name: str, owner: str | None = None) -> int:
        """Delete the node of ``owner``'s permit (of every permit held when None), in
        one multi-op that, for a read-write lock, also writes the fence node: the
        write counter moves past an evicted writer. Waiting requests are left alone;
        nothing is written when no permit matches."""
        self.check_permit_kind(kind)
        client = self._ready("force-release", name)
        parent = self.permit_dir(kind, name)
        for _ in range(5):
            seen, fence = self._permit_state(client, "force-release", kind, name)
            targets = [
                node
                for node in seen
                if node.holds and (owner is None or _permit_owner(node.child) == owner)
            ]
            if not targets or fence is None:
                return 0
            txn = client.transaction()
            for node in targets:
                txn.delete(f"{parent}/{node.child}", version=node.stat.version)
            if permit_family(kind) == RWLOCK:
                txn.set_data(parent, b"")
            results = self._commit("force-release", name, txn)
            if not any(isinstance(r, Exception) for r in results):
                return len(targets)
            # One of them went meanwhile: look again.
        return 0

    def permit_counter(self, name: str) -> int:
        self.check_permit_kind(WRITE)
        client = self._ready("read the write counter of", name)
        stat = self._get(
            "read the write counter of", name, client.exists_async(self.permit_dir(WRITE, name))
        )
        # version 0: the directory exists but no write token was issued yet.
        if stat is None or stat.version == 0:
            return 0
        return token_of(stat.mzxid, stat)

    # -- for tests and operations -------------------------------------------------

    def contenders(self, name: str) -> list[str]:
        """Owners of the contender nodes of ``name`` in queue order (holder first)."""
        client = self._ready("inspect", name)
        return [_owner_of(child) for child in self._children(client, "inspect", name)]

    def session_id(self) -> int | None:
        """The id of this process's current session (None before the first call)."""
        client = self._client
        return client.client_id[0] if client is not None and client.client_id else None
