"""What the public API adds over the backend, per backend: ``python -m bench.profile_lease``.

For each backend (in-process ``locmem``, Redis, PostgreSQL's fast server) this times the
uncontended cycle three ways, interleaved in blocks (the order rotating each block):

* ``backend``: ``backend.acquire`` + ``backend.release`` (``aacquire`` / ``arelease``
  for the asyncio rows), with a fresh owner and the caller's holder record, as
  :func:`~distlocks.locks.acquire_lease` calls them;
* ``lock()``: ``with lock(name, backend=alias, ttl=30, timeout=0): pass`` (default
  options: renewed, release at COMMIT);
* ``alock()``: ``async with alock(...)``, against the asyncio backend row;
* ``floor``, ``async floor`` (Redis): the benchmark's floors, redis-py's ``SET NX
  PX`` and a compare-and-delete script, for the client CPU of a cycle with nothing on top;
* ``floor`` (PostgreSQL): the benchmark's ``pg-floor``, ``pg_try_advisory_lock`` and
  ``pg_advisory_unlock`` through a psycopg cursor; ``statements``: the backend's own two
  statements (the acquire try with its registry write, the guarded unlock), prepared
  and sent with ``psycopg.pq`` on a bare connection, their parameters encoded once: the
  backend's server work with no Python layer on top (so ``backend`` minus
  ``statements`` is the backend's own client cost: pool, watchdog, parameters, lease
  record).

The figure that matters is the *client CPU* per cycle of the calling thread
(``time.thread_time()``), over all blocks and in the block that took least (``least``:
others' load only ever adds to it, so it is the steadiest on a busy machine), and of the
whole process (``time.process_time()``, ``process``: the reply watchdog's and the
renewer's threads too). The layer column gives both, lock() minus backend. The
server's work is the same in the backend and the lock() rows, so the difference of their
CPU columns is the cost of the Lock/Lease layer, and it holds under load far better than
wall-clock differences do.
The median wall clock per block is printed too, and two counts that load does not move
(Linux, from ``/proc``): ``sleeps``, the calling thread's voluntary context switches per
cycle (a round trip is one: more means it also waited for a lock, the interpreter's
included), and ``wakes``, the other threads' (renewer, reply watchdog, pool) per cycle:
a thread woken on every cycle would take the interpreter lock while the caller's reply
is ready. ``--profile`` adds a ``cProfile`` of
the lock() cycle on the backend named (default: the in-process one, where nothing but
the layer and the backend runs), functions by own time. Nothing is asserted; the
figures are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.cli import positive

#: A variant runs ``n`` cycles when called with ``n``.
Variant = tuple[str, Callable[[int], None]]
NAME = "bench:profile-lease"
BACKENDS = ("locmem", "default", "pg")


def _variants(alias: str, loop: asyncio.AbstractEventLoop) -> list[Variant]:
    from distlocks import alock, get_backend, lock
    from distlocks.locks import current_holder, new_owner

    backend = get_backend(alias)
    name = f"{NAME}:{alias}"

    def backend_cycles(n: int) -> None:
        acquire, release = backend.acquire, backend.release
        for _ in range(n):
            owner = new_owner()
            acquire(name + ":backend", owner, 30.0, current_holder())
            release(name + ":backend", owner)

    def lock_cycles(n: int) -> None:
        for _ in range(n):
            with lock(name + ":lock", backend=alias, ttl=30, timeout=0):
                pass

    async def abackend(n: int) -> None:
        acquire, release = backend.aacquire, backend.arelease
        for _ in range(n):
            owner = new_owner()
            await acquire(name + ":abackend", owner, 30.0, current_holder())
            await release(name + ":abackend", owner)

    async def alock_(n: int) -> None:
        for _ in range(n):
            async with alock(name + ":alock", backend=alias, ttl=30, timeout=0):
                pass

    variants = [
        (f"{alias}: backend", backend_cycles),
        (f"{alias}: lock()", lock_cycles),
        (f"{alias}: async backend", lambda n: loop.run_until_complete(abackend(n))),
        (f"{alias}: alock()", lambda n: loop.run_until_complete(alock_(n))),
    ]
    if alias == "default":
        variants += _redis_floors(name, loop)
    elif alias == "pg":
        variants += _pg_floors(name)
    return variants


def _pg_floors(name: str) -> list[Variant]:
    """The benchmark's ``pg-floor`` cycle, and the backend's two statements with nothing
    on top (``psycopg.pq``, prepared once, parameters encoded once), each on a
    connection of its own."""
    import psycopg

    from bench.base import Env
    from bench.postgres import PgFloor, bench_conninfo
    from distlocks import get_backend
    from distlocks.backends.postgres import session
    from distlocks.locks import current_holder, new_owner

    env = Env.from_environ()
    floor = PgFloor(env)
    conn = psycopg.connect(bench_conninfo(env), autocommit=True)
    # As the backend's own lock connections run (OPTIONS["synchronous_commit"]).
    conn.execute("SET synchronous_commit = off")
    pgconn = conn.pgconn
    for statement in (session.ACQUIRE_TRY, session.UNLOCK):
        pgconn.prepare(statement.name, statement.query, statement.types)
    backend: Any = get_backend("pg")
    named = backend._named(name + ":statements")
    try_args = backend._try_args(named, new_owner(), 30.0, current_holder())
    acquire, unlock = session.ACQUIRE_TRY.name, session.UNLOCK.name

    def floor_cycles(n: int) -> None:
        key = name + ":floor"
        for _ in range(n):
            handle = floor.try_acquire(key, 30.0)
            assert handle is not None, "the floor's lock was busy"
            floor.release(handle)

    def statement_cycles(n: int) -> None:
        for _ in range(n):
            token = pgconn.exec_prepared(acquire, try_args).get_value(0, 0)
            assert token is not None, "the statements' lock was busy"
            pgconn.exec_prepared(unlock, named.unlock_args).get_value(0, 0)

    return [("pg: floor", floor_cycles), ("pg: statements", statement_cycles)]


def _redis_floors(name: str, loop: asyncio.AbstractEventLoop) -> list[Variant]:
    """The benchmark's Redis floors (``floor``, ``async-floor``), for the client CPU a
    cycle costs with nothing on top of redis-py: SET NX PX and a compare-and-delete."""
    import redis
    import redis.asyncio

    from bench.base import Env
    from bench.implementations import _COMPARE_AND_DELETE

    url = Env.from_environ().redis_url
    client = redis.Redis.from_url(url)
    release = client.register_script(_COMPARE_AND_DELETE)
    aclient = redis.asyncio.Redis.from_url(url)
    arelease = aclient.register_script(_COMPARE_AND_DELETE)
    key = name + ":floor"

    def floor_cycles(n: int) -> None:
        for _ in range(n):
            token = os.urandom(16).hex()
            client.set(key, token, nx=True, px=30000)
            release(keys=[key], args=[token])

    async def afloor(n: int) -> None:
        for _ in range(n):
            token = os.urandom(16).hex()
            await aclient.set(key, token, nx=True, px=30000)
            await arelease(keys=[key], args=[token])

    return [
        ("default: floor", floor_cycles),
        ("default: async floor", lambda n: loop.run_until_complete(afloor(n))),
    ]


def _switches() -> dict[int, int]:
    """Voluntary context switches so far of each thread of this process, by native id
    (empty where /proc is not there)."""
    found: dict[int, int] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/status") as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches:"):
                        found[int(tid)] = int(line.split()[1])
                        break
        except OSError:
            continue  # the thread ended meanwhile
    return found


def _timed(
    variants: list[Variant], blocks: int, size: int
) -> dict[str, tuple[float, float, float, float, float, float]]:
    """title -> (median wall us per cycle over the blocks, thread CPU us per cycle over
    all blocks, and in the block that took least, process CPU us per cycle over all
    blocks, the calling thread's and the other threads' voluntary context switches per
    cycle). Other processes only ever add to a block's CPU time (cache misses,
    frequency), so the least is the steadiest figure on a loaded machine."""
    wall: dict[str, list[float]] = {title: [] for title, _ in variants}
    cpu: dict[str, list[float]] = {title: [] for title, _ in variants}
    process: dict[str, list[float]] = {title: [] for title, _ in variants}
    sleeps: dict[str, int] = dict.fromkeys(wall, 0)
    wakes: dict[str, int] = dict.fromkeys(wall, 0)
    me = threading.get_native_id()
    for _title, cycles in variants:  # warm-up: connections opened, scripts loaded
        cycles(50)
    for block in range(blocks):
        shift = block % len(variants)
        for title, cycles in variants[shift:] + variants[:shift]:
            before = _switches()
            c0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
            cycles(size)
            wall[title].append((time.perf_counter() - w0) / size)
            cpu[title].append((time.thread_time() - c0) / size)
            process[title].append((time.process_time() - p0) / size)
            for tid, count in _switches().items():
                moved = count - before.get(tid, 0)
                if tid == me:
                    sleeps[title] += moved
                else:
                    wakes[title] += moved
    n = blocks * size
    return {
        t: (
            statistics.median(wall[t]) * 1e6,
            statistics.mean(cpu[t]) * 1e6,
            min(cpu[t]) * 1e6,
            statistics.mean(process[t]) * 1e6,
            sleeps[t] / n,
            wakes[t] / n,
        )
        for t in wall
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_lease", description=__doc__)
    parser.add_argument("--blocks", type=positive, default=20, help="interleaved blocks (20)")
    parser.add_argument("--block-size", type=positive, default=200, help="cycles per block")
    parser.add_argument(
        "--backend", action="append", choices=BACKENDS, help="only these (repeatable)"
    )
    parser.add_argument(
        "--profile", nargs="?", const="locmem", choices=BACKENDS, help="cProfile lock() there"
    )
    args = parser.parse_args(argv)
    aliases = args.backend or list(BACKENDS)

    from bench.implementations import Distlocks
    from bench.postgres import PgFloor
    from bench.run import _start

    needed: list[Any] = [Distlocks] + ([PgFloor] if "pg" in aliases else [])
    with contextlib.ExitStack() as cleanup:
        started: list[Any] = []
        cleanup.callback(lambda: [server.close() for server in started])
        _start(needed, started)
        from django.conf import settings

        # The bench settings have no in-process backend: add one for this run.
        settings.DISTLOCKS_BACKENDS["locmem"] = {
            "BACKEND": "distlocks.backends.locmem.LocMemBackend"
        }
        from distlocks.handler import backends

        cleanup.callback(backends.reset)
        loop = asyncio.new_event_loop()
        cleanup.callback(loop.close)
        variants = [v for alias in aliases for v in _variants(alias, loop)]
        n = args.blocks * args.block_size
        print(
            f"== lock() over the backend: {args.blocks} blocks of {args.block_size} cycles, "
            f"interleaved, {n:,} cycles each (load before {os.getloadavg()[0]:.2f})\n"
        )
        results = _timed(variants, args.blocks, args.block_size)
        print(
            f"{'what runs':28} {'wall us':>8} {'CPU us':>8} {'least':>8} {'process':>8}"
            f" {'sleeps':>7} {'wakes':>7} {'layer CPU us':>13}"
        )
        for alias in aliases:
            rows = [(t, r) for t, r in results.items() if t.startswith(f"{alias}:")]
            base = {
                "lock()": results[f"{alias}: backend"],
                "alock()": results[f"{alias}: async backend"],
            }
            for title, (w, c, least, proc, sleeps, wakes) in rows:
                kind = title.split(": ", 1)[1]
                layer = ""
                if kind in base:
                    layer = f"{c - base[kind][1]:6.1f} {least - base[kind][2]:6.1f}"
                print(
                    f"{title:28} {w:8.1f} {c:8.1f} {least:8.1f} {proc:8.1f}"
                    f" {sleeps:7.3f} {wakes:7.3f} {layer:>13}"
                )
        print(f"(load after {os.getloadavg()[0]:.2f}; us per cycle)")
        if args.profile:
            from bench.profile_save import _by_function, _calls_per_save

            cycles = min(2000, n)
            alias = args.profile
            lock_cycles = dict(_variants(alias, loop))[f"{alias}: lock()"]
            per_cycle, stats = _calls_per_save(lambda: lock_cycles(1), cycles)
            print(f"\n== cProfile of {cycles:,} lock() cycles on {alias}: {per_cycle:.0f} calls")
            print(f"  {'calls':>6} {'own us':>7} {'cum us':>7}  function")
            functions = sorted(_by_function(stats, cycles).items(), key=lambda kv: -kv[1][1])
            for func, (calls, own, cumulative) in functions[:40]:
                print(f"  {calls:6.1f} {own:7.1f} {cumulative:7.1f}  {func}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
