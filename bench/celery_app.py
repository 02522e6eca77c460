"""The benchmark's Celery app: ``celery -A bench.celery_app worker`` for the end-to-end workload.

The broker is the benchmark's own throwaway Redis (``DISTLOCKS_TEST_REDIS_URL``,
as in :mod:`bench.settings`), the same server the run locks, the queue markers
and the peers' keys live on. Every broker key carries :data:`BROKER_PREFIX`, so
the run can remove exactly what it published, and no result backend is
configured: nothing is stored per task, in every implementation alike.

The tasks themselves are in :mod:`bench.celery_tasks`, imported once Django is
set up (their module imports distlocks' Celery integration).
"""

from __future__ import annotations

import os

from celery import Celery

from bench.celery_names import BROKER_PREFIX, QUEUE, SINGLETON_PREFIX
from bench.settings import REDIS_URL

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

#: How long a peer's enqueue-time marker lasts (seconds), like distlocks' ``unique_ttl``.
MARKER_TTL = 3600

app = Celery("distlocks-bench", include=["bench.celery_tasks"])
app.conf.update(
    broker_url=REDIS_URL,
    broker_transport_options={"global_keyprefix": BROKER_PREFIX},
    broker_connection_retry_on_startup=True,
    task_default_queue=QUEUE,
    task_default_exchange=QUEUE,
    task_default_routing_key=QUEUE,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    worker_enable_remote_control=False,
    worker_send_task_events=False,
    # The peers' settings, on the same Redis server.
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": REDIS_URL, "default_timeout": MARKER_TTL},
    },
    singleton_backend_url=REDIS_URL,
    singleton_key_prefix=SINGLETON_PREFIX,
    singleton_lock_expiry=MARKER_TTL,
)
