"""Bounded waiting for a condition in tests: checked, never slept-and-hoped."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path


def wait_for(
    predicate: Callable[[], object], limit: float = 15.0, what: str = "condition"
) -> float:
    """Poll ``predicate`` until true (failing after ``limit`` s); how long it took."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < limit, f"{what} not reached within {limit}s"
        time.sleep(0.005)
    return time.monotonic() - start


def wait_for_text(path: Path, limit: float = 15.0, what: str = "file") -> str:
    """The text of ``path`` once another process has written it: a file is created
    empty before it is written, so its existence alone is not enough (a reader under
    load sees it in between)."""

    def written() -> str:
        try:
            return path.read_text()
        except FileNotFoundError:
            return ""

    wait_for(lambda: written().strip(), limit, what)
    return written()


def process_alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie (an exited process nobody reaped yet:
    a container's first process may never reap orphans)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def wait_gone(pids: list[int], limit: float = 15.0) -> list[int]:
    """The pids still running after up to ``limit`` seconds (empty when all ended)."""
    deadline = time.monotonic() + limit
    while (alive := [pid for pid in pids if process_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def run_threads(threads: list[threading.Thread], limit: float = 120.0) -> None:
    """Start ``threads``, join each for up to ``limit`` seconds, and fail if any is
    still running (a hang must fail the test, not stall the session)."""
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(limit)
    alive = [thread.name for thread in threads if thread.is_alive()]
    assert not alive, f"still running after {limit}s: {alive}"
