"""Bounded waiting for a condition in tests: checked, never slept-and-hoped."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(
    predicate: Callable[[], object], limit: float = 15.0, what: str = "condition"
) -> float:
    """Poll ``predicate`` until true (failing after ``limit`` s); how long it took."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < limit, f"{what} not reached within {limit}s"
        time.sleep(0.005)
    return time.monotonic() - start
