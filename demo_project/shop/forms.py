from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings

from demo_project.shop.demos import MAX_WORKERS
from demo_project.shop.tasks import BANK_ACCOUNTS
from distlocks import get_backend


def backend_choices() -> list[tuple[str, str]]:
    """One choice per ``DISTLOCKS_BACKENDS`` alias, labelled with its class."""
    return [
        (alias, f"{alias} ({str(config.get('BACKEND', '')).rsplit('.', 1)[-1]})")
        for alias, config in settings.DISTLOCKS_BACKENDS.items()
    ]


def expiring_backend_choices() -> list[tuple[str, str]]:
    """The backends whose server frees a lock when its lease runs out."""
    return [
        (alias, label) for alias, label in backend_choices() if get_backend(alias).expires_on_server
    ]


class BackendForm(forms.Form):
    backend = forms.ChoiceField(initial="default")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Read on each use, so the choices follow the settings.
        self.fields["backend"].choices = self.choices()  # type: ignore[attr-defined]

    def choices(self) -> list[tuple[str, str]]:
        return backend_choices()


class ChargeForm(BackendForm):
    workers = forms.IntegerField(min_value=2, max_value=MAX_WORKERS, initial=8)
    mode = forms.ChoiceField(
        choices=[("lock", "with lock()"), ("none", "without a lock")], initial="lock"
    )


class HoldForm(BackendForm):
    mode = forms.ChoiceField(choices=[("hold", "hold, then release"), ("abandon", "abandon")])


class PausedHolderForm(BackendForm):
    """The paused-holder story needs a lease that the server ends when it runs out."""

    def choices(self) -> list[tuple[str, str]]:
        return expiring_backend_choices()


class ImportForm(forms.Form):
    """Which account's bank statement the Celery page queues for import."""

    account = forms.ChoiceField()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["account"].choices = [(name, name) for name in BANK_ACCOUNTS]  # type: ignore[attr-defined]
