"""What every implementation and workload builds on: a leaf of the bench package.

The classes (:class:`Implementation`, :class:`Workload`, :class:`Samples`...) and the
decorators that register them live here, and this module imports no other module of
the benchmark but :mod:`bench.stats` (itself a leaf), so any implementation or
workload module can import it without importing the others. Which modules make up
the benchmark, and in which order they register, is :mod:`bench.registry`'s business:
it imports them, and none of them imports it.

Adding an implementation is one class (see :mod:`bench.postgres` for real ones)::

    @implementation
    class SomePeer(Implementation):
        name = "some-peer"
        label = "some-peer Lock"
        role = "peer"
        family = "postgres"          # compared with the floor of this family
        servers = frozenset({"postgres"})

        def try_acquire(self, name, ttl): ...
        def release(self, handle): ...
        def acquire_blocking(self, name, ttl, timeout): ...

Adding a workload is one :class:`Workload` subclass with a ``measure()`` method,
decorated with :func:`workload`, in a module named in :data:`bench.registry.MODULES`.
The runner takes care of warm-up, of interleaving the implementations round-robin,
of statistics and of reporting.
"""

from __future__ import annotations

import gc
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any, ClassVar, Literal, TypeVar

from bench.stats import percentile
from distlocks.testing.servers import DATABASE_URL_ENV, REDIS_URL_ENV

#: Where the runner puts the connection string of the ZooKeeper server it started,
#: for Django's settings (:mod:`bench.settings`) and for the implementations.
ZOOKEEPER_ENV = "DISTLOCKS_BENCH_ZOOKEEPER"
#: The same for the etcd server's endpoint ("http://127.0.0.1:PORT").
ETCD_ENV = "DISTLOCKS_BENCH_ETCD"
#: The URL of the PostgreSQL with production settings the runner starts for the
#: ``pg-cycle-durable`` workload (see :mod:`bench.pg_durable`).
DURABLE_DATABASE_ENV = "DISTLOCKS_BENCH_DURABLE_DATABASE"

Role = Literal["floor", "distlocks", "peer"]
Metric = Literal["latency", "throughput"]


class BenchError(RuntimeError):
    """A benchmark could not run as designed (e.g. a lock that must be free was busy)."""


@dataclass(frozen=True)
class Env:
    """Where the servers are; the same in the runner and in its worker processes."""

    redis_url: str = ""
    database_url: str = ""
    #: A ZooKeeper connection string ("127.0.0.1:PORT"), only in runs that need it.
    zookeeper: str = ""
    #: An etcd endpoint ("http://127.0.0.1:PORT"), only in runs that need it.
    etcd: str = ""

    @classmethod
    def from_environ(cls) -> Env:
        return cls(
            redis_url=os.environ.get(REDIS_URL_ENV, ""),
            database_url=os.environ.get(DATABASE_URL_ENV, ""),
            zookeeper=os.environ.get(ZOOKEEPER_ENV, ""),
            etcd=os.environ.get(ETCD_ENV, ""),
        )


@dataclass(frozen=True)
class RunOptions:
    """The command-line knobs every workload sizes itself from."""

    quick: bool = False
    #: Overrides the cycle count (and, scaled down, the hand-off count).
    iterations: int | None = None


class Implementation(ABC):
    """One way of taking a lock, driven through the library's public API.

    Instances are created once per process and shared by the threads of a workload,
    so they hold only thread-safe state (clients, scripts), never a held lock.
    """

    #: Registry key, used on the command line, in JSON and in worker processes.
    name: ClassVar[str]
    #: What is measured, for the table ("redis-py Lock", ...).
    label: ClassVar[str]
    #: ``floor`` (the raw client doing the least a correct lock needs), ``distlocks``, ``peer``.
    role: ClassVar[Role]
    #: Implementations are compared with the floor of their own family.
    family: ClassVar[str]
    #: The throwaway servers it needs ("redis", "postgres", "postgres-durable",
    #: "zookeeper", "etcd").
    servers: ClassVar[frozenset[str]] = frozenset()
    #: Installed distribution whose version is recorded (None: nothing beyond redis-py).
    distribution: ClassVar[str | None] = None
    #: The distlocks row peers are compared against (one per family).
    reference: ClassVar[bool] = False
    #: Workloads it takes part in; None means every workload.
    workloads: ClassVar[frozenset[str] | None] = None
    #: Patterns of the keys it may leave behind for lock names starting ``bench:``.
    key_patterns: ClassVar[tuple[str, ...]] = ("bench:*",)

    def __init__(self, env: Env) -> None:
        self.env = env

    @classmethod
    def version(cls) -> str:
        if cls.distribution is None:
            return ""
        try:
            return version(cls.distribution)
        except PackageNotFoundError:
            return "not installed"

    @abstractmethod
    def try_acquire(self, name: str, ttl: float) -> Any | None:
        """Try once to take ``name`` for ``ttl`` seconds; a handle, or None when busy."""

    @abstractmethod
    def release(self, handle: Any) -> None:
        """Release what :meth:`try_acquire` or :meth:`acquire_blocking` returned."""

    @abstractmethod
    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> Any | None:
        """Wait up to ``timeout`` seconds for ``name``, the library's own way; None on timeout."""

    def release_contended(self, handle: Any) -> None:
        """Release while others wait in :meth:`acquire_blocking` (default: :meth:`release`)."""
        self.release(handle)

    def cycle(self, name: str, ttl: float) -> None:
        """One uncontended acquire + release, written the way a user of the library would."""
        handle = self.try_acquire(name, ttl)
        if handle is None:
            raise BenchError(f"{self.name}: lock {name!r} was busy in an uncontended cycle")
        self.release(handle)

    def thread_start(self) -> None:  # noqa: B027 - optional hook
        """Called by a workload's thread before its timed work: open per-thread resources
        (a connection), so that connecting never lands in a measurement."""

    def thread_done(self) -> None:  # noqa: B027 - optional hook
        """Called by a workload's thread as it ends: free what that thread opened."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free clients and connections."""


@dataclass
class Measurement:
    """What one implementation did in one round of one workload."""

    latencies_ns: list[int]
    #: Operations completed (equals len(latencies_ns) unless sampled).
    ops: int
    #: Wall-clock seconds the round took (throughput = ops / seconds).
    seconds: float


@dataclass
class Samples:
    """Every measurement of one implementation in one workload, across rounds."""

    latencies_ns: list[int] = field(default_factory=list)
    ops: int = 0
    seconds: float = 0.0
    round_medians_ns: list[float] = field(default_factory=list)
    round_rates: list[float] = field(default_factory=list)

    def add(self, measurement: Measurement) -> None:
        self.latencies_ns.extend(measurement.latencies_ns)
        self.ops += measurement.ops
        self.seconds += measurement.seconds
        if measurement.latencies_ns:
            self.round_medians_ns.append(percentile(sorted(measurement.latencies_ns), 50))
        if measurement.seconds > 0:
            self.round_rates.append(measurement.ops / measurement.seconds)


class Workload(ABC):
    """One way of exercising the implementations, measured in rounds.

    :meth:`run` warms every implementation up, then runs ``rounds`` rounds; each round
    measures every implementation once, in an order rotated by one each round, so
    no implementation always runs first (cold caches) or last (a warm, busy server).
    """

    name: ClassVar[str]
    title: ClassVar[str]
    #: ``latency``: the median is the headline; ``throughput``: operations per second is.
    metric: ClassVar[Metric] = "latency"
    #: What one operation is, for the throughput chart's axis ("tasks per second").
    unit: ClassVar[str] = "acquire+release"
    #: One paragraph for the docs and the JSON.
    description: ClassVar[str] = ""
    rounds: int = 1
    #: Only the implementations of this family run it (a workload of one server's own,
    #: such as ``zk-cycle``); None: every implementation that does not opt out.
    family: ClassVar[str | None] = None

    def __init__(self, options: RunOptions) -> None:
        self.options = options

    @classmethod
    def supports(cls, impl: type[Implementation]) -> bool:
        if cls.family is not None and impl.family != cls.family:
            return False
        return impl.workloads is None or cls.name in impl.workloads

    def params(self) -> dict[str, Any]:
        """The sizes this run used, recorded in the JSON."""
        return {"rounds": self.rounds}

    def setup(self, impls: list[Implementation]) -> None:  # noqa: B027 - optional hook
        """Prepare shared resources (worker processes, names) before warm-up."""

    def teardown(self) -> None:  # noqa: B027 - optional hook
        """Free what :meth:`setup` created; runs even when a round failed."""

    def warm_up(self, impl: Implementation) -> None:
        """Untimed work that opens connections and loads scripts (default: a short round)."""
        self.measure(impl, -1)

    @abstractmethod
    def measure(self, impl: Implementation, round_no: int) -> Measurement:
        """Measure ``impl`` once; ``round_no`` is -1 during warm-up."""

    def run(
        self,
        impls: list[Implementation],
        progress: Callable[[str], None] = lambda message: None,
    ) -> dict[str, Samples]:
        results = {impl.name: Samples() for impl in impls}
        self.setup(impls)
        try:
            for impl in impls:
                progress(f"{self.name}: warming up {impl.name}")
                self.warm_up(impl)
            if not self.options.quick:
                # What set-up and warm-up made lives to the end: frozen, it is not walked
                # again by the collection before each measurement (each took tens of ms).
                gc.collect()
                gc.freeze()
            for round_no in range(self.rounds):
                shift = round_no % len(impls)
                for impl in impls[shift:] + impls[:shift]:
                    progress(f"{self.name}: round {round_no + 1}/{self.rounds}, {impl.name}")
                    # A collection left over from the previous implementation's garbage
                    # would otherwise land in this one's timings. (Not in a --quick run,
                    # whose figures mean nothing: each collection costs tens of ms here.)
                    if not self.options.quick:
                        gc.collect()
                    results[impl.name].add(self.measure(impl, round_no))
        finally:
            gc.unfreeze()
            self.teardown()
        return results


IMPLEMENTATIONS: dict[str, type[Implementation]] = {}
WORKLOADS: dict[str, type[Workload]] = {}

ImplT = TypeVar("ImplT", bound=type[Implementation])
WorkloadT = TypeVar("WorkloadT", bound=type[Workload])


def implementation(cls: ImplT) -> ImplT:
    """Class decorator: register an implementation (table order = registration order)."""
    if cls.name in IMPLEMENTATIONS:
        raise ValueError(f"implementation {cls.name!r} is registered twice")
    IMPLEMENTATIONS[cls.name] = cls
    return cls


def workload(cls: WorkloadT) -> WorkloadT:
    """Class decorator: register a workload (run order = registration order)."""
    if cls.name in WORKLOADS:
        raise ValueError(f"workload {cls.name!r} is registered twice")
    WORKLOADS[cls.name] = cls
    return cls


def floor_of(family: str, names: Iterable[str]) -> str | None:
    """The floor implementation among ``names`` for ``family``."""
    for name in names:
        cls = IMPLEMENTATIONS[name]
        if cls.family == family and cls.role == "floor":
            return name
    return None


def reference_of(family: str, names: Iterable[str]) -> str | None:
    """The distlocks implementation among ``names`` that peers are compared with."""
    for name in names:
        cls = IMPLEMENTATIONS[name]
        if cls.family == family and cls.reference:
            return name
    return None
