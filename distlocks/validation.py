"""Argument checks shared by the public API: fail at the call, saying what to change."""

from __future__ import annotations

import math
from typing import Any

MAX_NAME_LENGTH = 200


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
    return name


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}.")
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{what} must be a finite number of seconds, not {value!r}.")
    return float(value)


def validate_ttl(ttl: Any) -> float:
    value = _number(ttl, "ttl")
    if value <= 0:
        raise ValueError(f"ttl must be > 0 seconds (the lease length), not {ttl!r}.")
    if value < 0.01:
        raise ValueError(f"ttl must be at least 0.01 seconds, not {ttl!r}.")
    return value


def validate_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    value = _number(timeout, "timeout")
    if value < 0:
        raise ValueError(
            f"timeout must be >= 0 seconds (0 tries once, None waits forever), not {timeout!r}."
        )
    return value
