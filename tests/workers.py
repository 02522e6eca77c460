"""Code run in separate OS processes by the multi-process tests.

Each function sets Django up itself: the processes are spawned, not forked, so
they share nothing with the test process but the environment (which names the
servers the test session started).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()


def increment_file(
    alias: str | None, name: str, path: str, rounds: int, window: float, start: Any
) -> None:
    """Read an integer from ``path``, wait ``window`` seconds, write it back plus one.

    With ``alias`` None the read-modify-write runs unprotected (the control case).
    ``start`` is a barrier: all workers begin together, once set up, so they overlap.
    """
    setup_django()
    from distlocks import lock

    start.wait(60)
    file = Path(path)
    for _ in range(rounds):
        if alias is None:
            _bump(file, window)
        else:
            with lock(name, backend=alias, ttl=10, timeout=60):
                _bump(file, window)


def _bump(file: Path, window: float) -> None:
    value = int(file.read_text() or 0)
    time.sleep(window)
    # Written whole and renamed over the file: two unprotected writers overlapping in
    # place could leave "92" from "9" and "12" (a count above the true one, as one
    # clean-clone run saw: 86 of 60); so the control case can only lose increments.
    spare = file.with_name(f"{file.name}.{os.getpid()}")
    spare.write_text(str(value + 1))
    os.replace(spare, file)


def try_to_steal(alias: str, name: str, seconds: float, result_path: str) -> None:
    """Try to take ``name`` (timeout=0) again and again for ``seconds``; record successes."""
    setup_django()
    from distlocks import lock
    from distlocks.exceptions import LockNotAcquired

    attempts = stolen = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        attempts += 1
        try:
            with lock(name, backend=alias, ttl=5, timeout=0):
                stolen += 1
        except LockNotAcquired:
            pass
        time.sleep(0.02)
    Path(result_path).write_text(f"{attempts} {stolen}")


def hold_and_report(alias: str, name: str, ttl: float, log_path: str) -> None:
    """Hold ``name`` and keep checking the lease; log what happens, with monotonic times.

    Each "alive" line carries a time taken *before* ensure_held() succeeded, so a line
    can never claim the lease at a moment after it was checked.
    """
    setup_django()
    from distlocks import lock
    from distlocks.exceptions import LockLost

    log = Path(log_path)

    def write(line: str) -> None:
        with log.open("a") as fh:
            fh.write(line + "\n")

    lease = lock(name, backend=alias, ttl=ttl, timeout=10).acquire()
    write(f"acquired {lease.fencing_token} {time.monotonic()}")
    try:
        while True:
            checked_at = time.monotonic()
            lease.ensure_held()
            write(f"alive {checked_at}")
            time.sleep(0.01)
    except LockLost as exc:
        write(f"lost {time.monotonic()} {exc.reason}")


def hold_until_killed(alias: str, name: str, ready_path: str) -> None:
    """Take ``name`` and wait to be killed; writes the fencing token when it holds it."""
    setup_django()
    from distlocks import lock

    lease = lock(name, backend=alias, ttl=30, timeout=10).acquire()
    Path(ready_path).write_text(str(lease.fencing_token))
    while True:
        time.sleep(0.1)


def hold_until_lost(alias: str, name: str, log_path: str) -> None:
    """Take ``name``, then wait until the lease is reported lost; log both events."""
    setup_django()
    import threading

    from distlocks import lock

    lost = threading.Event()
    lease = lock(name, backend=alias, ttl=1, timeout=10, on_lost=lambda _: lost.set()).acquire()
    Path(log_path).write_text(f"acquired {lease.fencing_token}\n")
    if lost.wait(30):
        with Path(log_path).open("a") as fh:
            fh.write(f"lost {lease.lost_reason}\n")


def fenced_increments(
    model_label: str, pk: int, alias: str, name: str, rounds: int, log_path: str
) -> None:
    """Read, pause, write +1 under the lock; log "ok" or "stale" per write."""
    setup_django()
    from django.apps import apps

    from distlocks import lock
    from distlocks.exceptions import StaleFencingToken

    model = apps.get_model(model_label)
    fenced = hasattr(model, "fencing_lock_name")
    log = Path(log_path)
    for _ in range(rounds):
        with lock(name, backend=alias, ttl=0.5, timeout=30) as lease:
            row = model.objects.get(pk=pk)
            value = row.value
            time.sleep(0.01)
            row.value = value + 1
            try:
                if fenced:
                    row.save(fencing_token=lease)
                else:
                    row.save()
                outcome = "ok"
            except StaleFencingToken:
                outcome = "stale"
        with log.open("a") as fh:
            fh.write(outcome + "\n")


def paused_writer(model_label: str, pk: int, alias: str, name: str, work_dir: str) -> None:
    """Take the lock, read the row, check the lease, then announce that it is about to
    write and wait for the test to let it go (the test stops it with SIGSTOP first,
    past its TTL: the pause that fencing exists for). Logs the write's outcome."""
    setup_django()
    from django.apps import apps

    from distlocks import lock
    from distlocks.exceptions import LockLost, StaleFencingToken

    model = apps.get_model(model_label)
    fenced = hasattr(model, "fencing_lock_name")
    work = Path(work_dir)
    lease = lock(name, backend=alias, ttl=0.5, timeout=30).acquire()
    row = model.objects.get(pk=pk)
    row.value += 1
    lease.ensure_held()  # it still holds the lock here...
    token = lease.fencing_token
    (work / "ready").write_text(str(token))
    while not (work / "go").exists():  # ...and is paused right here
        time.sleep(0.002)
    try:
        if fenced:
            row.save(fencing_token=token)
        else:
            row.save()
        outcome = "ok"
    except StaleFencingToken as exc:
        outcome = f"stale {exc.offered} {exc.stored}"
    with contextlib.suppress(LockLost):
        lease.release()
    (work / "outcome").write_text(outcome)
