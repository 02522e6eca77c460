"""The demo pages. Each one runs a demonstration from :mod:`demo_project.shop.demos`
on POST, keeps the result in the session, and redirects (so a reload never
re-runs it)."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from django import forms
from django.conf import settings
from django.contrib import messages
from django.db.models import Count, Q, Sum
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from kombu.exceptions import OperationalError

from demo_project.shop import demos, tasks
from demo_project.shop.admin import AccountAdmin
from demo_project.shop.forms import (
    BackendForm,
    ChargeForm,
    HoldForm,
    ImportForm,
    PausedHolderForm,
)
from demo_project.shop.models import Account, Invoice, JobRun, PlainAccount, SalesReport
from distlocks import get_backend, lock
from distlocks.exceptions import LockError, LockNotAcquired

#: How long the "hold" button keeps its lock before releasing it.
HOLD_SECONDS: float = 20
#: Lease of the held lock: short, so the live table shows automatic renewal at work.
HOLD_TTL: float = 6
#: Lease of the lock the "abandon" button takes and never releases.
ABANDON_TTL: float = 15
#: How often the live-locks page refreshes its table.
REFRESH_SECONDS = 2
#: How many times the Celery page's button calls delay().
IMPORT_CALLS = 5
#: How many runs of the periodic job the Celery page lists.
RECENT_RUNS = 8


@dataclass(frozen=True)
class Feature:
    title: str
    summary: str
    #: URL name of the page that shows it; empty while the feature is not built.
    url_name: str = ""


FEATURES = [
    Feature(
        "Charge an invoice once",
        "Eight threads race to charge the same invoice inside "
        "lock(f'invoice:{id}', ttl=10, timeout=0): one charges, the others get "
        "LockNotAcquired. Run it without the lock to see the double charge.",
        "shop:invoices",
    ),
    Feature(
        "Live locks",
        "Every lock held right now on each backend, Redis, PostgreSQL advisory locks, "
        "in-process, and etcd when it is installed (get_backend(alias).iter_locks()): "
        "who holds it, its fencing token, "
        "when it expires, and how often its lease was renewed automatically.",
        "shop:locks",
    ),
    Feature(
        "Fencing tokens",
        "Each acquisition of a lock gets a larger token, even after an operator "
        "force-releases a holder.",
        "shop:fencing",
    ),
    Feature(
        "Several locks at once",
        "lock_many() takes a set of locks in a canonical order, all or none, so two "
        "crossing transfers cannot deadlock.",
        "shop:lock_many",
    ),
    Feature(
        "Fenced writes",
        "A FencedModel row refuses a write whose fencing token is older than the one it "
        "stored: a holder paused past its lease cannot overwrite the next holder's write, "
        "and on PostgreSQL a trigger refuses it even from raw SQL. Accounts are edited in "
        "the admin under the row's lock (FencedModelAdmin).",
        "shop:fenced",
    ),
    Feature(
        "Celery single execution",
        "A periodic job sent by two beat schedulers runs once per period "
        "(single_execution with lock_at_least_for) and writes a fenced row with its "
        "lease's token; five delay() calls of an import queue it once "
        "(unique_while='queued_or_running').",
        "shop:celery",
    ),
]

COMING = [
    Feature(
        "Admin page of live locks and a management command",
        "/admin/distlocks/livelock/ with stuck-lock detection and an audited "
        "force-release; manage.py distlocks list|inspect|release.",
    ),
    Feature(
        "Redlock, Redis Cluster and Sentinel",
        "RedlockBackend over several independent Redis masters; RedisBackend on a Cluster "
        "or behind Sentinel.",
    ),
    Feature("rwlock() and semaphore()", "Shared/exclusive locks, and N holders at a time."),
    Feature("Metrics", "Optional Prometheus metrics of acquisitions, waits and losses."),
]

#: In distlocks already, but no page of this demo shows them yet.
NOT_SHOWN = [
    Feature("alock()", "The asyncio form: async with alock(name, ttl=30) as lease."),
]


def _seconds(delta: dt.timedelta | None) -> str:
    return "-" if delta is None else f"{delta.total_seconds():.1f} s"


def _server(config: dict[str, Any]) -> str:
    """Where a backend keeps its locks, for the index page."""
    if "DATABASE" in config:
        alias = config["DATABASE"]
        database = settings.DATABASES[alias]
        mode = (config.get("OPTIONS") or {}).get("mode", "session")
        return (
            f"PostgreSQL database {database['NAME']} on {database['HOST']}:{database['PORT']} "
            f"(DATABASES[{alias!r}]), {mode} mode"
        )
    if str(config.get("BACKEND", "")).endswith(".LocMemBackend"):
        return "this process's memory"
    return str(config.get("LOCATION", ""))


def _configured_backends() -> list[dict[str, str]]:
    return [
        {"alias": alias, "backend": str(config.get("BACKEND", "")), "location": _server(config)}
        for alias, config in settings.DISTLOCKS_BACKENDS.items()
    ]


@require_GET
def index(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "index.html",
        {
            "features": FEATURES,
            "coming": COMING,
            "not_shown": NOT_SHOWN,
            "backends": _configured_backends(),
        },
    )


# -- (a) charge an invoice once ---------------------------------------------------


def _race_key(pk: int) -> str:
    return f"shop:race:{pk}"


@require_GET
def invoice_list(request: HttpRequest) -> HttpResponse:
    invoices = Invoice.objects.annotate(
        charge_count=Count("charges"), charged_total=Sum("charges__amount")
    )
    return render(request, "shop/invoice_list.html", {"invoices": invoices})


@require_POST
def invoice_create(request: HttpRequest) -> HttpResponse:
    customer, amount = demos.SAMPLE_INVOICES[Invoice.objects.count() % len(demos.SAMPLE_INVOICES)]
    invoice = Invoice.objects.create(customer=customer, amount=amount)
    return redirect("shop:invoice", pk=invoice.pk)


@require_GET
def invoice_detail(request: HttpRequest, pk: int) -> HttpResponse:
    invoice = get_object_or_404(Invoice, pk=pk)
    race = request.session.get(_race_key(pk))
    return render(
        request,
        "shop/invoice_detail.html",
        {
            "invoice": invoice,
            "charges": list(invoice.charges.all()),
            "form": ChargeForm(initial=race["form"] if race else None),
            "race": race,
        },
    )


@require_POST
def invoice_charge(request: HttpRequest, pk: int) -> HttpResponse:
    invoice = get_object_or_404(Invoice, pk=pk)
    form = ChargeForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"Invalid request: {form.errors.as_text()}")
        return redirect("shop:invoice", pk=pk)
    backend = form.cleaned_data["backend"]
    use_lock = form.cleaned_data["mode"] == "lock"
    charges_before = invoice.charges.count()
    try:
        attempts = demos.race_to_charge(
            invoice.pk, workers=form.cleaned_data["workers"], backend=backend, use_lock=use_lock
        )
    except LockError as exc:
        messages.error(request, str(exc))
        return redirect("shop:invoice", pk=pk)
    request.session[_race_key(pk)] = {
        "form": form.cleaned_data,
        "use_lock": use_lock,
        "backend": backend,
        "attempts": [asdict(attempt) for attempt in attempts],
        "new_charges": invoice.charges.count() - charges_before,
        "summary": ", ".join(
            f"{count} {outcome}"
            for outcome in (demos.CHARGED, demos.BUSY, demos.ALREADY_PAID, demos.FAILED)
            if (count := sum(1 for attempt in attempts if attempt.outcome == outcome))
        ),
    }
    return redirect("shop:invoice", pk=pk)


@require_POST
def invoice_reset(request: HttpRequest, pk: int) -> HttpResponse:
    invoice = get_object_or_404(Invoice, pk=pk)
    invoice.charges.all().delete()
    invoice.paid_at = None
    invoice.save(update_fields=["paid_at"])
    request.session.pop(_race_key(pk), None)
    messages.info(request, f"{invoice.number} is unpaid again; its charges were deleted.")
    return redirect("shop:invoice", pk=pk)


# -- (b) live locks ---------------------------------------------------------------


def _live_lock_context() -> dict[str, Any]:
    listing = []
    for entry in demos.live_locks():
        rows = [
            {
                "name": info.name,
                "host": info.host,
                "pid": info.pid,
                "thread": info.thread,
                "fencing_token": info.fencing_token,
                "held_for": _seconds(info.held_for),
                "expires_in": _seconds(info.expires_in),
                "renewals": info.renewals,
            }
            for info in entry.locks
        ]
        listing.append({"alias": entry.alias, "class": entry.backend_class, "rows": rows,
                        "error": entry.error})  # fmt: skip
    return {"listing": listing, "refresh_seconds": REFRESH_SECONDS}


@require_GET
def locks(request: HttpRequest) -> HttpResponse:
    context = _live_lock_context()
    context.update(
        {
            "form": BackendForm(),
            "hold_seconds": HOLD_SECONDS,
            "hold_ttl": HOLD_TTL,
            "abandon_ttl": ABANDON_TTL,
        }
    )
    return render(request, "shop/locks.html", context)


@require_GET
def locks_table(request: HttpRequest) -> HttpResponse:
    """The table alone, fetched by the live-locks page every few seconds."""
    return render(request, "shop/_locks_table.html", _live_lock_context())


@require_POST
def locks_hold(request: HttpRequest) -> HttpResponse:
    form = HoldForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"Invalid request: {form.errors.as_text()}")
        return redirect("shop:locks")
    alias = form.cleaned_data["backend"]
    abandon = form.cleaned_data["mode"] == "abandon"
    name = "demo:crashed-worker" if abandon else "demo:nightly-report"
    expires = get_backend(alias).expires_on_server
    if abandon and not expires:
        messages.warning(
            request,
            f"Not taken: a lock on {alias!r} has no TTL on the server. It ends when its "
            f"holder's connection closes, which happens at once when a worker process "
            f"dies; this web server lives on, so an abandoned lock would stay until the "
            f"site stops.",
        )
        return redirect("shop:locks")
    # A crashed worker's renewals die with it. Here the process lives on, so the
    # abandoned lease must not be renewed, or it would never expire.
    ttl, auto_renew = (ABANDON_TTL, False) if abandon else (HOLD_TTL, True)
    try:
        lease = lock(name, backend=alias, ttl=ttl, timeout=0, auto_renew=auto_renew).acquire()
    except LockNotAcquired:
        messages.warning(
            request, f"{name!r} is already held on {alias!r}: timeout=0 tried once and gave up."
        )
        return redirect("shop:locks")
    except LockError as exc:
        messages.error(request, str(exc))
        return redirect("shop:locks")
    if abandon:
        messages.success(
            request,
            f"Took {name!r} on {alias!r} (fencing token {lease.fencing_token}) and dropped "
            f"the lease without releasing it, like a worker that crashed: the lock ends "
            f"when its {ABANDON_TTL} s TTL runs out.",
        )
    else:
        timer = threading.Timer(HOLD_SECONDS, demos.release_quietly, args=[lease.release])
        timer.daemon = True
        timer.start()
        renewal = (
            "renewed automatically"
            if expires
            # Nothing expires on the server: renewal only confirms the connection.
            else "whose renewal checks that the lock's connection still holds it,"
        )
        messages.success(
            request,
            f"Holding {name!r} on {alias!r} (fencing token {lease.fencing_token}) with a "
            f"{HOLD_TTL} s lease, {renewal} about every {HOLD_TTL / 3:g} s; "
            f"released in {HOLD_SECONDS} s.",
        )
    return redirect("shop:locks")


# -- (c) fencing tokens -----------------------------------------------------------


def _backend_demo(
    request: HttpRequest,
    key: str,
    form_class: type[forms.Form],
    run: Callable[[str], dict[str, Any]],
    context: Callable[[], dict[str, Any]] = dict,
) -> HttpResponse:
    """The pattern of the demo pages: a POST runs ``run(alias)`` on the chosen backend
    and keeps its result in the session for one redirect; a GET shows the last one
    with ``shop/<key>.html``."""
    session_key = f"shop:{key}"
    if request.method == "POST":
        form = form_class(request.POST)
        if form.is_valid():
            alias = form.cleaned_data["backend"]
            try:
                request.session[session_key] = {"backend": alias, **run(alias)}
            except LockError as exc:
                messages.error(request, str(exc))
        else:
            messages.error(request, f"Invalid request: {form.errors.as_text()}")
        return redirect(f"shop:{key}")
    result = request.session.get(session_key)
    return render(
        request,
        f"shop/{key}.html",
        {
            "form": form_class(initial={"backend": result["backend"]} if result else None),
            "result": result,
            **context(),
        },
    )


@require_http_methods(["GET", "POST"])
def fencing(request: HttpRequest) -> HttpResponse:
    return _backend_demo(
        request,
        "fencing",
        BackendForm,
        lambda alias: {"steps": [asdict(step) for step in demos.fencing_rounds(alias)]},
        lambda: {"lock_name": demos.FENCING_LOCK},
    )


# -- lock_many --------------------------------------------------------------------


@require_http_methods(["GET", "POST"])
def lock_many_view(request: HttpRequest) -> HttpResponse:
    return _backend_demo(
        request,
        "lock_many",
        BackendForm,
        lambda alias: {
            "transfers": [asdict(transfer) for transfer in demos.crossing_transfers(alias)]
        },
        lambda: {"work_ms": int(demos.TRANSFER_WORK * 1000)},
    )


# -- fenced writes ----------------------------------------------------------------


@require_http_methods(["GET", "POST"])
def fenced(request: HttpRequest) -> HttpResponse:
    def run(alias: str) -> dict[str, Any]:
        # One after the other: each story holds its own row's lock.
        stories = [
            demos.paused_holder(alias, fenced=True),
            demos.paused_holder(alias, fenced=False),
        ]
        return {
            "stories": [asdict(story) for story in stories],
            "raw": asdict(demos.raw_sql_lowering()),
        }

    return _backend_demo(
        request,
        "fenced",
        PausedHolderForm,
        run,
        lambda: {
            "account": demos.story_account(Account),
            "plain_account": demos.story_account(PlainAccount),
            "ttl": demos.PAUSE_TTL,
            "deposit_a": demos.DEPOSIT_A,
            "deposit_b": demos.DEPOSIT_B,
            "admin_backend": AccountAdmin.fencing_backend,
            "admin_timeout": AccountAdmin.fencing_timeout,
            "not_expiring": [
                alias
                for alias in settings.DISTLOCKS_BACKENDS
                if not get_backend(alias).expires_on_server
            ],
        },
    )


# -- Celery single execution --------------------------------------------------------


@dataclass
class Period:
    """A run of the periodic job and the triggers it made others skip."""

    run: JobRun
    skipped: list[JobRun]


def _periods(rows: list[JobRun]) -> list[Period]:
    """Attach each skipped trigger to the run that held the lock, newest run first.

    A skipped trigger whose holder is not among ``rows`` gets a line of its own.
    """
    periods = [Period(row, []) for row in rows if row.outcome != JobRun.SKIPPED]
    by_task = {period.run.task_id: period for period in periods}
    for row in rows:
        if row.outcome != JobRun.SKIPPED:
            continue
        holder = by_task.get(row.holder_task_id)
        if holder is not None:
            holder.skipped.insert(0, row)
        else:
            periods.append(Period(row, []))
    periods.sort(key=lambda period: (period.run.started_at, period.run.pk), reverse=True)
    return periods[:RECENT_RUNS]


def _import_states(ids: list[str]) -> dict[str, str]:
    """The result backend's state of each task id (STARTED while it runs, with
    CELERY_TASK_TRACK_STARTED)."""
    states = {}
    for task_id in dict.fromkeys(ids):
        try:
            states[task_id] = tasks.import_bank_statement.AsyncResult(task_id).state
        except Exception as exc:  # shown instead of a state: the backend is unreachable
            states[task_id] = f"unknown ({type(exc).__name__}: {exc})"
    return states


def _job_context() -> dict[str, Any]:
    """The periodic job's part of the Celery page."""
    report_runs = JobRun.objects.filter(job=tasks.REPORT_JOB)
    counts = report_runs.aggregate(
        triggers=Count("pk"),
        runs=Count("pk", filter=~Q(outcome=JobRun.SKIPPED) & Q(fencing_token__isnull=False)),
        skipped=Count("pk", filter=Q(outcome=JobRun.SKIPPED)),
        failed=Count("pk", filter=Q(outcome=JobRun.FAILED)),
    )
    return {
        "counts": counts,
        "periods": _periods(list(report_runs[: RECENT_RUNS * 4])),
        "report": SalesReport.objects.first(),
    }


def _import_context(request: HttpRequest) -> dict[str, Any]:
    """The imports' part: this session's last click, and the recent imports."""
    queued = request.session.get("shop:celery_import")
    if queued:
        states = _import_states(queued["ids"])
        queued = {
            **queued,
            "distinct": list(states),
            "states": states,
            "runs": list(JobRun.objects.filter(task_id__in=states).order_by("started_at")),
        }
    return {"queued": queued, "imports": list(JobRun.objects.filter(job=tasks.IMPORT_JOB)[:5])}


@require_GET
def celery_page(request: HttpRequest) -> HttpResponse:
    context = {**_job_context(), **_import_context(request)}
    context.update(
        {
            "refresh_seconds": REFRESH_SECONDS,
            "form": ImportForm(),
            "period": settings.DEMO_REPORT_PERIOD,
            "at_least": tasks.REPORT_AT_LEAST_FOR,
            "import_seconds": tasks.IMPORT_SECONDS,
            "import_calls": IMPORT_CALLS,
            "unique_ttl": tasks.IMPORT_UNIQUE_TTL,
            "broker": settings.CELERY_BROKER_URL,
            "lock_name": SalesReport.fencing_lock_name,
        }
    )
    return render(request, "shop/celery.html", context)


@require_GET
def celery_table(request: HttpRequest) -> HttpResponse:
    """The periodic job's table alone, fetched by the Celery page every few seconds."""
    return render(request, "shop/_celery_table.html", _job_context())


@require_GET
def celery_imports(request: HttpRequest) -> HttpResponse:
    """The imports' part alone, fetched by the Celery page every few seconds."""
    return render(request, "shop/_celery_imports.html", _import_context(request))


@require_POST
def celery_import(request: HttpRequest) -> HttpResponse:
    form = ImportForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"Invalid request: {form.errors.as_text()}")
        return redirect("shop:celery")
    account = form.cleaned_data["account"]
    try:
        ids = [tasks.import_bank_statement.delay(account).id for _ in range(IMPORT_CALLS)]
    except (LockError, OperationalError) as exc:
        messages.error(request, f"Not queued: {type(exc).__name__}: {exc}")
        return redirect("shop:celery")
    request.session["shop:celery_import"] = {
        "account": account,
        "ids": ids,
        "queued_at": dt.datetime.now(dt.UTC).strftime("%H:%M:%S"),
    }
    return redirect("shop:celery")
