"""Models of the distlocks app.

* :class:`LockRegistry`: the PostgreSQL backend's name registry and durable,
  per-name fencing counter (advisory locks know only a 64-bit key).
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class LockRegistry(models.Model):
    """One row per lock name ever taken through the PostgreSQL backend.

    ``key`` is the advisory-lock key (a cryptographic hash of prefix and name);
    ``fencing_token`` only ever grows. The holder columns describe the latest
    acquisition; whether it is still held is told by ``pg_locks``, not by this row.
    """

    key = models.BigIntegerField(primary_key=True)
    name = models.CharField(max_length=200, db_index=True)
    fencing_token = models.BigIntegerField(default=0)
    owner = models.CharField(max_length=32, blank=True)
    host = models.CharField(max_length=255, blank=True)
    pid = models.IntegerField(null=True)
    thread = models.CharField(max_length=255, blank=True)
    backend_pid = models.IntegerField(null=True)
    acquired_at = models.DateTimeField(null=True)
    ttl = models.FloatField(null=True)
    renewals = models.IntegerField(default=0)
    extra = models.JSONField(default=dict, blank=True)

    class Meta:
        db_table = "distlocks_lockregistry"
        verbose_name = _("lock registry entry")
        verbose_name_plural = _("lock registry")

    def __str__(self) -> str:
        return self.name
