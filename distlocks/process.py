"""This process's id, read without a system call.

``os.getpid()`` is a system call, and one lock cycle asked for it six times (the holder
record, the lease, and each check that a lease was not inherited by a forked child).
The id is read once here and renewed in a forked child before any of its code runs.
Read it as ``process.pid`` (the module attribute, never a copy of it).
"""

from __future__ import annotations

import os

pid = os.getpid()


def _renew_after_fork() -> None:
    global pid
    pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_after_fork)
