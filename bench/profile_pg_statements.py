"""What each form of the PostgreSQL acquire statement costs on the server:
``python -m bench.profile_pg_statements``.

The statements alone, from bare psycopg on one autocommit connection, prepared, on
the fast bench server (``synchronous_commit`` off, as the lock connections have it):
each row is one acquire + unlock cycle of one name, its median wall clock over
``--blocks`` blocks of ``--size`` cycles, the rows interleaved block by block (the
order rotating each block), and its ratio to the advisory-lock floor measured in the
same run. Rows:

- the floor (``pg_try_advisory_lock`` + ``pg_advisory_unlock``), and the floor with
  distlocks' guarded unlock;
- the write a registry needs at least: ``nextval()`` of an UNLOGGED sequence, and an
  UPDATE of one UNLOGGED row (a write transaction);
- ``before``: the acquire statement of migration 0003 (every acquisition read G and M
  and carried the raise of G and the write of M as data-modifying CTEs), kept here as
  text; ``in use``: :data:`~distlocks.backends.postgres.sql.ACQUIRE_TRY`, which calls
  ``distlocks_mint`` (migration 0004): one UPDATE of the row bounded by its own ceiling;
- what-ifs without the function: the UPDATE as a CTE bounded by G read in the same
  statement, and bounded by the row's ceiling (a new name would then need a second
  statement); the same work as a LANGUAGE sql function (created in ``pg_temp``);
- ``new name``: the same cycles on a new name each time (locks per entity), where the
  mint inserts the row (with the marker present: no durable write);
- ``lock()``: a whole ``distlocks.lock()`` cycle on the bench's "pg" backend, with the
  statement before and the statement in use as its acquire (the Python layers the same);
- the renewal ping :data:`~distlocks.backends.postgres.sql.HOLDS` after a try.

Besides the wall clock, each row shows the server process's CPU time per cycle (from
``/proc/<pid>/schedstat``; the server runs on this machine), which a loaded machine
moves much less. Nothing is asserted; the figures are printed, with the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import os
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

from bench.postgres import PgFloor, bench_conninfo
from bench.run import _start
from distlocks.backends.postgres import sql
from distlocks.backends.postgres.keys import key_parts, lock_key

Cycle = Callable[[], None]
IN_USE = sql.ACQUIRE_TRY

# The acquire statement as it was before the split: every acquisition carried the
# raise of G and the write of M as CTEs that change nothing unless needed.
BEFORE = f"""
WITH granted AS MATERIALIZED ({{lock}}),
fence AS MATERIALIZED ({sql.FENCE_READ}),
minted AS (
INSERT INTO {sql.TABLE} AS r
    (key, name, fencing_token, owner, host, pid, thread, backend_pid,
     acquired_at, ttl, renewals, extra)
SELECT %(key)s, %(name)s,
       greatest(coalesce(fence.floor, coalesce(fence.ceiling, 0) + 1), {sql.CLOCK_US}),
       %(owner)s, %(host)s, %(pid)s, %(thread)s,
       pg_backend_pid(), clock_timestamp(), %(ttl)s, 0, %(extra)s
FROM granted, fence WHERE granted.ok
ON CONFLICT (key) DO UPDATE SET
    fencing_token = greatest(r.fencing_token + 1, {sql.CLOCK_US}),
    name = EXCLUDED.name, owner = EXCLUDED.owner,
    host = EXCLUDED.host, pid = EXCLUDED.pid, thread = EXCLUDED.thread,
    backend_pid = EXCLUDED.backend_pid, acquired_at = EXCLUDED.acquired_at,
    ttl = EXCLUDED.ttl, renewals = 0, extra = EXCLUDED.extra
RETURNING r.fencing_token
), raised AS (
{sql.RAISE.format(minted="minted", fence="fence")}
), marked AS (
{sql.MARK.format(minted="minted", fence="fence")}
)
SELECT fencing_token FROM minted
""".format(lock=sql.TRY)

_GRANTED = f"WITH granted AS MATERIALIZED ({sql.TRY}), "
_SET = """name = %(name)s, owner = %(owner)s, host = %(host)s, pid = %(pid)s,
        thread = %(thread)s, backend_pid = pg_backend_pid(), acquired_at = clock_timestamp(),
        ttl = %(ttl)s, renewals = 0, extra = %(extra)s"""

# Without the function: the row's UPDATE bounded by G, read in the same statement.
BOUNDED_BY_G = (
    _GRANTED
    + f"""fence AS MATERIALIZED (
    {sql.FENCE_READ}, {sql.CLOCK_US} AS now FROM granted WHERE granted.ok
), bumped AS (
    UPDATE {sql.TABLE} AS r SET fencing_token = greatest(r.fencing_token + 1, fence.now),
        {_SET}
    FROM fence
    WHERE r.key = %(key)s AND greatest(r.fencing_token + 1, fence.now) <= fence.ceiling
    RETURNING r.fencing_token
)
SELECT (SELECT fencing_token FROM bumped) FROM granted WHERE granted.ok
"""
)

# Without the function: the row's UPDATE bounded by its own ceiling (what the
# function's common case does, as a statement).
BOUNDED_BY_ROW = f"""
WITH granted AS MATERIALIZED (SELECT pg_try_advisory_lock(%(key)s) AS ok, {sql.CLOCK_US} AS now),
bumped AS (
    UPDATE {sql.TABLE} AS r SET fencing_token = greatest(r.fencing_token + 1, granted.now),
        {_SET}
    FROM granted
    WHERE r.key = %(key)s AND granted.ok
      AND greatest(r.fencing_token + 1, granted.now) <= r.ceiling
    RETURNING r.fencing_token
)
SELECT (SELECT fencing_token FROM bumped) FROM granted WHERE granted.ok
"""

# The common case as a LANGUAGE sql function (inlined or not, its plan is the caller's).
SQL_FUNCTION = f"""
CREATE FUNCTION pg_temp.bounded(p_key bigint, p_name text, p_owner text, p_host text,
    p_pid integer, p_thread text, p_ttl double precision, p_extra jsonb)
RETURNS bigint LANGUAGE sql AS $$
    UPDATE {sql.TABLE} AS r SET fencing_token = greatest(r.fencing_token + 1, {sql.CLOCK_US}),
        name = p_name, owner = p_owner, host = p_host, pid = p_pid, thread = p_thread,
        backend_pid = pg_backend_pid(), acquired_at = clock_timestamp(), ttl = p_ttl,
        renewals = 0, extra = p_extra
    WHERE r.key = p_key AND greatest(r.fencing_token + 1, {sql.CLOCK_US}) <= r.ceiling
    RETURNING r.fencing_token
$$
"""
SQL_FUNCTION_CALL = sql.ACQUIRE_TRY.replace(sql.MINT, "pg_temp.bounded").replace(
    ", pg_backend_pid())", ")"
)


def _cpu_ns(pid: int) -> int:
    """CPU time the process ``pid`` has run, in ns (the server is on this machine)."""
    with open(f"/proc/{pid}/schedstat") as stat:
        return int(stat.read().split()[0])


def _cycle(cur: Any, statements: list[tuple[str, Any]]) -> Cycle:
    def cycle() -> None:
        for statement, params in statements:
            cur.execute(statement, params, prepare=True).fetchone()

    return cycle


def _lock_cycle(statement: str, name: str) -> Cycle:
    """A ``lock()`` cycle on the "pg" backend (session mode: the pool, the watchdog, the
    lease) with ``statement`` as the acquire: the layers above the statement, the same
    for both, so the difference is the statement's."""
    from distlocks import lock
    from distlocks.backends.postgres import session
    from distlocks.backends.postgres.wire import Statement, to_int

    # The session recipe sends session.ACQUIRE_TRY, a statement prepared per connection
    # under its name: each variant is one of its own, under a name of its own, and must
    # take its parameters in the same order (the recipe fills them by position).
    label = hashlib.sha1(statement.encode()).hexdigest()[:12]
    prepared = Statement(f"distlocks_bench_{label}", statement, to_int)
    if prepared.params != session.ACQUIRE_TRY.params:
        raise SystemExit(
            f"the variant's parameters {prepared.params} are not the backend's "
            f"{session.ACQUIRE_TRY.params}: a lock() row cannot run it"
        )

    def cycle() -> None:
        session.ACQUIRE_TRY = prepared  # read by the session recipe at each acquire
        with lock(name, backend="pg", ttl=30.0):
            pass

    cycle()  # the row and its ceiling, made by the mint in use or by the statement
    return cycle


def _variants(cur: Any) -> dict[str, Cycle]:
    run = uuid.uuid4().hex[:8]
    fresh = itertools.count()

    def params(name: str) -> dict[str, Any]:
        return {
            "key": lock_key("bench", name),
            "guard": lock_key("bench", name + "\x00guard"),
            "name": name,
            "owner": uuid.uuid4().hex,
            "host": "bench-host",
            "pid": os.getpid(),
            "thread": "MainThread",
            "ttl": 30.0,
            "extra": "{}",
        }

    def known(statement: str, *more: tuple[str, Any]) -> Cycle:
        """Cycles of one name of its own (its row made by the mint before timing)."""
        bound = params(f"bench:stmt:{run}:{len(cycles)}")
        cur.execute(sql.ACQUIRE_TRY, bound).fetchone()
        cur.execute(sql.UNLOCK, bound).fetchone()
        return _cycle(cur, [(statement, bound), *((s, bound) for s, _ in more)])

    def new_name(statement: str) -> Cycle:
        def cycle() -> None:
            bound = params(f"bench:stmt:{run}:new:{next(fresh)}")
            cur.execute(statement, bound, prepare=True).fetchone()
            cur.execute(sql.UNLOCK, bound, prepare=True).fetchone()

        return cycle

    cycles: dict[str, Cycle] = {}
    floor = params(f"bench:stmt:{run}:floor")
    bare_unlock = "SELECT pg_advisory_unlock(%(key)s)"
    cycles["floor"] = _cycle(cur, [(sql.TRY, floor), (bare_unlock, floor)])
    cycles["floor + guarded unlock"] = _cycle(cur, [(sql.TRY, floor), (sql.UNLOCK, floor)])
    cycles["try+nextval temp seq"] = _cycle(
        cur, [(sql.TRY.replace(" AS ok", ", nextval('bench_seq')"), floor), (bare_unlock, floor)]
    )
    cycles["try+update temp row"] = _cycle(
        cur,
        [
            (
                _GRANTED + "u AS (UPDATE bench_row SET tok = tok + 1 FROM granted"
                " WHERE id = 1 AND granted.ok RETURNING tok) SELECT tok FROM u",
                floor,
            ),
            (bare_unlock, floor),
        ],
    )
    unlock = (sql.UNLOCK, None)
    cycles["before: 0003's statement"] = known(BEFORE, unlock)
    cycles["in use: distlocks_mint"] = known(sql.ACQUIRE_TRY, unlock)
    cycles["what-if: CTE bounded by G"] = known(BOUNDED_BY_G, unlock)
    cycles["what-if: CTE bounded by row"] = known(BOUNDED_BY_ROW, unlock)
    cycles["what-if: LANGUAGE sql fn"] = known(SQL_FUNCTION_CALL, unlock)
    cycles["before, new name"] = new_name(BEFORE)
    cycles["in use, new name"] = new_name(sql.ACQUIRE_TRY)
    cycles["lock(): before"] = _lock_cycle(BEFORE, f"bench:stmt:{run}:lock-before")
    cycles["lock(): in use"] = _lock_cycle(sql.ACQUIRE_TRY, f"bench:stmt:{run}:lock-in-use")
    classid, objid = key_parts(floor["key"])
    cycles["try + HOLDS + unlock"] = _cycle(
        cur, [(sql.TRY, floor), (sql.HOLDS, (classid, objid)), (sql.UNLOCK, floor)]
    )
    return cycles


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument(
        "--only", action="append", default=[], help="rows whose title contains this (repeatable)"
    )
    args = parser.parse_args(argv)
    import psycopg

    with contextlib.ExitStack() as cleanup:
        started: list[Any] = []
        cleanup.callback(lambda: [server.close() for server in started])
        env = _start([PgFloor], started)
        conn = psycopg.connect(bench_conninfo(env), autocommit=True)
        cleanup.callback(conn.close)
        conn.execute("SET synchronous_commit = off")
        conn.execute("CREATE TEMPORARY SEQUENCE bench_seq")
        # A temporary table is unlogged too, and private to this run.
        conn.execute("CREATE TEMPORARY TABLE bench_row (id int PRIMARY KEY, tok bigint)")
        conn.execute("INSERT INTO bench_row VALUES (1, 1)")
        conn.execute(SQL_FUNCTION)
        cur = conn.cursor()
        variants = {
            title: cycle
            for title, cycle in _variants(cur).items()
            if title == "floor" or not args.only or any(part in title for part in args.only)
        }
        for cycle in variants.values():  # warm up: plans prepared, rows in place
            for _ in range(args.size):
                cycle()
        times: dict[str, list[float]] = {title: [] for title in variants}
        # The server process's own CPU time per block (the scheduler's count, in ns):
        # much less noisy than the wall clock on a loaded machine.
        server: dict[str, list[float]] = {title: [] for title in variants}
        # Every session of this run (the bench's own server): this connection, and the
        # pool's of the lock() rows; each idle while the others' rows run.
        pids = [
            int(pid)
            for (pid,) in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND backend_type = 'client backend'"
            ).fetchall()
        ]
        order = list(variants.items())
        for block in range(args.blocks):
            shift = block % len(order)
            for title, cycle in order[shift:] + order[:shift]:
                before = sum(map(_cpu_ns, pids))
                for _ in range(args.size):
                    start = time.perf_counter()
                    cycle()
                    times[title].append(time.perf_counter() - start)
                server[title].append((sum(map(_cpu_ns, pids)) - before) / args.size)
        sql.ACQUIRE_TRY = IN_USE
        # The rows of this run's names (never used again): the table stays as it was.
        conn.execute(f"DELETE FROM {sql.TABLE} WHERE name LIKE 'bench:stmt:%%'")
        floor = statistics.median(times["floor"])
        floor_cpu = statistics.median(server["floor"])
        print(f"load average {os.getloadavg()}; {args.blocks} x {args.size} cycles per row")
        print(f"{'':34} {'wall (median)':>17} {'server CPU (median block)':>26}")
        for title, values in times.items():
            median = statistics.median(values)
            cpu = statistics.median(server[title])
            print(
                f"{title:34} {median * 1e6:8.1f} us {median / floor:5.2f}x"
                f" {cpu / 1e3:8.1f} us {cpu / floor_cpu:5.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
