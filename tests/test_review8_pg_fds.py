"""Review 8 of the PostgreSQL backend: its descriptors. Each lock connection holds
libpq's socket plus a duplicate of its own (to shut it down from another thread);
these tests run each scenario in a fresh Python process (its own descriptor table, its
own RLIMIT_NOFILE, free to fork) against the session's real server:

- a process out of descriptors gets a LockError that says what to change, and its
  pool loses no slot;
- a duplicate that cannot be made leaves no connection open behind it;
- a thousand lock cycles, and cycles that fail (a busy lock, a pooled connection the
  server ended), leave no descriptor behind;
- a forked child's lock(), release, garbage collection and exit never end, cut or
  close the parent's session, and the parent's lease stays usable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]

ROOT = Path(__file__).resolve().parent.parent

# Every child starts with this: Django set up on the test settings (the servers the
# session started are named by the environment it inherits), and helpers.
PRELUDE = """
import gc, json, os, resource, sys, time
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
import django
django.setup()
import psycopg
from django.db import connection
from distlocks import get_backend, lock
from distlocks.backends.postgres.keys import key_parts
from distlocks.exceptions import LockError, LockNotAcquired
from tests.pg_backend import pg

def fds():
    return sorted(int(fd) for fd in os.listdir("/proc/self/fd"))

def holders(key):
    # Server pids holding the advisory lock of key (a session of Django's own).
    classid, objid = key_parts(key)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND classid = %s AND objid = %s AND objsubid = 1", [classid, objid])
        return sorted(row[0] for row in cursor.fetchall())

def fill_descriptors():
    # Open descriptors until the process has none left; the list of them.
    filled = []
    try:
        while True:
            filled.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    return filled

def report(**values):
    print("REPORT " + json.dumps(values), flush=True)
"""


def run_child(body: str, timeout: float = 300) -> dict[str, Any]:
    """Run ``body`` (after PRELUDE) in a new interpreter; the values it reported."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    code = PRELUDE + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    reported: dict[str, Any] = {}
    for line in done.stdout.splitlines():
        if line.startswith("REPORT "):
            reported.update(json.loads(line[len("REPORT ") :]))
    assert done.returncode == 0, f"child failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return reported


def test_out_of_descriptors_is_a_lock_error_that_says_what_to_change(name: str) -> None:
    """A process with no descriptor left cannot open a lock connection: the caller gets
    a LockError naming the limit and what to change (not a bare OSError from deep in the
    driver), the pool keeps its slot, and once descriptors are free the lock works."""
    got = run_child(f"""
        backend = pg()
        first = lock({name!r} + "-a", backend="pg", ttl=30, timeout=0).acquire()
        count = backend.pool._count
        filled = fill_descriptors()
        os.close(filled.pop())  # one left: the socket, not the driver's poller besides
        try:
            lock({name!r} + "-b", backend="pg", ttl=30, timeout=0).acquire()
            error = None
        except Exception as exc:
            error = [type(exc).__name__, isinstance(exc, LockError), str(exc)]
        slots = backend.pool._count
        for fd in filled:
            os.close(fd)
        with lock({name!r} + "-b", backend="pg", ttl=30, timeout=0) as lease:
            token = lease.fencing_token
        first.release()
        report(error=error, count=count, slots=slots, token=token)
    """)
    assert got["error"] is not None, "acquired a lock with no descriptor left?"
    kind, is_lock_error, message = got["error"]
    assert is_lock_error, f"{kind}: {message}"
    assert "descriptor" in message and "RLIMIT_NOFILE" in message, message
    assert "pool_size" in message, message
    assert got["slots"] == got["count"]
    assert got["token"] > 0


def test_a_duplicate_that_cannot_be_made_closes_its_connection() -> None:
    """The connection is made, then its socket's duplicate cannot be (no descriptor
    left): the error is raised, and the connection's socket is not left open behind
    it (nor its server session)."""
    got = run_child("""
        from psycopg import pq
        from distlocks.backends.postgres.pool import Connection
        kwargs = pg()._connect_kwargs()
        conninfo = psycopg.conninfo.make_conninfo(**{
            k: v for k, v in kwargs.items() if k not in ("autocommit", "prepare_threshold")})
        before = fds()
        pgconn = pq.PGconn.connect(conninfo.encode())  # blocking: no poller's descriptor
        assert pgconn.status == pq.ConnStatus.OK, pgconn.error_message
        filled = fill_descriptors()
        try:
            Connection(pgconn)
            error = None
        except OSError as exc:
            error = str(exc)
        for fd in filled:
            os.close(fd)
        gc.collect()
        after = fds()
        report(error=error, before=before, after=after, closed=pgconn.status == pq.ConnStatus.BAD)
    """)
    assert got["error"] is not None
    assert got["closed"], "the connection whose duplicate failed is still open"
    assert got["after"] == got["before"]


def test_no_descriptor_leaks_over_a_thousand_cycles_and_failures(name: str) -> None:
    """1,000 lock/release cycles, then cycles that fail (the lock busy; the pooled
    connection ended by the server while idle; a lease whose session was ended),
    leave the process with the descriptors it had once its pool is closed."""
    got = run_child(f"""
        backend = pg()
        with lock({name!r}, backend="pg", ttl=30, timeout=0):
            pass
        backend.pool.close()
        backend._pool = None
        connection.ensure_connection()
        baseline = fds()
        for i in range(1000):
            with lock({name!r} + str(i % 7), backend="pg", ttl=30, timeout=0):
                pass
        busy = lock({name!r}, backend="pg", ttl=30, timeout=0).acquire()
        refused = 0
        for _ in range(50):
            try:
                lock({name!r}, backend="pg", ttl=30, timeout=0).acquire()
            except LockNotAcquired:
                refused += 1
        busy.release()
        ended = 0
        for _ in range(20):
            lease = lock({name!r}, backend="pg", ttl=30, timeout=0, auto_renew=False).acquire()
            held_pid = backend._held[lease.owner].conn.info.backend_pid
            with connection.cursor() as cursor:  # the held session ended under it
                cursor.execute("SELECT pg_terminate_backend(%s, 10000)", [held_pid])
            try:
                lease.release()
            except Exception:
                ended += 1
            with lock({name!r}, backend="pg", ttl=30, timeout=0):
                pass
            idle_pid = backend.pool._idle[-1].info.backend_pid
            with connection.cursor() as cursor:  # an idle pooled one ended
                cursor.execute("SELECT pg_terminate_backend(%s, 10000)", [idle_pid])
        middle = len(fds())
        backend.pool.close()
        backend._pool = None
        gc.collect()
        report(baseline=baseline, after=fds(), refused=refused, middle=middle)
    """)
    assert got["refused"] == 50
    assert got["after"] == got["baseline"], (got["baseline"], got["after"])


def test_a_forked_child_never_touches_the_parents_session(name: str) -> None:
    """The parent holds a lock (its connection, libpq's socket and the duplicate are
    inherited by the child). The child tries the lease (refused), locks other names and
    the same one (busy) on its own connections, collects its garbage and exits the
    ordinary way (finalizing every inherited object); a second child leaves with
    os._exit. The parent's session still holds the lock throughout, its lease still
    confirms and extends, and releases."""
    got = run_child(f"""
        backend = pg()
        lease = lock({name!r}, backend="pg", ttl=30, timeout=0, auto_renew=False).acquire()
        key = backend.key({name!r})
        owner_pid = backend._held[lease.owner].conn.info.backend_pid
        connection.close()  # Django's connection: not shared with the children
        children = []
        for how in ("exit", "_exit"):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    if lease.held():
                        code = 3
                    try:
                        lease.release()
                    except Exception:
                        pass
                    try:
                        lock({name!r}, backend="pg", ttl=30, timeout=0).acquire()
                        code = 4  # took the parent's lock
                    except LockNotAcquired:
                        pass
                    with lock({name!r} + "-child", backend="pg", ttl=30, timeout=0):
                        pass
                    pg().close()
                    gc.collect()
                except BaseException:
                    import traceback
                    traceback.print_exc()
                    code = 5
                if how == "_exit":
                    os._exit(code)
                sys.exit(code)
            children.append(os.waitpid(pid, 0)[1])
        after = holders(key)
        held = backend.extend({name!r}, lease.owner, 30)
        lease.release()
        report(children=[os.waitstatus_to_exitcode(s) for s in children], owner_pid=owner_pid,
               after=after, held=held, left=holders(key))
    """)
    assert got["children"] == [0, 0]
    assert got["after"] == [got["owner_pid"]], "a child ended the parent's session"
    assert got["held"] is True
    assert got["left"] == []


def test_a_forked_child_keeps_no_duplicate_of_the_parents_sockets(name: str) -> None:
    """A parent holding many locks forks (a prefork worker pool): the child cannot use
    the inherited lock connections, so their duplicates (ours, made only to shut a
    socket down) are closed there at once: the child keeps one descriptor per
    inherited connection (libpq's, which it never touches), not two. Closing a copy
    in the child never ends the parent's sessions: the parent still holds every lock
    and releases them."""
    got = run_child(f"""
        backend = pg()
        leases = [lock({name!r} + str(i), backend="pg", ttl=30, timeout=0,
                       auto_renew=False).acquire() for i in range(15)]
        keys = [backend.key({name!r} + str(i)) for i in range(15)]
        pids = sorted(backend._held[lease.owner].conn.info.backend_pid for lease in leases)
        connection.close()
        read, write = os.pipe()
        before = len(fds())
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.write(write, str(len(fds()) - 1).encode())  # without the read end closed
            gc.collect()
            sys.exit(0)
        os.close(write)
        in_child = int(os.read(read, 100))
        os.close(read)
        status = os.waitpid(pid, 0)[1]
        holding = sorted(p for key in keys for p in holders(key))
        for lease in leases:
            lease.release()
        report(before=before, in_child=in_child, status=os.waitstatus_to_exitcode(status),
               pids=pids, holding=holding, left=[p for key in keys for p in holders(key)])
    """)
    assert got["status"] == 0
    assert got["holding"] == got["pids"], "a child ended some of the parent's sessions"
    assert got["left"] == []
    assert got["in_child"] <= got["before"] - 15, (got["before"], got["in_child"])
