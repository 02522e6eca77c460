"""The demo's Celery tasks, run by the worker that :mod:`demo_project.run` starts.

* :func:`refresh_sales_report` is the periodic job. Every beat sends it every
  ``DEMO_REPORT_PERIOD`` seconds, and the runner starts two beats, standing for two
  nodes whose schedules both fire. The run takes well under a second, so a plain
  lock would be free again when the second trigger arrives and the job would run
  twice per period; ``lock_at_least_for`` keeps the lock for most of the period
  after a run started, so the second trigger finds it taken and is skipped. The run
  writes the :class:`~demo_project.shop.models.SalesReport` row with its lease's
  fencing token.
* :func:`import_bank_statement` is queued from the Celery page. With
  ``unique_while="queued_or_running"``, while an import of an account waits in the
  queue or runs, ``delay()`` returns its ``AsyncResult`` instead of queueing another.

Every delivery of either task to a worker leaves a
:class:`~demo_project.shop.models.JobRun`: the body writes the row of a run, and
:func:`record_delivery` (a ``task_postrun`` receiver) the row of a delivery whose
body never ran, with the task id of the run that held the lock.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from decimal import Decimal
from typing import Any

from celery.signals import task_postrun
from django.conf import settings
from django.db.models import Count, Sum
from django.utils import timezone

from demo_project.shop.models import Charge, Invoice, JobRun, SalesReport
from distlocks import get_backend
from distlocks.contrib.celery import current_lease, single_execution
from distlocks.exceptions import LockError

logger = logging.getLogger(__name__)

REPORT_JOB = "sales-report"
IMPORT_JOB = "bank-import"
#: How long the periodic job keeps its lock after a run started: a little less than
#: the beat period (DEMO_REPORT_PERIOD, 10 s), so the next period's run is not held up.
REPORT_AT_LEAST_FOR = 0.8 * settings.DEMO_REPORT_PERIOD
#: How long an import takes (simulated), long enough to click again while it runs.
IMPORT_SECONDS = 4.0
#: How long a queued import keeps duplicates away if its message is never run
#: (no worker, a purged queue).
IMPORT_UNIQUE_TTL = 120.0
BANK_ACCOUNTS = ["acme-checking", "acme-savings"]
#: The backend of both tasks' locks (the single_execution default).
BACKEND = "default"


def _start_run(task: Any, job: str, triggered_by: str, detail: str = "") -> JobRun:
    lease = current_lease()
    return JobRun.objects.create(
        job=job,
        task_id=task.request.id or "",
        triggered_by=triggered_by,
        outcome=JobRun.RUNNING,
        worker=task.request.hostname or socket.gethostname(),
        pid=os.getpid(),
        fencing_token=None if lease is None else lease.fencing_token,
        detail=detail,
    )


def _finish_run(run: JobRun, detail: str = "") -> None:
    run.outcome = JobRun.RAN
    run.finished_at = timezone.now()
    run.detail = detail or run.detail
    run.save(update_fields=["outcome", "finished_at", "detail"])


@single_execution(
    name="shop.refresh_sales_report",
    # The report row's lock name: the run lock's token is the one the row checks.
    key=SalesReport.fencing_lock_name,
    ttl=30,
    lock_at_least_for=REPORT_AT_LEAST_FOR,
    on_duplicate="skip",
    bind=True,
)
def refresh_sales_report(self: Any, triggered_by: str = "") -> dict[str, Any]:
    """Recompute the sales figures: at most once per period, however many beats fire.

    ``triggered_by`` (the beat's node name) is not part of the lock's key: a trigger
    from any node is the same job.
    """
    run = _start_run(self, REPORT_JOB, triggered_by)
    lease = current_lease()
    assert lease is not None  # a single_execution task runs only under its lock
    totals = Charge.objects.aggregate(charges=Count("pk"), total=Sum("amount"))
    report = SalesReport.objects.first() or SalesReport()
    report.invoices = Invoice.objects.count()
    report.paid = Invoice.objects.filter(paid_at__isnull=False).count()
    report.charges = totals["charges"]
    report.charged_total = totals["total"] or Decimal("0.00")
    report.refreshed_at = timezone.now()
    report.refreshed_by = run.task_id
    # Refused with StaleFencingToken if a later run of the job has written already.
    report.save(fencing_token=current_lease())
    _finish_run(run, f"{report.charges} charges, {report.charged_total} in total")
    return {"fencing_token": lease.fencing_token, "charges": report.charges}


@single_execution(
    name="shop.import_bank_statement",
    key="shop:bank-import:{account}",
    ttl=30,
    unique_while="queued_or_running",
    unique_ttl=IMPORT_UNIQUE_TTL,
    bind=True,
)
def import_bank_statement(self: Any, account: str) -> dict[str, Any]:
    """Import an account's bank statement: queued once however often it is asked for."""
    run = _start_run(self, IMPORT_JOB, "web page", f"account {account}")
    time.sleep(IMPORT_SECONDS)  # the import itself (simulated)
    lease = current_lease()
    assert lease is not None
    lease.ensure_held()  # before the import's results would be committed
    _finish_run(run, f"account {account}: imported")
    return {"account": account, "fencing_token": lease.fencing_token}


#: The demo's tasks and the job each one records.
JOBS = {
    refresh_sales_report.name: REPORT_JOB,
    import_bank_statement.name: IMPORT_JOB,
}


@task_postrun.connect
def record_delivery(
    sender: Any = None,
    task_id: str = "",
    task: Any = None,
    args: Any = (),
    kwargs: Any = None,
    retval: Any = None,
    state: str = "",
    **_: Any,
) -> None:
    """Record a delivery whose body did not run (a skipped trigger, or a failure before
    the body started), and mark a run whose body raised as failed."""
    job = JOBS.get(getattr(task, "name", ""))
    if job is None or not task_id:
        return
    kwargs = dict(kwargs or {})
    run = JobRun.objects.filter(task_id=task_id, job=job).order_by("-pk").first()
    if run is not None:
        if state != "SUCCESS" and run.outcome == JobRun.RUNNING:
            run.outcome = JobRun.FAILED
            run.finished_at = timezone.now()
            run.detail = _error(retval)
            run.save(update_fields=["outcome", "finished_at", "detail"])
        return
    holder, detail = "", ""
    try:
        name = task.lock_name(args, kwargs)
        info = get_backend(BACKEND).inspect(name)
    except LockError as exc:
        detail = f"could not inspect the lock: {exc}"
    else:
        if info is not None:
            holder = str(info.extra.get("celery_task_id") or "")
            left = (
                "" if info.expires_in is None else f", {info.expires_in.total_seconds():.1f} s left"
            )
            detail = f"{name!r} was held{left}"
    JobRun.objects.create(
        job=job,
        task_id=task_id,
        triggered_by=str(kwargs.get("triggered_by", "")),
        outcome=JobRun.SKIPPED if state == "SUCCESS" else JobRun.FAILED,
        worker=getattr(task.request, "hostname", None) or socket.gethostname(),
        pid=os.getpid(),
        holder_task_id=holder,
        detail=detail if state == "SUCCESS" else _error(retval),
        finished_at=timezone.now(),
    )


def _error(retval: Any) -> str:
    """A failed task's error as one line (the worker passes an ExceptionInfo)."""
    exc = getattr(retval, "exception", retval)
    return f"{type(exc).__name__}: {exc}"
