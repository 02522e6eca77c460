"""Code run in separate OS processes by the multi-process tests.

Each function sets Django up itself: the processes are spawned, not forked, so
they share nothing with the test process but the environment (which names the
servers the test session started).
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()


def increment_file(alias: str | None, name: str, path: str, rounds: int, window: float) -> None:
    """Read an integer from ``path``, wait ``window`` seconds, write it back plus one.

    With ``alias`` None the read-modify-write runs unprotected (the control case).
    """
    setup_django()
    from distlocks import lock

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
    file.write_text(str(value + 1))
