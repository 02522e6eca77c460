"""The project's code that takes locks."""

from __future__ import annotations

from shop.models import Stock

from distlocks import lock
from distlocks.lease import Lease


@lock("nightly-report", ttl=60, timeout=0)
def nightly_report() -> str:
    """At most one run at a time, anywhere: a second caller gets LockNotAcquired."""
    return "done"


def restock(sku: str, added: int) -> Lease:
    """Add to a row's count under its lock, with a fenced write; the lease it used."""
    with lock(f"stock:{sku}", ttl=30, timeout=5) as lease:
        stock = Stock.objects.get(sku=sku)
        stock.count += added
        stock.save(fencing_token=lease)
    return lease
