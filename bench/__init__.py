"""Benchmarks of distlocks against the raw client floor and peer libraries.

Run with ``python -m bench`` (or ``make bench``). Every number is measured in the
same run, on the same throwaway servers, and reported as ratios, so the figures
can be compared across machines even though absolute times cannot.

The two extension points are registries, see :mod:`bench.base`:

* an implementation (a way of taking a lock) is one :class:`~bench.base.Implementation`
  subclass decorated with :func:`~bench.base.implementation`;
* a workload (a way of exercising implementations) is one
  :class:`~bench.base.Workload` subclass decorated with :func:`~bench.base.workload`.

A new module of either is named in :data:`bench.registry.MODULES`, the one module that
imports them all (and that none of them imports).
"""
