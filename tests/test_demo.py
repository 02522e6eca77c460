"""The demo site (``make demo``): settings, system checks and pages (the runner itself
is tested in tests/test_demo_runner.py).

The demo has its own settings and apps, so everything that needs them runs in a
subprocess on the servers this test session started (tests/settings.py exported
their URLs): ``python -m tests.test_demo`` drives the demo pages through
Django's test client on a throwaway database and prints what it saw as JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis

from distlocks.testing.servers import DATABASE_URL_ENV, REDIS_URL_ENV

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 8
#: The demo's lock backends: Redis, PostgreSQL advisory locks, in-process.
BACKENDS = ["default", "pg", "locmem"]
#: Those whose server ends a lease that runs out (the paused-holder story needs one).
EXPIRING = ["default", "locmem"]
#: Holder A's lease in the paused-holder story, shrunk from the page's 1 s.
PAUSE_TTL = 0.3
#: Upper bound for one subprocess; generous, as it migrates a fresh database.
SUBPROCESS_TIMEOUT = 180


def demo_env(**extra: str) -> dict[str, str]:
    """The environment of a demo subprocess: this session's servers, demo settings."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("DEMO_")}
    env["DJANGO_SETTINGS_MODULE"] = "demo_project.settings"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_python(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env or demo_env(),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        check=False,
    )


# -- settings and checks ----------------------------------------------------------


def test_settings_take_the_servers_from_the_environment() -> None:
    from demo_project import settings as demo

    database_url = urllib.parse.urlsplit(os.environ[DATABASE_URL_ENV])
    database = demo.DATABASES["default"]
    assert database["ENGINE"] == "django.db.backends.postgresql"
    assert database["NAME"] == "distlocks_demo"
    assert (database["HOST"], database["PORT"]) == (database_url.hostname, database_url.port)
    assert demo.DISTLOCKS_BACKENDS["default"] == {
        "BACKEND": "distlocks.backends.redis.RedisBackend",
        "LOCATION": os.environ[REDIS_URL_ENV],
    }
    assert demo.DISTLOCKS_BACKENDS["pg"] == {
        "BACKEND": "distlocks.backends.postgres.PostgresBackend",
        "DATABASE": "default",
        "OPTIONS": {"mode": "session"},
    }
    assert demo.DISTLOCKS_BACKENDS["locmem"]["BACKEND"] == (
        "distlocks.backends.locmem.LocMemBackend"
    )
    assert demo.TEMPLATES[0]["DIRS"] == [ROOT / "templates"]
    assert (ROOT / "templates" / "base.html").is_file()


SETTINGS_PROBE = (
    "import json; from demo_project import settings as s; "
    "print(json.dumps([s.SECRET_KEY, s.DEBUG, s.ALLOWED_HOSTS, s.DEMO_REPORT_PERIOD]))"
)


def test_settings_defaults_are_for_local_development() -> None:
    result = run_python("-c", SETTINGS_PROBE)
    assert result.returncode == 0, result.stderr
    secret_key, debug, allowed_hosts, period = json.loads(result.stdout)
    assert secret_key.startswith("django-insecure-")
    assert debug is True
    assert allowed_hosts == ["127.0.0.1", "localhost", "[::1]"]
    assert period == 10.0


def test_settings_read_the_demo_variables() -> None:
    env = demo_env(
        DEMO_SECRET_KEY="s3cret",
        DEMO_DEBUG="0",
        DEMO_ALLOWED_HOSTS="a.test, b.test",
        DEMO_REPORT_PERIOD="",
    )
    result = run_python("-c", SETTINGS_PROBE, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["s3cret", False, ["a.test", "b.test"], 10.0]


#: Settings read with bad periods (each refused at import), then with " 2.5 ".
PERIOD_PROBE = """
import importlib, json, os, sys
refused = {}
for value in BAD_PERIODS:
    os.environ["DEMO_REPORT_PERIOD"] = value
    try:
        importlib.import_module("demo_project.settings")
    except ValueError as exc:
        refused[value] = str(exc)
    else:
        sys.exit(f"{value!r} was taken")
os.environ["DEMO_REPORT_PERIOD"] = " 2.5 "
import django
django.setup()
from django.conf import settings as s
from demo_project.shop import tasks
from distlocks.contrib.celery import SingleExecution
job = SingleExecution.coerce(tasks.refresh_sales_report.single_execution)
schedule = s.CELERY_BEAT_SCHEDULE["refresh-sales-report"]["schedule"]
print(json.dumps([refused, s.DEMO_REPORT_PERIOD, schedule, job.lock_at_least_for]))
"""
BAD_PERIODS = ["0", "-1", "soon", "nan", "inf"]


def test_the_report_period_comes_from_the_environment() -> None:
    """The runner's test shortens the beats' period (DEMO_REPORT_PERIOD, 10 s by
    default); the job keeps its lock for 80% of whatever period it is, and a period
    that is not a positive number of seconds is refused with a message."""
    probe = f"BAD_PERIODS = {BAD_PERIODS!r}\n{PERIOD_PROBE}"
    result = run_python("-c", probe)
    assert result.returncode == 0, result.stderr
    refused, period, schedule, at_least = json.loads(result.stdout)
    assert refused == {
        value: f"DEMO_REPORT_PERIOD must be a number of seconds above 0, not {value!r}."
        for value in BAD_PERIODS
    }
    assert period == schedule == 2.5
    assert at_least == 2.0


def test_check_passes_on_demo_settings() -> None:
    result = run_python("manage.py", "check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues (0 silenced)." in result.stdout


def test_demo_migrations_are_up_to_date() -> None:
    result = run_python("manage.py", "makemigrations", "shop", "--check", "--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No changes detected" in result.stdout


# -- the pages, through the test client in a subprocess ---------------------------


def drive_demo() -> dict[str, Any]:
    """Exercise the demo pages on a throwaway database; runs with the demo's settings."""
    import django

    django.setup()
    from django.conf import settings
    from django.db import connection
    from django.test import Client
    from django.test.utils import setup_test_environment

    setup_test_environment()
    # A name of our own, so that two test sessions on one server do not collide.
    settings.DATABASES["default"].setdefault("TEST", {})["NAME"] = (
        f"test_distlocks_demo_{os.getpid()}"
    )
    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    try:
        return _drive_pages(Client())
    finally:
        from distlocks import get_backend

        # The pg backend's own connections would keep the test database from being dropped.
        get_backend("pg").close()
        connection.creation.destroy_test_db(old_name, verbosity=0)


def _race(client: Any, invoice: Any, backend: str, mode: str) -> dict[str, Any]:
    before = invoice.charges.count()
    response = client.post(
        f"/invoices/{invoice.pk}/charge/",
        {"backend": backend, "workers": WORKERS, "mode": mode},
    )
    page = client.get(f"/invoices/{invoice.pk}/")
    race = client.session[f"shop:race:{invoice.pk}"]
    summary = re.search(r"Outcomes: ([^<]*)\.", page.content.decode())
    return {
        "status": response.status_code,
        "location": response.headers.get("Location"),
        "page_status": page.status_code,
        "new_charges": invoice.charges.count() - before,
        "outcomes": [attempt["outcome"] for attempt in race["attempts"]],
        "tokens": [attempt["fencing_token"] for attempt in race["attempts"]],
        "summary": summary.group(1) if summary else None,
    }


def _drive_pages(client: Any) -> dict[str, Any]:
    from demo_project.run import ensure_superuser
    from demo_project.shop.models import Invoice
    from distlocks import lock

    results: dict[str, Any] = {"charge": {}}
    for backend in BACKENDS:
        invoice = Invoice.objects.create(customer="Test", amount="9.99")
        first = _race(client, invoice, backend, "lock")
        again = _race(client, invoice, backend, "lock")
        unlocked = _race(
            client, Invoice.objects.create(customer="T", amount="1.00"), backend, "none"
        )
        results["charge"][backend] = {"first": first, "again": again, "unlocked": unlocked}

    results["pages"] = {
        url: client.get(url).status_code
        for url in [
            "/",
            "/invoices/",
            "/locks/",
            "/fencing/",
            "/lock-many/",
            "/fenced/",
            "/celery/",
            "/admin/login/",
        ]
    }
    results["index"] = client.get("/").content.decode()
    results["celery"] = _celery_page(client)

    name = f"test:live:{uuid.uuid4().hex[:8]}"
    results["live"] = {}
    for backend in BACKENDS:
        with lock(name, backend=backend, ttl=30, timeout=0) as lease:
            held = client.get("/locks/table/").content.decode()
            results["live"][backend] = {"token": lease.fencing_token, "held": held}
        results["live"][backend]["after"] = client.get("/locks/table/").content.decode()
    results["pid"] = os.getpid()

    results["hold"] = {backend: _hold_and_abandon(client, backend) for backend in BACKENDS}

    results["fencing"] = {}
    for backend in ("default", "pg"):
        results["fencing"][backend] = []
        for _ in range(2):
            client.post("/fencing/", {"backend": backend})
            results["fencing"][backend].append(client.session["shop:fencing"]["steps"])

    results["lock_many"] = {}
    for backend in ("default", "pg"):
        client.post("/lock-many/", {"backend": backend})
        results["lock_many"][backend] = client.session["shop:lock_many"]["transfers"]

    results["fenced"] = {backend: _fenced_story(client, backend) for backend in EXPIRING}
    refused = client.post("/fenced/", {"backend": "pg"}, follow=True)
    results["fenced_pg_refused"] = "pg is not one of the available choices" in (
        refused.content.decode()
    )

    results["superuser_created"] = [ensure_superuser("admin", "first"), None]
    results["superuser_created"][1] = ensure_superuser("admin", "second")
    results["login"] = {
        "old": client.login(username="admin", password="first"),
        "new": client.login(username="admin", password="second"),
    }
    results["admin_index"] = client.get("/admin/").status_code
    results["admin_account"] = _edit_account_in_admin(client)
    return results


def _summary(page: str) -> dict[str, int]:
    """The counts the Celery page's table carries as data attributes."""
    tag = re.search(r'<p id="job-summary"([^>]*)>', page)
    assert tag is not None, page
    return {key: int(value) for key, value in re.findall(r'data-(\w+)="(\d+)"', tag.group(1))}


def _celery_page(client: Any) -> dict[str, Any]:
    """The Celery page with no worker: the periodic job run twice in this process (as a
    worker would, through Celery's own local execution), and the import button, whose
    messages stay queued in the real broker."""
    from django.conf import settings

    from demo_project.celery import app
    from demo_project.shop import tasks
    from demo_project.shop.models import JobRun, SalesReport
    from distlocks import get_backend

    backend = get_backend(tasks.BACKEND)
    report_lock = SalesReport.fencing_lock_name
    import_lock = tasks.import_bank_statement.lock_name(("acme-checking",))
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    queue = settings.CELERY_TASK_DEFAULT_QUEUE

    def clean() -> None:
        for name in (report_lock, import_lock, import_lock + ":queued"):
            backend.force_release(name)
        broker.delete(queue)

    clean()
    try:
        before = client.get("/celery/table/").content.decode()
        # Two nodes' triggers of one period: the first runs, the second finds the lock
        # kept by lock_at_least_for and is skipped.
        first = tasks.refresh_sales_report.apply(kwargs={"triggered_by": "node-a"})
        second = tasks.refresh_sales_report.apply(kwargs={"triggered_by": "node-b"})
        kept = backend.inspect(report_lock)
        report = SalesReport.objects.get()
        rows = {row.task_id: row for row in JobRun.objects.filter(job=tasks.REPORT_JOB)}
        table = client.get("/celery/table/").content.decode()

        clicks = []
        for _ in range(2):
            response = client.post("/celery/import/", {"account": "acme-checking"})
            clicks.append({"status": response.status_code, **client.session["shop:celery_import"]})
        page = client.get("/celery/").content.decode()
        imports = client.get("/celery/imports/").content.decode()
        queued = broker.llen(queue)
        marker = backend.inspect(import_lock + ":queued")
        bad = client.post("/celery/import/", {"account": "nobody"}, follow=True)
        return {
            "before": _summary(before),
            "first": {"state": first.state, "result": first.result, "id": first.id},
            "second": {"state": second.state, "result": second.result, "id": second.id},
            "kept_seconds": None if kept is None else kept.expires_in.total_seconds(),
            "rows": {
                task_id: {
                    "outcome": row.outcome,
                    "triggered_by": row.triggered_by,
                    "fencing_token": row.fencing_token,
                    "holder_task_id": row.holder_task_id,
                    "pid": row.pid,
                }
                for task_id, row in rows.items()
            },
            "report": {"fencing_token": report.fencing_token, "refreshed_by": report.refreshed_by},
            "summary": _summary(table),
            "table_skipped_line": "node-b at " in table and "<strong>skipped</strong>" in table,
            "clicks": clicks,
            "queued": queued,
            "marker_task_id": None if marker is None else marker.extra.get("celery_task_id"),
            "page_one_id": "One task id for 5 calls" in page,
            "page_state": "PENDING" in page,
            "imports_partial": imports.count(clicks[0]["ids"][0]) == 5,
            "page_nav": 'href="/celery/">Celery</a>' in page,
            "bad_account": "Select a valid choice" in bad.content.decode(),
            "app_broker": app.conf.broker_url == settings.CELERY_BROKER_URL,
        }
    finally:
        clean()
        broker.close()


def _fenced_story(client: Any, backend: str) -> dict[str, Any]:
    """Run the fenced-writes page once; what it kept, showed, and what the rows hold."""
    from demo_project.shop import demos
    from demo_project.shop.models import Account, PlainAccount

    demos.PAUSE_TTL = PAUSE_TTL
    response = client.post("/fenced/", {"backend": backend})
    page = client.get("/fenced/").content.decode()
    result = client.session["shop:fenced"]
    fenced, plain = result["stories"]
    account = Account.objects.get(owner=demos.STORY_OWNER)
    plain_account = PlainAccount.objects.get(owner=demos.STORY_OWNER)
    return {
        "status": response.status_code,
        "fenced": fenced,
        "plain": plain,
        "raw": result["raw"],
        "rows": {
            "fenced": [str(account.balance), account.fencing_token],
            "plain": str(plain_account.balance),
        },
        "page": {
            "stale": "A's save raised StaleFencingToken" in page,
            "lost": "is lost." in page,
            "refused": "Refused: StaleFencingToken" in page,
        },
    }


def _edit_account_in_admin(client: Any) -> dict[str, Any]:
    """Edit the fenced account through the admin (logged in): once freely, once while
    another holder has its lock."""
    from demo_project.shop import demos
    from demo_project.shop.admin import AccountAdmin
    from demo_project.shop.models import Account
    from distlocks import get_backend, lock

    account = demos.story_account(Account)
    url = f"/admin/shop/account/{account.pk}/change/"
    name = account.get_fencing_lock_name()
    before = account.fencing_token
    form = client.get(url)
    saved = client.post(url, {"owner": account.owner, "balance": "1234.56", "_save": "Save"})
    account.refresh_from_db()
    edited = {
        "form_status": form.status_code,
        "status": saved.status_code,
        "location": saved.headers.get("Location"),
        "balance": str(account.balance),
        "token_went_up": account.fencing_token > before,
        # The token stored is the last one issued for the row's lock: the admin's own.
        "token_is_the_locks": account.fencing_token
        == get_backend(AccountAdmin.fencing_backend).fencing_counter(name),
    }

    AccountAdmin.fencing_timeout = 0.3
    token = account.fencing_token
    with lock(name, backend=AccountAdmin.fencing_backend, ttl=30, timeout=0):
        busy = client.post(url, {"owner": account.owner, "balance": "1.00", "_save": "Save"})
    page = client.get(url).content.decode()
    account.refresh_from_db()
    busy_result = {
        "status": busy.status_code,
        "location": busy.headers.get("Location"),
        "message": "Not saved: the row is locked by another holder right now" in page,
        "balance": str(account.balance),
        "token_unchanged": account.fencing_token == token,
    }

    added = client.post(
        "/admin/shop/account/add/", {"owner": "Grace Hopper", "balance": "5.00", "_save": "Save"}
    )
    new = Account.objects.filter(owner="Grace Hopper").first()
    return {
        "edited": edited,
        "busy": busy_result,
        "added": [
            added.status_code,
            None if new is None else [str(new.balance), new.fencing_token],
        ],
    }


def _poll(condition: Any, timeout: float = 10.0) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _hold_and_abandon(client: Any, backend: str) -> dict[str, Any]:
    """Press the live-locks page's two buttons, with leases shrunk to fractions of a second."""
    from demo_project.shop import views
    from distlocks import get_backend

    views.HOLD_TTL, views.HOLD_SECONDS, views.ABANDON_TTL = 0.3, 1.0, 0.3
    server = get_backend(backend)
    held = client.post("/locks/hold/", {"backend": backend, "mode": "hold"}, follow=True)
    again = client.post("/locks/hold/", {"backend": backend, "mode": "hold"}, follow=True)
    info = server.inspect("demo:nightly-report")

    def renewed_twice() -> bool:
        current = server.inspect("demo:nightly-report")
        return current is not None and current.renewals >= 2

    # PostgreSQL's listing does not count renewals (nothing expires there to renew).
    renewed = _poll(renewed_twice) if server.expires_on_server else None
    released = _poll(lambda: server.inspect("demo:nightly-report") is None)
    abandon = client.post("/locks/hold/", {"backend": backend, "mode": "abandon"}, follow=True)
    abandoned = server.inspect("demo:crashed-worker")
    expired = _poll(lambda: server.inspect("demo:crashed-worker") is None)
    return {
        "held_message": "Holding &#x27;demo:nightly-report&#x27;" in held.content.decode(),
        "busy_message": "is already held" in again.content.decode(),
        "held_at_first": info is not None,
        "renewed": renewed,
        "released": released,
        "abandon_refused": "Not taken: a lock on" in abandon.content.decode(),
        "abandoned_at_first": abandoned is not None,
        "abandoned_expired": expired,
    }


@pytest.fixture(scope="module")
def demo() -> dict[str, Any]:
    result = run_python("-m", "tests.test_demo")
    assert result.returncode == 0, result.stdout + result.stderr
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_charge_view_charges_exactly_once(demo: dict[str, Any], backend: str) -> None:
    race = demo["charge"][backend]["first"]
    assert race["status"] == 302
    assert race["page_status"] == 200
    assert race["new_charges"] == 1
    assert Counter(race["outcomes"]) == {"charged": 1, "LockNotAcquired": WORKERS - 1}
    assert race["summary"] == f"1 charged, {WORKERS - 1} LockNotAcquired"
    # Only the holder got a lease, hence a fencing token.
    assert len([token for token in race["tokens"] if token is not None]) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_charging_a_paid_invoice_again_charges_nothing(demo: dict[str, Any], backend: str) -> None:
    race = demo["charge"][backend]["again"]
    assert race["new_charges"] == 0
    assert "charged" not in race["outcomes"]
    assert "already paid" in race["outcomes"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_the_lock_every_worker_charges(demo: dict[str, Any], backend: str) -> None:
    # The demo's point: the same code without the lock double-charges.
    race = demo["charge"][backend]["unlocked"]
    assert race["new_charges"] == WORKERS
    assert race["outcomes"] == ["charged"] * WORKERS


def test_pages_render(demo: dict[str, Any]) -> None:
    assert demo["pages"] == {
        "/": 200,
        "/invoices/": 200,
        "/locks/": 200,
        "/fencing/": 200,
        "/lock-many/": 200,
        "/fenced/": 200,
        "/celery/": 200,
        "/admin/login/": 200,
    }
    links = ["/invoices/", "/locks/", "/fencing/", "/lock-many/", "/fenced/", "/celery/", "/admin/"]
    for link in links:
        assert f'href="{link}"' in demo["index"]


def _section(page: str, heading: str) -> str:
    return page.split(f"<h2>{heading}</h2>", 1)[1].split("<h2>", 1)[0]


def test_index_lists_what_exists_and_what_does_not(demo: dict[str, Any]) -> None:
    index = demo["index"]
    shown = _section(index, "Try it")
    assert "Fenced writes" in shown
    assert "FencedModelAdmin" in shown
    assert "PostgreSQL" in shown
    not_shown = _section(index, "In distlocks, not shown here yet")
    assert "alock()" in not_shown
    assert "PostgreSQL" not in not_shown
    assert "Fenced" not in not_shown
    assert "Celery single execution" in shown
    assert "lock_at_least_for" in shown
    coming = _section(index, "Not built yet")
    assert "Celery" not in coming
    for planned in [
        "/admin/distlocks/livelock/",
        "manage.py distlocks",
        "Redlock",
        "Sentinel",
        "Cluster",
        "rwlock()",
        "semaphore()",
        "Metrics",
    ]:
        assert planned in coming, planned
    assert "Fenced" not in coming
    assert "PostgreSQL" not in coming
    backends = _section(index, "Backends configured")
    assert "<code>distlocks.backends.postgres.PostgresBackend</code>" in backends
    assert "PostgreSQL database test_distlocks_demo_" in backends


@pytest.mark.parametrize("backend", BACKENDS)
def test_live_locks_page_lists_held_locks(demo: dict[str, Any], backend: str) -> None:
    live = demo["live"][backend]
    section = live["held"].split(f"<code>{backend}</code>", 1)[1].split("<h2>", 1)[0]
    assert "test:live:" in section
    assert f"<td>{live['token']}</td>" in section
    assert f"/ {demo['pid']} / MainThread" in section
    assert "test:live:" not in live["after"]


@pytest.mark.parametrize("backend", EXPIRING)
def test_hold_renews_then_releases_and_abandon_expires(demo: dict[str, Any], backend: str) -> None:
    assert demo["hold"][backend] == {
        "held_message": True,
        "busy_message": True,
        "held_at_first": True,
        # Its lease is far shorter than the hold: only renewal keeps it alive.
        "renewed": True,
        "released": True,
        "abandon_refused": False,
        "abandoned_at_first": True,
        # Not renewed, so it ends by its TTL, like a crashed holder's lock.
        "abandoned_expired": True,
    }


def test_hold_on_pg_releases_and_abandon_is_refused(demo: dict[str, Any]) -> None:
    assert demo["hold"]["pg"] == {
        "held_message": True,
        "busy_message": True,
        "held_at_first": True,
        "renewed": None,  # not checked: the pg listing does not count renewals
        "released": True,
        # A session lock has no TTL on the server: abandoned in this long-lived
        # process, it would never end, so the page says so instead of taking it.
        "abandon_refused": True,
        "abandoned_at_first": False,
        "abandoned_expired": True,
    }


@pytest.mark.parametrize("backend", ["default", "pg"])
def test_fencing_tokens_only_increase(demo: dict[str, Any], backend: str) -> None:
    runs = demo["fencing"][backend]
    tokens = [step["fencing_token"] for run in runs for step in run]
    assert tokens == sorted(set(tokens)), tokens
    for run in runs:
        evicted, after = run[-2]["fencing_token"], run[-1]["fencing_token"]
        # The force-release moved the counter: the evicted holder's token is outdated
        # at once, and the next holder's is higher still.
        assert after > evicted + 1
        assert "release() returned False" in run[-2]["note"]
        assert "raised LockLost" in run[-2]["note"]


@pytest.mark.parametrize("backend", ["default", "pg"])
def test_lock_many_crossing_transfers_both_finish(demo: dict[str, Any], backend: str) -> None:
    transfers = demo["lock_many"][backend]
    assert [t["outcome"] for t in transfers] == ["done", "done"]
    assert [t["order"] for t in transfers] == [["account:alice", "account:bob"]] * 2


@pytest.mark.parametrize("backend", EXPIRING)
def test_paused_holder_cannot_overwrite_a_fenced_row(demo: dict[str, Any], backend: str) -> None:
    run = demo["fenced"][backend]
    assert run["status"] == 302
    story = run["fenced"]
    assert story["a_outcome"] == "StaleFencingToken", story
    assert story["offered"] == story["a_token"]
    assert story["stored"] == story["b_token"]
    assert story["offered"] < story["stored"]
    # A really outlived its lease: B only got the lock once it had run out.
    # (The pause is timed from after A's read, so it can be a little under the ttl,
    # which counts from the grant: the lease's own verdict is what matters.)
    assert story["held_after_pause"] is False
    assert story["paused_for"] > 0
    assert story["ttl"] == PAUSE_TTL
    # The row kept B's write (and token), as the database says too.
    start = Decimal(story["start_balance"])
    assert Decimal(story["final_balance"]) == start + Decimal("50.00")
    assert story["final_token"] == story["b_token"]
    assert story["b_update_kept"] is True
    assert [step["who"] for step in story["steps"]] == ["A", "B", "A"]
    assert run["rows"]["fenced"][1] == story["b_token"]
    assert run["page"]["stale"] is True


@pytest.mark.parametrize("backend", EXPIRING)
def test_paused_holder_overwrites_a_plain_row(demo: dict[str, Any], backend: str) -> None:
    """The control: the same story on a plain model loses B's deposit."""
    story = demo["fenced"][backend]["plain"]
    assert story["a_outcome"] == "saved", story
    assert story["held_after_pause"] is False
    assert story["a_token"] < story["b_token"]
    start = Decimal(story["start_balance"])
    assert Decimal(story["final_balance"]) == start + Decimal("10.00")
    assert story["b_update_kept"] is False
    assert demo["fenced"][backend]["rows"]["plain"] == story["final_balance"]
    assert demo["fenced"][backend]["page"]["lost"] is True


@pytest.mark.parametrize("backend", EXPIRING)
def test_raw_sql_lowering_the_token_is_refused(demo: dict[str, Any], backend: str) -> None:
    raw = demo["fenced"][backend]["raw"]
    assert raw["outcome"] == "StaleFencingToken", raw
    assert raw["offered"] == raw["stored"] - 1
    assert raw["after"] == raw["before"]
    # Every FencedModel table: the accounts, and the Celery page's sales report.
    assert raw["trigger_tables"] == ["shop_account", "shop_salesreport"]
    assert demo["fenced"][backend]["page"]["refused"] is True


def test_fenced_page_does_not_offer_pg(demo: dict[str, Any]) -> None:
    assert demo["fenced_pg_refused"] is True


def test_admin_edits_the_fenced_account_under_its_lock(demo: dict[str, Any]) -> None:
    admin = demo["admin_account"]
    edited = admin["edited"]
    assert edited["form_status"] == 200
    assert (edited["status"], edited["location"]) == (302, "/admin/shop/account/")
    assert edited["balance"] == "1234.56"
    assert edited["token_went_up"] is True
    assert edited["token_is_the_locks"] is True
    # While another holder has the row's lock, the admin saves nothing and says why.
    busy = admin["busy"]
    assert busy["status"] == 302
    assert busy["location"].endswith("/change/")
    assert busy["message"] is True
    assert busy["balance"] == "1234.56"
    assert busy["token_unchanged"] is True
    # A new row needs no lock: it starts at token 0.
    assert admin["added"] == [302, ["5.00", 0]]


def test_periodic_job_runs_once_when_two_nodes_trigger_it(demo: dict[str, Any]) -> None:
    celery = demo["celery"]
    assert celery["before"] == {"triggers": 0, "runs": 0, "skipped": 0, "failed": 0}
    first, second = celery["first"], celery["second"]
    assert first["state"] == second["state"] == "SUCCESS"
    assert second["result"] is None  # skipped: on_duplicate="skip"
    token = first["result"]["fencing_token"]
    # The run is over, but lock_at_least_for keeps its lock for most of the period.
    assert celery["kept_seconds"] is not None and 0 < celery["kept_seconds"] <= 8
    rows = celery["rows"]
    assert rows[first["id"]]["outcome"] == "ran"
    assert rows[first["id"]]["triggered_by"] == "node-a"
    assert rows[first["id"]]["fencing_token"] == token
    # The skipped trigger was recorded by the task_postrun receiver, with the holder.
    assert rows[second["id"]]["outcome"] == "skipped"
    assert rows[second["id"]]["triggered_by"] == "node-b"
    assert rows[second["id"]]["holder_task_id"] == first["id"]
    assert rows[second["id"]]["fencing_token"] is None
    # The run wrote the fenced report row with its lease's token.
    assert celery["report"] == {"fencing_token": token, "refreshed_by": first["id"]}
    assert celery["summary"] == {"triggers": 2, "runs": 1, "skipped": 1, "failed": 0}
    assert celery["table_skipped_line"] is True


def test_import_button_queues_one_task_for_five_calls(demo: dict[str, Any]) -> None:
    celery = demo["celery"]
    first, second = celery["clicks"]
    assert first["status"] == second["status"] == 302
    assert len(first["ids"]) == 5
    assert len(set(first["ids"])) == 1
    # No worker took it, so the second click finds it still queued.
    assert second["ids"] == first["ids"]
    assert celery["queued"] == 1  # one message in the real broker for ten delay() calls
    assert celery["marker_task_id"] == first["ids"][0]
    assert celery["page_one_id"] is True
    assert celery["page_state"] is True
    assert celery["imports_partial"] is True
    assert celery["page_nav"] is True
    assert celery["bad_account"] is True
    assert celery["app_broker"] is True


def test_superuser_is_created_then_reset(demo: dict[str, Any]) -> None:
    assert demo["superuser_created"] == [True, False]
    assert demo["login"] == {"old": False, "new": True}
    assert demo["admin_index"] == 200


if __name__ == "__main__":
    print(json.dumps(drive_demo()))
