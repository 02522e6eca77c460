"""The admin page of live locks of every backend (:class:`LiveLockAdmin`): the
list, a page per lock, and a confirmed, audited force release for holders of the
``distlocks.force_release_livelock`` permission."""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import parse_qsl, urlencode

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.translation import gettext_lazy as _

from distlocks import audit, livelocks
from distlocks.admin.display import VisibleMessages
from distlocks.backends.capabilities import NotSupported, Permits, require
from distlocks.models import LiveLock
from distlocks.redaction import escape_control
from distlocks.validation import validate_name

# The admin's one logger, as before the split: its name is what logging settings
# and operators' filters know.
logger = logging.getLogger("distlocks.admin")


_SEPARATOR = audit.SEPARATOR

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
_KIND_LABELS = {
    livelocks.LOCK: _("lock"),
    livelocks.SEMAPHORE: _("semaphore permit"),
    livelocks.READ: _("read lease"),
    livelocks.WRITE: _("write lease"),
}
_STATUS_LABELS = {
    livelocks.OK: _("ok"),
    livelocks.EXPIRING: _("expiring"),
    livelocks.STUCK: _("stuck"),
    livelocks.ORPHANED: _("orphaned"),
    livelocks.KEPT: _("kept"),
}


@admin.register(LiveLock)
class LiveLockAdmin(VisibleMessages, admin.ModelAdmin):
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
    #: Seconds a listing is reused, by every viewer, for other pages, sorts, searches,
    #: filters and reloads of the same backends (0: read the servers on every request).
    #: None: the refresh interval, so that the servers are read at most once per
    #: interval however many pages are open, and a reload never shows data older than
    #: one interval (5 seconds if the page does not reload itself). A force release or
    #: the "read again now" link reads them again.
    snapshot_ttl: float | None = None
    PAUSED_SNAPSHOT_TTL = 5.0

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    has_delete_permission = has_change_permission

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

    def lock_url(self, alias: str, name: str, kind: str = "", owner: str = "") -> str:
        """The page of the lock ``name``, or of ``owner``'s permit of ``kind`` on it."""
        if kind and kind != livelocks.LOCK:
            return self._url("lock", backend=alias, name=name, kind=kind, owner=owner)
        return self._url("lock", backend=alias, name=name)

    def _item_url(self, view: str, item: livelocks.LiveLock, filters: str = "") -> str:
        if filters:
            return self._url(view, **item.ref, **{_FILTERS: filters})
        return self._url(view, **item.ref)

    def _list_url(self, filters: str = "") -> str:
        """The list, with the search, filters, order and page the operator came from."""
        url = self._url("changelist")
        return f"{url}?{filters}" if filters else url

    def _context(self, request: HttpRequest, title: str, **extra: Any) -> dict[str, Any]:
        return {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            "list_url": self._list_url(_filters_of(request)),
            "filters": _filters_of(request),
            "status_labels": _STATUS_LABELS,
            **extra,
        }

    def _check_view(self, request: HttpRequest) -> None:
        if not self.has_view_permission(request):
            raise PermissionDenied

    def _ref(
        self, request: HttpRequest, data: Any
    ) -> tuple[tuple[str, str, str, str] | None, HttpResponse | None]:
        """``(alias, name, kind, owner)`` from the query or the form, checked; or a
        redirect to the list with a message saying what is wrong."""
        alias, name = data.get("backend", ""), data.get("name", "")
        aliases = livelocks.configured_aliases()
        if alias not in aliases:
            # Say which aliases there are: a hand-edited or truncated link is the usual cause.
            defined = ", ".join(repr(each) for each in aliases)
            if alias:
                text = _("There is no backend %(alias)r; DISTLOCKS_BACKENDS defines %(defined)s.")
            else:
                text = _(
                    "The request names no backend (?backend=<alias>); DISTLOCKS_BACKENDS "
                    "defines %(defined)s."
                )
            self.message_user(
                request,
                escape_control(text % {"alias": alias, "defined": defined}),
                messages.ERROR,
            )
            return None, HttpResponseRedirect(self._list_url(_filters_of(request)))
        try:
            validate_name(name)
            kind, owner = livelocks.check_ref(data.get("kind", ""), data.get("owner", ""))
        except (ValueError, TypeError) as exc:
            self.message_user(request, escape_control(str(exc)), messages.ERROR)
            return None, HttpResponseRedirect(self._list_url(_filters_of(request)))
        return (alias, name, kind, owner), None

    def _lookup(
        self, request: HttpRequest, ref: tuple[str, str, str, str]
    ) -> tuple[livelocks.LiveLock | None, HttpResponse | None]:
        """The live lock or permit, or a redirect with a message saying why there is none."""
        alias, name, kind, owner = ref
        try:
            item = livelocks.inspect(alias, name, kind, owner)
        except NotSupported as exc:  # a permit on a backend without them: the one answer
            self.message_user(request, escape_control(str(exc)), messages.ERROR)
            return None, HttpResponseRedirect(self._list_url(_filters_of(request)))
        except Exception as exc:  # any backend failure is a message, never a 500
            logger.warning("Could not inspect %r on backend %r", name, alias, exc_info=True)
            self.message_user(
                request,
                _("Backend %(alias)r cannot be read: %(error)s")
                % {"alias": alias, "error": livelocks.describe_error(exc)},
                messages.ERROR,
            )
            return None, HttpResponseRedirect(self._list_url(_filters_of(request)))
        if item is None:
            if kind == livelocks.LOCK:
                text = _("Lock %(name)r on backend %(alias)r is not held (any more).")
            else:
                text = _(
                    "The %(kind)s of owner %(owner)s on %(name)r (backend %(alias)r) is not "
                    "held (any more)."
                )
            self.message_user(
                request,
                text
                % {
                    "name": name,
                    "alias": alias,
                    "kind": _KIND_LABELS[kind],
                    "owner": owner,
                },
                messages.WARNING,
            )
            return None, HttpResponseRedirect(self._list_url(_filters_of(request)))
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
        ttl = self.snapshot_ttl
        if ttl is None:
            ttl = self.refresh_interval or self.PAUSED_SNAPSHOT_TTL
        if not ttl:
            snapshot = livelocks.collect(read, limit=self.list_limit)
        else:
            # "Read again now" (fresh): a new listing, which the next views then reuse.
            snapshot = livelocks.snapshots.get(
                read, ttl, self.list_limit, refresh=bool(params.get("fresh"))
            )
        # Worked out once per snapshot and view: other pages of it cost their rows only.
        selection = snapshot.select(query=query, status=status, order=order)
        counts = selection.counts
        rows = selection.rows
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

        # What a lock's page, its force release and their redirects bring the operator
        # back to: this very list (search, filters, order, page).
        here = link(p=params.get("p", ""))[1:]

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
                    "url": self._item_url("lock", item, here),
                    "kind": "" if item.kind == livelocks.LOCK else item.kind,
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
                    "count": selection.searched,
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
        """The page of one lock (``?backend=&name=``) or of one permit of a semaphore or
        read-write lock (also ``&kind=semaphore|read|write&owner=<owner id>``)."""
        self._check_view(request)
        ref, redirect = self._ref(request, request.GET)
        item = None
        if ref is not None:
            item, redirect = self._lookup(request, ref)
        if item is None or ref is None:
            assert redirect is not None
            return redirect
        alias, name, kind, _owner = ref
        backend = livelocks.get(alias)
        try:
            counter: int | None
            if kind == livelocks.LOCK:
                counter = backend.fencing_counter(name)
            elif kind == livelocks.SEMAPHORE:
                counter = None  # a semaphore issues no tokens
            else:
                counter = require(backend, Permits, kind).permit_counter(name)
        except Exception:
            counter = None
        info = item.info
        fields = [
            (_("Name"), info.name),
            (_("Kind"), _KIND_LABELS[kind]),
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
            (
                _("Write fencing counter") if kind in (livelocks.READ, livelocks.WRITE)
                else _("Fencing counter"),
                "-" if counter is None else counter,
            ),
            (_("Renewals"), info.renewals),
            (_("Waiters"), "-" if info.waiters is None else info.waiters),
        ]  # fmt: skip
        others: list[dict[str, Any]] = []
        if kind != livelocks.LOCK:
            # The other holders of the same semaphore or read-write lock.
            try:
                holders = require(backend, Permits, kind).permit_holders(kind, name)
            except Exception:
                logger.debug("Could not list the holders of %r", name, exc_info=True)
                holders = []
            for other in holders:
                if other.owner == info.owner:
                    continue
                row = livelocks.LiveLock(other, *livelocks.classify(other))
                others.append(
                    {
                        "item": row,
                        "url": self._item_url("lock", row, _filters_of(request)),
                        "kind": _KIND_LABELS[row.kind],
                    }
                )
        context = self._context(
            request,
            (_("Lock %(name)s") if kind == livelocks.LOCK else _("%(kind)s of %(name)s"))
            % {"name": escape_control(name), "kind": str(_KIND_LABELS[kind]).capitalize()},
            item=item,
            kind_label=_KIND_LABELS[kind],
            fields=fields,
            others=others,
            can_release=self.has_force_release_permission(request),
            release_url=self._item_url("release", item, _filters_of(request)),
        )
        return TemplateResponse(request, "distlocks/admin/livelock_detail.html", context)

    def logged_object_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """A LogEntry's object id -> the page of that lock or permit: ``<alias>:<name>``,
        and for a permit ``<alias>:<name>\x1f<kind>\x1f<owner>`` (names have no
        control characters, so the separator cannot be part of one)."""
        self._check_view(request)
        object_id = unquote(object_id)
        for alias in livelocks.configured_aliases():
            if object_id.startswith(f"{alias}:"):
                name, *permit = object_id[len(alias) + 1 :].split(_SEPARATOR)
                if len(permit) == 2:
                    return HttpResponseRedirect(self.lock_url(alias, name, *permit))
                return HttpResponseRedirect(self.lock_url(alias, name))
        return HttpResponseRedirect(self._list_url(_filters_of(request)))

    # -- force release ----------------------------------------------------------

    def release_view(self, request: HttpRequest) -> HttpResponse:
        """GET: a confirmation page. POST (CSRF-checked): free the lock (or evict the
        permit's holder), bump the fencing counter, write a LogEntry, send
        ``lock_force_released``."""
        self._check_view(request)
        if not self.has_force_release_permission(request):
            raise PermissionDenied
        data = request.POST if request.method == "POST" else request.GET
        ref, redirect = self._ref(request, data)
        if ref is None:
            assert redirect is not None
            return redirect
        alias, name, kind, owner = ref
        if request.method != "POST":
            item, redirect = self._lookup(request, ref)
            if item is None:
                assert redirect is not None
                return redirect
            context = self._context(
                request,
                (
                    _("Force-release lock %(name)s?")
                    if kind == livelocks.LOCK
                    else _("Evict this holder of %(name)s?")
                )
                % {"name": escape_control(name)},
                item=item,
                kind=kind,
                kind_label=_KIND_LABELS[kind],
                lock_url=self._item_url("lock", item, _filters_of(request)),
            )
            return TemplateResponse(request, "distlocks/admin/livelock_release.html", context)

        expected = _token_of(data.get("fencing_token"))
        lock_url = self.lock_url(alias, name, kind, owner)
        if _filters_of(request):
            lock_url += "&" + urlencode({_FILTERS: _filters_of(request)})
        if kind == livelocks.LOCK and expected is None:
            # Only the holder the operator saw (and confirmed) may be evicted: a form
            # without its token names nobody, so nothing is done.
            self.message_user(
                request,
                _(
                    "Lock %(name)r on backend %(alias)r was not released: the request did "
                    "not say which holder (fencing token) to evict. Use the Force release "
                    "button on the lock's page."
                )
                % {"name": name, "alias": alias},
                messages.ERROR,
            )
            return HttpResponseRedirect(lock_url)
        what: dict[str, Any] = {
            "name": name,
            "alias": alias,
            "kind": _KIND_LABELS[kind],
            "owner": owner,
        }
        try:
            done = livelocks.force_release(
                alias,
                name,
                kind=kind,
                owner=owner,
                expected_token=expected,
                user=request.user,
                via="admin",
            )
        except livelocks.TokenChanged as exc:
            if kind != livelocks.LOCK:
                text = _(
                    "The %(kind)s of owner %(owner)s on %(name)r (backend %(alias)r) is no "
                    "longer held: nothing was done."
                )
            elif exc.current is None:
                text = _("Lock %(name)r on backend %(alias)r was released meanwhile.")
            else:
                text = _(
                    "Lock %(name)r on backend %(alias)r changed hands since you confirmed "
                    "(now fencing token %(token)s): nothing was done. Review it again."
                )
            what["token"] = exc.current.info.fencing_token if exc.current else ""
            self.message_user(request, text % what, messages.WARNING)
            return HttpResponseRedirect(
                lock_url if exc.current else self._list_url(_filters_of(request))
            )
        except Exception as exc:  # any backend failure is a message, never a 500
            logger.warning("Could not force-release %r on %r", name, alias, exc_info=True)
            what["error"] = livelocks.describe_error(exc)
            self.message_user(
                request,
                _("Could not force-release %(name)r on backend %(alias)r: %(error)s") % what,
                messages.ERROR,
            )
            return HttpResponseRedirect(lock_url)
        audit.log_force_release(done, request.user)
        what["holder"] = done.before.holder if done.before else "-"
        what["counter"] = done.counter if done.counter is not None else "?"
        if kind == livelocks.LOCK and done.released:
            text = _(
                "Lock %(name)r on backend %(alias)r was force-released from %(holder)s. "
                "Fencing tokens up to %(counter)s are now stale."
            )
        elif kind == livelocks.LOCK:
            text = _("Lock %(name)r on backend %(alias)r was already free: nothing was done.")
        elif not done.released:
            text = _(
                "The %(kind)s of owner %(owner)s on %(name)r (backend %(alias)r) ended "
                "before it could be evicted."
            )
        elif kind == livelocks.SEMAPHORE:
            text = _(
                "The %(kind)s of owner %(owner)s on %(name)r (backend %(alias)r) was "
                "force-released from %(holder)s; the other holders keep theirs."
            )
        else:
            text = _(
                "The %(kind)s of owner %(owner)s on %(name)r (backend %(alias)r) was "
                "force-released from %(holder)s; the other holders keep theirs. Write "
                "fencing tokens up to %(counter)s are now stale."
            )
        self.message_user(
            request, text % what, messages.SUCCESS if done.released else messages.WARNING
        )
        return HttpResponseRedirect(self._list_url(_filters_of(request)))


#: The query parameter carrying the list's own query string (Django's admin name for it).
_FILTERS = "_changelist_filters"
#: What the list's query string may hold; anything else is dropped, not echoed back.
_LIST_PARAMS = ("q", "status", "backend", "o", "p", "refresh")


def _filters_of(request: HttpRequest) -> str:
    """The list query string a page was opened from, rebuilt from known parameters only."""
    raw = request.POST.get(_FILTERS) or request.GET.get(_FILTERS) or ""
    if not raw:
        return ""
    kept = [(k, v) for k, v in parse_qsl(raw[:2000]) if k in _LIST_PARAMS and v]
    return urlencode(kept)


def _token_of(value: Any) -> int | None:
    """The fencing token a force-release form names, or None when it names none that
    a lock can have (missing, not an integer, negative, beyond 64 bits)."""
    # ASCII digits: isdigit() takes "²", a 500 in int(), and other scripts' digits.
    if not isinstance(value, str) or not re.fullmatch(r"[0-9]{1,19}", value.strip()):
        return None
    token = int(value)
    return token if token <= 2**63 - 1 else None
