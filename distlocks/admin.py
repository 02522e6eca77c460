"""Admin integration.

:class:`FencedModelAdmin`: edits of a fenced row in the Django admin take the
row's lock and save with its token, so an admin edit can neither interleave with
a worker holding that lock nor overwrite a newer holder's write.

:class:`LiveLockAdmin`: the page of live locks of every backend
(``/admin/distlocks/livelock/``), a page per lock, and a confirmed, audited force
release for holders of the ``distlocks.force_release_livelock`` permission.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.admin.utils import unquote
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.translation import gettext_lazy as _

from distlocks import livelocks
from distlocks.exceptions import (
    LockBackendUnavailable,
    LockNotAcquired,
    StaleFencingToken,
)
from distlocks.fencing import unfenced
from distlocks.models import FencedModel, LiveLock

logger = logging.getLogger(__name__)


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


#: Columns of the list: (sort key or "", heading).
_COLUMNS = [
    ("name", _("Name")),
    ("status", _("Status")),
    ("backend", _("Backend")),
    ("holder", _("Holder")),
    ("", _("Celery task")),
    ("", _("PostgreSQL pid")),
    ("acquired", _("Acquired at")),
    ("held", _("Held for")),
    ("expires", _("Expires in")),
    ("token", _("Fencing token")),
    ("renewals", _("Renewals")),
    ("waiters", _("Waiters")),
]
_STATUS_LABELS = {
    livelocks.OK: _("ok"),
    livelocks.EXPIRING: _("expiring"),
    livelocks.STUCK: _("stuck"),
    livelocks.ORPHANED: _("orphaned"),
}


@admin.register(LiveLock)
class LiveLockAdmin(admin.ModelAdmin):
    """Live locks of every configured backend, read from the servers on each request.

    There is no table: the list, the page of one lock and the force release are
    views of their own over :mod:`distlocks.livelocks`. Seeing them takes
    ``distlocks.view_livelock``; freeing one, ``distlocks.force_release_livelock``.
    """

    list_per_page = 100
    #: Seconds between automatic reloads of the list (0: never).
    refresh_interval = 10
    #: Most locks read from one backend for one listing.
    list_limit = livelocks.DEFAULT_LIMIT
    #: Seconds a listing is reused for other pages, sorts, searches and filters of the
    #: same backends (0: read the servers on every request). A force release or the
    #: refresh link reads them again.
    snapshot_ttl: float = 5.0

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(f"{self.opts.app_label}.force_release_livelock"))

    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        wrap = self.admin_site.admin_view
        return [
            path("", wrap(self.changelist_view), name="{}_{}_changelist".format(*info)),
            path("lock/", wrap(self.lock_view), name="{}_{}_lock".format(*info)),
            path("release/", wrap(self.release_view), name="{}_{}_release".format(*info)),
            # Where the admin's action history links a LogEntry of a released lock.
            path(
                "<path:object_id>/change/",
                wrap(self.logged_object_view),
                name="{}_{}_change".format(*info),
            ),
        ]

    # -- helpers ----------------------------------------------------------------

    def _url(self, view: str, **params: str) -> str:
        url = reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_{view}",
            current_app=self.admin_site.name,
        )
        return f"{url}?{urlencode(params)}" if params else url

    def lock_url(self, alias: str, name: str) -> str:
        return self._url("lock", backend=alias, name=name)

    def _context(self, request: HttpRequest, title: str, **extra: Any) -> dict[str, Any]:
        return {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            "list_url": self._url("changelist"),
            "status_labels": _STATUS_LABELS,
            **extra,
        }

    def _check_view(self, request: HttpRequest) -> None:
        if not self.has_view_permission(request):
            raise PermissionDenied

    def _lookup(
        self, request: HttpRequest, alias: str, name: str
    ) -> tuple[livelocks.LiveLock | None, HttpResponse | None]:
        """The live lock, or a redirect with a message saying why there is none."""
        if alias not in livelocks.configured_aliases():
            self.message_user(
                request, _("There is no backend %(alias)r.") % {"alias": alias}, messages.ERROR
            )
            return None, HttpResponseRedirect(self._url("changelist"))
        try:
            item = livelocks.inspect(alias, name)
        except Exception as exc:  # any backend failure is a message, never a 500
            logger.warning("Could not inspect %r on backend %r", name, alias, exc_info=True)
            self.message_user(
                request,
                _("Backend %(alias)r cannot be read: %(error)s")
                % {"alias": alias, "error": livelocks.describe_error(exc)},
                messages.ERROR,
            )
            return None, HttpResponseRedirect(self._url("changelist"))
        if item is None:
            self.message_user(
                request,
                _("Lock %(name)r on backend %(alias)r is not held (any more).")
                % {"name": name, "alias": alias},
                messages.WARNING,
            )
            return None, HttpResponseRedirect(self._url("changelist"))
        return item, None

    # -- the list ---------------------------------------------------------------

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        self._check_view(request)
        params = request.GET
        aliases = livelocks.configured_aliases()
        query = params.get("q", "").strip()
        status = params.get("status", "")
        status = status if status in livelocks.STATUSES else ""
        backend = params.get("backend", "")
        backend = backend if backend in aliases else ""
        order = params.get("o", "name")
        if order.lstrip("-") not in livelocks.SORTS:
            order = "name"
        try:
            refresh = max(0, int(params.get("refresh", self.refresh_interval)))
        except ValueError:
            refresh = self.refresh_interval

        read = [backend] if backend else aliases
        if params.get("fresh") or not self.snapshot_ttl:
            snapshot = livelocks.collect(read, limit=self.list_limit)
        else:
            snapshot = livelocks.snapshots.get(read, self.snapshot_ttl, self.list_limit)
        searched = livelocks.select(snapshot.locks, query=query, order=order)
        counts = livelocks.status_counts(searched)
        rows = [item for item in searched if item.status == status] if status else searched
        paginator = Paginator(rows, self.list_per_page)
        page = paginator.get_page(params.get("p"))
        # Details a backend's listing leaves out are fetched for this page only.
        page_items = livelocks.complete(list(page.object_list))

        current = {"q": query, "status": status, "backend": backend, "o": order}
        if refresh != self.refresh_interval:
            current["refresh"] = str(refresh)

        def link(**changes: Any) -> str:
            merged = {**current, **changes}
            return "?" + urlencode({k: v for k, v in merged.items() if v not in ("", None)})

        columns = []
        for key, heading in _COLUMNS:
            sorted_here = key and order.lstrip("-") == key
            descending = order.startswith("-")
            columns.append(
                {
                    "heading": heading,
                    "key": key,
                    "sorted": bool(sorted_here),
                    "descending": sorted_here and descending,
                    "url": link(o=f"-{key}" if sorted_here and not descending else key, p="")
                    if key
                    else "",
                }
            )
        context = self._context(
            request,
            str(self.opts.verbose_name_plural).capitalize(),
            snapshot=snapshot,
            rows=[
                {
                    "item": item,
                    "url": self.lock_url(item.backend, item.name),
                    "held": livelocks.format_seconds(item.held_for) or "-",
                    "expires": livelocks.format_seconds(item.expires_in) or _("never"),
                    "status": _STATUS_LABELS[item.status],
                }
                for item in page_items
            ],
            columns=columns,
            page=page,
            paginator=paginator,
            page_links=[
                {"number": n, "url": link(p=n) if isinstance(n, int) else ""}
                for n in paginator.get_elided_page_range(page.number)
            ]
            if paginator.num_pages > 1
            else [],
            total=len(rows),
            query=query,
            hidden_params=[(k, v) for k, v in current.items() if k != "q" and v],
            backend_choices=[
                {"label": _("All"), "url": link(backend="", p=""), "selected": not backend}
            ]
            + [
                {"label": alias, "url": link(backend=alias, p=""), "selected": alias == backend}
                for alias in aliases
            ],
            status_choices=[
                {
                    "label": _("All"),
                    "count": len(searched),
                    "url": link(status="", p=""),
                    "selected": not status,
                }
            ]
            + [
                {
                    "label": _STATUS_LABELS[s],
                    "count": counts[s],
                    "url": link(status=s, p=""),
                    "selected": s == status,
                }
                for s in livelocks.STATUSES
            ],
            refresh=refresh,
            refresh_toggle_url=link(refresh=0 if refresh else self.refresh_interval),
            fresh_url=link(fresh=1),
            stuck_after=livelocks.format_seconds(float(livelocks.conf.STUCK_AFTER)),
            **(extra_context or {}),
        )
        return TemplateResponse(request, "distlocks/admin/livelock_list.html", context)

    # -- one lock ---------------------------------------------------------------

    def lock_view(self, request: HttpRequest) -> HttpResponse:
        self._check_view(request)
        alias, name = request.GET.get("backend", ""), request.GET.get("name", "")
        item, redirect = self._lookup(request, alias, name)
        if item is None:
            assert redirect is not None
            return redirect
        try:
            counter: int | None = livelocks.get(alias).fencing_counter(name)
        except Exception:
            counter = None
        info = item.info
        fields = [
            (_("Name"), info.name),
            (_("Backend"), info.backend),
            (_("Status"), _STATUS_LABELS[item.status]),
            (_("Why"), item.reason or "-"),
            (_("Owner (acquisition id)"), info.owner),
            (_("Host"), info.host),
            (_("Process id"), info.pid),
            (_("Thread"), info.thread),
            (_("Celery task"), item.celery_task_id or "-"),
            (_("PostgreSQL backend pid"), item.backend_pid or "-"),
            (_("Acquired at"), info.acquired_at or "-"),
            (_("Held for"), livelocks.format_seconds(item.held_for) or "-"),
            (_("Lease (ttl)"), f"{info.ttl:g}s" if info.ttl else "-"),
            (_("Expires in"), livelocks.format_seconds(item.expires_in) or _("never")),
            (_("Fencing token"), info.fencing_token),
            (_("Fencing counter"), "-" if counter is None else counter),
            (_("Renewals"), info.renewals),
            (_("Waiters"), "-" if info.waiters is None else info.waiters),
        ]
        context = self._context(
            request,
            _("Lock %(name)s") % {"name": name},
            item=item,
            fields=fields,
            can_release=self.has_force_release_permission(request),
            release_url=self._url("release", backend=alias, name=name),
        )
        return TemplateResponse(request, "distlocks/admin/livelock_detail.html", context)

    def logged_object_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """``<alias>:<name>`` (a LogEntry's object id) -> the page of that lock."""
        self._check_view(request)
        object_id = unquote(object_id)
        for alias in livelocks.configured_aliases():
            if object_id.startswith(f"{alias}:"):
                return HttpResponseRedirect(self.lock_url(alias, object_id[len(alias) + 1 :]))
        return HttpResponseRedirect(self._url("changelist"))

    # -- force release ----------------------------------------------------------

    def release_view(self, request: HttpRequest) -> HttpResponse:
        """GET: a confirmation page. POST (CSRF-checked): free the lock, bump its
        fencing counter, write a LogEntry, send ``lock_force_released``."""
        self._check_view(request)
        if not self.has_force_release_permission(request):
            raise PermissionDenied
        data = request.POST if request.method == "POST" else request.GET
        alias, name = data.get("backend", ""), data.get("name", "")
        if request.method != "POST":
            item, redirect = self._lookup(request, alias, name)
            if item is None:
                assert redirect is not None
                return redirect
            context = self._context(
                request,
                _("Force-release lock %(name)s?") % {"name": name},
                item=item,
                lock_url=self.lock_url(alias, name),
            )
            return TemplateResponse(request, "distlocks/admin/livelock_release.html", context)

        if alias not in livelocks.configured_aliases():
            self.message_user(
                request, _("There is no backend %(alias)r.") % {"alias": alias}, messages.ERROR
            )
            return HttpResponseRedirect(self._url("changelist"))
        try:
            expected = int(data.get("fencing_token", ""))
        except ValueError:
            expected = None
        try:
            done = livelocks.force_release(
                alias, name, expected_token=expected, user=request.user, via="admin"
            )
        except livelocks.TokenChanged as exc:
            if exc.current is None:
                text = _("Lock %(name)r on backend %(alias)r was released meanwhile.")
            else:
                text = _(
                    "Lock %(name)r on backend %(alias)r changed hands since you confirmed "
                    "(now fencing token %(token)s): nothing was done. Review it again."
                )
            self.message_user(
                request,
                text
                % {
                    "name": name,
                    "alias": alias,
                    "token": exc.current.info.fencing_token if exc.current else "",
                },
                messages.WARNING,
            )
            return HttpResponseRedirect(
                self.lock_url(alias, name) if exc.current else self._url("changelist")
            )
        except Exception as exc:  # any backend failure is a message, never a 500
            logger.warning("Could not force-release %r on %r", name, alias, exc_info=True)
            self.message_user(
                request,
                _("Could not force-release %(name)r on backend %(alias)r: %(error)s")
                % {"name": name, "alias": alias, "error": livelocks.describe_error(exc)},
                messages.ERROR,
            )
            return HttpResponseRedirect(self.lock_url(alias, name))
        self._log(request, done)
        if done.released:
            self.message_user(
                request,
                _(
                    "Lock %(name)r on backend %(alias)r was force-released from %(holder)s. "
                    "Fencing tokens up to %(counter)s are now stale."
                )
                % {
                    "name": name,
                    "alias": alias,
                    "holder": done.before.holder if done.before else "-",
                    "counter": done.counter if done.counter is not None else "?",
                },
                messages.SUCCESS,
            )
        else:
            self.message_user(
                request,
                _(
                    "Lock %(name)r on backend %(alias)r was already free; its fencing "
                    "counter was advanced anyway."
                )
                % {"name": name, "alias": alias},
                messages.WARNING,
            )
        return HttpResponseRedirect(self._url("changelist"))

    def _log(self, request: HttpRequest, done: livelocks.ForceReleased) -> None:
        before = done.before
        holder = (
            f"{before.holder}, owner {before.info.owner}, fencing token {before.info.fencing_token}"
            if before
            else "no holder"
        )
        if before and before.celery_task_id:
            holder += f", Celery task {before.celery_task_id}"
        user_id = request.user.pk
        assert user_id is not None  # admin views are for signed-in staff only
        LogEntry.objects.create(
            user_id=user_id,
            content_type_id=ContentType.objects.get_for_model(
                LiveLock, for_concrete_model=False
            ).pk,
            object_id=f"{done.alias}:{done.name}",
            object_repr=f"{done.name} ({done.alias})"[:200],
            action_flag=DELETION,
            change_message=(
                f"Force-released ({'was held' if done.released else 'was free'}): {holder}; "
                f"fencing counter now {done.counter if done.counter is not None else 'unknown'}."
            ),
        )
