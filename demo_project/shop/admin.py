from __future__ import annotations

from django.contrib import admin

from demo_project.shop.models import Charge, Invoice


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
