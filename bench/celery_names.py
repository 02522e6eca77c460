"""The names the benchmark's Celery app and its workloads share: a leaf module.

:mod:`bench.celery_app` configures the broker with them and
:mod:`bench.celery_overhead` cleans up and starts workers by them; keeping them
here lets each import them without importing the other.
"""

from __future__ import annotations

#: Prefix of every key the broker writes (queue, bindings, unacked messages).
BROKER_PREFIX = "distlocks-bench-celery:"
#: The one queue every benchmark task is published to.
QUEUE = "distlocks-bench"
#: Key prefix of the peer that keeps its markers under a configurable prefix.
SINGLETON_PREFIX = "bench:celery-singleton:"
