"""What ``single_execution`` costs per Celery task: implementations and workloads.

Issue 9's benchmark. Every implementation is one Celery task with the same
trivial body (:mod:`bench.celery_tasks`), wrapped differently:

* ``celery-plain``: a plain ``@app.task``, the floor of these workloads;
* ``celery-single``: ``single_execution`` with its defaults (a run lock only);
* ``celery-single-queued`` / ``celery-single-unique``: ``single_execution`` with
  ``unique_while="queued"`` / ``"queued_or_running"`` (a queue marker as well);
* ``celery-once`` / ``celery-singleton``: the two peers, which mark a task when it
  is enqueued and clear the mark after it ran (no lock around the run).

Three workloads, all on the benchmark's Redis, which is also the broker:

* ``celery-run``: ``task.apply()``, Celery's local execution through the same
  tracer and ``__call__`` a worker uses, so the run-side work (key, run lock,
  marker release, the peers' clean-up) is measured without a worker's noise;
* ``celery-enqueue``: ``task.apply_async()`` to the real broker, no worker: the
  enqueue-side work (key, marker, the check for a running task) plus the publish;
* ``celery-cycle``: both ends of one task in one thread: ``apply_async()`` to the
  broker, the message taken back from the queue and run as a worker runs it (its
  ``Request.execute()``, not eager), so a marker is taken at enqueue and let go by the
  run, as in production;
* ``celery-e2e``: tasks per second through one real worker (prefork, two
  processes), from the first publish to the last task's end; per task, the time
  the worker took to run it.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

from bench.base import (
    BenchError,
    Env,
    Implementation,
    Measurement,
    RunOptions,
    Workload,
    implementation,
    workload,
)
from bench.celery_names import BROKER_PREFIX, QUEUE, SINGLETON_PREFIX
from distlocks.testing.servers import _parent_death_signal

RUN, ENQUEUE, CYCLE, E2E = "celery-run", "celery-enqueue", "celery-cycle", "celery-e2e"
CELERY_WORKLOADS = frozenset({RUN, ENQUEUE, CYCLE, E2E})
#: Where the end-to-end tasks note their run and finish times (one list per round).
DONE_PREFIX = "bench:celery-e2e:"
# bench.settings.DISTLOCKS_KEY_PREFIX: that module is read only once the servers run.
DISTLOCKS_KEY_PREFIX = "distlocks-bench"


class CeleryTask(Implementation):
    """One way of wrapping the benchmark's trivial task; takes part only in the
    Celery workloads, and they only admit these."""

    family = "celery"
    servers = frozenset({"redis"})
    workloads = frozenset({RUN, ENQUEUE, CYCLE})
    distribution = "distlocks"
    #: Attribute of :mod:`bench.celery_tasks` holding the task.
    task_attr: ClassVar[str]
    #: The task run by the worker in ``celery-e2e`` (those taking part in it).
    e2e_task_attr: ClassVar[str] = ""
    #: Keys its ``apply_async()`` leaves (markers), removed after every enqueue round.
    marker_patterns: ClassVar[tuple[str, ...]] = ()

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        import redis

        from bench import celery_tasks

        self.app = celery_tasks.app
        self.task: Any = getattr(celery_tasks, self.task_attr)
        self.e2e_task: Any = (
            getattr(celery_tasks, self.e2e_task_attr) if self.e2e_task_attr else None
        )
        self.client = redis.Redis.from_url(env.redis_url)

    def delete_markers(self) -> None:
        """Remove the markers the last enqueue round left (no worker ever ran those tasks)."""
        for pattern in self.marker_patterns:
            keys = list(self.client.scan_iter(match=pattern, count=1000))
            for start in range(0, len(keys), 500):
                self.client.delete(*keys[start : start + 500])

    # Not a lock: the lock workloads never run these implementations.
    def try_acquire(self, name: str, ttl: float) -> Any | None:
        raise NotImplementedError(f"{self.name} runs Celery tasks; it takes no lock")

    def release(self, handle: Any) -> None:
        raise NotImplementedError(f"{self.name} runs Celery tasks; it takes no lock")

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> Any | None:
        raise NotImplementedError(f"{self.name} runs Celery tasks; it takes no lock")

    def close(self) -> None:
        from distlocks.handler import backends

        self.client.close()
        self.client.connection_pool.disconnect()
        backends.reset()


def _marker_pattern(task: str) -> str:
    # distlocks' queue markers: "<key prefix>:{celery:<task name>:<digest>:queued}:lock|fence".
    return f"{DISTLOCKS_KEY_PREFIX}:{{celery:{task}:*:queued}}:*"


@implementation
class CeleryPlain(CeleryTask):
    """A plain ``@app.task``: the floor of the Celery workloads."""

    name = "celery-plain"
    label = "plain @app.task"
    role = "floor"
    distribution = "celery"
    workloads = CELERY_WORKLOADS
    task_attr = "plain"
    e2e_task_attr = "plain_e2e"
    key_patterns = (f"{BROKER_PREFIX}*", f"{DONE_PREFIX}*")


@implementation
class CelerySingle(CeleryTask):
    """``@single_execution`` with its defaults: a run lock named from the arguments."""

    name = "celery-single"
    label = "single_execution (run lock)"
    role = "distlocks"
    reference = True
    workloads = CELERY_WORKLOADS
    task_attr = "single"
    e2e_task_attr = "single_e2e"
    key_patterns = (f"{DISTLOCKS_KEY_PREFIX}:*",)


@implementation
class CelerySingleQueued(CeleryTask):
    """``@single_execution(unique_while="queued")``: a queue marker taken by ``apply_async``.

    In ``celery-run`` (``task.apply()``: no marker to let go) its run side would be that
    of ``celery-single``, so it takes part in the enqueue and cycle workloads only.
    """

    name = "celery-single-queued"
    label = 'single_execution(unique_while="queued")'
    role = "distlocks"
    workloads = frozenset({ENQUEUE, CYCLE})
    task_attr = "single_queued"
    key_patterns = (f"{DISTLOCKS_KEY_PREFIX}:*",)
    marker_patterns = (_marker_pattern("bench.celery.single_queued"),)


@implementation
class CelerySingleUnique(CeleryTask):
    """``@single_execution(unique_while="queued_or_running")``: marker and running check."""

    name = "celery-single-unique"
    label = 'single_execution(unique_while="queued_or_running")'
    role = "distlocks"
    task_attr = "single_unique"
    key_patterns = (f"{DISTLOCKS_KEY_PREFIX}:*",)
    marker_patterns = (_marker_pattern("bench.celery.single_unique"),)


@implementation
class CeleryOnce(CeleryTask):
    """celery-once's ``QueueOnce`` (graceful): a marker at enqueue, deleted after the run."""

    name = "celery-once"
    label = "celery-once QueueOnce"
    role = "peer"
    distribution = "celery-once"
    task_attr = "once"
    key_patterns = ("qo_bench.celery.*",)
    marker_patterns = ("qo_bench.celery.once_*",)


@implementation
class CelerySingleton(CeleryTask):
    """celery-singleton's ``Singleton``: a marker at enqueue, deleted after the run."""

    name = "celery-singleton"
    label = "celery-singleton Singleton"
    role = "peer"
    distribution = "celery-singleton"
    task_attr = "singleton"
    key_patterns = (f"{SINGLETON_PREFIX}*",)
    marker_patterns = (f"{SINGLETON_PREFIX}*",)


class _CeleryWorkload(Workload):
    """A latency workload over the Celery tasks: one thread, rounds of a batch each."""

    metric = "latency"
    unit = "tasks"

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        self.iterations = options.iterations or (40 if options.quick else 5000)
        self.rounds = 1 if options.quick else 10
        self.batch = max(1, math.ceil(self.iterations / self.rounds))
        self.warm_up_iterations = 5 if options.quick else 300

    @classmethod
    def supports(cls, impl: type[Implementation]) -> bool:
        return issubclass(impl, CeleryTask) and super().supports(impl)

    def params(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "iterations": self.batch * self.rounds,
            "per_round": self.batch,
            "warm_up": self.warm_up_iterations,
        }


@workload
class CeleryRun(_CeleryWorkload):
    name = RUN
    title = "Celery task run overhead, task.apply() in-process"
    description = (
        "One thread runs a task with a trivial body through Celery's own execution path "
        "in-process (task.apply(): the tracer and the task's __call__, as in a worker), "
        "an argument that changes every call; plain @app.task (the floor here), "
        "single_execution, with and without a queue marker, and the peers. The time of "
        "each apply() call is one sample."
    )

    def measure(self, impl: Implementation, round_no: int) -> Measurement:
        assert isinstance(impl, CeleryTask)
        count = self.warm_up_iterations if round_no < 0 else self.batch
        apply = impl.task.apply
        clock = time.perf_counter_ns
        latencies = [0] * count
        began = clock()
        for i in range(count):
            started = clock()
            result = apply(args=(i,), throw=True)
            latencies[i] = clock() - started
            # A run skipped as a duplicate would return None: it must never happen here.
            if result.result != i:
                raise BenchError(f"{impl.name}: task({i}) returned {result.result!r}")
        return Measurement(latencies, count, (clock() - began) / 1e9)


@workload
class CeleryEnqueue(_CeleryWorkload):
    name = ENQUEUE
    title = "Celery enqueue overhead, apply_async() to the Redis broker"
    description = (
        "One thread publishes a task with apply_async() to the real Redis broker (no "
        "worker), with an argument that changes every call, so no call is a duplicate; "
        "the queue is purged and the markers removed after every round. The time of each "
        "apply_async() call is one sample."
    )

    def measure(self, impl: Implementation, round_no: int) -> Measurement:
        assert isinstance(impl, CeleryTask)
        count = self.warm_up_iterations if round_no < 0 else self.batch
        apply_async = impl.task.apply_async
        clock = time.perf_counter_ns
        latencies = [0] * count
        began = clock()
        for i in range(count):
            started = clock()
            apply_async(args=(i,))
            latencies[i] = clock() - started
        seconds = (clock() - began) / 1e9
        published = _purge(impl.app)
        impl.delete_markers()
        # Every call published: none was taken for a duplicate, none was lost.
        if published != count:
            raise BenchError(f"{impl.name}: {published} messages queued for {count} calls")
        return Measurement(latencies, count, seconds)


@workload
class CeleryCycle(_CeleryWorkload):
    name = CYCLE
    title = "Celery enqueue + run, apply_async() then the worker's execution in-process"
    description = (
        "One thread publishes a task with apply_async() to the real Redis broker, takes "
        "the message back from the queue (basic_get, no_ack) and runs it as a "
        "worker does, in-process: Celery's worker Request and its execute() (the tracer "
        "and the task's __call__, not eager). An argument that changes every call; one "
        "sample is the publish, the fetch and the run of one task."
    )

    def measure(self, impl: Implementation, round_no: int) -> Measurement:
        from celery.worker.request import Request

        assert isinstance(impl, CeleryTask)
        count = self.warm_up_iterations if round_no < 0 else self.batch
        task, app = impl.task, impl.app
        apply_async = task.apply_async
        clock = time.perf_counter_ns
        latencies = [0] * count
        with app.connection_for_read() as conn:
            channel = conn.default_channel
            began = clock()
            for i in range(count):
                started = clock()
                apply_async(args=(i,))
                # Acknowledged as it is taken: the broker's bookkeeping of unacknowledged
                # messages (two more round trips, the same in every row) stays out.
                message = channel.basic_get(QUEUE, no_ack=True)
                if message is None:
                    # Every call carries a new argument: none may be taken for a duplicate.
                    raise BenchError(f"{impl.name}: task({i}) was not queued")
                request = Request(message, app=app, task=task, hostname="distlocks-bench")
                result = request.execute()
                latencies[i] = clock() - started
                if result != i:
                    raise BenchError(f"{impl.name}: task({i}) returned {result!r}")
            seconds = (clock() - began) / 1e9
        left = _purge(app)
        impl.delete_markers()
        if left:
            raise BenchError(f"{impl.name}: {left} messages were left in the queue")
        return Measurement(latencies, count, seconds)


def _purge(app: Any) -> int:
    """Empty the benchmark's queue; the number of messages it held."""
    with app.connection_for_write() as conn:
        return int(conn.default_channel.queue_purge(QUEUE) or 0)


@workload
class CeleryEndToEnd(Workload):
    name = E2E
    title = "Celery end-to-end throughput, one worker (prefork, 2 processes)"
    metric = "throughput"
    unit = "tasks"
    description = (
        "One real worker (celery worker, prefork pool, concurrency 2, started once) runs "
        "a burst of tasks with a trivial body, published by the benchmark. Tasks per "
        "second from the first publish to the last finish; a task's sample is the time "
        "its worker process took to run it (Celery's task_prerun to task_postrun: the "
        "wrapper and the body, not the queueing)."
    )
    #: Seconds the worker may take to start before the run gives up.
    start_timeout = 90.0

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        # Bursts long enough that starting and draining a burst weigh little.
        self.rounds = 1 if options.quick else 5
        # With --iterations N, N/2 tasks in all, as many as by default for N = 5000.
        total = max(1, options.iterations // 2) if options.iterations else 0
        total = total or (20 if options.quick else 2500)
        self.tasks = max(1, math.ceil(total / self.rounds))
        self.warm_up_tasks = 10 if options.quick else 100
        # A round gives up below 20 tasks per second: something is wrong, not slow.
        self.round_timeout = max(60.0, self.tasks / 20)
        self.concurrency = 2
        self.worker: subprocess.Popen[bytes] | None = None
        self.workdir: Path | None = None
        self._round = 0

    @classmethod
    def supports(cls, impl: type[Implementation]) -> bool:
        return issubclass(impl, CeleryTask) and super().supports(impl)

    def params(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "tasks": self.tasks * self.rounds,
            "per_round": self.tasks,
            "warm_up": self.warm_up_tasks,
            "concurrency": self.concurrency,
            "pool": "prefork",
        }

    def setup(self, impls: list[Implementation]) -> None:
        first = impls[0]
        assert isinstance(first, CeleryTask)
        _purge(first.app)
        self.workdir = Path(tempfile.mkdtemp(prefix="distlocks-bench-celery-"))
        log = self.workdir / "worker.log"
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "bench.settings"}
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
        )
        with log.open("wb") as out:
            self.worker = subprocess.Popen(
                [
                    sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker",
                    "--pool=prefork", f"--concurrency={self.concurrency}", "-Q", QUEUE,
                    "--without-gossip", "--without-mingle", "--without-heartbeat",
                    "--loglevel=WARNING", f"--hostname=distlocks-bench@{os.getpid()}",
                ],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                # A benchmark killed before its teardown still takes its worker with it.
                preexec_fn=lambda: _parent_death_signal(signal.SIGTERM),
                start_new_session=True,
            )  # fmt: skip
        # The first task answered is the sign that the worker consumes.
        self._burst(first, 1, self.start_timeout, "worker start")

    def teardown(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)  # warm shutdown: children finish and exit
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                # The worker leads its own session: this reaches its pool processes too.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(10)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def warm_up(self, impl: Implementation) -> None:
        assert isinstance(impl, CeleryTask)
        self._burst(impl, self.warm_up_tasks, self.round_timeout, "warm-up")

    def measure(self, impl: Implementation, round_no: int) -> Measurement:
        assert isinstance(impl, CeleryTask)
        return self._burst(impl, self.tasks, self.round_timeout, f"round {round_no + 1}")

    def _burst(self, impl: CeleryTask, count: int, timeout: float, what: str) -> Measurement:
        """Publish ``count`` tasks, wait until all have finished, and time them."""
        self._round += 1
        done = f"{DONE_PREFIX}{os.getpid()}:{self._round}"
        client = impl.client
        client.delete(done)
        apply_async = impl.e2e_task.apply_async
        began = time.monotonic_ns()
        for n in range(count):
            apply_async(args=(done, n))
        deadline = time.monotonic() + timeout
        # Polled, not timed by the poll: each task notes its own finish time.
        while client.llen(done) < count:
            if self.worker is not None and self.worker.poll() is not None:
                raise BenchError(f"the Celery worker exited during {what}:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                raise BenchError(
                    f"{impl.name}: {client.llen(done)} of {count} tasks finished within "
                    f"{timeout:.0f}s ({what}); worker log:\n{self._log_tail()}"
                )
            time.sleep(0.005)
        runs = [0] * count
        finished = [0] * count
        entries: list[Any] = client.lrange(done, 0, -1)  # bytes: the client does not decode
        for entry in entries:
            n, took, at = (int(part) for part in entry.split(b":"))
            runs[n], finished[n] = took, at
        client.delete(done)
        missing = [n for n in range(count) if not finished[n]]
        if missing:
            raise BenchError(f"{impl.name}: tasks {missing[:10]} did not report ({what})")
        return Measurement(runs, count, (max(finished) - began) / 1e9)

    def _log_tail(self, lines: int = 30) -> str:
        if self.workdir is None:
            return ""
        try:
            text = (self.workdir / "worker.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
