from __future__ import annotations

from django.contrib import admin

from distlocks.admin import FencedModelAdmin
from tests.testapp.models import Account


@admin.register(Account)
class AccountAdmin(FencedModelAdmin):
    fencing_timeout = 0.3
    list_display = ("owner", "balance")
    list_editable = ("balance",)
