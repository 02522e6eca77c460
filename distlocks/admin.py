"""Admin integration.

:class:`FencedModelAdmin`: edits of a fenced row in the Django admin take the
row's lock and save with its token, so an admin edit can neither interleave with
a worker holding that lock nor overwrite a newer holder's write.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.utils.translation import gettext_lazy as _

from distlocks.exceptions import LockBackendUnavailable, LockNotAcquired, StaleFencingToken
from distlocks.fencing import unfenced
from distlocks.models import FencedModel


class FencedModelAdmin(admin.ModelAdmin):
    """ModelAdmin for :class:`~distlocks.models.FencedModel` subclasses."""

    #: Backend alias of the row locks.
    fencing_backend = "default"
    #: Seconds to wait for a row lock held by someone else before giving up.
    fencing_timeout: float = 5.0
    #: Lease length while saving.
    fencing_ttl: float = 30.0

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        if not isinstance(obj, FencedModel):
            raise TypeError(f"{type(self).__name__} is for FencedModel subclasses.")
        if not change or obj.pk is None:
            # A new row: nobody else can hold its lock yet; it starts at token 0,
            # below every token a holder will offer.
            with unfenced():
                obj.save()
            return
        # changeform_view holds the row's lock: the save uses its token.
        obj.save()

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        obj = None
        if request.method == "POST" and object_id is not None:
            obj = self.get_object(request, unquote(object_id))
        if obj is None:
            return super().changeform_view(request, object_id, form_url, extra_context)
        try:
            # The lock is held around the admin's whole transaction and released
            # after COMMIT, so no holder can read the row before the edit is visible.
            with obj.fenced_lock(
                backend=self.fencing_backend, ttl=self.fencing_ttl, timeout=self.fencing_timeout
            ):
                return super().changeform_view(request, object_id, form_url, extra_context)
        except LockNotAcquired:
            self.message_user(
                request,
                _("Not saved: the row is locked by another holder right now. Try again."),
                messages.ERROR,
            )
        except StaleFencingToken:
            self.message_user(
                request,
                _("Not saved: a newer lock holder changed this row meanwhile. Reload it."),
                messages.ERROR,
            )
        except LockBackendUnavailable:
            self.message_user(
                request, _("Not saved: the lock server cannot be reached."), messages.ERROR
            )
        return HttpResponseRedirect(request.get_full_path())
