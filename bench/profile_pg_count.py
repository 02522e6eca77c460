"""Run N PostgreSQL lock cycles and nothing else, for deterministic counts:
``python -m bench.profile_pg_count WHAT N``.

Wall-clock and CPU times move with the machine's load; the client's instruction count
per cycle (valgrind's cachegrind) and its system calls per cycle (``strace -c``) do not.
The N measured cycles run inside one call of ``sorted()`` (its key function), and
nothing else of the run does: valgrind counts that call alone, in the calling thread
alone (start-up varies by millions of instructions from run to run, and the reply
watchdog's thread ticks with the wall clock)::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --separate-threads=yes \\
        --toggle-collect=builtin_sorted --callgrind-out-file=cg.out \\
        python -m bench.profile_pg_count backend 1000
    (the "totals:" of cg.out-01, divided by 1000: two runs agree within 0.2%)

Valgrind counts ``time.monotonic()`` and uncontended ``threading.Lock`` far above their
native cost (its clock and futex emulation): compare counts of variants that make the
same such calls, and check a change in them with CPU time (``bench.profile_lease``).

``WHAT`` is ``conn`` (the backend's two statements on one of its pool's connections,
through ``Connection.value_encoded``: the reply watchdog and the connection's locks,
no pool, no lease record), ``backend`` (``PostgresBackend.acquire`` / ``release``, as
:func:`~distlocks.locks.acquire_lease` calls them), ``lock`` (``with lock(name,
backend="pg", ttl=30, timeout=0)``, default options) or ``statements`` (the backend's
own two statements prepared on a bare connection, sent with ``psycopg.pq``: the floor
of what the backend sends). Uses the servers named by ``DISTLOCKS_TEST_DATABASE_URL``
and ``DISTLOCKS_TEST_REDIS_URL`` if set (``serve`` starts them and prints them, so
that many counted runs share one pair of servers), else starts its own. Every cycle's lock must be
granted: a refusal stops the run (the count would then be of another path).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any

NAME = "bench:profile-pg-count"


def _cycles(what: str) -> Callable[[int], Any]:
    from distlocks import get_backend, lock
    from distlocks.locks import current_holder, new_owner

    if what == "backend":
        backend = get_backend("pg")
        acquire, release = backend.acquire, backend.release
        name = NAME + ":backend"

        def backend_cycles(n: int) -> None:
            for _ in range(n):
                owner = new_owner()
                if not acquire(name, owner, 30.0, current_holder()).acquired:
                    raise SystemExit("the backend's lock was busy")
                release(name, owner)

        return backend_cycles
    if what == "conn":
        from distlocks.backends.postgres import session

        backend = get_backend("pg")
        named = backend._named(NAME + ":conn")
        conn = backend.pool.get()  # kept out of the pool for the run
        unlock_args = named.unlock_args

        def conn_cycles(n: int) -> None:
            for _ in range(n):
                args = backend._try_args(named, new_owner(), 30.0, current_holder())
                if conn.value_encoded(session.ACQUIRE_TRY, args) is None:
                    raise SystemExit("the connection's lock was busy")
                conn.value_encoded(session.UNLOCK, unlock_args)

        return conn_cycles
    if what == "lock":

        def lock_cycles(n: int) -> None:
            for _ in range(n):
                with lock(NAME + ":lock", backend="pg", ttl=30, timeout=0):
                    pass

        return lock_cycles
    return _statement_cycles()


def _statement_cycles() -> Callable[[int], None]:
    import psycopg

    from bench.base import Env
    from bench.postgres import bench_conninfo
    from distlocks import get_backend
    from distlocks.backends.postgres import session
    from distlocks.locks import current_holder, new_owner

    conn = psycopg.connect(bench_conninfo(Env.from_environ()), autocommit=True)
    conn.execute("SET synchronous_commit = off")  # as the backend's connections run
    pgconn = conn.pgconn
    for statement in (session.ACQUIRE_TRY, session.UNLOCK):
        pgconn.prepare(statement.name, statement.query, statement.types)
    backend: Any = get_backend("pg")
    named = backend._named(NAME + ":statements")
    try_args = backend._try_args(named, new_owner(), 30.0, current_holder())
    acquire, unlock = session.ACQUIRE_TRY.name, session.UNLOCK.name

    def statement_cycles(n: int) -> None:
        for _ in range(n):
            if pgconn.exec_prepared(acquire, try_args).get_value(0, 0) is None:
                raise SystemExit("the statements' lock was busy")
            pgconn.exec_prepared(unlock, named.unlock_args).get_value(0, 0)

    return statement_cycles


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_pg_count", description=__doc__)
    parser.add_argument("what", choices=("statements", "conn", "backend", "lock", "serve"))
    parser.add_argument("n", type=int, nargs="?", default=1000, help="cycles (1000)")
    args = parser.parse_args(argv)

    from bench.implementations import Distlocks
    from bench.postgres import PgFloor
    from bench.run import _start

    with contextlib.ExitStack() as cleanup:
        started: list[Any] = []
        cleanup.callback(lambda: [server.close() for server in started])
        _start([Distlocks, PgFloor], started)
        if args.what == "serve":
            # The servers stay up until this process is stopped (Ctrl-C).
            print(
                f"export DISTLOCKS_TEST_DATABASE_URL={os.environ['DISTLOCKS_TEST_DATABASE_URL']}"
                f" DISTLOCKS_TEST_REDIS_URL={os.environ['DISTLOCKS_TEST_REDIS_URL']}",
                flush=True,
            )
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
            return 0
        from distlocks.handler import backends

        cleanup.callback(backends.reset)
        cycles = _cycles(args.what)
        cycles(50)  # warm: statements prepared, caches filled, threads started
        # The only call of sorted() in the run: valgrind's --toggle-collect window.
        sorted([args.n], key=cycles)
    return 0


if __name__ == "__main__":
    sys.exit(main())
