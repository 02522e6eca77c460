"""A command that runs until Ctrl-C, as a user starts and stops it in a terminal:
``python -m distlocks.testing.sandbox``, ``python -m distlocks.testing.servers`` and
``python -m demo_project.run``."""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

#: How long a command may take to say it is ready (it may start PostgreSQL first).
READY_WITHIN = 180.0


def _reader(stream: object, lines: queue.Queue[str | None]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.put(line)
    lines.put(None)


def start_reading(
    command: list[str], cwd: Path, env: dict[str, str], *, new_session: bool = True
) -> tuple[subprocess.Popen[str], queue.Queue[str | None]]:
    """Start ``command``, and a thread that puts each line of its output (stdout and
    stderr) on the queue returned, then None once the output ends: the process never
    blocks on a full pipe. ``new_session``: a session (and process group) of its own."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_reader, args=(process.stdout, lines), daemon=True).start()
    return process, lines


def start_until(
    command: list[str], cwd: Path, env: dict[str, str], ready: str
) -> tuple[subprocess.Popen[str], str]:
    """Start ``command`` in a session of its own and read its output up to the line
    that contains ``ready`` (within :data:`READY_WITHIN`): the process and what it
    printed. Its output is drained from then on, so it never blocks on a full pipe."""
    process, lines = start_reading(command, cwd, env)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + READY_WITHIN
        while ready not in "".join(seen):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "".join(seen)
            seen.append(line)
    except BaseException:
        process.kill()
        process.wait(10)
        raise
    return process, "".join(seen)


def ctrl_c(process: subprocess.Popen[str], limit: float = 60.0) -> int:
    """Press Ctrl-C (SIGINT) and return the exit status; a process still running after
    ``limit`` seconds is killed (and the wait's timeout raised)."""
    try:
        process.send_signal(signal.SIGINT)
        return process.wait(limit)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
