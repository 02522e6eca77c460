"""Keep credentials out of every message, page, log line and exception.

A ``LOCATION`` (or a ``DATABASES`` entry) may carry a password, and a malformed one
is exactly what ends up quoted in an error. Every piece of text distlocks shows that
may name a location goes through :func:`redact`, which removes

* the password of any URL's user information (``scheme://user:secret@host``), for
  every scheme, including misspelt ones and several hosts (``host:1,host:2``);
* the value of a ``password=`` (or ``passwd=``, ``pwd=``) parameter, in a query
  string or a ``key=value`` connection string;
* the value of a ``'password': ...`` item in the repr of a dict;
* every password configured in ``DISTLOCKS_BACKENDS`` (inside LOCATION, or in
  ``OPTIONS``) or ``DATABASES``, literally, wherever it appears.

The last rule catches what no pattern can (a password quoted on its own by a
driver), the first three what settings do not list (a URL in an environment
variable, a password of one or two characters).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import unquote

MASK = "***"

# scheme://user:password@host  ->  scheme://user:***@host, and scheme://token@host ->
# scheme://***@host (some clients read a lone token there as the password). The user
# information runs to the last "@" of the URL, since a careless password may itself
# hold "@", ":" or "/"; masking too much is the safe way to be wrong.
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^\s'\"]*)@")


def _mask_url(match: re.Match[str]) -> str:
    user, colon, _ = match["userinfo"].partition(":")
    if colon and "/" not in user and "@" not in user:
        return f"{match['scheme']}{user}:{MASK}@"
    return f"{match['scheme']}{MASK}@"


def _url_secrets(text: str) -> Iterator[str]:
    for match in _URL.finditer(text):
        user, colon, password = match["userinfo"].partition(":")
        secret = password if colon else user
        if secret:
            yield secret
            yield unquote(secret)


# password=secret in a query string or a libpq connection string.
_PARAM = re.compile(
    r"(?P<head>\b(?:password|passwd|pwd|sentinel_password)\s*=\s*)(?P<secret>'[^']*'|[^\s&;,)]+)",
    re.IGNORECASE,
)
# 'password': 'secret' in a dict's repr.
_DICT_ITEM = re.compile(
    r"(?P<head>['\"](?:password|passwd|pwd|sentinel_password)['\"]\s*:\s*)"
    r"(?P<secret>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^,}\s]+)",
    re.IGNORECASE,
)
_PASSWORD_KEYS = frozenset({"password", "passwd", "pwd", "sentinel_password"})


def redact_url(url: str) -> str:
    """``url`` with the password of its user information replaced by ``***``."""
    return _URL.sub(_mask_url, url)


def redact(text: Any) -> str:
    """``text`` (made a str) with every credential removed; see the module docstring."""
    text = str(text)
    if not text:
        return text
    if "@" in text:
        text = _URL.sub(_mask_url, text)
    if "=" in text:
        text = _PARAM.sub(lambda m: f"{m['head']}{MASK}", text)
    if ":" in text:
        text = _DICT_ITEM.sub(lambda m: f"{m['head']}'{MASK}'", text)
    for secret in configured_secrets():
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def configured_secrets() -> tuple[str, ...]:
    """Every password the settings give distlocks' backends and Django's databases,
    longest first (so a password that contains another is masked whole)."""
    try:
        from django.conf import settings

        if not settings.configured:
            return ()
        sources = (
            getattr(settings, "DISTLOCKS_BACKENDS", None),
            getattr(settings, "DATABASES", None),
            getattr(settings, "CACHES", None),
        )
    except Exception:
        return ()
    key = tuple(id(source) for source in sources)
    cached = _cache.get("secrets")
    if cached is not None and cached[0] == key:
        return cached[1]
    found: set[str] = set()
    for source in sources:
        found.update(_secrets_in(source))
    # Very short strings would mask ordinary words; the patterns above cover the
    # places where a short password appears (a URL, a parameter, a dict item).
    secrets = tuple(sorted((s for s in found if len(s) >= 4), key=len, reverse=True))
    _cache["secrets"] = (key, secrets)
    return secrets


_cache: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {}


def _secrets_in(value: Any, depth: int = 0) -> Iterator[str]:
    if depth > 6:
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and key.lower() in _PASSWORD_KEYS and isinstance(item, str):
                if item:
                    yield item
                    yield unquote(item)
            else:
                yield from _secrets_in(item, depth + 1)
    elif isinstance(value, str):
        yield from _secrets_of_text(value)
    elif isinstance(value, Iterable) and not isinstance(value, bytes):
        for item in value:
            yield from _secrets_in(item, depth + 1)


def _secrets_of_text(text: str) -> Iterator[str]:
    yield from _url_secrets(text)
    for match in _PARAM.finditer(text):
        secret = match["secret"].strip("'")
        if secret:
            yield secret
            yield unquote(secret)


def escape_control(text: Any) -> str:
    """``text`` with control characters (escape codes, CR, LF, NUL...) shown as
    ``\\x1b``-style escapes, for terminal and log output of values a holder chose
    (thread names, Celery task ids, extra details)."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
