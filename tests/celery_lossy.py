"""A Redis backend alias whose connections go through the session's lost-reply proxy
(tests/lost_reply_proxy.py), for the tests of what the Celery run path does when the
server ran a call and its reply never came back."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings as django_settings

from distlocks import get_backend
from distlocks.backends.redis import RedisBackend
from distlocks.contrib import celery_redis
from tests.lost_reply_proxy import LostReplyProxy


def lossy_backend(
    proxy: LostReplyProxy, settings: Any, alias: str, prefix: str
) -> Iterator[RedisBackend]:
    """Configure ``alias`` (with the ``settings`` fixture) on the session's Redis
    database through ``proxy``, under a key prefix of its own starting with ``prefix``;
    yield its backend, then delete its keys. For a fixture to ``yield from``."""
    db = int(urlsplit(django_settings.REDIS_URL).path.strip("/") or 0)
    prefix = f"{prefix}-{uuid.uuid4().hex[:8]}"
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        alias: {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": proxy.url(db),
            "OPTIONS": {"key_prefix": prefix},
        },
    }
    backend = get_backend(alias)
    assert isinstance(backend, RedisBackend) and celery_redis.usable(backend)
    yield backend
    keys = list(backend.client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        backend.client.delete(*keys)
