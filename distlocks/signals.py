"""Signals sent by distlocks. The lock signals carry the lease as ``lease``.

* ``lock_acquired(lease)``: a lease was granted.
* ``lock_released(lease)``: a lease was released by its holder.
* ``lock_lost(lease, reason)``: a lease ended before its holder released it.
* ``fencing_rejected(model, pk, offered, stored)``: a fenced write was refused.
"""

from __future__ import annotations

from django.dispatch import Signal

lock_acquired = Signal()
lock_released = Signal()
lock_lost = Signal()
fencing_rejected = Signal()
