"""Prometheus metrics, on with ``DISTLOCKS_METRICS = True`` (extra ``prometheus``).

:func:`install` (called by ``AppConfig.ready()`` when the setting is on) connects
receivers to the distlocks signals and registers a collector that reads the live
locks of every backend when Prometheus scrapes. Only this module imports
``prometheus_client``: ``import distlocks`` never needs it.

Lock names are never labels (there may be millions); labels are the backend alias,
the result or outcome, and the model of a rejected fenced write.

========================================== ======================================
``distlocks_acquisitions_total``           acquisitions by ``backend``, ``result``
                                           (acquired / not_acquired / error)
``distlocks_acquire_wait_seconds``         time spent acquiring, by ``backend``,
                                           ``result``
``distlocks_hold_seconds``                 how long leases were held, by
                                           ``backend``, ``outcome`` (released / lost)
``distlocks_leases_lost_total``            leases that ended before their release
``distlocks_fencing_rejections_total``     fenced writes refused, by ``model``
``distlocks_force_releases_total``         operator force releases, by ``backend``,
                                           ``via`` (admin / command)
``distlocks_live_locks``                   live locks now, by ``backend``, ``status``
``distlocks_oldest_lock_age_seconds``      the longest-held live lock, by ``backend``
``distlocks_backend_up``                   1 if the backend could be listed, else 0
``distlocks_renewal_lateness_seconds``     how late recent renewals ran against their
                                           schedule, by ``backend``, ``quantile``
                                           (0.5, 0.99); late by more than two thirds
                                           of a ttl is a lost lease
``distlocks_renewal_turns``                renewal turns taken (one lease or a batch),
                                           by ``backend``
========================================== ======================================

A backend that cannot list its locks (it does not declare the ``Listing`` capability)
has no ``distlocks_live_locks``, ``distlocks_oldest_lock_age_seconds`` or
``distlocks_backend_up`` series: it is not down, it cannot be counted.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Iterable
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse

from distlocks import livelocks, renewal, signals
from distlocks.exceptions import LockNotAcquired

try:
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        REGISTRY,
        CollectorRegistry,
        Counter,
        Histogram,
        generate_latest,
    )
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImproperlyConfigured(
        "DISTLOCKS_METRICS = True needs prometheus_client: pip install 'distlocks[prometheus]'."
    ) from exc

logger = logging.getLogger(__name__)

#: Waits: from an uncontended grant (about a millisecond) to long queues.
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
#: Holds: from a quick critical section to an hours-long job.
HOLD_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 1800, 3600, 14400)


class LiveLocksCollector(Collector):
    """Reads every backend's live locks at scrape time (nothing between scrapes)."""

    def describe(self) -> Iterable[GaugeMetricFamily]:
        # Declared without samples, so registering does not read the backends.
        return self._families()

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "distlocks_live_locks",
                "Live locks by backend and status.",
                labels=["backend", "status"],
            ),
            GaugeMetricFamily(
                "distlocks_oldest_lock_age_seconds",
                "How long the longest-held live lock has been held.",
                labels=["backend"],
            ),
            GaugeMetricFamily(
                "distlocks_backend_up",
                "1 if the backend's live locks could be listed at this scrape, else 0.",
                labels=["backend"],
            ),
        )

    def collect(self) -> Iterable[GaugeMetricFamily]:
        live, oldest, up = self._families()
        # Counted as the listing streams by, nothing kept (livelocks.tally): exact at
        # any number of locks, in memory that does not grow with them.
        counted = livelocks.tally()
        for alias in counted.aliases:
            if alias in counted.unlisted:
                continue  # it cannot list its locks: no numbers, and it is not down
            healthy = alias not in counted.errors
            up.add_metric([alias], 1.0 if healthy else 0.0)
            if not healthy:
                continue  # no numbers rather than misleading zeros
            for status, count in counted.counts[alias].items():
                live.add_metric([alias, status], float(count))
            oldest.add_metric([alias], counted.oldest[alias])
        return (live, oldest, up)


class RenewalCollector(Collector):
    """Reads the renewers' recent lateness at scrape time (in memory, no I/O)."""

    def describe(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        return self._families()

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, CounterMetricFamily]:
        return (
            GaugeMetricFamily(
                "distlocks_renewal_lateness_seconds",
                "How late recent lease renewals ran against their schedule (quantiles of "
                "the last renewals of this process).",
                labels=["backend", "quantile"],
            ),
            CounterMetricFamily(
                "distlocks_renewal_turns",
                "Renewal turns taken by this process (one lease, or a batch due together).",
                labels=["backend"],
            ),
        )

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        late, turns = self._families()
        for alias, numbers in sorted(renewal.lateness().items()):
            late.add_metric([alias, "0.5"], numbers["p50"])
            late.add_metric([alias, "0.99"], numbers["p99"])
            turns.add_metric([alias], numbers["turns"])
        return (late, turns)


class Metrics:
    """The metric objects of one registry, and the signal receivers that feed them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.acquisitions = Counter(
            "distlocks_acquisitions",
            "Lock acquisitions by result (acquired, not_acquired, error).",
            ["backend", "result"],
            registry=registry,
        )
        self.wait = Histogram(
            "distlocks_acquire_wait_seconds",
            "Seconds spent acquiring a lock, by result.",
            ["backend", "result"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.hold = Histogram(
            "distlocks_hold_seconds",
            "Seconds a lease was held, by how it ended (released, lost).",
            ["backend", "outcome"],
            buckets=HOLD_BUCKETS,
            registry=registry,
        )
        self.lost = Counter(
            "distlocks_leases_lost",
            "Leases that ended before their holder released them.",
            ["backend"],
            registry=registry,
        )
        self.fencing_rejections = Counter(
            "distlocks_fencing_rejections",
            "Fenced writes refused because a newer lock holder had written.",
            ["model"],
            registry=registry,
        )
        self.force_releases = Counter(
            "distlocks_force_releases",
            "Locks freed by an operator, whoever held them.",
            ["backend", "via"],
            registry=registry,
        )
        self.collector = LiveLocksCollector()
        registry.register(self.collector)
        self.renewal = RenewalCollector()
        registry.register(self.renewal)

    # -- receivers (never raise: a metric must not break a lock) ----------------------

    def on_acquired(self, sender: Any, lease: Any, waited: float | None = None, **kw: Any) -> None:
        self.acquisitions.labels(lease.backend, "acquired").inc()
        if waited is not None:
            self.wait.labels(lease.backend, "acquired").observe(waited)

    def on_not_acquired(
        self, sender: Any, backend: str, waited: float, error: BaseException, **kw: Any
    ) -> None:
        result = "not_acquired" if isinstance(error, LockNotAcquired) else "error"
        self.acquisitions.labels(backend, result).inc()
        self.wait.labels(backend, result).observe(waited)

    def _held(self, lease: Any, outcome: str) -> None:
        acquired = getattr(lease, "acquired_at", None)
        if isinstance(acquired, dt.datetime):
            seconds = (dt.datetime.now(dt.UTC) - acquired).total_seconds()
            self.hold.labels(lease.backend, outcome).observe(max(0.0, seconds))

    def on_released(self, sender: Any, lease: Any, **kw: Any) -> None:
        self._held(lease, "released")

    def on_lost(self, sender: Any, lease: Any, **kw: Any) -> None:
        self.lost.labels(lease.backend).inc()
        self._held(lease, "lost")

    def on_fencing_rejected(self, sender: Any, model: Any = None, **kw: Any) -> None:
        meta = getattr(model, "_meta", None)
        self.fencing_rejections.labels(meta.label if meta else str(model)).inc()

    def on_force_released(self, sender: Any, backend: str, via: str = "", **kw: Any) -> None:
        self.force_releases.labels(backend, via or "other").inc()

    def connections(self) -> list[tuple[Any, Any]]:
        return [
            (signals.lock_acquired, self.on_acquired),
            (signals.lock_not_acquired, self.on_not_acquired),
            (signals.lock_released, self.on_released),
            (signals.lock_lost, self.on_lost),
            (signals.fencing_rejected, self.on_fencing_rejected),
            (signals.lock_force_released, self.on_force_released),
        ]


_installed: Metrics | None = None
_install_lock = threading.Lock()


def install(registry: CollectorRegistry | None = None) -> Metrics:
    """Create the metrics in ``registry`` (default: the global one) and connect them
    to the signals. Idempotent: a second call returns the installed metrics."""
    global _installed
    with _install_lock:
        if _installed is None:
            metrics = Metrics(REGISTRY if registry is None else registry)
            for signal, receiver in metrics.connections():
                signal.connect(receiver, dispatch_uid=f"distlocks-metrics-{receiver.__name__}")
            _installed = metrics
        return _installed


def uninstall() -> None:
    """Disconnect the receivers and unregister every metric (for tests, reloads)."""
    global _installed
    with _install_lock:
        metrics, _installed = _installed, None
    if metrics is None:
        return
    for signal, receiver in metrics.connections():
        signal.disconnect(dispatch_uid=f"distlocks-metrics-{receiver.__name__}")
    for collector in (
        metrics.acquisitions,
        metrics.wait,
        metrics.hold,
        metrics.lost,
        metrics.fencing_rejections,
        metrics.force_releases,
        metrics.collector,
        metrics.renewal,
    ):
        metrics.registry.unregister(collector)


def installed() -> Metrics | None:
    return _installed


def metrics_view(request: HttpRequest) -> HttpResponse:
    """The global registry in Prometheus's text format, for a URLconf entry such as
    ``path("metrics/", metrics_view)`` (restrict who can reach it, as for any metrics)."""
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)
