"""Configuration: the OPTIONS and their defaults, what is wrong with a LOCATION or the
OPTIONS (never quoting a piece of them), and :class:`ZooKeeperConfig`, the bottom of
the backend's classes: it reads the settings and declares the per-process state every
class above it keeps (the session's, the nodes', the outages')."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from kazoo.client import KazooClient
from kazoo.hosts import collect_hosts

from distlocks.backends.base import RWLOCK, SEMAPHORE, BaseBackend
from distlocks.backends.capabilities import Listing, Permits, Waiting
from distlocks.backends.zookeeper.nodes import _Node

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


class ZooKeeperConfig(Listing, Waiting, Permits, BaseBackend):
    """The settings of one backend, checked, and the state of this process's session
    and nodes (used by the classes above: see the package's docstring)."""

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
        #: The base (nodes.fence_base) of fence nodes seen whose stat does not tell it,
        #: by (path, czxid, ctime): fixed for the life of a node (zxids start again
        #: after the loss of the data, the ctime does not), read once per process.
        self._bases: dict[tuple[str, int, int], int] = {}
        self._waiting: set[threading.Event] = set()
        self._state_lock = threading.Lock()
        #: The session timeout the server granted at the last handshake (seconds),
        #: None before the first: it may be shorter than the one asked for (the
        #: server's maxSessionTimeout), and a reconnect to another server may change it.
        self._negotiated: float | None = None
        #: When the client's handshakes began to be answered by a closed connection
        #: (None while they succeed): how a server that lost its data refuses a client
        #: that has seen later zxids (see ZooKeeperSession._ready).
        self._refused_since: float | None = None
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
