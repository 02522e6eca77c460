"""The quorum's arithmetic, free of I/O: how many masters must agree and may fail,
the clock-drift allowance, what a round's answers decide, the milliseconds a master
is sent, and what one round of requests brought back."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


def quorum(masters: int) -> int:
    """How many of ``masters`` must agree: a strict majority."""
    return masters // 2 + 1


def spare(masters: int) -> int:
    """How many of ``masters`` may fail (or refuse) with a quorum left."""
    return masters - quorum(masters)


def drift(ttl: float, factor: float, margin: float) -> float:
    """Seconds taken off a lease of ``ttl`` for clocks that run at different speeds."""
    return ttl * factor + margin


def verdict(yes: int, no: int, masters: int) -> bool | None:
    """What ``yes`` confirmations and ``no`` denials of a compare-and-something decide:
    True once a quorum confirmed it, False once so many denied it that no quorum can
    hold it, None while the masters that did not answer could still go either way.

    Denials and failures are not added up: a master that did not answer may still
    hold the entry (see ``RedlockHeld._by_quorum``)."""
    if yes >= quorum(masters):
        return True
    if no > spare(masters):
        return False
    return None


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
