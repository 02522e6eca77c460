#!/usr/bin/env python
"""Django's command-line utility for the distlocks demo site."""

from __future__ import annotations

import contextlib
import os
import sys


def end_with_parent() -> None:
    """Under ``make demo`` (DEMO_END_WITH_PARENT=1, Linux): end when the parent ends.

    The runner asks this of runserver; runserver's reloader starts the process that
    serves, and that one asks it here too, so a runner killed outright leaves nothing
    running. If the parent is already gone (re-parented to init), exit at once."""
    if os.environ.get("DEMO_END_WITH_PARENT") != "1" or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if parent == 1 or os.getppid() != parent:
        sys.exit(1)


def main() -> None:
    end_with_parent()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
