"""The PostgreSQL backend's own connection pool against psycopg_pool:
``python -m bench.pool_compare [--rounds 20] [--cycles 500]``.

Issue 28 asks whether the backend should keep its own pool
(:class:`distlocks.backends.postgres.pool.Pool`) or adopt psycopg_pool's
``ConnectionPool``. This times, on a throwaway server
(:func:`distlocks.testing.servers.ensure_test_servers`), with the connection
settings ``PostgresBackend`` derives from ``DATABASES`` (the same dict for every pool,
and the same connection class, which carries the reply watchdog):

* ``checkout``: take a connection from the pool and give it back (no statement);
* ``lock cycle``: the same around ``pg_try_advisory_lock`` and ``pg_advisory_unlock``
  (two round trips), the shape of an uncontended acquire and release.

Pools compared:

* ``own Pool``: the backend's pool (an idle connection is polled with ``select()``
  before it is handed out, so one the server ended is replaced first);
* ``own Pool, control``: a second one of the same: the spread between two identical
  pools (each on a server process of its own, which the scheduler may place on the
  client's core or not) is what a difference must exceed to mean anything;
* ``psycopg_pool, poll check``: ``ConnectionPool`` with that same poll as its ``check``
  callback, which is what adopting it would need to keep that guarantee;
* ``psycopg_pool, no check``: ``ConnectionPool`` as configured by default (a
  connection the server ended is handed out as it is).

Rounds are interleaved, the order of the pools rotating each round, and every cycle
is timed on its own (``perf_counter_ns``); median and p99 over all rounds. psycopg_pool
is not a dependency of distlocks: the script says so and stops when it is missing.
Nothing is asserted; the figures are printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def _settings(database_url: str) -> None:
    """Minimal Django settings naming the throwaway server as ``default``."""
    import django
    from django.conf import settings
    from psycopg.conninfo import conninfo_to_dict

    parts = conninfo_to_dict(database_url)
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": parts.get("dbname", "postgres"),
                "USER": parts.get("user", ""),
                "PASSWORD": parts.get("password", ""),
                "HOST": parts.get("host", ""),
                "PORT": parts.get("port", ""),
            }
        },
        INSTALLED_APPS=["django.contrib.contenttypes", "distlocks"],
        USE_TZ=True,
    )
    django.setup()


def _percentile(samples: list[int], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] / 1000


def _down_server(psycopg_pool: Any, kwargs: dict[str, Any], connection: Any, pool: Any) -> str:
    """How long each pool takes to report a server that refuses connections, and what."""
    import socket

    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        refused = {**kwargs, "host": "127.0.0.1", "port": sock.getsockname()[1]}
    lines = ["A refused connection (pool timeout 5 s):"]
    own = pool(refused, max_size=20, timeout=5.0)
    other = psycopg_pool.ConnectionPool(
        kwargs=refused, connection_class=connection, min_size=0, max_size=20, timeout=5.0,
        open=True, reconnect_timeout=1.0,
    )  # fmt: skip
    try:
        for name, get in (("own Pool", own.get), ("psycopg_pool", other.getconn)):
            start = time.perf_counter()
            try:
                get()
            except Exception as exc:
                took = time.perf_counter() - start
                cause = str(exc).splitlines()[0][:90]
                lines.append(f"  {name:<14} {took:6.3f} s  {type(exc).__name__}: {cause}")
    finally:
        other.close()
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--cycles", type=int, default=500, help="cycles per pool per round")
    args = parser.parse_args(argv)
    try:
        import psycopg_pool
    except ImportError:
        print("psycopg_pool is not installed: nothing to compare.", file=sys.stderr)
        return 2

    from distlocks.testing.servers import ensure_test_servers

    _, database_url = ensure_test_servers(redis=False, postgres=True)
    _settings(database_url)

    from distlocks.backends.postgres import PostgresBackend
    from distlocks.backends.postgres.pool import Connection, Pool, ended_while_idle

    backend = PostgresBackend("pg", {"DATABASE": "default"})
    kwargs = backend._connect_kwargs()
    reply_timeout = PostgresBackend.DEFAULT_SOCKET_TIMEOUT
    size = PostgresBackend.DEFAULT_POOL_SIZE

    def configure(conn: Connection) -> None:
        conn.reply_timeout = reply_timeout  # the watchdog, as the own pool sets it

    def poll(conn: Connection) -> None:
        if ended_while_idle(conn):
            raise psycopg_pool.PoolTimeout("ended while idle")  # any error: replaced

    own = Pool(kwargs, max_size=size, timeout=5.0, reply_timeout=reply_timeout)
    control = Pool(kwargs, max_size=size, timeout=5.0, reply_timeout=reply_timeout)
    common: dict[str, Any] = {
        "kwargs": kwargs,
        "connection_class": Connection,
        "min_size": 1,
        "max_size": size,
        "timeout": 5.0,
        "configure": configure,
        "open": True,
    }
    checked = psycopg_pool.ConnectionPool(check=poll, name="poll-check", **common)
    plain = psycopg_pool.ConnectionPool(name="no-check", **common)
    checked.wait()
    plain.wait()
    for pool in (checked, plain):  # the watchdog is on for every pool's connections
        with pool.connection() as conn:
            assert conn.reply_timeout == reply_timeout, conn

    pools: dict[str, tuple[Callable[[], Connection], Callable[[Connection], None]]] = {
        "own Pool": (own.get, own.put),
        "own Pool, control": (control.get, control.put),
        "psycopg_pool, poll check": (checked.getconn, checked.putconn),
        "psycopg_pool, no check": (plain.getconn, plain.putconn),
    }
    params = {"key": backend.key("pool-compare")}

    def checkout(get: Callable[[], Connection], put: Callable[[Connection], None]) -> None:
        put(get())

    def lock_cycle(get: Callable[[], Connection], put: Callable[[Connection], None]) -> None:
        conn = get()
        conn.execute("SELECT pg_try_advisory_lock(%(key)s)", params).fetchone()
        conn.execute("SELECT pg_advisory_unlock(%(key)s)", params).fetchone()
        put(conn)

    cycles: dict[str, Callable[..., None]] = {"checkout": checkout, "lock cycle": lock_cycle}
    samples: dict[tuple[str, str], list[int]] = {
        (cycle, pool): [] for cycle in cycles for pool in pools
    }
    names = list(pools)
    try:
        for cycle_name, cycle in cycles.items():
            for get, put in pools.values():  # warm-up: connections made, statements prepared
                for _ in range(200):
                    cycle(get, put)
            for round_no in range(args.rounds):
                shift = round_no % len(names)
                for pool_name in names[shift:] + names[:shift]:
                    get, put = pools[pool_name]
                    out = samples[(cycle_name, pool_name)]
                    clock = time.perf_counter_ns
                    for _ in range(args.cycles):
                        start = clock()
                        cycle(get, put)
                        out.append(clock() - start)
    finally:
        own.close()
        control.close()
        checked.close()
        plain.close()

    print(_down_server(psycopg_pool, kwargs, Connection, Pool))
    print(f"{args.rounds} interleaved rounds x {args.cycles} cycles per pool; microseconds")
    print(f"{'cycle':<12} {'pool':<26} {'median':>8} {'p99':>8} {'vs own (median)':>16}")
    for cycle_name in cycles:
        base = statistics.median(samples[(cycle_name, "own Pool")]) / 1000
        for pool_name in names:
            data = samples[(cycle_name, pool_name)]
            median = statistics.median(data) / 1000
            p99 = _percentile(data, 0.99)
            ratio = f"{(median / base - 1) * 100:+.1f} %"
            print(f"{cycle_name:<12} {pool_name:<26} {median:>8.1f} {p99:>8.1f} {ratio:>16}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
