"""What every throwaway server shares: its process (started with a parent-death
signal, from a thread that lives as long as this process), its run directory (swept
when its owner is gone), the wait for it to answer, and :class:`ServerError`.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import ctypes
import importlib.util
import os
import pwd
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

REDIS_URL_ENV = "DISTLOCKS_TEST_REDIS_URL"
DATABASE_URL_ENV = "DISTLOCKS_TEST_DATABASE_URL"


RUN_DIR_PREFIX = "distlocks-servers-"
START_TIMEOUT = 30.0

_PR_SET_PDEATHSIG = 1

T = TypeVar("T")


class ServerError(RuntimeError):
    """A throwaway server could not be started."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _parent_death_signal(signum: int) -> None:
    """Ask the kernel to send ``signum`` to this (child) process when its parent dies."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


class _Spawner:
    """Starts server processes from one thread that lives as long as the process.

    The kernel's parent-death signal fires when the *thread* that forked the child
    exits, not the process: a server started from a short-lived thread (a worker of
    ``asyncio.to_thread``, a thread pool) would be killed with that thread. So servers
    are started from the main thread, or else handed to this daemon thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = 0
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]

    def run(self, start: Callable[[], T]) -> T:
        if threading.current_thread() is threading.main_thread():
            return start()
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: no thread yet
                self._jobs = queue.SimpleQueue()
                threading.Thread(
                    target=self._serve, args=(self._jobs,), name="distlocks-spawner", daemon=True
                ).start()
                self._pid = os.getpid()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((start, done))
        return done.result()

    @staticmethod
    def _serve(
        jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]],
    ) -> None:
        while True:
            start, done = jobs.get()
            try:
                done.set_result(start())
            except BaseException as exc:  # handed back to the caller
                done.set_exception(exc)


_spawner = _Spawner()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _package_dir(name: str, extra_hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ServerError(
            f"The '{name}' package is not installed. Install the test dependencies "
            f"(pip install -e '.[dev]') or {extra_hint}."
        )
    return Path(next(iter(spec.submodule_search_locations)))


class _Server:
    """Common process handling for one server in its own directory."""

    name = "server"

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: Path = base_dir / f"{self.name}.log"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def _spawn(self, args: list[str], *, user: str | None = None, death_signal: int) -> None:
        log = open(self._log_file, "ab")  # noqa: SIM115 - the child keeps it open
        try:
            self.process = _spawner.run(
                lambda: subprocess.Popen(
                    args,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Runs after the uid switch in the child, so the kernel keeps it.
                    preexec_fn=lambda: _parent_death_signal(death_signal),
                    # Drop root's groups too, or directory checks match group "root".
                    user=user,
                    group=pwd.getpwnam(user).pw_gid if user else None,
                    extra_groups=[] if user else None,
                    start_new_session=True,
                )
            )
        finally:
            log.close()

    def _wait_ready(self, probe: Callable[[], None]) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise ServerError(
                    f"{self.name} exited with code {self.process.returncode} while starting;"
                    f" its log says:\n{self.log_tail()}"
                )
            try:
                probe()
                return
            except Exception as exc:  # any failure means "not ready yet"
                last_error = exc
                time.sleep(0.05)
        self.kill()
        raise ServerError(
            f"{self.name} did not accept connections within {START_TIMEOUT:.0f}s "
            f"(last error: {last_error!r}); its log says:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self._log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        """Stop the server, politely first."""
        if not self.process or self.process.poll() is not None:
            return
        self.process.send_signal(self._stop_signal)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    _stop_signal = signal.SIGTERM


def _sweep_stale_run_dirs() -> None:
    """Remove directories of earlier runs whose owning process is gone."""
    for path in Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"):
        try:
            owner = int((path / "owner.pid").read_text())
        except (OSError, ValueError):
            continue
        if not _pid_alive(owner):
            for pidfile in path.glob("pgdata/postmaster.pid"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
            shutil.rmtree(path, ignore_errors=True)


def restore_ctrl_c() -> None:
    """Make Ctrl-C (SIGINT) raise KeyboardInterrupt in this process, whatever it
    inherited: a shell starts background jobs (``... &``) with SIGINT ignored, and a
    parent may have it blocked; both survive exec, and Python then leaves SIGINT alone.
    For the commands that run until Ctrl-C (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def _install_signal_cleanup() -> None:
    """Turn SIGTERM/SIGHUP into SystemExit so that atexit cleanup runs."""
    if threading.current_thread() is not threading.main_thread():
        return

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) in (signal.SIG_DFL, None):
            signal.signal(signum, _exit)


def _wait_until(predicate: Callable[[], bool], what: str, timeout: float = START_TIMEOUT) -> None:
    """Poll ``predicate`` (errors count as "not yet") until true; ServerError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception as exc:  # a node still starting or reconfiguring
            last_error = exc
        time.sleep(0.05)
    raise ServerError(f"{what} not reached within {timeout:.0f}s (last error: {last_error!r})")


class _RunDir:
    """A run directory of its own (swept like the others if this process is killed), and
    clean-up of the servers in it when this process exits."""

    def __init__(self) -> None:
        _sweep_stale_run_dirs()
        self.base_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
        (self.base_dir / "owner.pid").write_text(str(os.getpid()))
        self._closed = False
        _install_signal_cleanup()
        atexit.register(self.close)

    def servers(self) -> list[_Server]:
        raise NotImplementedError

    def close(self) -> None:
        """Stop every server and remove the directory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for server in self.servers():
            with contextlib.suppress(Exception):
                server.kill()
        shutil.rmtree(self.base_dir, ignore_errors=True)
