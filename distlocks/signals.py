"""Signals sent by distlocks. The lock signals carry the lease as ``lease``.

* ``lock_acquired(lease, waited)``: a lease was granted, after ``waited`` seconds.
* ``lock_not_acquired(name, backend, waited, error)``: an acquisition ended without a
  lease after ``waited`` seconds; ``error`` is the exception about to be raised
  (:class:`~distlocks.exceptions.LockNotAcquired` when the lock stayed busy).
* ``lock_released(lease)``: a lease was released by its holder.
* ``lock_lost(lease, reason)``: a lease ended before its holder released it.
* ``lock_force_released(name, backend, info, released, user, via)``: an operator freed
  a lock whoever held it (``info``: the holder as seen just before, or None;
  ``released``: whether it was still held; ``via``: ``"admin"`` or ``"command"``).
* ``fencing_rejected(model, pk, offered, stored)``: a fenced write was refused.
"""

from __future__ import annotations

from django.dispatch import Signal

lock_acquired = Signal()
lock_not_acquired = Signal()
lock_released = Signal()
lock_lost = Signal()
lock_force_released = Signal()
fencing_rejected = Signal()
