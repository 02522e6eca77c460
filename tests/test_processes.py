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


EXIT_HOLDING = """
import sys
from tests.workers import setup_django
setup_django()
from distlocks import lock
HELD = lock(sys.argv[1], backend="pg", ttl=600, timeout=5, auto_renew=False).acquire()
print(HELD.fencing_token, flush=True)
"""


@pytest.mark.django_db
def test_a_process_that_exits_holding_an_unrenewed_lease_exits_cleanly(
    name: str, pg_ready: None
) -> None:
    """A lease nothing renews, on a backend whose locks never expire, is released by its
    finalizer if its holder drops it; at interpreter exit that finalizer runs during
    the exit itself. It must free the lock there without a traceback (Python 3.12+
    refuses to start the cleanup thread at exit: the matrix run printed
    "can't create new thread at interpreter shutdown")."""
    import subprocess
    import sys

    from distlocks import get_backend

    done = subprocess.run(
        [sys.executable, "-c", EXIT_HOLDING, name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[0]) > 0
    assert "Traceback" not in done.stderr, done.stderr
    assert get_backend("pg").inspect(name) is None
