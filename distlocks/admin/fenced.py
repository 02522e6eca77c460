"""Edits of a fenced row in the Django admin (:class:`FencedModelAdmin`): they take
the row's lock and save with its token, so an admin edit can neither interleave with a
worker holding that lock nor overwrite a newer holder's write."""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.utils.translation import gettext_lazy as _

from distlocks import lock_many
from distlocks.exceptions import (
    LockBackendUnavailable,
    LockNotAcquired,
    StaleFencingToken,
)
from distlocks.fencing import unfenced
from distlocks.models import FencedModel
from distlocks.redaction import escape_control

if TYPE_CHECKING:
    from django.utils.functional import _StrPromise as StrPromise

    from distlocks.lease import BaseLease

# The leases the admin holds for the rows of the request being handled, by the text
# of their primary key. A row is saved with its own lease, found here, not by the
# lock name of the edited object: an edit of a field the name is built from would
# look under the new name, which nobody holds.
_row_leases: contextvars.ContextVar[Mapping[str, BaseLease] | None] = contextvars.ContextVar(
    "distlocks_admin_row_leases", default=None
)


@contextlib.contextmanager
def _holding(leases: Mapping[str, BaseLease]) -> Iterator[None]:
    token = _row_leases.set(leases)
    try:
        yield
    finally:
        _row_leases.reset(token)


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
        # changeform_view (or changelist_view) holds the row's lock, taken under the
        # name the row was loaded with: the save uses that lease, even if the edit
        # changed a field the lock name is built from.
        lease = self.row_lease(obj)
        if lease is None:
            obj.save()
        else:
            obj.save(fencing_token=lease)

    def row_lease(self, obj: Any) -> BaseLease | None:
        """The lease this admin holds on ``obj``'s row for the request being handled
        (taken before the form changed anything), or None outside one."""
        return (_row_leases.get() or {}).get(str(obj.pk))

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        # An operator's confirmed delete is an explicit bypass (docs/fencing.md): a
        # holder that later saves the row it loaded gets FencedRowDeleted.
        with unfenced():
            obj.delete()

    def delete_queryset(self, request: HttpRequest, queryset: Any) -> None:
        with unfenced():
            queryset.delete()

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
        if obj is None or not self.has_change_permission(request, obj):
            # Nothing to lock, or Django refuses the POST (403): a user who may not
            # change the row must not wait for, nor take, the lock a worker needs.
            return super().changeform_view(request, object_id, form_url, extra_context)
        # The lock is held around the admin's whole transaction and released after
        # COMMIT, so no holder can read the row before the edit is visible.
        with (
            self._refusals(request, several=False),
            obj.fenced_lock(
                backend=self.fencing_backend, ttl=self.fencing_ttl, timeout=self.fencing_timeout
            ) as lease,
            _holding({str(obj.pk): lease}),
        ):
            return super().changeform_view(request, object_id, form_url, extra_context)
        return HttpResponseRedirect(request.get_full_path())

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The list, and saves of ``list_editable`` rows: the locks of every row in the
        submitted form are taken together (all or none), and held until COMMIT."""
        if not (
            request.method == "POST"
            and self.list_editable
            and "_save" in request.POST
            and self.has_change_permission(request)  # else Django refuses it, unlocked
        ):
            return super().changelist_view(request, extra_context)
        edited = self._edited_rows(request)
        rows = [(str(obj.pk), obj.get_fencing_lock_name()) for obj in edited]
        names = [name for _, name in rows]
        # How the page shows each row, to name the one a refusal is about: the list
        # reloads with the stored values, so "one of these rows" alone leaves the
        # operator guessing which edit to make again.
        labels: dict[tuple[str, str], str] = {}
        for obj in edited:
            labels["pk", str(obj.pk)] = labels["name", obj.get_fencing_lock_name()] = str(obj)
        if not names:  # nothing to lock: let the formset report what is wrong
            return super().changelist_view(request, extra_context)
        try:
            row_locks = lock_many(
                names, backend=self.fencing_backend, ttl=self.fencing_ttl,
                timeout=self.fencing_timeout,
            )  # fmt: skip
        except ValueError as exc:
            # More rows than the backend can ever lock at once (a PostgreSQL pool in
            # session mode): nothing was taken or written; the message says what to change.
            self.message_user(request, _("Not saved: %(reason)s") % {"reason": exc},
                              messages.ERROR)  # fmt: skip
            return HttpResponseRedirect(request.get_full_path())
        with self._refusals(request, several=True, labels=labels), row_locks as leases:
            held = {pk: leases[name] for pk, name in rows}
            with _holding(held):
                return super().changelist_view(request, extra_context)
        return HttpResponseRedirect(request.get_full_path())

    def _edited_rows(self, request: HttpRequest) -> list[Any]:
        """The rows a ``list_editable`` POST submits (by the primary keys in its forms)."""
        field = re.compile(rf"^form-\d+-{re.escape(self.opts.pk.name)}$")
        pks = [value for key, value in request.POST.items() if field.match(key)]
        try:
            return list(self.get_queryset(request).filter(pk__in=pks))
        except (ValueError, ValidationError):
            return []

    @contextlib.contextmanager
    def _refusals(
        self,
        request: HttpRequest,
        *,
        several: bool,
        labels: Mapping[tuple[str, str], str] | None = None,
    ) -> Iterator[None]:
        """A save refused because of the locks, as a message on the page. The
        exception ended the admin's transaction: nothing was written. With several
        rows, ``labels`` (by lock name and by primary key) names the row at fault."""
        labels = labels or {}
        try:
            yield
        except LockNotAcquired as exc:
            row = labels.get(("name", exc.name))
            text: str | StrPromise
            if several and row is not None:
                text = _(
                    "Not saved: one of these rows (“%(row)s”) is locked by another holder "
                    "right now. Try again."
                ) % {"row": escape_control(row)}
            elif several:
                text = _(
                    "Not saved: one of these rows is locked by another holder right now. Try again."
                )
            else:
                text = _("Not saved: the row is locked by another holder right now. Try again.")
            self.message_user(request, text, messages.ERROR)
        except StaleFencingToken as exc:
            row = labels.get(("pk", str(exc.pk)))
            if several and row is not None:
                text = _(
                    "Not saved: a newer lock holder changed one of these rows (“%(row)s”) "
                    "meanwhile. Reload."
                ) % {"row": escape_control(row)}
            elif several:
                text = _(
                    "Not saved: a newer lock holder changed one of these rows meanwhile. Reload."
                )
            else:
                text = _("Not saved: a newer lock holder changed this row meanwhile. Reload it.")
            self.message_user(request, text, messages.ERROR)
        except LockBackendUnavailable:
            self.message_user(
                request, _("Not saved: the lock server cannot be reached."), messages.ERROR
            )
