"""Invoices and the charges made against them, and two kinds of account.

``Charge.fencing_token`` only records the token of the lease under which a
charge was made, for display; nothing checks it. :class:`Account` is fenced
(``distlocks.models.FencedModel``): the token of each write is stored on the row
and a write with an older one is refused. :class:`PlainAccount` is the same
account without fencing, the control of the "Fenced writes" page.
"""

from __future__ import annotations

from django.db import models

from distlocks.models import FencedModel


class Invoice(models.Model):
    customer = models.CharField(max_length=100)
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    paid_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-pk"]

    def __str__(self) -> str:
        return f"{self.number} ({self.customer}, {self.amount})"

    @property
    def number(self) -> str:
        return f"INV-{self.pk:05d}" if self.pk else "INV-(new)"

    @property
    def lock_name(self) -> str:
        """The lock that guards charging this invoice."""
        return f"invoice:{self.pk}"


class Charge(models.Model):
    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="charges")
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    #: Name of the thread that made the charge.
    worker = models.CharField(max_length=100)
    #: Backend alias of the lock held while charging; empty when charged without a lock.
    backend = models.CharField(max_length=50, blank=True)
    fencing_token = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["pk"]

    def __str__(self) -> str:
        return f"{self.amount} charged on {self.invoice.number} by {self.worker}"


class Account(FencedModel):
    """A balance whose writes carry the fencing token of the row's lock
    (``shop.account:<pk>``, the FencedModel default)."""

    owner = models.CharField(max_length=100)
    balance = models.DecimalField(max_digits=12, decimal_places=2, default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["pk"]

    def __str__(self) -> str:
        return f"{self.owner}: {self.balance}"


class PlainAccount(models.Model):
    """The same account as a plain model: saves carry no token, nothing is checked."""

    owner = models.CharField(max_length=100)
    balance = models.DecimalField(max_digits=12, decimal_places=2, default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["pk"]

    def __str__(self) -> str:
        return f"{self.owner}: {self.balance} (not fenced)"

    @property
    def lock_name(self) -> str:
        """The lock its writers take: the same name scheme as :class:`Account`'s."""
        return f"shop.plainaccount:{self.pk}"
