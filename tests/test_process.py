"""distlocks.process: this process's id without a system call, renewed at fork."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from distlocks import lock, process
from distlocks.locks import current_holder

fork_only = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _in_child(report: Callable[[], object]) -> str:
    """Fork; the child writes the repr of ``report()`` (or of its error) and exits."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            try:
                text = repr(report())
            except BaseException as exc:
                text = f"raised {exc!r}"
            os.write(write, text.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    return text


def test_the_pid_is_this_process_s() -> None:
    assert process.pid == os.getpid()


@fork_only
def test_a_forked_child_has_its_own_pid_holder_and_no_lease_of_its_parent() -> None:
    parent = os.getpid()
    current_holder()  # the parent's holder record, reused per thread
    with lock("test_process:child", backend="locmem", ttl=30) as lease:
        text = _in_child(
            lambda: (process.pid == os.getpid(), current_holder().pid == os.getpid(), lease.held())
        )
    assert text == "(True, True, False)"
    assert process.pid == parent == current_holder().pid
