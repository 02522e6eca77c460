"""The ``contended-*`` workloads: workers fighting over one lock, each holding it 1 ms.

Every worker loops: wait for the lock (the implementation's own blocking acquire), hold
it for ``HOLD`` seconds, release it, and start again at once, for a fixed time. The
samples are the waits; the headline is acquisitions per second over all workers, which
a lock can at best bring to ``1 / (HOLD + hand-off)``. The parameters give, per
implementation, that throughput as a fraction of ``1 / HOLD`` (the ideal with a free
hand-off) and the fairness: the acquisitions of the worker served least over those of
the worker served most (1.0: all equal; 0: one worker starved).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from bench.base import (
    BenchError,
    Implementation,
    Measurement,
    RunOptions,
    Workload,
    workload,
)
from bench.workers import QUICK_PROCESSES, TASKS, WorkerPool, close_pool, open_pool

#: How long each acquisition holds the lock.
HOLD = 0.001
#: Lease length: nothing expires during a round.
TTL = 30.0
#: The longest one wait may take before the worker counts a timeout and tries again.
WAIT = 10.0


def contend(impl: Implementation, name: str, start_at: float, stop_at: float) -> dict[str, Any]:
    """One worker's loop; its waits (ns) and how many it got."""
    clock = time.perf_counter_ns
    waits: list[int] = []
    timeouts = 0
    delay = start_at - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    while time.monotonic() < stop_at:
        started = clock()
        handle = impl.acquire_blocking(name, TTL, WAIT)
        if handle is None:
            timeouts += 1
            continue
        waits.append(clock() - started)
        time.sleep(HOLD)  # the critical section
        impl.release_contended(handle)
    return {"waits_ns": waits, "timeouts": timeouts, "ended_at": time.monotonic()}


def _task_contend(impl: Implementation, task: dict[str, Any]) -> dict[str, Any]:
    return contend(impl, task["name"], task["start_at"], task["start_at"] + task["duration"])


TASKS["contend"] = _task_contend


class _Contended(Workload):
    metric = "throughput"
    unit = "acquisition (1 ms hold)"

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        self.duration = 0.15 if options.quick else 3.0
        # Long enough to open every connection; a --quick run's figures mean nothing.
        self.warm_up_duration = 0.02 if options.quick else 0.2
        self.rounds = 1 if options.quick else 3
        self.details: dict[str, dict[str, Any]] = {}

    def params(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "workers": self.workers,
            "duration_s": self.duration,
            "hold_s": HOLD,
            **self.details,
        }

    def warm_up(self, impl: Implementation) -> None:
        self._run(impl, min(self.duration, self.warm_up_duration), -1)

    def measure(self, impl: Implementation, round_no: int) -> Measurement:
        return self._run(impl, self.duration, round_no)

    def _record(
        self, impl: Implementation, answers: list[dict[str, Any]], start: float
    ) -> Measurement:
        counts = [len(answer["waits_ns"]) for answer in answers]
        seconds = max(answer["ended_at"] for answer in answers) - start
        total = sum(counts)
        mine = self.details.setdefault(
            impl.name, {"fairness_by_round": [], "of_ideal_by_round": []}
        )
        mine["fairness_by_round"].append(round(min(counts) / max(max(counts), 1), 3))
        mine["of_ideal_by_round"].append(round(total / seconds * HOLD, 3))
        mine["timeouts"] = mine.get("timeouts", 0) + sum(a["timeouts"] for a in answers)
        waits = [value for answer in answers for value in answer["waits_ns"]]
        return Measurement(waits, total, seconds)

    def _run(self, impl: Implementation, duration: float, round_no: int) -> Measurement:
        raise NotImplementedError


@workload
class ContendedThreads(_Contended):
    name = "contended-threads"
    title = "Contended throughput, 8 threads on one lock, 1 ms hold"
    description = (
        "Eight threads of one process wait for the same lock, hold it 1 ms and release it, "
        "for a fixed time; acquisitions per second over all threads. Fairness and the "
        "fraction of the ideal (1 / hold) are in the parameters."
    )
    workers = 8

    def _run(self, impl: Implementation, duration: float, round_no: int) -> Measurement:
        name = f"bench:{impl.name}:contended-threads"
        answers: list[dict[str, Any]] = [{} for _ in range(self.workers)]
        errors: list[BaseException] = []
        ready = threading.Barrier(self.workers + 1)
        start_at = [0.0]

        def work(index: int) -> None:
            try:
                impl.thread_start()
                ready.wait()
                ready.wait()  # the runner set the start time in between
                answers[index] = contend(impl, name, start_at[0], start_at[0] + duration)
            except BaseException as exc:
                errors.append(exc)
                ready.abort()
            finally:
                impl.thread_done()

        threads = [
            threading.Thread(target=work, args=(i,), daemon=True) for i in range(self.workers)
        ]
        for thread in threads:
            thread.start()
        ready.wait()
        start_at[0] = time.monotonic() + 0.01
        ready.wait()
        for thread in threads:
            thread.join()
        if errors:
            raise BenchError(f"{impl.name}: a contending thread failed") from errors[0]
        if round_no < 0:
            return Measurement([], 0, duration)
        return self._record(impl, answers, start_at[0])


@workload
class ContendedProcesses(_Contended):
    name = "contended-processes"
    title = "Contended throughput, 4 processes on one lock, 1 ms hold"
    description = (
        "Four worker processes (spawned once, reused) wait for the same lock, hold it 1 ms "
        "and release it, for a fixed time; acquisitions per second over all processes. "
        "Fairness and the fraction of the ideal (1 / hold) are in the parameters."
    )
    workers = 4

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        self.pool: WorkerPool | None = None
        if options.quick:
            # The pool of throughput-processes' size: a --quick run spawns one, for both.
            self.workers = QUICK_PROCESSES
            self.title = f"Contended throughput, {self.workers} processes on one lock, 1 ms hold"

    def setup(self, impls: list[Implementation]) -> None:
        self.pool = open_pool(self.workers, self.options.quick)

    def teardown(self) -> None:
        if self.pool is not None:
            close_pool(self.pool, self.options.quick)
            self.pool = None

    def _run(self, impl: Implementation, duration: float, round_no: int) -> Measurement:
        assert self.pool is not None
        start_at = time.monotonic() + 0.1
        task = {
            "kind": "contend",
            "impl": impl.name,
            "name": f"bench:{impl.name}:contended-processes",
            "start_at": start_at,
            "duration": duration,
        }
        answers = self.pool.run([dict(task) for _ in range(len(self.pool))])
        if round_no < 0:
            return Measurement([], 0, duration)
        return self._record(impl, answers, start_at)
