"""What the Redis backend reads of its settings: ``LOCATION`` parsed into a
:class:`Location` (one server, a Redis Cluster or a Sentinel service), with errors
that say what to change and never show a password; and the error of a Redis Cluster
node named as one server (:class:`ClusterNodeAsServer`).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured

from distlocks.exceptions import LockBackendUnavailable
from distlocks.redaction import redact, redact_url
from redis.cluster import RedisCluster
from redis.connection import Connection, ConnectionPool, SSLConnection, parse_url
from redis.exceptions import ClusterCrossSlotError

_SCHEMES = ("redis", "rediss", "unix")
_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_LOCATION_FORMS = (
    "start with redis://, rediss:// or unix:// (one server), "
    "redis+cluster:// (a Redis Cluster: redis+cluster://host:port[,host:port...]) or "
    "redis+sentinel:// (Sentinel: redis+sentinel://host:port[,host:port...]/<service>[/<db>])"
)


@dataclasses.dataclass(frozen=True)
class Location:
    """A parsed ``LOCATION``: one server, a Redis Cluster, or a Sentinel service."""

    #: "server", "cluster" or "sentinel".
    mode: str
    #: (host, port) of each cluster node or Sentinel named (empty for one server).
    nodes: tuple[tuple[str, int], ...] = ()
    #: The Sentinel service: the name its ``sentinel monitor`` line gives the primary.
    service: str = ""
    db: int = 0
    #: Options for the Redis servers from the URL: credentials, TLS, query string.
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _node(text: str, default_port: int, location: str) -> tuple[str, int]:
    try:
        parts = urlsplit(f"//{text}")
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or "@" in text or parts.path:
        # Not quoted: a password holding "/" or "?" is cut by the parser into a piece
        # that lands here.
        raise ValueError(
            f"LOCATION {location!r} has a node that is not host:port (percent-encode a "
            f"password holding '/', '?', '#' or '@')"
        )
    return host, port or default_port


def _parse_error(exc: ValueError, location: str) -> str:
    """The URL parser's complaint, without any piece of the URL's user information
    (a password holding "/" or "@" is cut by the parser into a "port" or a "path" it
    then quotes), and what to change."""
    text = redact(exc)
    userinfo = location.partition("://")[2].rpartition("@")[0]
    for piece in sorted(set(re.split(r"[/?#@:;&=,\s]+", userinfo)), key=len, reverse=True):
        # Quoted, any piece is masked; bare, only one long enough not to be a word.
        for quoted in (f"'{piece}'", f'"{piece}"'):
            text = text.replace(quoted, "'***'")
        if len(piece) >= 4:
            text = text.replace(piece, "***")
    return (
        f"{text} (a password holding '/', '@', ':', '?' or '#' must be percent-encoded, "
        f"e.g. with urllib.parse.quote(password, safe=''))"
    )


def parse_location(location: str) -> Location:
    """Parse a ``LOCATION`` URL (no I/O); ValueError saying what to change if invalid.

    ``redis+cluster://[user:password@]host:port[,host:port...][/0][?options]`` names
    some nodes of a Redis Cluster (the client finds the others);
    ``redis+sentinel://[user:password@]host:port[,host:port...]/<service>[/<db>][?options]``
    names Sentinels and the service they watch. ``rediss+`` turns TLS on for the Redis
    servers. Credentials and options apply to the Redis servers, as in a ``redis://``
    URL; the Sentinels' own are ``OPTIONS["sentinel_kwargs"]``.
    """
    shown = redact_url(location)  # messages quote the URL without its password
    scheme = location.partition("://")[0].lower() if "://" in location else ""
    if scheme in _SCHEMES:
        try:
            parsed = parse_url(location)  # what the client does on first use, read now
        except ValueError as exc:
            raise ValueError(f"LOCATION {shown!r}: {_parse_error(exc, location)}") from None
        _refuse_unknown_query_keys(parsed, shown)
        path = urlsplit(location).path if scheme != "unix" else ""
        if path.strip("/") and not path.strip("/").isdigit():
            # redis-py would quietly use database 0 instead.
            raise ValueError(
                f"LOCATION {shown!r}: the path must be a database number (e.g. /0), "
                f"not {redact(path)!r}"
            )
        return Location("server")
    if scheme not in _CLUSTER_SCHEMES + _SENTINEL_SCHEMES:
        raise ValueError(f"LOCATION {shown!r} must {_LOCATION_FORMS}")
    cluster = scheme in _CLUSTER_SCHEMES
    example = (
        "redis+cluster://host:port,host:port"
        if cluster
        else "redis+sentinel://host:port,host:port/<service>/0"
    )
    rest = location.split("://", 1)[1]
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    if "?" in netloc:
        netloc, _, query = netloc.partition("?")
    userinfo, _, hosts = netloc.rpartition("@")
    if not hosts:
        raise ValueError(f"LOCATION {shown!r} names no host; write e.g. {example}")
    default_port = 6379 if cluster else 26379
    nodes = tuple(_node(text, default_port, shown) for text in hosts.split(","))
    segments = [segment for segment in path.split("/") if segment]
    service, db_text = "", "0"
    if cluster:
        if segments not in ([], ["0"]):
            raise ValueError(
                f"LOCATION {shown!r}: a Redis Cluster has database 0 only; "
                f"drop the path, e.g. {example}"
            )
    elif len(segments) not in (1, 2):
        raise ValueError(
            f"LOCATION {shown!r} must name the service the Sentinels watch, "
            f"and optionally a database: {example}"
        )
    else:
        service, db_text = segments[0], (segments[1:] or ["0"])[0]
    if not db_text.isdigit():
        raise ValueError(f"LOCATION {shown!r}: database {db_text!r} is not a number")
    tls = scheme.startswith("rediss")
    credentials = f"{userinfo}@" if userinfo else ""
    try:
        # Credentials and query options are read exactly as for a redis:// URL.
        options = parse_url(f"redis://{credentials}localhost/0?{query}")
    except ValueError as exc:
        raise ValueError(f"LOCATION {shown!r}: {_parse_error(exc, location)}") from None
    _refuse_unknown_query_keys(
        {**options, "connection_class": SSLConnection if tls else Connection},
        shown,
        RedisCluster if cluster else None,
    )
    for key in ("host", "port", "db", "path", "connection_class"):
        options.pop(key, None)
    if tls:
        options["ssl"] = True
    return Location("cluster" if cluster else "sentinel", nodes, service, int(db_text), options)


def _refuse_unknown_query_keys(
    parsed: Mapping[str, Any], shown: str, client: type | None = None
) -> None:
    """redis-py hands every query key to the connection class, so a misspelt one
    (``?socket_timout=1``) would be a TypeError at the first lock: refused here.
    ``client``: a client class that reads some keys itself (RedisCluster)."""
    connection = parsed.get("connection_class", Connection)
    known = {"host", "port", "path", "connection_class"}
    for cls in (ConnectionPool, *connection.__mro__, *([client] if client else [])):
        init = cls.__dict__.get("__init__")
        if init is not None:
            known.update(inspect.signature(init).parameters)
    unknown = sorted(set(parsed) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        meant = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"LOCATION {shown!r}: unknown query option(s) {', '.join(map(repr, unknown))}"
            f"{meant}; {connection.__name__} reads none such. Fix or remove it."
        )


def _positive(options: Mapping[str, Any], key: str, problems: list[str]) -> None:
    value = options.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        problems.append(f"OPTIONS['{key}'] must be a number of seconds > 0, not {value!r}")


class ClusterNodeAsServer(LockBackendUnavailable, ImproperlyConfigured):
    """A node of a Redis Cluster named as one server (``redis://host:port``) refused a
    call: its keys are in two hash slots (CROSSSLOT: with the listing index on, every
    lock call names the lock's keys and the index's), or in a slot that another node
    serves (MOVED, ASK). Nothing of the call ran.

    Both a :class:`LockBackendUnavailable` (this LOCATION cannot serve locks, and every
    ``except LockError`` of distlocks and its callers sees it) and an
    ``ImproperlyConfigured`` (the fix is in the settings), as a bad LOCATION found at
    the first use is."""


def cluster_node_error(
    backend: Any, action: str, name: str, exc: Exception, detail: str
) -> ClusterNodeAsServer:
    """The error of a call that ``backend`` (one server) had refused by a Redis Cluster
    node: which server, why it refused, and the LOCATION to use instead. Built from
    the pool's host and port, never from the URL, so no credential can be quoted."""
    pool = backend.client.connection_pool
    host, port = pool.connection_kwargs.get("host"), pool.connection_kwargs.get("port")
    where = f"{host}:{port}" if host else "host:port"
    tls = issubclass(pool.connection_class, SSLConnection)
    scheme = "rediss+cluster" if tls else "redis+cluster"
    crossslot = isinstance(exc, ClusterCrossSlotError)
    index = backend.listing_index
    setting = "LOCATION" if "LOCATION" in backend.config else "CACHE"
    why = "serves the slot of this lock's keys on another node"
    if crossslot:
        why = "runs no script whose keys are in two hash slots"
        if index:
            why += ", and each lock call names the lock's keys and the listing index's"
    fix = f"set LOCATION to {scheme}://{where}"
    if setting == "CACHE":
        fix = f"use LOCATION {scheme}://{where} instead of CACHE"
    extra = (
        " On a cluster of a single node, OPTIONS['listing_index'] = False works too."
        if crossslot and index
        else ""
    )
    return ClusterNodeAsServer(
        backend.alias,
        f"{action} {name!r} failed: the server at {setting} ({where}) is a node of a Redis "
        f"Cluster, named as one server; it {why} ({detail}), and ran none of the call. "
        f"To use the cluster, {fix}: the backend then sends each call to the node that "
        f"serves its slot (see 'Redis Cluster' in docs/backends.md).{extra}",
    )
