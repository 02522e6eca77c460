"""The workloads, one registered class each.

Lock names start with ``bench:`` and the implementation's name, so implementations
that use the name as it is (as a Redis key, or hashed to an advisory-lock key)
never meet each other's locks.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.base import (
    BenchError,
    Implementation,
    Measurement,
    RunOptions,
    Workload,
    workload,
)
from bench.workers import QUICK_PROCESSES, WorkerPool, close_pool, cycles_until, open_pool

#: Lease length of every lock taken; long enough that nothing expires mid-measurement.
TTL = 30.0

#: Rounds of the one-thread cycle workloads (this one and ``async-cycle``): many short
#: rounds rather than a few long ones. The machine's speed moves in steps (another
#: guest's load, the host's frequency): in the run of 2026-11-27 the floor's rounds
#: took 220 or 300 us, nothing in between. Each row's median is taken over all its
#: samples, so with 10 rounds one round more in the slow state (a step between two
#: rows of the same round) moved a row's ratio by 10-15% (distlocks 1.16x the floor,
#: 1.03x round by round); with 50 rounds of 100 cycles each row sees the machine's
#: states in nearly the same proportions (``python -m bench.rounds_simulation``: a
#: 1.03x row's ratio spreads over 0.94-1.12x with 10 rounds, 1.00-1.07x with 50).
#: Same cycles in all.
CYCLE_ROUNDS = 50


@workload
class Cycle(Workload):
    """One lock, one thread: acquire (try once) and release, again and again."""

    name = "cycle"
    title = "Uncontended acquire + release cycle"
    metric = "latency"
    description = (
        "One thread takes and releases the same free lock in a loop (try once, no wait). "
        "The time of each acquire+release pair is one sample."
    )

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        self.iterations = options.iterations or (40 if options.quick else 5000)
        self.rounds = 1 if options.quick else CYCLE_ROUNDS
        self.batch = max(1, math.ceil(self.iterations / self.rounds))
        self.warm_up_iterations = 5 if options.quick else 300

    def params(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "iterations": self.batch * self.rounds,
            "per_round": self.batch,
            "warm_up": self.warm_up_iterations,
            "ttl_s": TTL,
        }

    def measure(self, impl: Implementation, round_no: int) -> Measurement:
        count = self.warm_up_iterations if round_no < 0 else self.batch
        name = f"bench:{impl.name}:cycle"
        clock = time.perf_counter_ns
        cycle = impl.cycle
        latencies = [0] * count
        began = clock()
        for i in range(count):
            started = clock()
            cycle(name, TTL)
            latencies[i] = clock() - started
        return Measurement(latencies, count, (clock() - began) / 1e9)


class _Throughput(Workload):
    """Several workers cycling over many distinct (never contended) names for a fixed time."""

    metric = "throughput"
    names_per_worker = 256

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        self.workers = QUICK_PROCESSES if options.quick else 4
        self.duration = 0.05 if options.quick else 0.5
        self.rounds = 1 if options.quick else 5

    def params(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "workers": self.workers,
            "duration_s": self.duration,
            "names_per_worker": self.names_per_worker,
            "ttl_s": TTL,
        }

    def warm_up(self, impl: Implementation) -> None:
        self._run(impl, min(self.duration, 0.1))

    def measure(self, impl: Implementation, round_no: int) -> Measurement:
        return self._run(impl, self.duration)

    def _run(self, impl: Implementation, duration: float) -> Measurement:
        raise NotImplementedError


@workload
class ThroughputThreads(_Throughput):
    name = "throughput-threads"
    title = "Throughput, distinct locks, threads in one process"
    description = (
        "Several threads of one process each acquire+release their own names (256 per "
        "thread, never contended) for a fixed time; operations per second over all threads."
    )

    def _run(self, impl: Implementation, duration: float) -> Measurement:
        results: list[list[int]] = [[] for _ in range(self.workers)]
        ends = [0.0] * self.workers
        errors: list[BaseException] = []
        window: dict[str, float] = {}

        def open_window() -> None:
            # Runs once every thread has opened its connections; a short margin lets
            # all of them leave the barrier before the clock starts.
            window["start_at"] = time.monotonic() + 0.01
            window["stop_at"] = window["start_at"] + duration

        ready = threading.Barrier(self.workers, action=open_window)

        def work(index: int) -> None:
            names = [f"bench:{impl.name}:tp:t{index}:{i}" for i in range(self.names_per_worker)]
            try:
                impl.thread_start()
                ready.wait()
                time.sleep(max(0.0, window["start_at"] - time.monotonic()))
                results[index] = cycles_until(impl, names, window["stop_at"], TTL)
            except BaseException as exc:
                errors.append(exc)
                ready.abort()
            finally:
                ends[index] = time.monotonic()
                impl.thread_done()

        threads = [
            threading.Thread(target=work, args=(i,), name=f"bench-tp-{i}", daemon=True)
            for i in range(self.workers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise BenchError(f"{impl.name}: a throughput thread failed") from errors[0]
        latencies = [value for chunk in results for value in chunk]
        return Measurement(latencies, len(latencies), max(ends) - window["start_at"])


@workload
class ThroughputProcesses(_Throughput):
    name = "throughput-processes"
    title = "Throughput, distinct locks, separate processes"
    description = (
        "Several worker processes (spawned once, reused) each acquire+release their own "
        "names for a fixed time, starting together; operations per second over all processes."
    )

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        self.pool: WorkerPool | None = None

    def setup(self, impls: list[Implementation]) -> None:
        self.pool = open_pool(self.workers, self.options.quick)

    def teardown(self) -> None:
        if self.pool is not None:
            close_pool(self.pool, self.options.quick)
            self.pool = None

    def _run(self, impl: Implementation, duration: float) -> Measurement:
        assert self.pool is not None
        # A margin for the tasks to reach every process before the common start.
        start_at = time.monotonic() + 0.1
        answers = self.pool.run(
            [
                {
                    "kind": "cycles",
                    "impl": impl.name,
                    "prefix": f"bench:{impl.name}:tp:p{index}",
                    "names": self.names_per_worker,
                    "start_at": start_at,
                    "duration": duration,
                    "ttl": TTL,
                }
                for index in range(len(self.pool))
            ]
        )
        latencies = [value for answer in answers for value in answer["latencies_ns"]]
        ended = max(answer["ended_at"] for answer in answers)
        return Measurement(latencies, len(latencies), ended - start_at)


class _HandOffRound:
    """State shared by the threads of one hand-off round.

    Every participant loops: wait for the lock (the implementation's own way),
    hold it briefly, note the time, release it, then wait until someone *else* has
    been granted it before queueing again, so each sample is a real hand-off to a
    thread that was already waiting.
    """

    def __init__(self, impl: Implementation, name: str, handoffs: int, deadline: float) -> None:
        self.impl = impl
        self.name = name
        self.handoffs = handoffs
        self.deadline = deadline
        self.cond = threading.Condition()
        self.grants = 0
        self.released_at: int | None = None
        self.samples: list[int] = []
        self.done = False
        self.errors: list[BaseException] = []

    def _handed_on(self, grant: int) -> Callable[[], bool]:
        """Predicate: someone was granted the lock after grant number ``grant``."""
        return lambda: self.grants > grant or self.done

    def participant(self, ready: threading.Barrier, hold: float, settle: float) -> None:
        try:
            self.impl.thread_start()
            ready.wait()
            self._loop(hold, settle)
        except BaseException as exc:
            ready.abort()
            with self.cond:
                self.errors.append(exc)
                self.done = True
                self.cond.notify_all()
        finally:
            self.impl.thread_done()

    def _loop(self, hold: float, settle: float) -> None:
        impl, cond = self.impl, self.cond
        while True:
            with cond:
                if self.done:
                    return
            handle = impl.acquire_blocking(self.name, TTL, HandOff.acquire_timeout)
            granted_at = time.perf_counter_ns()
            if handle is None:
                if time.monotonic() > self.deadline:
                    return
                continue
            with cond:
                if self.released_at is not None and not self.done:
                    self.samples.append(granted_at - self.released_at)
                self.released_at = None
                self.grants += 1
                grant = self.grants
                if len(self.samples) >= self.handoffs or time.monotonic() > self.deadline:
                    self.done = True
                done = self.done
                cond.notify_all()
            if done:
                # Still the waking release, so the remaining waiters drain quickly.
                impl.release_contended(handle)
                return
            # The first holder gives everyone time to start waiting.
            time.sleep(settle if grant == 1 else hold)
            with cond:
                self.released_at = time.perf_counter_ns()
            impl.release_contended(handle)
            with cond:
                cond.wait_for(self._handed_on(grant), timeout=30)


@workload
class HandOff(Workload):
    """16 waiters on one lock: time from a release to the next grant."""

    name = "handoff"
    title = "Contended hand-off latency, 16 waiters"
    metric = "latency"
    description = (
        "17 threads share one lock: one holds it, 16 wait in the library's own blocking "
        "acquire. The holder keeps it 1 ms, releases, and does not queue again until "
        "another thread has it. A sample is the time from the start of release() to "
        "the return of the next acquire."
    )
    acquire_timeout = 10.0

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        self.waiters = 16
        if options.iterations:
            total = max(4, options.iterations // 20)
        else:
            total = 6 if options.quick else 300
        self.rounds = 1 if options.quick else 6
        self.per_round = max(1, math.ceil(total / self.rounds))
        self.hold = 0.001
        self.settle = 0.02 if options.quick else 0.05
        self.round_timeout = 15.0 if options.quick else 45.0

    def params(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "waiters": self.waiters,
            "handoffs": self.per_round * self.rounds,
            "per_round": self.per_round,
            "hold_s": self.hold,
            "settle_s": self.settle,
            "ttl_s": TTL,
        }

    def warm_up(self, impl: Implementation) -> None:
        # Load scripts and open a connection; contended rounds open the rest before
        # their first release, while every participant makes its first attempt.
        name = f"bench:{impl.name}:handoff-warm"
        for _ in range(5):
            handle = impl.acquire_blocking(name, TTL, self.acquire_timeout)
            if handle is None:
                raise BenchError(f"{impl.name}: a free lock was not granted during warm-up")
            impl.release_contended(handle)

    def measure(self, impl: Implementation, round_no: int) -> Measurement:
        name = f"bench:{impl.name}:handoff"
        began = time.monotonic()
        state = _HandOffRound(impl, name, self.per_round, began + self.round_timeout)
        ready = threading.Barrier(self.waiters + 1)
        threads = [
            threading.Thread(
                target=state.participant,
                args=(ready, self.hold, self.settle),
                name=f"bench-handoff-{i}",
                daemon=True,
            )
            for i in range(self.waiters + 1)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.round_timeout + 2 * self.acquire_timeout)
        if state.errors:
            raise BenchError(f"{impl.name}: a hand-off thread failed") from state.errors[0]
        if any(thread.is_alive() for thread in threads):
            raise BenchError(f"{impl.name}: hand-off threads did not finish")
        if len(state.samples) < self.per_round:
            raise BenchError(
                f"{impl.name}: only {len(state.samples)} of {self.per_round} hand-offs "
                f"within {self.round_timeout:.0f}s"
            )
        return Measurement(state.samples, len(state.samples), time.monotonic() - began)
