from __future__ import annotations

from django.db import models

from distlocks.models import FencedModel


class Stock(FencedModel):
    fencing_lock_name = "stock:{sku}"

    sku = models.CharField(max_length=20, unique=True)
    count = models.IntegerField(default=0)
