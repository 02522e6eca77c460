"""Views for tests/test_transactions.py: locks taken by views under ATOMIC_REQUESTS."""

from __future__ import annotations

from django.db import connection
from django.db.models import F
from django.http import HttpRequest, JsonResponse
from django.urls import path

from distlocks import lock
from tests.testapp.models import PlainCounter


def locked_increment(request: HttpRequest, pk: int) -> JsonResponse:
    """Increment a row under a lock; report what the lease looks like after the block."""
    from tests.test_transactions import taken_elsewhere

    alias, name = request.GET["alias"], request.GET["name"]
    with lock(name, backend=alias, ttl=30, timeout=10) as lease:
        PlainCounter.objects.filter(pk=pk).update(value=F("value") + 1)
    if request.GET.get("fail"):
        raise RuntimeError("the view failed after its locked block")
    return JsonResponse(
        {
            "in_atomic_block": connection.in_atomic_block,
            "held": lease.held(),
            "pending": lease.release_pending,
            "taken_elsewhere": taken_elsewhere(alias, name),
        }
    )


urlpatterns = [path("increment/<int:pk>/", locked_increment)]
