"""Keep credentials out of every message, page, log line and exception.

A ``LOCATION`` (or a ``DATABASES`` entry) may carry a password, and a malformed one
is exactly what ends up quoted in an error. Every piece of text distlocks shows that
may name a location goes through :func:`redact`, which removes

* the password of any URL's user information (``scheme://user:secret@host``), for
  every scheme, including misspelt ones and several hosts (``host:1,host:2``);
* whatever lies before the last "@" of any word (up to a space, a quote or a
  bracket) that could hold a credential, whatever its shape: one character of
  ``://`` missing (``redis//:pw@host``, ``redis:/:pw@host``), no scheme
  (``u:pw@host``), backslashes, percent-encoding, several "@". Only a plain name
  (``celery@worker-1``) is left alone; a scheme, the host and the port stay readable;
* the value of a ``password=`` (or ``passwd=``, ``pwd=``) parameter, in a query
  string or a ``key=value`` connection string;
* the value of a ``'password': ...`` item in the repr of a dict;
* every password configured in ``DISTLOCKS_BACKENDS`` (inside LOCATION, with or
  without a scheme, or in ``OPTIONS``: ``*password`` keys and ZooKeeper's ``auth``
  credentials), ``DATABASES`` or ``CACHES``, literally, wherever it appears; and
  every piece of a configured string that could be a credential however malformed
  it is (each substring between separators before its last "@"), also as a repr
  shows it, and where it stands before an "@" however short it is.

The last rule catches what no pattern can (a password quoted on its own by a
driver, a location a parser cut into pieces), the patterns what settings do not
list (a URL from elsewhere, a password of one or two characters).
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import unquote

MASK = "***"

#: Scheme names kept readable in front of a masked location, whatever separator
#: follows them (``redis//***@host`` says more than ``***@host``), and never taken
#: for a secret on their own.
_SCHEMES = frozenset(
    {
        "redis",
        "rediss",
        "unix",
        "redis+sentinel",
        "rediss+sentinel",
        "redis+cluster",
        "rediss+cluster",
        "http",
        "https",
        "zk",
        "etcd",
        "postgres",
        "postgresql",
        "digest",
        "sasl",
    }
)
#: Words a location's user name often is: not masked wherever they appear (they are
#: masked in a location all the same, by the patterns).
_NOT_SECRETS = _SCHEMES | {"user", "username", "default", "root", "admin", "localhost"}

# scheme://user:password@host  ->  scheme://user:***@host, and scheme://token@host ->
# scheme://***@host (some clients read a lone token there as the password). A scheme
# missing one character of "://" ("redis//", "redis:/", "redis:\\") is a URL all the
# same. The user information runs to the last "@" of the URL, since a careless
# password may itself hold "@", ":" or "/"; masking too much is the safe way to be wrong.
#: (Bounded, and anchored at the start of a word, so that no text makes the search
#: quadratic; a longer user information is the next pattern's.)
_URL = re.compile(
    r"(?<![A-Za-z0-9+.\-])(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*(?:://|:/|//|:?\\\\|:\\))"
    r"(?P<userinfo>[^\s'\"]{0,256})@"
)
# Any run of characters with an "@" in it, up to a space, a quote or a bracket: what
# lies before its last "@" may be user information, whatever the shape of the rest
# (no scheme, "redis:pw@host", a percent-encoded or unicode password, a host list).
_AT_TOKEN = re.compile(r"(?<![^\s'\"`<>(){}\[\]])(?P<left>[^\s'\"`<>(){}\[\]]+)@")
# What may stay readable of such a token's left part: a plain prefix ("url="), a
# scheme and its separator, and (after "://") a plain user name.
_HEAD = re.compile(
    r"(?P<prefix>(?:[\w.+\-]*=)?)(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*)"
    r"(?P<sep>://|:?[/\\]+|:)(?P<rest>.*)",
    re.DOTALL,
)
# A name before an "@" that cannot hide a password by itself (celery@worker-1):
# shown as it is.
_PLAIN = re.compile(r"[\w.+\-]*")


def _mask_url(match: re.Match[str]) -> str:
    user, colon, _ = match["userinfo"].partition(":")
    if match["scheme"].endswith("://") and colon and _PLAIN.fullmatch(user):
        return f"{match['scheme']}{user}:{MASK}@"
    return f"{match['scheme']}{MASK}@"


def _mask_left(left: str) -> str:
    """The part of a token before its last "@", with whatever could be a credential
    masked: everything but a plain prefix, a scheme and a plain user name."""
    if _PLAIN.fullmatch(left):
        return left
    head = _HEAD.fullmatch(left)
    if head is None:
        return MASK
    sep = head["sep"]
    if sep != "://" and head["scheme"].lower() not in _SCHEMES:
        return MASK
    shown = head["prefix"] + head["scheme"] + sep
    if sep == "://":
        user, colon, _ = head["rest"].partition(":")
        if colon and _PLAIN.fullmatch(user):
            shown += f"{user}:"
    return shown + MASK


def _mask_patterns(text: str) -> str:
    """``text`` with the credentials masked that patterns find (no settings read)."""
    if "@" in text:
        text = _URL.sub(_mask_url, text)
        text = _AT_TOKEN.sub(lambda m: f"{_mask_left(m['left'])}@", text)
    if "=" in text:
        text = _PARAM.sub(lambda m: f"{m['head']}{MASK}", text)
    if ":" in text:
        text = _DICT_ITEM.sub(lambda m: f"{m['head']}'{MASK}'", text)
    return text


def _url_secrets(text: str) -> Iterator[str]:
    for match in _URL.finditer(text):
        user, colon, password = match["userinfo"].partition(":")
        yield from _pieces(password if colon else user)


# Where a URL parser may cut a careless password ("redis://u:pass/word@host" is host
# "u", port "pass", path "/word@host" to urllib): each piece may be quoted alone.
_CUTS = re.compile(r"[/?#@:;&=,'\"`\s\\\x00-\x1f\x7f]+")


def _pieces(secret: str) -> Iterator[str]:
    """``secret``, unquoted, and the pieces a parser may cut it into."""
    if not secret:
        return
    for whole in (secret, unquote(secret)):
        yield whole
        yield from _CUTS.split(whole)


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
#: Settings keys whose value is a list of ``(scheme, credential)`` pairs (ZooKeeper's
#: ``OPTIONS["auth"]``, kazoo's ``auth_data``): every credential is a secret.
_CREDENTIAL_LIST_KEYS = frozenset({"auth", "auth_data"})


def _is_password_key(key: str) -> bool:
    """``password`` and its kin, also as a suffix (``keyfile_password``, ``ssl_password``)."""
    key = key.lower()
    return key in _PASSWORD_KEYS or key.endswith(("_password", "_passwd", "_pwd"))


def redact_url(url: str) -> str:
    """``url`` with every credential removed (see :func:`redact`)."""
    return redact(url)


def redact(text: Any) -> str:
    """``text`` (made a str) with every credential removed; see the module docstring."""
    text = str(text)
    if not text:
        return text
    # The configured secrets first: a pattern that masked part of one (a password
    # holding a space) would leave the rest of it for no rule to find.
    secrets, before_at = _configured()
    # Without regard to case: a driver may show a piece of a location as a host name,
    # lowercased (kazoo's "Cannot resolve <host>").
    folded = text.casefold()
    for secret in secrets:
        if secret.casefold() in folded:
            text = re.sub(
                re.escape(secret), lambda match: _masked(match[0]), text, flags=re.IGNORECASE
            )
            folded = text.casefold()
    if before_at is not None and "@" in text:
        text = before_at.sub(lambda match: _masked(match[0]), text)
    return _mask_patterns(text)


def _masked(secret: str) -> str:
    """``***`` in place of ``secret``, with the separators around it kept (a piece of
    a location such as "//:pw" becomes "//:***", which reads as one)."""
    core = secret.strip(_SEPARATORS)
    if not core:
        return MASK
    start = secret.index(core)
    return f"{secret[:start]}{MASK}{secret[start + len(core) :]}"


def configured_secrets() -> tuple[str, ...]:
    """Every password the settings give distlocks' backends and Django's databases,
    longest first (so a password that contains another is masked whole), and every
    piece of a configured location that could be a credential."""
    return _configured()[0]


def _configured() -> tuple[tuple[str, ...], re.Pattern[str] | None]:
    """The configured secrets, and a pattern of the user information of configured
    locations where it stands before an "@" (for those too short to mask anywhere)."""
    try:
        from django.conf import settings

        if not settings.configured:
            return (), None
        sources = (
            getattr(settings, "DISTLOCKS_BACKENDS", None),
            getattr(settings, "DATABASES", None),
            getattr(settings, "CACHES", None),
        )
    except Exception:
        return (), None
    # Keyed by the setting objects themselves (kept alive by the cache, so an id is
    # never reused by a replacement setting while the cache still names it).
    cached = _cache.get("secrets")
    if cached is not None and all(a is b for a, b in zip(cached[0], sources, strict=True)):
        return cached[1], cached[2]
    found: set[str] = set()
    userinfos: set[str] = set()
    for source in sources:
        found.update(_secrets_in(source, userinfos=userinfos))
    # As a repr or escape_control() shows them (backslashes doubled, control
    # characters and quotes escaped).
    found.update([repr(s)[1:-1] for s in found if not s.isprintable() or "\\" in s or "'" in s])
    # Very short strings would mask ordinary words; the patterns above cover the
    # places where a short password appears (a URL, a parameter, a dict item, the
    # user information of a configured location).
    secrets = tuple(
        sorted(
            (s for s in found if len(s) >= 4 and s.strip()),
            key=len,
            reverse=True,
        )
    )
    before_at = None
    if userinfos:
        choices = "|".join(map(re.escape, sorted(userinfos, key=len, reverse=True)))
        before_at = re.compile(rf"(?:^|(?<=[\s'\"`<>(){{}}\[\]/:\\@,;=]))(?:{choices})(?=@)")
    _cache["secrets"] = (sources, secrets, before_at)
    return secrets, before_at


_cache: dict[str, tuple[tuple[Any, ...], tuple[str, ...], re.Pattern[str] | None]] = {}


def _secrets_in(value: Any, depth: int = 0, *, userinfos: set[str]) -> Iterator[str]:
    if depth > 6:
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and _is_password_key(key) and isinstance(item, str):
                yield from _pieces(item)
                yield from _location_secrets(item, userinfos)
            elif isinstance(key, str) and key.lower() in _CREDENTIAL_LIST_KEYS:
                yield from _credentials(item)
                yield from _secrets_in(item, depth + 1, userinfos=userinfos)
            else:
                yield from _secrets_in(item, depth + 1, userinfos=userinfos)
    elif isinstance(value, str):
        yield from _secrets_of_text(value)
        yield from _location_secrets(value, userinfos)
    elif isinstance(value, bytes):
        yield from _secrets_in(value.decode(errors="replace"), depth + 1, userinfos=userinfos)
    elif isinstance(value, Iterable):
        for item in value:
            yield from _secrets_in(item, depth + 1, userinfos=userinfos)


# Where user information may start in a location, whatever its shape.
_STARTS = frozenset("/:\\@,;=?#&'\"`")


def _location_secrets(text: str, userinfos: set[str]) -> Iterator[str]:
    """What of a configured ``text`` could be a credential, however malformed: every
    substring of its part before its last "@" that starts at its beginning or after a
    separator ("/", ":", "\\", "@", ",", ...) and ends at a separator or that "@",
    but a scheme, a plain user name, a port or an address. The ones that end at the
    "@" also go to ``userinfos``."""
    if "@" not in text:
        return
    left = text[: text.rfind("@")]
    for form in {left, unquote(left)}:
        cuts = [
            index
            for index, char in enumerate(form)
            if char in _STARTS or char.isspace() or not char.isprintable()
        ]
        starts, ends = [0, *(cut + 1 for cut in cuts)], [*cuts, len(form)]
        for start in starts:
            if _SCHEME_START.match(form, start):
                continue  # the same without its scheme comes next: keep "redis//" readable
            for end in ends:
                candidate = form[start:end]
                # A host of an earlier item of a host list is masked too: it cannot be
                # told from a password holding "@" and ",". Safe beats readable.
                core = candidate.strip(_SEPARATORS)
                if core and not _NOT_A_SECRET.fullmatch(core):
                    if end == len(form):
                        userinfos.add(candidate)
                    yield candidate


# A scheme, a usual user name, a number, an address: never masked on their own, nor
# with separators around them ("redis://").
_SEPARATORS = "".join(_STARTS) + " \t\r\n\x0b\x0c\u00a0"
_SCHEME_START = re.compile(
    "(?:" + "|".join(map(re.escape, sorted(_SCHEMES, key=len, reverse=True))) + r")[:/\\]",
    re.IGNORECASE,
)
_NOT_A_SECRET = re.compile(
    "|".join(map(re.escape, sorted(_NOT_SECRETS))) + r"|[\d.]*|\[[0-9A-Fa-f:.]*\]",
    re.IGNORECASE,
)


def _credentials(value: Any) -> Iterator[str]:
    """The credentials of ``[(scheme, credential), ...]``, however malformed: every
    string in it but a lone scheme name, and the part after a ``user:`` (digest)."""
    items = value if isinstance(value, list | tuple) else [value]
    for item in items:
        parts = list(item) if isinstance(item, list | tuple) else [item]
        for index, part in enumerate(parts):
            if isinstance(part, bytes):
                part = part.decode(errors="replace")
            if not isinstance(part, str) or (index == 0 and len(parts) > 1):
                continue  # the scheme ("digest", "sasl")
            yield from _pieces(part)
            yield from _pieces(part.partition(":")[2])


def _secrets_of_text(text: str) -> Iterator[str]:
    yield from _url_secrets(text)
    for match in _PARAM.finditer(text):
        yield from _pieces(match["secret"].strip("'"))
    # "user:password@host" with no scheme (a ZooKeeper connection string, a host
    # list): each comma-separated host's user information, where it has a password.
    if "@" in text:
        for host in text.partition("/")[0].split(","):
            if "://" in host or "@" not in host:
                continue
            _, colon, password = host.rpartition("@")[0].partition(":")
            if colon:
                yield from _pieces(password)


def escape_control(text: Any) -> str:
    """``text`` with control characters (escape codes, CR, LF, NUL...) shown as
    ``\\x1b``-style escapes, for terminal, log and admin output of values a holder
    chose (lock names, thread names, Celery task ids, extra details). Format characters
    (bidi controls, zero-width ones) and the letters and marks that draw nothing are
    escaped too: raw, they make one text read as another."""
    text = str(text)
    if text.isprintable() and not _INVISIBLE.search(text):
        return text
    return "".join(
        ch if ch.isprintable() and not _INVISIBLE.match(ch) else _escape(ch) for ch in text
    )


# Printable for Python (letters, marks) yet drawn as nothing: Unicode's "default
# ignorable" code points outside the format category, which isprintable() lets through.
_INVISIBLE = re.compile(
    "[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u3164\ufe00-\ufe0f\uffa0\U000e0100-\U000e01ef]"
)


def _escape(ch: str) -> str:
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


# -- exceptions and log records ------------------------------------------------------


def redact_exception(exc: BaseException | None) -> None:
    """Remove credentials, in place, from ``exc`` and every exception of its
    ``__cause__``/``__context__`` chain (a driver's error quoting a URL is chained
    under the error distlocks raises, and a traceback prints the whole chain).

    A link whose message cannot be changed in place (its ``__str__`` reads something
    other than its arguments) is replaced in the chain by a :class:`RedactedError`
    carrying its type name and redacted message.
    """
    seen: set[int] = set()
    pending = [exc]
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        _redact_args(exc)
        for attribute in ("__cause__", "__context__"):
            link = getattr(exc, attribute)
            if link is not None and id(link) not in seen:
                _redact_args(link)
                if _leaks(link):
                    link = RedactedError.of(link)
                    setattr(exc, attribute, link)
                pending.append(link)


def redact_handled() -> None:
    """:func:`redact_exception` on the exception being handled, if any: a
    :class:`~distlocks.exceptions.LockError` made in an ``except`` block is raised
    from (or in the context of) that driver error."""
    handled = sys.exc_info()[1]
    if handled is not None:
        redact_exception(handled)


class RedactedError(Exception):
    """Stands in a chain for an exception whose message held a credential."""

    @classmethod
    def of(cls, exc: BaseException) -> RedactedError:
        try:
            text = redact(exc)
        except Exception:
            text = "(message not shown)"
        stand_in = cls(f"{type(exc).__module__}.{type(exc).__qualname__}: {text}")
        stand_in.__cause__, stand_in.__context__ = exc.__cause__, exc.__context__
        stand_in.__suppress_context__ = exc.__suppress_context__
        stand_in.__traceback__ = exc.__traceback__
        return stand_in


def _redact_args(exc: BaseException) -> None:
    try:
        args = tuple(redact(arg) if isinstance(arg, str) else arg for arg in exc.args)
        if args != exc.args:
            exc.args = args
        for name in ("strerror", "filename", "filename2", "msg", "message"):
            value = getattr(exc, name, None)
            if isinstance(value, str) and redact(value) != value:
                setattr(exc, name, redact(value))
    except Exception:  # a read-only attribute: _leaks() then tells
        pass


def _leaks(exc: BaseException) -> bool:
    try:
        return any(redact(text) != text for text in (str(exc), repr(exc)))
    except Exception:  # an exception that cannot even be shown
        return True


class RedactingFilter(logging.Filter):
    """Removes credentials from a log record: its message, and its exception chain
    (see :func:`redact_exception`). Installed on distlocks' loggers by
    :func:`install_log_redaction`."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the handler's to report
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            redact_exception(error)
            if _leaks(error):
                record.exc_info = (RedactedError, RedactedError.of(error), record.exc_info[2])
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


#: The drivers distlocks hands a location to: what they log (kazoo's "Cannot resolve
#: <host>", where a malformed LOCATION put a password) is redacted too.
DRIVER_PACKAGES = ("kazoo", "redis", "psycopg", "psycopg_pool")


def install_log_redaction(package: str | None = None) -> None:
    """Put a :class:`RedactingFilter` on the logger of ``package`` and of each of its
    modules (a logger's filters see only the records logged on it, not on its
    children), imported or not; idempotent. No ``package``: distlocks and the
    :data:`DRIVER_PACKAGES`."""
    import importlib.util
    import os

    names: set[str] = set()
    for top in (package,) if package else ("distlocks", *DRIVER_PACKAGES):
        names.add(top)
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):  # a driver that is not installed
            spec = None
        # The module names are read from the files: importing a module only to name
        # its logger would load optional drivers.
        for root in (spec.submodule_search_locations or []) if spec else []:
            for folder, _, files in os.walk(root):
                parts = os.path.relpath(folder, root).split(os.sep)
                prefix = ".".join([top, *(p for p in parts if p != ".")])
                modules = [f"{prefix}.{f[:-3]}" for f in files if f.endswith(".py")]
                if modules:
                    names.update([prefix, *modules])
    for name in sorted(names):
        logger = logging.getLogger(name.removesuffix(".__init__"))
        if not any(isinstance(f, RedactingFilter) for f in logger.filters):
            logger.addFilter(_FILTER)


_FILTER = RedactingFilter()
