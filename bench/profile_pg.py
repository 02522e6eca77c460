"""Where the PostgreSQL lock cycle spends its time on a durable server:
``python -m bench.profile_pg``.

A companion of the ``pg-cycle-durable`` workload (:mod:`bench.pg_durable`), for the
analysis in docs/benchmarks.md. It starts the servers of that workload as ``python -m
bench`` does (the durable one restarted with ``pg_stat_statements`` preloaded) and, in
the benchmark's database on the durable server:

1. times the uncontended cycle layer by layer, interleaved in blocks (the order rotating
   each block): the advisory-lock floor; distlocks' statements from bare psycopg,
   prepared, with what-ifs (the statement as it was before issue 29, on a LOGGED copy of
   the registry; an UPDATE-then-INSERT form of the statement in use; the unlogged write
   without the ceiling's read; synchronous_commit off and on); the statements on a
   pooled connection; ``PostgresBackend`` (on one name, and on a new name each cycle, as
   locks per entity take them); ``lock()``. Median wall clock per cycle, and
   the process's CPU time per cycle (``time.process_time()``: the backend's threads too);
2. runs each variant alone for the server's side: the WAL written per cycle (from the
   insert position), each statement's execution time, WAL records, full-page images and
   bytes per call (``pg_stat_statements``); ``EXPLAIN (ANALYZE, BUFFERS, WAL)`` of the
   acquire statement and whether its update was HOT (``pg_stat_xact_user_tables``);
3. profiles ``lock()``'s cycle (``cProfile``): calls per cycle, functions by own time.

Each connection is a server process of its own: on a machine with few cores, whether
the scheduler runs it on the client's core can move its round trip by more than the
registry write costs. Rows 1-6 share one connection, rows 7-8 another; compare
rows across connections only over several runs.

The LOGGED copy is dropped and the durable server stopped at the end, also on an
error or Ctrl-C. Nothing is asserted; the figures are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, cast

import psycopg
from django.db import connections

from bench.cli import positive
from bench.pg_durable import DurablePgFloor, durable_env, server_settings
from bench.postgres import bench_conninfo
from bench.profile_save import _by_function, _calls_per_save
from bench.run import _start
from distlocks import get_backend, lock
from distlocks.backends import postgres as pg
from distlocks.locks import current_holder

Variant = tuple[str, Callable[[], None]]
FLOOR = "floor: try + unlock"
PROFILED = "lock(), sync off (default)"
LOGGED = "distlocks_profile_logged"
_STATEMENTS = r"""
SELECT calls, mean_exec_time, wal_records, wal_fpi, wal_bytes,
       regexp_replace(query, '\s+', ' ', 'g')
FROM pg_stat_statements WHERE calls >= %s AND query !~ 'pg_stat_statements|pg_current_wal'
ORDER BY total_exec_time DESC LIMIT 4
"""
#: The registry row the statements write (the key is added per statement).
_ROW = {"name": "bench:profile-pg", "owner": "o" * 32, "host": "h", "pid": 1, "thread": "t",
        "ttl": 30.0, "extra": "{}"}  # fmt: skip
#: The head of every acquire-like statement, shortened in the server's table.
_GRANTED = "WITH granted AS MATERIALIZED (SELECT pg_try_advisory_lock($1) AS ok) "


def _start_durable(started: list[Any]) -> None:
    """Start the servers and Django as ``python -m bench`` does, then restart the durable
    server on its port with ``pg_stat_statements`` loaded."""
    _start([DurablePgFloor], started)
    durable = started[-1]
    connections.close_all()
    with psycopg.connect(durable.location, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
    durable.server.stop()
    durable.server.start(port=durable.server.port)


def _pair(conn: Any, first: str, second: str, params: dict[str, Any]) -> Callable[[], None]:
    def cycle() -> None:
        conn.execute(first, params).fetchone()
        conn.execute(second, params).fetchone()

    return cycle


# The acquire statement as it was before issue 29: every token written to the logged
# registry (timed on a logged copy of it, LOGGED).
_BEFORE = f"""
WITH granted AS MATERIALIZED ({{lock}})
INSERT INTO {LOGGED} AS r
    (key, name, fencing_token, owner, host, pid, thread, backend_pid,
     acquired_at, ttl, renewals, extra)
SELECT %(key)s, %(name)s, {pg._CLOCK_US}, %(owner)s, %(host)s, %(pid)s, %(thread)s,
       pg_backend_pid(), clock_timestamp(), %(ttl)s, 0, %(extra)s
FROM granted WHERE granted.ok
ON CONFLICT (key) DO UPDATE SET
    fencing_token = greatest(r.fencing_token + 1, EXCLUDED.fencing_token),
    name = EXCLUDED.name, owner = EXCLUDED.owner,
    host = EXCLUDED.host, pid = EXCLUDED.pid, thread = EXCLUDED.thread,
    backend_pid = EXCLUDED.backend_pid, acquired_at = EXCLUDED.acquired_at,
    ttl = EXCLUDED.ttl, renewals = 0, extra = EXCLUDED.extra
RETURNING r.fencing_token
"""

# A candidate: the unlogged row updated in place when it exists, inserted otherwise
# (no ON CONFLICT: the lock is held, so no one else inserts the key meanwhile), and
# the ceiling raised and the marker written as in the statement in use.
_UPDATE_THEN_INSERT = f"""
WITH granted AS MATERIALIZED ({{lock}}),
fence AS MATERIALIZED ({pg.sql.FENCE_READ}),
updated AS (
    UPDATE {pg.TABLE} AS r SET fencing_token = greatest(r.fencing_token + 1, {pg._CLOCK_US}),
        name = %(name)s, owner = %(owner)s, host = %(host)s, pid = %(pid)s,
        thread = %(thread)s, backend_pid = pg_backend_pid(), acquired_at = clock_timestamp(),
        ttl = %(ttl)s, renewals = 0, extra = %(extra)s
    FROM granted WHERE r.key = %(key)s AND granted.ok RETURNING r.fencing_token
), inserted AS (
    INSERT INTO {pg.TABLE}
        (key, name, fencing_token, owner, host, pid, thread, backend_pid,
         acquired_at, ttl, renewals, extra)
    SELECT %(key)s, %(name)s,
           greatest(coalesce(fence.floor, coalesce(fence.ceiling, 0) + 1), {pg._CLOCK_US}),
           %(owner)s, %(host)s, %(pid)s, %(thread)s,
           pg_backend_pid(), clock_timestamp(), %(ttl)s, 0, %(extra)s
    FROM granted, fence WHERE granted.ok AND NOT EXISTS (SELECT 1 FROM updated)
    RETURNING fencing_token
), minted AS (
    SELECT fencing_token FROM updated UNION ALL SELECT fencing_token FROM inserted
), raised AS (
{pg.sql.RAISE.format(minted="minted", fence="fence")}
), marked AS (
{pg.sql.MARK.format(minted="minted", fence="fence")}
)
SELECT fencing_token FROM minted
"""


def _statement_variants(connect: Callable[[str], Any], pooled: Any) -> list[Variant]:
    """distlocks' statements sent alone, and pieces of them, as (title, cycle)."""
    off, on = connect("off"), connect("on")
    key, guard = pg.lock_key("bench", "profile-pg"), pg.lock_key("bench", "profile-pg-guard")
    params = {**_ROW, "key": key, "guard": guard}
    acquire = pg._ACQUIRE.format(lock=pg.TRY)
    before = _BEFORE.format(lock=pg.TRY)
    candidate = _UPDATE_THEN_INSERT.format(lock=pg.TRY)
    granted = f"WITH granted AS MATERIALIZED ({pg.TRY}) "
    # The registry write alone, without the ceiling's read: what the ceiling costs.
    no_ceiling = granted + (
        f"UPDATE {pg.TABLE} AS r SET fencing_token = greatest(r.fencing_token + 1,"
        f" {pg._CLOCK_US}), name = %(name)s, owner = %(owner)s, host = %(host)s, pid = %(pid)s,"
        " thread = %(thread)s, backend_pid = pg_backend_pid(), acquired_at = clock_timestamp(),"
        " ttl = %(ttl)s, renewals = 0, extra = %(extra)s FROM granted"
        " WHERE r.key = %(key)s AND granted.ok RETURNING r.fencing_token"
    )
    unlock = pg._UNLOCK
    return [
        (FLOOR, _pair(off, pg.TRY, "SELECT pg_advisory_unlock(%(key)s)", params)),
        ("try + distlocks' guarded unlock", _pair(off, pg.TRY, unlock, params)),
        ("before: logged registry + unlock", _pair(off, before, unlock, params)),
        ("acquire statement + unlock", _pair(off, acquire, unlock, params)),
        ("UPDATE-then-INSERT + unlock", _pair(off, candidate, unlock, params)),
        ("unlogged UPDATE, no ceiling + unlock", _pair(off, no_ceiling, unlock, params)),
        ("before, sync on", _pair(on, before, unlock, params)),
        ("acquire + unlock, sync on", _pair(on, acquire, unlock, params)),
        ("acquire + unlock, the pool's _Connection", _pair(pooled, acquire, unlock, params)),
    ]


def _api_variants(backend: Any) -> list[Variant]:
    holder = current_holder()

    def backend_cycle() -> None:
        backend.acquire("bench:profile-pg-backend", "owner", 30.0, holder)
        backend.release("bench:profile-pg-backend", "owner")

    # Locks per entity ("payment:{id}"): a name never locked before, each cycle.
    new_names = itertools.count()
    run = f"{os.getpid()}-{time.time_ns()}"

    def new_name_cycle() -> None:
        name = f"bench:profile-pg-new:{run}:{next(new_names)}"
        backend.acquire(name, "owner", 30.0, holder)
        backend.release(name, "owner")

    def api(alias: str, **options: Any) -> Callable[[], None]:
        def cycle() -> None:
            with lock("bench:profile-pg-api", backend=alias, ttl=30, timeout=0, **options):
                pass

        return cycle

    return [
        ("PostgresBackend.acquire/release", backend_cycle),
        ("PostgresBackend, a new name each cycle", new_name_cycle),
        ("lock(), auto_renew=False", api("pg-durable", auto_renew=False)),
        (PROFILED, api("pg-durable")),
        ("lock(), sync on", api("pg-durable-sync")),
    ]


def _timed(variants: list[Variant], blocks: int, size: int) -> dict[str, tuple[float, float]]:
    """title -> (median wall us per cycle, process CPU us per cycle)."""
    wall: dict[str, list[float]] = {title: [] for title, _ in variants}
    cpu = dict.fromkeys(wall, 0.0)
    for _title, cycle in variants:  # warm-up
        for _ in range(50):
            cycle()
    for block in range(blocks):
        shift = block % len(variants)
        for title, cycle in variants[shift:] + variants[:shift]:
            samples, perf = wall[title], time.perf_counter
            c0 = time.process_time()
            for _ in range(size):
                t0 = perf()
                cycle()
                samples.append(perf() - t0)
            cpu[title] += time.process_time() - c0
    n = blocks * size
    return {t: (statistics.median(wall[t]) * 1e6, cpu[t] / n * 1e6) for t in wall}


def _server_side(admin: Any, variants: list[Variant], cycles: int) -> None:
    print(f"{'what runs':40} {'WAL bytes':>9} (all of the server's WAL, per cycle)")
    print(f"    {'exec us':>7} {'WAL rec':>7} {'FPI':>5} {'bytes':>5}  per call: statement")
    for title, cycle in variants:
        admin.execute("SELECT pg_stat_statements_reset()")
        before = admin.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
        for _ in range(cycles):
            cycle()
        since = "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s::pg_lsn)"
        wal = admin.execute(since, (before,)).fetchone()[0]
        print(f"{title:40} {float(wal) / cycles:9.0f}")
        for calls, mean_ms, records, fpi, size, query in admin.execute(_STATEMENTS, (cycles,)):
            text = query.replace(_GRANTED, "[try] ")[:60]
            print(f"    {mean_ms * 1000:7.1f} {records / calls:7.2f} {fpi / calls:5.2f}"
                  f" {int(size) / calls:5.0f}  {text}")  # fmt: skip


def _explain(conn: Any, statement: str, table: str) -> tuple[list[str], int, int]:
    """The plan of an acquire statement writing ``table`` (the last of three runs: the
    row exists), and the rows it updated, and HOT-updated (its transaction's statistics)."""
    params = {**_ROW, "key": 1, "name": "bench:profile-pg-explain"}
    counts = "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = %s"
    for _ in range(3):
        with conn.transaction():  # the counts also hold earlier transactions not yet flushed
            updated, hot = conn.execute(counts, (table,)).fetchone()
            query = "EXPLAIN (ANALYZE, BUFFERS, WAL, TIMING, SUMMARY) " + statement
            plan = [line for (line,) in conn.execute(query, params)]
            after = conn.execute(counts, (table,)).fetchone()
        conn.execute("SELECT pg_advisory_unlock_all()")
    return plan, after[0] - updated, after[1] - hot


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_pg", description=__doc__)
    parser.add_argument("--blocks", type=positive, default=30, help="interleaved blocks (30)")
    parser.add_argument("--block-size", type=positive, default=100, help="cycles per block (100)")
    args = parser.parse_args(argv)
    n = args.blocks * args.block_size
    cycles = min(1000, n)  # for the server's side and cProfile

    # Undone in reverse order, each step even if another failed: the servers last.
    with contextlib.ExitStack() as cleanup:
        started: list[Any] = []
        cleanup.callback(lambda: [server.close() for server in started])
        _start_durable(started)
        conninfo = bench_conninfo(durable_env())

        def connect(sync: str) -> Any:
            conn = psycopg.connect(conninfo, autocommit=True, prepare_threshold=0,
                                   options=f"-c synchronous_commit={sync}")  # fmt: skip
            cleanup.callback(conn.close)
            return conn

        admin = connect("off")
        admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        admin.execute(f"CREATE TABLE {LOGGED} (LIKE {pg.TABLE} INCLUDING ALL)")
        cleanup.callback(admin.execute, f"DROP TABLE {LOGGED}")
        for alias in ("pg-durable", "pg-durable-sync"):
            cleanup.callback(get_backend(alias).close)
        backend = cast(pg.PostgresBackend, get_backend("pg-durable"))
        pooled = backend.pool.get()
        cleanup.callback(backend.pool.put, pooled)
        variants = _statement_variants(connect, pooled) + _api_variants(backend)
        version = admin.execute("SHOW server_version").fetchone()[0]
        print(f"== Durable server: PostgreSQL {version}, {server_settings()}\n")

        print(
            f"== Layers: {args.blocks} blocks of {args.block_size} cycles, interleaved, "
            f"{n:,} cycles each; medians (load before {os.getloadavg()[0]:.2f})\n"
        )
        results = _timed(variants, args.blocks, args.block_size)
        floor = results[FLOOR][0]
        print(f"{'what runs':40} {'median us':>10} {'x floor':>8} {'client CPU us':>14}")
        for title, (wall, cpu) in results.items():
            print(f"{title:40} {wall:10.1f} {wall / floor:7.2f}x {cpu:14.1f}")
        print(
            f"(load after {os.getloadavg()[0]:.2f}; sync: the lock connection's "
            "synchronous_commit, off unless said; CPU: the whole process, per cycle;\n"
            " rows 1-6 share one connection, rows 7-8 another, the rest the backends' pools)"
        )

        print(
            f"\n== The server's side: each variant alone, {cycles:,} cycles; "
            "statements run at least once per cycle (pg_stat_statements)\n"
        )
        _server_side(admin, variants, cycles)
        explain_conn = connect("off")
        explained = (
            ("in use, UNLOGGED registry", pg._ACQUIRE.format(lock=pg.TRY), pg.TABLE),
            ("before issue 29, LOGGED copy", _BEFORE.format(lock=pg.TRY), LOGGED),
        )
        for title, statement, table in explained:
            print(f"\n== EXPLAIN (ANALYZE, BUFFERS, WAL) of the acquire statement, {title}\n")
            plan, updated, hot = _explain(explain_conn, statement, table)
            print("\n".join(f"  {line}" for line in plan))
            print(f"  ({updated} row(s) updated, {hot} of them HOT: pg_stat_xact_user_tables)")

        per_cycle, stats = _calls_per_save(dict(variants)[PROFILED], cycles)
        print(f"\n== cProfile of {cycles:,} cycles of {PROFILED}: {per_cycle:.0f} calls per cycle")
        print("functions by own time per cycle, under the profiler (read them as shares):\n")
        print(f"  {'calls':>6} {'own us':>7} {'cum us':>7}  function")
        functions = sorted(_by_function(stats, cycles).items(), key=lambda kv: -kv[1][1])
        for name, (calls, own, cumulative) in functions[:20]:
            print(f"  {calls:6.1f} {own:7.1f} {cumulative:7.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
