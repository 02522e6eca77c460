"""The hot statements' fast path: named prepared statements sent through psycopg's
own libpq binding (:mod:`psycopg.pq`), without a cursor.

A cursor's ``execute`` looks up an adapter for each parameter, converts the query,
asks psycopg's prepared-statement cache, builds result loaders and a row: about 30 us
of client CPU per statement, more than the server's part of a lock try. The session
lock cycle's statements (the acquire try, the unlock, the renewal ping) are known at
import and their parameters are ints and strings: this module turns each into a
:class:`Statement` (its ``%(name)s`` placeholders as ``$n``, each parameter's type
fixed) and encodes the values itself, exactly as psycopg's text dumpers would (the
same bytes, the same errors). :meth:`.pool.Connection.value` sends them.

No I/O here; no protocol code either (libpq speaks the protocol).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psycopg

#: PostgreSQL type oids of the parameters; 0 lets the server infer the type from the
#: statement (the column a value goes to), as psycopg does for every ``str``.
UNKNOWN, INT4, INT8, FLOAT8 = 0, 23, 20, 701

#: The declared type of each parameter name the backend's statements use (anything
#: else: UNKNOWN). psycopg picks int2, int4 or int8 by the value and prepares one
#: statement per combination; fixed types give one statement, and every value of the
#: narrower types is cast by the server to the same column or argument type.
TYPES: Mapping[str, int] = {
    "key": INT8,
    "guard": INT8,
    "reader": INT8,
    "classid": INT8,
    "objid": INT8,
    "pid": INT4,
    "backend_pid": INT4,
    "ttl": FLOAT8,
}

_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%s|%%")

# psycopg's own words for a NUL in a text parameter (its text dumper refuses it).
_NUL = "PostgreSQL text fields cannot contain NUL (0x00) bytes"


def is_true(value: bytes | None) -> bool:
    """A boolean column's text (``t``/``f``; NULL is false)."""
    return value == b"t"


def to_int(value: bytes | None) -> int | None:
    return None if value is None else int(value)


class Statement:
    """One statement of the fast path: the name it is prepared under on each
    connection, its text with ``$n`` placeholders, its parameters' names in ``$n``
    order with their types, and how to read its one result value."""

    __slots__ = ("load", "name", "params", "query", "text", "types")

    def __init__(
        self,
        name: str,
        text: str,
        load: Callable[[bytes | None], Any],
        positional: Sequence[str] = (),
    ) -> None:
        # Never psycopg's own prefix (_pg3_): its cache deallocates its names only.
        if not name.startswith("distlocks_"):
            raise ValueError(f"a fast statement's name starts with 'distlocks_', not {name!r}")
        self.name = name.encode("ascii")
        self.text = text
        self.load = load
        query, params = to_numbered(text, positional)
        self.query = query.encode()
        self.params = params
        self.types = [TYPES.get(param, UNKNOWN) for param in params]

    def __repr__(self) -> str:
        return f"Statement({self.name.decode()!r})"


def to_numbered(text: str, positional: Sequence[str] = ()) -> tuple[str, tuple[str, ...]]:
    """``text`` with psycopg's placeholders as PostgreSQL's ``$n`` and the parameters'
    names in ``$n`` order: a ``%(name)s`` used twice is one parameter (as psycopg
    sends it), ``%s`` takes the next name of ``positional``, ``%%`` is ``%``."""
    names: list[str] = []
    left = list(positional)

    def number(match: re.Match[str]) -> str:
        token = match.group(0)
        if token == "%%":
            return "%"
        if token == "%s":
            if not left:
                raise ValueError(f"more %s placeholders than names in {positional!r}")
            param = left.pop(0)
        else:
            if positional:
                raise ValueError("a statement mixes %s and %(name)s placeholders")
            param = match.group(1)
        if param not in names:
            names.append(param)
        return f"${names.index(param) + 1}"

    numbered = _PLACEHOLDER.sub(number, text)
    if left:
        raise ValueError(f"names without a %s placeholder: {left!r}")
    return numbered, tuple(names)


def encode(value: Any, encoding: str) -> bytes | None:
    """``value`` as psycopg's text dumpers send it (the same bytes, the same errors)."""
    kind = type(value)
    if kind is str:
        if "\x00" in value:
            raise psycopg.DataError(_NUL)
        return value.encode(encoding)
    if kind is int:
        return str(value).encode()
    if kind is float:  # psycopg's repr, "inf" and "nan" included (the server reads them)
        return repr(value).encode()
    if value is None:
        return None
    # Nothing else is sent on the fast path (a bool is an int subclass, never sent).
    raise TypeError(f"no fast-path encoding for {kind.__name__} values")


def values(statement: Statement, params: Mapping[str, Any], encoding: str) -> list[bytes | None]:
    """The encoded parameters of ``statement`` from ``params``, in ``$n`` order."""
    return [encode(params[param], encoding) for param in statement.params]
