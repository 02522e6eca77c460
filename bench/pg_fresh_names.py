"""What a new lock name costs on a durable PostgreSQL: ``python -m bench.pg_fresh_names``.

Locks per entity (``payment:{id}``, ``order:{id}``) take each name once or a few times,
so the cost of a name's first acquisition is the cost of nearly every acquisition such
an application makes. This times, on the durable server of ``pg-cycle-durable``
(:mod:`bench.pg_durable`: ``fsync=on``), interleaved in blocks (the order rotating each
block), the raw advisory-lock pair (the floor), and ``lock()`` on the ``pg-durable`` alias
(``synchronous_commit=off``, the default) and on ``pg-durable-sync`` (``on``), each on
one name used over and over and on a new name every cycle. It prints the median wall
clock per cycle, its ratio to the floor, and the WAL the server wrote per cycle (each row
alone, from ``pg_current_wal_insert_lsn()``).

It uses only the public API and the bench's own server setup, so the same file measures
an older checkout too: ``PYTHONPATH=<checkout> python <this file>``; compare ratios to
the floor measured in the same run, not milliseconds across runs. Nothing is asserted.
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
from typing import Any

import psycopg

from bench.cli import positive
from bench.pg_durable import DurablePgFloor, durable_env, server_settings
from bench.postgres import bench_conninfo
from bench.run import _start
from distlocks import get_backend, lock

Variant = tuple[str, Callable[[], None]]
FLOOR = "floor: try + unlock"


def _variants(conn: Any, run: str) -> list[Variant]:
    key = {"key": 7_000_001}
    new_names = itertools.count()

    def floor() -> None:
        conn.execute("SELECT pg_try_advisory_lock(%(key)s)", key).fetchone()
        conn.execute("SELECT pg_advisory_unlock(%(key)s)", key).fetchone()

    def api(alias: str, fresh: bool) -> Callable[[], None]:
        def cycle() -> None:
            name = f"bench:{run}:{alias}:new:{next(new_names)}" if fresh else f"bench:{alias}"
            with lock(name, backend=alias, ttl=30, timeout=0):
                pass

        return cycle

    return [
        (FLOOR, floor),
        ("lock(), one name, sync off (default)", api("pg-durable", False)),
        ("lock(), a new name each cycle, sync off", api("pg-durable", True)),
        ("lock(), one name, sync on", api("pg-durable-sync", False)),
        ("lock(), a new name each cycle, sync on", api("pg-durable-sync", True)),
    ]


def _timed(variants: list[Variant], blocks: int, size: int) -> dict[str, float]:
    """title -> median wall us per cycle."""
    wall: dict[str, list[float]] = {title: [] for title, _ in variants}
    for _title, cycle in variants:  # warm-up: connections, prepared statements
        for _ in range(20):
            cycle()
    for block in range(blocks):
        shift = block % len(variants)
        for title, cycle in variants[shift:] + variants[:shift]:
            samples, perf = wall[title], time.perf_counter
            for _ in range(size):
                t0 = perf()
                cycle()
                samples.append(perf() - t0)
    return {t: statistics.median(s) * 1e6 for t, s in wall.items()}


def _wal_per_cycle(admin: Any, cycle: Callable[[], None], cycles: int) -> float:
    before = admin.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
    for _ in range(cycles):
        cycle()
    since = "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s::pg_lsn)"
    return float(admin.execute(since, (before,)).fetchone()[0]) / cycles


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pg_fresh_names", description=__doc__)
    parser.add_argument("--blocks", type=positive, default=20, help="interleaved blocks (20)")
    parser.add_argument("--block-size", type=positive, default=50, help="cycles per block (50)")
    args = parser.parse_args(argv)
    n = args.blocks * args.block_size
    run = f"{os.getpid()}-{time.time_ns()}"

    # Undone in reverse order, each step even if another failed: the servers last.
    with contextlib.ExitStack() as cleanup:
        started: list[Any] = []
        cleanup.callback(lambda: [server.close() for server in started])
        _start([DurablePgFloor], started)
        conn = psycopg.connect(bench_conninfo(durable_env()), autocommit=True)
        cleanup.callback(conn.close)
        for alias in ("pg-durable", "pg-durable-sync"):
            cleanup.callback(get_backend(alias).close)
        variants = _variants(conn, run)
        version = conn.execute("SHOW server_version").fetchone()[0]
        print(f"== Durable server: PostgreSQL {version}, {server_settings()}")
        print(
            f"== {args.blocks} blocks of {args.block_size} cycles, interleaved, {n:,} cycles"
            f" each; medians (load before {os.getloadavg()[0]:.2f})\n"
        )
        results = _timed(variants, args.blocks, args.block_size)
        load = os.getloadavg()[0]
        wal = {title: _wal_per_cycle(conn, cycle, min(n, 500)) for title, cycle in variants}
        floor = results[FLOOR]
        print(f"{'what runs':42} {'median us':>10} {'x floor':>8} {'WAL B/cycle':>12}")
        for title, wall in results.items():
            print(f"{title:42} {wall:10.1f} {wall / floor:7.2f}x {wal[title]:12.0f}")
        print(f"(load after the timed blocks {load:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
