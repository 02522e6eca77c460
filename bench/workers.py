"""Long-lived worker processes for the multi-process workloads.

The processes are spawned (not forked: the runner holds open connections and
threads) once per workload and reused for every implementation and round, so
interpreter and Django start-up never lands in a measurement. Each one builds
implementations on first use and runs the task functions of :data:`TASKS`; a
workload adds a task by adding a function there.

Each task carries its implementation's class and its task function (both pickled
by reference: the process imports the modules that define them), so this module
needs no registry, and the workloads that import it are never imported back.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from bench.base import IMPLEMENTATIONS, BenchError, Env, Implementation

#: How long the runner waits for one task's answer before giving up on the pool.
TASK_TIMEOUT = 120.0
#: Worker processes of every multi-process workload in a --quick run: one pool, spawned
#: once, serves them all (see :func:`open_pool`).
QUICK_PROCESSES = 2


def cycles_until(impl: Implementation, names: list[str], stop_at: float, ttl: float) -> list[int]:
    """Acquire + release ``names`` in turn until the monotonic clock passes ``stop_at``,
    at least once (a worker woken after the window closed, on a loaded machine during a
    --quick run's 50 ms window, still reports a cycle rather than an empty row).

    Returns the duration of every cycle in nanoseconds.
    """
    clock = time.perf_counter_ns
    monotonic = time.monotonic
    cycle = impl.cycle
    latencies: list[int] = []
    append = latencies.append
    count = len(names)
    i = 0
    while True:
        name = names[i % count]
        started = clock()
        cycle(name, ttl)
        append(clock() - started)
        i += 1
        if monotonic() >= stop_at:
            return latencies


def _task_cycles(impl: Implementation, task: dict[str, Any]) -> dict[str, Any]:
    names = [f"{task['prefix']}:{i}" for i in range(task["names"])]
    start_at, duration = task["start_at"], task["duration"]
    delay = start_at - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    latencies = cycles_until(impl, names, start_at + duration, task["ttl"])
    return {"latencies_ns": latencies, "ops": len(latencies), "ended_at": time.monotonic()}


TASKS: dict[str, Callable[[Implementation, dict[str, Any]], dict[str, Any]]] = {
    "cycles": _task_cycles,
}


def _serve(conn: Connection) -> None:
    """Worker process main loop: one request in, one ``(ok, payload)`` reply out."""
    import django

    django.setup()
    env = Env.from_environ()
    impls: dict[str, Implementation] = {}
    try:
        while True:
            task = conn.recv()
            if task is None:
                break
            try:
                impl = impls.get(task["impl"])
                if impl is None:
                    impl = impls[task["impl"]] = task["impl_class"](env)
                conn.send((True, task["function"](impl, task)))
            except Exception:
                conn.send((False, traceback.format_exc()))
    finally:
        for impl in impls.values():
            impl.close()
        conn.close()


class WorkerPool:
    """``size`` spawned processes, each given the same kind of task at the same time."""

    def __init__(self, size: int) -> None:
        context = multiprocessing.get_context("spawn")
        # The children configure Django from the same settings module as the runner.
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
        self._workers: list[tuple[Any, Connection]] = []
        for index in range(size):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=_serve, args=(child_end,), name=f"bench-worker-{index}", daemon=True
            )
            process.start()
            child_end.close()
            self._workers.append((process, parent_end))

    def __len__(self) -> int:
        return len(self._workers)

    def run(self, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Send ``tasks[i]`` to worker ``i`` and return their answers in order."""
        if len(tasks) != len(self._workers):
            raise ValueError(f"{len(tasks)} tasks for {len(self._workers)} workers")
        for (_, conn), task in zip(self._workers, tasks, strict=True):
            conn.send(
                {
                    **task,
                    "impl_class": IMPLEMENTATIONS[task["impl"]],
                    "function": TASKS[task["kind"]],
                }
            )
        answers = []
        for process, conn in self._workers:
            if not conn.poll(TASK_TIMEOUT):
                raise BenchError(f"{process.name} did not answer within {TASK_TIMEOUT:.0f}s")
            ok, payload = conn.recv()
            if not ok:
                raise BenchError(f"{process.name} failed:\n{payload}")
            answers.append(payload)
        return answers

    def close(self) -> None:
        for _, conn in self._workers:
            with contextlib.suppress(OSError):
                conn.send(None)
        for process, conn in self._workers:
            process.join(10)
            if process.is_alive():
                process.terminate()
                process.join(5)
            conn.close()
        self._workers = []


#: A --quick run's pools, by size, kept from one workload to the next (see open_pool()).
_QUICK_POOLS: dict[int, WorkerPool] = {}


def open_pool(size: int, quick: bool) -> WorkerPool:
    """A pool for a workload's setup, to be given back with :func:`close_pool`.

    A full run spawns a pool for each workload, so nothing of one workload's processes
    (connections, heap) carries into the next one's figures. A --quick run, whose
    figures mean nothing, spawns one pool of each size and reuses it: spawning a
    process and setting Django up in it costs about a second.
    """
    if not quick:
        return WorkerPool(size)
    if size not in _QUICK_POOLS:
        _QUICK_POOLS[size] = WorkerPool(size)
    return _QUICK_POOLS[size]


def close_pool(pool: WorkerPool, quick: bool) -> None:
    """End a pool from :func:`open_pool` (a --quick run's stays for the next workload)."""
    if not quick:
        pool.close()


def close_quick_pools() -> None:
    """End the pools a --quick run kept; the run calls this once it is over."""
    pools = list(_QUICK_POOLS.values())
    _QUICK_POOLS.clear()
    for pool in pools:
        pool.close()
