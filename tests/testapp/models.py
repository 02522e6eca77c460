"""Models used by the test suite only."""

from __future__ import annotations

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
