from __future__ import annotations

from django.contrib import admin

from demo_project.shop.models import Account, Charge, Invoice, PlainAccount
from distlocks.admin import FencedModelAdmin


class ChargeInline(admin.TabularInline):
    model = Charge
    extra = 0
    readonly_fields = ["amount", "worker", "backend", "fencing_token", "created_at"]
    can_delete = False


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    list_display = ["number", "customer", "amount", "paid_at", "created_at"]
    inlines = [ChargeInline]


@admin.register(Charge)
class ChargeAdmin(admin.ModelAdmin):
    list_display = ["invoice", "amount", "worker", "backend", "fencing_token", "created_at"]
    list_filter = ["backend"]


@admin.register(Account)
class AccountAdmin(FencedModelAdmin):
    """Saving an account here takes its row lock (shop.account:<pk>) on the same
    backend as the fenced-writes page, and writes with that lease's token."""

    fencing_backend = "default"
    list_display = ["owner", "balance", "fencing_token", "updated_at"]
    readonly_fields = ["fencing_token", "updated_at"]


@admin.register(PlainAccount)
class PlainAccountAdmin(admin.ModelAdmin):
    list_display = ["owner", "balance", "updated_at"]
    readonly_fields = ["updated_at"]
