"""Code run in separate OS processes by tests/test_transactions.py.

Spawned, not forked: each sets Django up itself and finds the servers the test
session started through the environment (see tests/workers.py).
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.workers import setup_django

#: How long a worker waits for the test's go-ahead before giving up (seconds).
PATIENCE = 120.0


def _wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + PATIENCE
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.002)


def write_then_commit_later(alias: str, name: str, pk: int, value: int, work_dir: str) -> None:
    """Inside one transaction: take the lock, write ``value``, leave the ``with`` block
    (the release), then wait for the test's "commit" file before COMMIT."""
    setup_django()
    from django.db import transaction

    from distlocks import lock
    from tests.testapp.models import PlainCounter

    work = Path(work_dir)
    with transaction.atomic():
        # A ttl shorter than the wait below (a reader process starting), yet long
        # enough for a renewal to be late on a loaded machine.
        with lock(name, backend=alias, ttl=5, timeout=60) as lease:
            PlainCounter.objects.filter(pk=pk).update(value=value)
        (work / "token").write_text(str(lease.fencing_token))
        (work / "released").write_text(f"held={lease.held()} pending={lease.release_pending}")
        _wait_for_file(work / "commit")
        # Still held after the wait (renewed meanwhile: the wait may outlast the ttl).
        (work / "committing").write_text(f"held={lease.held()} renewals={lease.renewals}")
    (work / "committed").write_text(lease.state)


def wait_then_read(alias: str, name: str, pk: int, work_dir: str) -> None:
    """Wait for the lock, then read the row: the value and whether the writer had
    reached its COMMIT by then."""
    setup_django()
    from distlocks import lock
    from tests.testapp.models import PlainCounter

    work = Path(work_dir)
    (work / "waiting").write_text("1")
    with lock(name, backend=alias, ttl=5, timeout=PATIENCE) as lease:
        after_commit = (work / "committing").exists()
        value = PlainCounter.objects.get(pk=pk).value
    (work / "read").write_text(f"{value} {after_commit} {lease.fencing_token}")
