"""Invoices and the charges made against them, and two kinds of account.

``Charge.fencing_token`` only records the token of the lease under which a
charge was made, for display; nothing checks it. :class:`Account` is fenced
(``distlocks.models.FencedModel``): the token of each write is stored on the row
and a write with an older one is refused. :class:`PlainAccount` is the same
account without fencing, the control of the "Fenced writes" page.

:class:`JobRun` and :class:`SalesReport` belong to the Celery page: every
delivery of a demo task leaves one ``JobRun`` (a run, or a trigger that found the
job's lock taken), and the periodic job writes the single ``SalesReport`` row with
the fencing token of its run lock.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone

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


class JobRun(models.Model):
    """One delivery of a demo Celery task to a worker: a run, or a trigger that did
    not run because another run held the task's lock.

    The task body writes the row of a run when it starts and completes it when it
    ends; a delivery whose body never ran is recorded after the fact by a
    ``task_postrun`` receiver (:mod:`demo_project.shop.tasks`).
    """

    RUNNING = "running"
    RAN = "ran"
    SKIPPED = "skipped"
    FAILED = "failed"
    OUTCOMES = [(RUNNING, "running"), (RAN, "ran"), (SKIPPED, "skipped"), (FAILED, "failed")]

    #: Which demo job: the periodic sales report or a bank statement import.
    job = models.CharField(max_length=50)
    task_id = models.CharField(max_length=64, db_index=True)
    #: Who asked for it: the beat node that sent it, or the web page.
    triggered_by = models.CharField(max_length=100, blank=True)
    outcome = models.CharField(max_length=10, choices=OUTCOMES)
    worker = models.CharField(max_length=200, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    #: The run lock's token (runs only).
    fencing_token = models.BigIntegerField(null=True, blank=True)
    #: For a skipped trigger: the task id of the run that held the lock.
    holder_task_id = models.CharField(max_length=64, blank=True)
    detail = models.TextField(blank=True)
    started_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.job} {self.task_id}: {self.outcome}"


class SalesReport(FencedModel):
    """The figures the periodic job refreshes: one row, fenced by the job's run lock.

    Its lock name is the periodic task's key, so the token of the task's lease is
    the one this row checks.
    """

    fencing_lock_name = "shop:sales-report"

    invoices = models.IntegerField(default=0)
    paid = models.IntegerField(default=0)
    charges = models.IntegerField(default=0)
    charged_total = models.DecimalField(max_digits=14, decimal_places=2, default=0)
    refreshed_at = models.DateTimeField(null=True, blank=True)
    #: The task id of the run that wrote the figures.
    refreshed_by = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["pk"]

    def __str__(self) -> str:
        return f"Sales report: {self.charges} charges, {self.charged_total}"
