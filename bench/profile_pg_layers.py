"""The client's side of the PostgreSQL lock cycle, layer by layer, on the fast server of
``make bench``: ``python -m bench.profile_pg_layers``.

A companion of :mod:`bench.profile_pg` (which looks at the durable server's side). This
one times the uncontended cycle of the ``cycle`` workload from the floor up, one layer
added per row, interleaved in blocks (the order rotating each block):

1. the floor: ``pg_try_advisory_lock`` + ``pg_advisory_unlock`` on a bare connection;
2. distlocks' acquire and unlock statements on one cursor of a bare
   ``psycopg.Connection`` opened with the pool's own connection arguments (prepared after
   two uses, as the pool's are);
3. the same through :meth:`~distlocks.backends.postgres.pool.Connection.fetchone` of
   the pool's connection class, whose every request registers with the reply watchdog;
3b. the same statements on the backend's fast path,
   :meth:`~distlocks.backends.postgres.pool.Connection.value` (named prepared statements
   sent with ``psycopg.pq``, no cursor), still under the watchdog;
4. ``PostgresBackend.acquire`` / ``release`` (checkout, owner's parameters, held lease);
5. ``with lock(..., auto_renew=False)``; 6. ``with lock(...)`` (default).

For each row: the median wall clock per cycle, its ratio to the floor, and the CPU time
per cycle of the calling thread (``time.thread_time()``) and of the whole process
(``time.process_time()``: the watchdog's and renewer's threads too). The server's work is
the same in rows 2-6, so the differences of their CPU columns are the client's Python,
and hold under load far better than wall-clock differences do. Rows 2-6 each use a
connection of their own (each a server process): on a loaded machine, compare their
wall clocks over several runs.

``--profile`` adds a ``cProfile`` of the ``lock()`` cycle: Python calls per cycle and the
functions by own time. Nothing is asserted; the figures are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

from bench.cli import positive

Variant = tuple[str, Callable[[], None]]
FLOOR = "floor: try + unlock, bare psycopg"
PROFILED = "lock() (default)"
NAME = "bench:profile-pg-layers"


def _variants(cleanup: contextlib.ExitStack) -> list[Variant]:
    import psycopg

    from bench.base import Env
    from bench.postgres import advisory_key, bench_conninfo
    from distlocks import get_backend, lock
    from distlocks.backends import postgres as pg
    from distlocks.backends.postgres import pool as pg_pool
    from distlocks.backends.postgres import session, sql
    from distlocks.locks import current_holder

    backend = cast(pg.PostgresBackend, get_backend("pg"))
    cleanup.callback(backend.close)
    floor_conn = psycopg.connect(bench_conninfo(Env.from_environ()), autocommit=True)
    cleanup.callback(floor_conn.close)
    floor_key = advisory_key(NAME + ":floor")

    def floor() -> None:
        floor_conn.execute("SELECT pg_try_advisory_lock(%s)", (floor_key,)).fetchone()
        floor_conn.execute("SELECT pg_advisory_unlock(%s)", (floor_key,)).fetchone()

    kwargs = backend._connect_kwargs()
    bare = psycopg.Connection.connect(**kwargs)
    cleanup.callback(bare.close)
    watched = pg_pool.Connection.connect(**kwargs)
    watched.reply_timeout = backend.pool.reply_timeout
    cleanup.callback(watched.close)
    fast = pg_pool.Connection.connect(**kwargs)
    fast.reply_timeout = backend.pool.reply_timeout
    cleanup.callback(fast.close)
    holder = current_holder()

    def statements(conn: Any, name: str) -> Callable[[], None]:
        params = backend._params(name, uuid.uuid4().hex, 30.0, holder)
        unlock = {"key": params["key"], "reader": 0, "guard": backend._guard(name)}

        # One cursor, as the backend's connections keep (Connection.fetchone).
        fetchone = getattr(conn, "fetchone", None) if isinstance(conn, pg_pool.Connection) else None
        cursor = conn.cursor()

        def cycle() -> None:
            if fetchone is not None:
                fetchone(sql.ACQUIRE_TRY, params)
                fetchone(sql.UNLOCK, unlock)
            else:
                cursor.execute(sql.ACQUIRE_TRY, params).fetchone()
                cursor.execute(sql.UNLOCK, unlock).fetchone()

        return cycle

    def fast_statements(name: str) -> Callable[[], None]:
        params = backend._params(name, uuid.uuid4().hex, 30.0, holder)
        unlock = {"key": params["key"], "reader": 0, "guard": backend._guard(name)}
        value, unlock_statement = fast.value, session.UNLOCKS[sql.UNLOCK]

        def cycle() -> None:
            value(session.ACQUIRE_TRY, params)
            value(unlock_statement, unlock)

        return cycle

    def backend_cycle() -> None:
        owner = os.urandom(16).hex()
        backend.acquire(NAME + ":backend", owner, 30.0, current_holder())
        backend.release(NAME + ":backend", owner)

    def api(**options: Any) -> Callable[[], None]:
        name = f"{NAME}:api:{options}"

        def cycle() -> None:
            with lock(name, backend="pg", ttl=30, timeout=0, **options):
                pass

        return cycle

    return [
        (FLOOR, floor),
        ("statements, bare psycopg, one cursor", statements(bare, NAME + ":bare")),
        ("statements, pool's Connection.fetchone", statements(watched, NAME + ":watched")),
        ("statements, Connection.value (pq)", fast_statements(NAME + ":fast")),
        ("PostgresBackend.acquire/release", backend_cycle),
        ("lock(), auto_renew=False", api(auto_renew=False)),
        (PROFILED, api()),
    ]


def _timed(
    variants: list[Variant], blocks: int, size: int
) -> dict[str, tuple[float, float, float]]:
    """title -> (median wall us, thread CPU us, process CPU us) per cycle."""
    wall: dict[str, list[float]] = {title: [] for title, _ in variants}
    thread_cpu = dict.fromkeys(wall, 0.0)
    process_cpu = dict.fromkeys(wall, 0.0)
    for _title, cycle in variants:  # warm-up: statements prepared, pools filled
        for _ in range(50):
            cycle()
    perf = time.perf_counter
    for block in range(blocks):
        shift = block % len(variants)
        for title, cycle in variants[shift:] + variants[:shift]:
            samples = wall[title]
            t0, p0 = time.thread_time(), time.process_time()
            for _ in range(size):
                started = perf()
                cycle()
                samples.append(perf() - started)
            thread_cpu[title] += time.thread_time() - t0
            process_cpu[title] += time.process_time() - p0
    n = blocks * size
    return {
        t: (statistics.median(wall[t]) * 1e6, thread_cpu[t] / n * 1e6, process_cpu[t] / n * 1e6)
        for t in wall
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_pg_layers", description=__doc__)
    parser.add_argument("--blocks", type=positive, default=30, help="interleaved blocks (30)")
    parser.add_argument("--block-size", type=positive, default=100, help="cycles per block (100)")
    parser.add_argument("--profile", action="store_true", help="cProfile the lock() cycle")
    args = parser.parse_args(argv)

    from bench.postgres import PgFloor
    from bench.profile_save import _by_function, _calls_per_save
    from bench.run import _start

    with contextlib.ExitStack() as cleanup:
        started: list[Any] = []
        cleanup.callback(lambda: [server.close() for server in started])
        _start([PgFloor], started)
        variants = _variants(cleanup)
        n = args.blocks * args.block_size
        print(
            f"== Layers on the fast server: {args.blocks} blocks of {args.block_size} cycles, "
            f"interleaved, {n:,} cycles each; medians (load before {os.getloadavg()[0]:.2f})\n"
        )
        results = _timed(variants, args.blocks, args.block_size)
        floor = results[FLOOR][0]
        header = f"{'median us':>10} {'x floor':>8} {'thread CPU':>11} {'process CPU':>12}"
        print(f"{'what runs':40} {header}")
        for title, (wall, thread, process) in results.items():
            print(f"{title:40} {wall:10.1f} {wall / floor:7.2f}x {thread:11.1f} {process:12.1f}")
        print(f"(load after {os.getloadavg()[0]:.2f}; CPU in us per cycle)")
        if args.profile:
            cycles = min(2000, n)
            per_cycle, stats = _calls_per_save(dict(variants)[PROFILED], cycles)
            print(f"\n== cProfile of {cycles:,} cycles of {PROFILED}: {per_cycle:.0f} calls each")
            print(f"  {'calls':>6} {'own us':>7} {'cum us':>7}  function")
            functions = sorted(_by_function(stats, cycles).items(), key=lambda kv: -kv[1][1])
            for name, (calls, own, cumulative) in functions[:40]:
                print(f"  {calls:6.1f} {own:7.1f} {cumulative:7.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
