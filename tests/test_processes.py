"""Mutual exclusion between OS processes, on backends shared between processes."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from tests import workers

PROCESSES = 4
ROUNDS = 15
WINDOW = 0.002


def run_workers(alias: str | None, name: str, path: Path) -> int:
    path.write_text("0")
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(PROCESSES)
    procs = [
        ctx.Process(
            target=workers.increment_file, args=(alias, name, str(path), ROUNDS, WINDOW, start)
        )
        for _ in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0, f"worker exited with {proc.exitcode}"
    return int(path.read_text())


@pytest.mark.slow
def test_processes_lose_no_increment(shared_alias: str, name: str, tmp_path: Path) -> None:
    assert run_workers(shared_alias, name, tmp_path / "counter") == PROCESSES * ROUNDS


@pytest.mark.slow
def test_control_without_lock_loses_increments(name: str, tmp_path: Path) -> None:
    """Shows the race window is real, so the test above could fail."""
    assert run_workers(None, name, tmp_path / "counter") < PROCESSES * ROUNDS
