"""Argument checks shared by the public API: fail at the call, saying what to change."""

from __future__ import annotations

import math
from typing import Any

MAX_NAME_LENGTH = 200
#: Longest lease (``ttl``, ``max_hold``, ``release_after()``): one year, in seconds.
#: Every server stores it, and every date derived from it (expiry, the admin page's
#: "expires in") stays representable.
MAX_TTL = 365 * 86400
#: Longest wait for a busy lock (``timeout``): one year; ``None`` waits forever.
MAX_TIMEOUT = 365 * 86400
#: Most permits one semaphore can have. PostgreSQL keeps one advisory-lock slot per
#: permit, so the bound keeps an acquire's work and memory small on every backend.
MAX_SEMAPHORE_LIMIT = 10_000


def validate_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"Lock name must be a str, not {type(name).__name__}: {name!r}.")
    if not name:
        raise ValueError("Lock name must not be empty.")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"Lock name is {len(name)} characters long; the limit is {MAX_NAME_LENGTH}. "
            f"Use a shorter name, e.g. a hash of the long part."
        )
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        raise ValueError(f"Lock name {name!r} contains control characters; remove them.")
    try:
        name.encode()
    except UnicodeEncodeError:
        raise ValueError(
            f"Lock name {name!r} is not valid Unicode text (it has a lone surrogate, as a "
            f"badly decoded byte string does); decode it properly or use another name."
        ) from None
    return name


def _number(value: Any, what: str, bound: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}.")
    if isinstance(value, int) and not -bound <= value <= bound:
        # Checked before float(), which cannot even represent some ints (10**400).
        if value < 0:
            raise ValueError(f"{what} must not be negative, not {_short(value)}.")
        raise ValueError(f"{what} must be at most {bound:,} seconds, not {_short(value)}.")
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{what} must be a finite number of seconds, not {value!r}.")
    if value > bound:
        raise ValueError(f"{what} must be at most {bound:,} seconds, not {_short(value)}.")
    return float(value)


def _short(value: float) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


def validate_ttl(ttl: Any, what: str = "ttl") -> float:
    """A lease length in seconds: a finite number, 0.01 <= ttl <= :data:`MAX_TTL`."""
    value = _number(ttl, what, MAX_TTL)
    if value <= 0 and what == "ttl":
        raise ValueError(f"{what} must be > 0 seconds (the lease length), not {ttl!r}.")
    if value < 0.01:
        raise ValueError(f"{what} must be at least 0.01 seconds, not {ttl!r}.")
    return value


def validate_timeout(timeout: Any) -> float | None:
    """A wait in seconds: None (forever), or 0 <= timeout <= :data:`MAX_TIMEOUT`."""
    if timeout is None:
        return None
    value = _number(timeout, "timeout", MAX_TIMEOUT)
    if value < 0:
        raise ValueError(
            f"timeout must be >= 0 seconds (0 tries once, None waits forever), not {timeout!r}."
        )
    return value


def validate_flag(value: Any, what: str) -> bool:
    """A yes/no argument: only True or False (a string such as "no" is a mistake)."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, not {type(value).__name__}: {value!r}.")
    return value
