"""Real Celery worker processes for a test module: started on the session's broker,
waited for until each answers a ping, stopped (their whole process group) at the end.

Shared by tests/test_celery.py (tests.celery_app) and tests/test_claims.py
(tests.claim_celery_app): the same start, the same readiness check, the same stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import redis
from celery import Celery

from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent


def tails(logs: Path) -> str:
    """The end of every worker's log, for a failure message."""
    return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs.glob("*.log"))


@contextlib.contextmanager
def celery_workers(
    app: Celery,
    module: str,
    logs: Path,
    workers: Sequence[tuple[str, Sequence[str]]],
    settings: str = "tests.settings",
) -> Iterator[list[int]]:
    """One ``celery -A <module> worker`` (``module`` defines ``app``) per ``(node name,
    extra arguments)`` of
    ``workers``, logging to ``logs/<node name>.log``, with Django's ``settings``
    module; yields their pids once every one answers a ping (90 s at most), and
    stops them on exit."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": settings, "PYTHONPATH": str(ROOT)}
    # The node name as --hostname, not -n, which reads as pytest-xdist's option to
    # whatever looks at a process's arguments (tests/settings.py once took a worker for
    # the xdist controller and gave it placeholder server URLs).
    procs = []
    for node, extra in workers:
        log = (logs / f"{node}.log").open("w")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", module, "worker",
                 "--pool", "prefork", "--hostname", f"{node}@%h", "--without-gossip",
                 "--without-mingle", "--loglevel", "INFO", "--prefetch-multiplier", "1",
                 *extra],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        )  # fmt: skip

    # Counted by name: other workers on the same broker (another module's, another
    # test session's) answer the broadcast ping too.
    nodes = {f"{node}@{socket.gethostname()}" for node, _ in workers}

    def ready() -> bool:
        for proc in procs:
            assert proc.poll() is None, tails(logs)
        try:
            answered = {name for reply in app.control.ping(timeout=0.5) for name in reply}
            return nodes <= answered
        except (redis.ConnectionError, OSError):
            # A pooled broker connection the server dropped: the next poll reconnects.
            return False

    try:
        wait_for(ready, limit=90, what=f"{len(procs)} Celery workers answering ping")
        yield [proc.pid for proc in procs]
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
