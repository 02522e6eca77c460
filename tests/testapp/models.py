"""Models used by the test suite only."""

from __future__ import annotations

import uuid
from decimal import Decimal

from django.db import models

from distlocks.models import FencedModel


class Account(FencedModel):
    fencing_lock_name = "account:{pk}"

    owner = models.CharField(max_length=50)
    balance = models.IntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return self.owner


class Counter(FencedModel):
    value = models.IntegerField(default=0)

    def __str__(self) -> str:
        return str(self.value)


class PlainCounter(models.Model):
    """The same counter without fencing: the control case."""

    value = models.IntegerField(default=0)

    def __str__(self) -> str:
        return str(self.value)


class TaskRun(models.Model):
    """One run of a test Celery task, written by the worker process that ran it.

    ``started``/``ended`` are ``time.monotonic()`` readings: the clock is system-wide
    on Linux, so the intervals of different worker processes can be compared.
    """

    run = models.CharField(max_length=64, db_index=True)  # the test that enqueued it
    task_id = models.CharField(max_length=64)
    attempt = models.IntegerField(default=0)
    pid = models.IntegerField()
    fencing_token = models.BigIntegerField(null=True)
    started = models.FloatField()
    ended = models.FloatField(null=True)

    def __str__(self) -> str:
        return f"{self.run} {self.task_id} #{self.attempt}"


class Parcel(FencedModel):
    """A fenced row with what a plain counter lacks: quoted column names, a UUID key,
    JSON, a decimal and a foreign key (the fenced UPDATE prepares each value as Django
    would)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, db_column="parcel id")
    code = models.CharField(max_length=20, db_column="Parcel Code")
    data = models.JSONField(default=dict)
    weight = models.DecimalField(max_digits=8, decimal_places=3, default=Decimal(0))
    account = models.ForeignKey(Account, null=True, on_delete=models.SET_NULL)

    class Meta:
        db_table = "testapp parcels"

    def __str__(self) -> str:
        return self.code
