"""The quorum's arithmetic, free of I/O: how many masters must agree, the
milliseconds a master is sent, and what one round of requests brought back (which
the backend counts against the quorum)."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


def quorum(masters: int) -> int:
    """How many of ``masters`` must agree: a strict majority."""
    return masters // 2 + 1


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


@dataclass
class _Replies(Generic[T]):
    """What one round of requests to the masters brought back."""

    results: dict[int, T] = field(default_factory=dict)
    errors: dict[int, Exception] = field(default_factory=dict)
    #: Requests still running when the round ended (decided early, or out of time:
    #: those are in ``errors`` too).
    pending: dict[int, concurrent.futures.Future[T]] = field(default_factory=dict)
