"""The etcd backend's configuration: the OPTIONS it accepts and their defaults, the
endpoints and credentials of ``LOCATION``, what is wrong with a config (one sentence
each, never quoting a credential), and the TLS context.
"""

from __future__ import annotations

import dataclasses
import ssl
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from distlocks.redaction import redact

DEFAULTS: dict[str, Any] = {
    "prefix": "distlocks",
    "connect_timeout": 3.0,
    "socket_timeout": 5.0,
    "token_floor": 0,
}
_TLS_KEYS = ("ca_file", "cert_file", "key_file", "verify")
_OPTION_KEYS = frozenset(DEFAULTS) | {"user", "password"} | set(_TLS_KEYS)


@dataclasses.dataclass(frozen=True)
class _Endpoint:
    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


def _parse_endpoints(location: Any) -> list[_Endpoint]:
    """Endpoints of ``LOCATION`` (a URL, several separated by commas, or a list);
    ValueError saying what is wrong. Messages never quote the user information."""
    items = location if isinstance(location, list | tuple) else str(location).split(",")
    endpoints = []
    for raw in items:
        if not isinstance(raw, str) or not raw.strip():
            raise ValueError("LOCATION must name etcd endpoints such as 'http://127.0.0.1:2379'")
        text = raw.strip()
        if "://" not in text:
            text = f"http://{text}"
        parts = urllib.parse.urlsplit(text)
        if parts.scheme not in ("http", "https"):
            raise ValueError(
                f"LOCATION endpoint {redact(text)!r} must be http:// or https:// (the gateway)"
            )
        try:
            port = parts.port or 2379
        except ValueError:
            raise ValueError(
                f"LOCATION endpoint {parts.scheme}://{parts.hostname or ''} has a bad port "
                f"(percent-encode special characters of a password)"
            ) from None
        if not parts.hostname:
            raise ValueError(f"LOCATION endpoint {redact(text)!r} names no host")
        endpoints.append(_Endpoint(parts.scheme, parts.hostname, port))
    return endpoints


def _credentials(location: Any) -> tuple[str, str] | None:
    items = location if isinstance(location, list | tuple) else str(location).split(",")
    for raw in items:
        text = str(raw).strip()
        parts = urllib.parse.urlsplit(text if "://" in text else f"http://{text}")
        if parts.username:
            return urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or "")
    return None


def config_problems(config: Mapping[str, Any]) -> list[str]:
    """What is wrong with the ``LOCATION`` and ``OPTIONS`` of an etcd backend's config
    (the base class checks the rest): one sentence each, saying what to change."""
    problems: list[str] = []
    location = config.get("LOCATION")
    try:
        if location is None:
            raise ValueError("LOCATION must name etcd endpoints such as 'http://127.0.0.1:2379'")
        _parse_endpoints(location)
    except ValueError as exc:
        problems.append(str(exc))
    options = config.get("OPTIONS") or {}
    if isinstance(options, Mapping):
        unknown = set(options) - _OPTION_KEYS
        if unknown:
            problems.append(
                f"unknown OPTIONS key(s) {', '.join(sorted(map(str, unknown)))}; "
                f"EtcdBackend accepts {', '.join(sorted(_OPTION_KEYS))}"
            )
        for key in ("connect_timeout", "socket_timeout"):
            value = options.get(key, DEFAULTS[key])
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                problems.append(f"OPTIONS[{key!r}] must be a positive number of seconds")
        prefix = options.get("prefix", DEFAULTS["prefix"])
        if not isinstance(prefix, str) or not prefix.strip("/"):
            problems.append("OPTIONS['prefix'] must be a key prefix such as 'distlocks'")
        floor = options.get("token_floor", 0)
        if isinstance(floor, bool) or not isinstance(floor, int) or not 0 <= floor < 2**52:
            problems.append(
                "OPTIONS['token_floor'] must be an int from 0 to 2**52 (tokens stay below 2**53)"
            )
        for key in ("user", "password", "ca_file", "cert_file", "key_file"):
            if key in options and not isinstance(options[key], str):
                problems.append(f"OPTIONS[{key!r}] must be a str")
        if "password" in options and "user" not in options:
            problems.append("OPTIONS['password'] needs OPTIONS['user']")
    return problems


def needs_tls(endpoints: Sequence[_Endpoint], opts: Mapping[str, Any]) -> bool:
    return any(e.scheme == "https" for e in endpoints) or any(
        key in opts for key in ("ca_file", "cert_file")
    )


def ssl_context(opts: Mapping[str, Any]) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=opts.get("ca_file"))
    if opts.get("cert_file"):
        context.load_cert_chain(opts["cert_file"], opts.get("key_file"))
    if opts.get("verify") is False:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
