"""Code run in separate OS processes by the ZooKeeper tests (spawned, not forked).

The test settings have no ZooKeeper alias (the server is started by the test module),
so each worker adds one for the server it is given.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

ALIAS = "zk"


def _setup(location: str) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django.conf import settings

    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        ALIAS: {"BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend", "LOCATION": location},
    }


def race(location: str, name: str, directory: str, rounds: int, start: Any) -> None:
    """Take ``name`` ``rounds`` times; inside, claim a marker file that must not exist
    (O_EXCL), bump a counter with a read-modify-write, and drop the marker. Two
    holders at once would find the marker, or lose an increment."""
    _setup(location)
    from distlocks import lock

    folder = Path(directory)
    counter = folder / "counter"
    start.wait(60)
    for _ in range(rounds):
        with lock(name, backend=ALIAS, ttl=10, timeout=60):
            try:
                fd = os.open(folder / "inside", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                with (folder / "violations").open("a") as fh:
                    fh.write(f"{os.getpid()}\n")
                continue
            value = int(counter.read_text() or 0)
            time.sleep(0.002)
            counter.write_text(str(value + 1))
            os.close(fd)
            os.unlink(folder / "inside")


def hold_and_report(location: str, name: str, log_path: str) -> None:
    """Hold ``name`` (1 s session, 1 s lease) and keep checking the lease; log each
    check with a monotonic time taken before it, and the loss."""
    _setup(location)
    from django.conf import settings

    settings.DISTLOCKS_BACKENDS[ALIAS]["OPTIONS"] = {"session_timeout": 1}
    from distlocks import lock
    from distlocks.exceptions import LockLost

    log = Path(log_path)

    def write(line: str) -> None:
        with log.open("a") as fh:
            fh.write(line + "\n")

    lease = lock(name, backend=ALIAS, ttl=1, timeout=10).acquire()
    write(f"acquired {lease.fencing_token} {time.monotonic()}")
    try:
        while True:
            checked_at = time.monotonic()
            lease.ensure_held()
            write(f"alive {checked_at}")
            time.sleep(0.01)
    except LockLost as exc:
        write(f"lost {time.monotonic()} {exc.reason}")


def race_through_faults(
    location: str, name: str, directory: str, seconds: float, start: Any
) -> None:
    """Like :func:`race`, through server faults, until the file ``stop`` appears in
    ``directory`` (or, at the latest, for ``seconds``): a call that finds the ensemble
    unavailable is tried again. Each holder appends its token to ``tokens`` while it
    holds the lock, so the file is in the order the lock was held."""
    _setup(location)
    from django.conf import settings

    settings.DISTLOCKS_BACKENDS[ALIAS]["OPTIONS"] = {
        "session_timeout": 4,
        "connect_timeout": 1,
        "socket_timeout": 1,
    }
    from distlocks import lock
    from distlocks.exceptions import LockBackendUnavailable, LockLost, LockNotAcquired

    folder = Path(directory)
    start.wait(60)
    deadline = time.monotonic() + seconds
    stop = folder / "stop"
    while time.monotonic() < deadline and not stop.exists():
        try:
            with lock(name, backend=ALIAS, ttl=4, timeout=5) as lease:
                lease.ensure_held()
                try:
                    fd = os.open(folder / "inside", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    with (folder / "violations").open("a") as fh:
                        fh.write(f"{os.getpid()} {lease.fencing_token}\n")
                    continue
                with (folder / "tokens").open("a") as fh:
                    fh.write(f"{lease.fencing_token}\n")
                time.sleep(0.002)
                os.close(fd)
                os.unlink(folder / "inside")
        except (LockBackendUnavailable, LockNotAcquired, LockLost):
            time.sleep(0.05)
