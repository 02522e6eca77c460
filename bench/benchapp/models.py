"""Two tables with the same columns, one fenced and one plain.

``FencedRow`` has, in addition, the ``fencing_token`` column of
:class:`~distlocks.models.FencedModel` and, on PostgreSQL, the fencing trigger
that ``migrate`` installs on every FencedModel table. Everything else (an integer
and a short text) is the same, so a save of one against a save of the other
measures what fencing adds.
"""

from __future__ import annotations

from django.db import models

from distlocks.models import FencedModel


class FencedRow(FencedModel):
    number = models.IntegerField(default=0)
    label = models.CharField(max_length=40, blank=True)

    class Meta:
        app_label = "benchapp"

    def __str__(self) -> str:
        return f"fenced row {self.pk}"


class PlainRow(models.Model):
    number = models.IntegerField(default=0)
    label = models.CharField(max_length=40, blank=True)

    class Meta:
        app_label = "benchapp"

    def __str__(self) -> str:
        return f"plain row {self.pk}"
