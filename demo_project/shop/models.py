"""Invoices and the charges made against them.

``Charge.fencing_token`` only records the token of the lease under which a
charge was made, for display. It is not checked by the database: fenced writes
(``distlocks.models.FencedModel``) are not part of distlocks yet.
"""

from __future__ import annotations

from django.db import models


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
