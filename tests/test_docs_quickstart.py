"""docs/quickstart.md and docs/fencing.md's worked example, followed word for word.

A fresh Django project is written outside this repository (``mysite``, with the apps
``shop`` and ``billing``) from the pages' own blocks: the settings block of the quickstart
(its Redis URL replaced by the test session's server), its PostgreSQL block (on a database
of its own, created on the session's server), the ``Account`` model, and the worked
example's ``billing/models.py``, ``billing/worker.py`` and management command. Then every
runnable block of the quickstart is run, in order, by ``manage.py shell``, and the worked
example's command charges a due invoice in a process of its own.

Only what a page leaves to the reader is supplied: the ``Invoice``/``Order`` models and the
functions a block calls but does not define (``provider.charge``, ``import_catalog``...).
A block the runner does not know fails the test, so a new example is run, not skipped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from django.conf import settings

from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "docs" / "quickstart.md"
FENCING = ROOT / "docs" / "fencing.md"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


#: The connection keywords of each project's database (see the fixture).
DSN: dict[Path, dict[str, object]] = {}


def blocks(page: Path, section: str = "") -> list[str]:
    """The Python blocks of ``page``, or of its section headed ``section``."""
    text = page.read_text()
    if section:
        text = text.split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


#: What the quickstart's blocks use without defining it: the reader's own code.
MODELS = """\
from django.db import models

from distlocks.models import FencedModel


class Invoice(models.Model):
    paid = models.BooleanField(default=False)


class Order(models.Model):
    status = models.CharField(max_length=20, default="new")

"""

PRELUDE = """\
import asyncio
import logging

from django.http import HttpResponse

from distlocks import lock
from shop.models import Account, Invoice, Order

logger = logging.getLogger("quickstart")
charged, reports, imported, transfers = [], [], [], []


class provider:
    @staticmethod
    def charge(invoice):
        charged.append(invoice.pk)


class alerts:
    @staticmethod
    def send(text): ...


async def charge(invoice_id, fencing_token):
    assert fencing_token > 0
    charged.append(invoice_id)


def import_catalog(): imported.append("catalog")
def import_batch(batch): imported.append(batch)
def build_report(): reports.append("built")
def rebuild_ledger(): ...
def transfer(src, dst, amount): transfers.append((src, dst, amount))
def refund(): ...


batches = [1, 2]
src, dst, amount = 1, 2, 10
order_id = Order.objects.create().pk
invoice_id = Invoice.objects.create().pk
account = Account.objects.create(balance=100)
"""

#: After the blocks: each defined function called once, and its effect checked.
CHECKS = """\
assert charged == [invoice_id], charged  # by the asyncio block's pay()
pay(invoice_id)
assert Invoice.objects.get(pk=invoice_id).paid and charged == [invoice_id] * 2, charged
nightly_report()
settle()  # takes "account:42", then refund() takes it again
assert imported == ["catalog", 1, 2] and reports == ["built"], (imported, reports)
assert transfers == [(1, 2, 10)] and Order.objects.get(pk=order_id).status == "shipped"
account.refresh_from_db()
assert account.balance == 90 and account.fencing_token > 0, account.balance
response = view(None, Invoice.objects.create().pk)
assert response.status_code == 200, response.content
busy = lock(f"invoice:{invoice_id}", timeout=0).acquire()
try:
    # The page's answer to a busy invoice, after pay()'s timeout of 5 s.
    assert view(None, invoice_id).status_code == 409
finally:
    busy.release()
print("QUICKSTART-OK")
"""


def _runnable(block: str) -> str | None:
    """The block as code to run in the shell, or None for a settings or signature block."""
    first = block.splitlines()[0]
    if re.match(r"(INSTALLED_APPS|DISTLOCKS_BACKENDS) = ", first) or "<default>" in block:
        return None  # settings (written into mysite/settings.py) and signatures
    if first.startswith("from .local_settings"):
        return None  # the sandbox's settings file: the test has servers of its own
    if first.startswith("from django.db import models"):
        return None  # the model: written into shop/models.py
    if "await " in block and "async def" in block and re.search(r"^lease = await", block, re.M):
        # Top-level await, as in an async view or a notebook: run on a loop here.
        return (
            "async def _asyncio_block():\n"
            + textwrap.indent(block, "    ")
            + "    await pay(invoice_id)\n    await nightly_report()\n"
            "asyncio.run(_asyncio_block())\n"
        )
    if re.search(r"^\s*return HttpResponse", block, re.M):
        # The view body of "A typical call site".
        return "def view(request, invoice_id):\n" + textwrap.indent(block, "    ")
    return block


def _quickstart_code() -> str:
    code = [PRELUDE]
    for block in blocks(QUICKSTART):
        runnable = _runnable(block)
        if runnable is not None:
            code.append(runnable)
    code.append(CHECKS)
    return "\n".join(code)


def _settings_blocks() -> tuple[dict, dict]:
    found = [b for b in blocks(QUICKSTART) if re.match(r"(INSTALLED_APPS|DISTLOCKS_BACKENDS) ", b)]
    first: dict = {}
    exec(found[0], first)  # INSTALLED_APPS and the Redis backend
    postgres: dict = {}
    exec(next(b for b in found if "PostgresBackend" in b), postgres)
    return first, postgres["DISTLOCKS_BACKENDS"]


def _fencing_files() -> dict[str, str]:
    named = {}
    for block in blocks(FENCING, "Worked example"):
        match = re.match(r"# (billing/[\w/]+\.py)\n", block)
        if match:
            named[match.group(1)] = block
    return named


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, pg_ready: None) -> Iterator[Path]:
    """The newcomer's project, migrated; its database's connection keywords are in
    ``DSN[base]``."""
    base = tmp_path_factory.mktemp("quickstart")
    server = settings.DATABASES["default"]
    database = f"quickstart_{uuid.uuid4().hex[:12]}"
    dsn = {
        "host": server["HOST"], "port": server["PORT"], "user": server["USER"],
        "password": server["PASSWORD"], "dbname": "postgres",
    }  # fmt: skip
    with psycopg.connect(**dsn, autocommit=True) as conn:
        try:
            conn.execute(f'CREATE DATABASE "{database}"')
        except psycopg.errors.InsufficientPrivilege:
            pytest.skip(
                "the test server's role may not CREATE DATABASE (DISTLOCKS_TEST_DATABASE_URL)"
            )
    try:
        _write_project(base, database)
        done = subprocess.run(
            [sys.executable, "manage.py", "makemigrations", "shop", "billing", "-v", "0"],
            cwd=base, env=_env(base), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        done = subprocess.run(
            [sys.executable, "manage.py", "migrate", "-v", "0"],
            cwd=base, env=_env(base), capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        DSN[base] = {**dsn, "dbname": database}
        yield base
    finally:
        with psycopg.connect(**dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def _write_project(base: Path, database: str) -> None:
    first, postgres = _settings_blocks()
    backends = first["DISTLOCKS_BACKENDS"]
    # The page's Redis is the usual local one; the test session's stands in for it.
    backends["default"]["LOCATION"] = settings.DISTLOCKS_BACKENDS["default"]["LOCATION"]
    backends["pg"] = postgres["default"]
    backends["pg-xact"] = postgres["pg-xact"]
    apps = [app for app in first["INSTALLED_APPS"] if app is not Ellipsis]
    server = {
        key: settings.DATABASES["default"][key] for key in ("HOST", "PORT", "USER", "PASSWORD")
    }
    (base / "mysite").mkdir()
    (base / "mysite" / "__init__.py").touch()
    (base / "mysite" / "settings.py").write_text(
        f"""
SECRET_KEY = "docs-quickstart"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", *{apps!r},
                  "shop", "billing"]
DATABASES = {{"default": {{"ENGINE": "django.db.backends.postgresql", "NAME": {database!r},
                           **{server!r}}}}}
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DISTLOCKS_BACKENDS = {backends!r}
# Other test files use the same Redis server: this project's keys are its own.
DISTLOCKS_KEY_PREFIX = {f"quickstart-{uuid.uuid4().hex[:8]}"!r}
"""
    )
    (base / "manage.py").write_text(
        "import os, sys\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'mysite.settings')\n"
        "from django.core.management import execute_from_command_line\n"
        "execute_from_command_line(sys.argv)\n"
    )
    account = next(b for b in blocks(QUICKSTART) if b.startswith("from django.db import models"))
    (base / "shop").mkdir()
    (base / "shop" / "__init__.py").touch()
    (base / "shop" / "models.py").write_text(MODELS + account.split("\n\n\n", 1)[1])
    files = _fencing_files()
    assert set(files) == {
        "billing/models.py",
        "billing/worker.py",
        "billing/management/commands/charge_invoices.py",
    }
    for path, text in files.items():
        target = base / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    for package in ("billing", "billing/management", "billing/management/commands"):
        (base / package / "__init__.py").touch()
    # "your payment provider's client": one charge per idempotency key, as providers do.
    (base / "billing" / "payments.py").write_text(
        "import types\n"
        "charges = {}\n"
        "def charge(amount_cents, idempotency_key):\n"
        "    return charges.setdefault(idempotency_key, types.SimpleNamespace("
        "id=f'ch_{len(charges) + 1}'))\n"
    )


def _env(base: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = os.pathsep.join([str(base), str(ROOT)])
    return env


def _shell(base: Path, code: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=base, env=_env(base), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_runner_knows_every_block_of_the_quickstart() -> None:
    code = _quickstart_code()
    compile(code, "quickstart", "exec")  # every block it runs is valid Python
    for name in ("def pay(", "def nightly_report(", "lock_many(", "fenced_lock(", "lock_lost"):
        assert name in code


def test_the_settings_blocks_pass_the_system_checks(project: Path) -> None:
    done = subprocess.run(
        [sys.executable, "manage.py", "check", "--fail-level", "WARNING"],
        cwd=project, env=_env(project), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_quickstart_blocks_run_in_order(project: Path) -> None:
    assert "QUICKSTART-OK" in _shell(project, _quickstart_code())


def test_the_worked_example_charges_each_invoice_once(project: Path) -> None:
    out = _shell(
        project,
        "from billing import payments\n"
        "from billing.models import Invoice\n"
        "from billing.worker import charge_once\n"
        "invoice = Invoice.objects.create(number='W-1', amount_cents=500)\n"
        "charge_once(Invoice.objects.get(pk=invoice.pk))\n"
        "charge_once(Invoice.objects.get(pk=invoice.pk))  # paid already: returns\n"
        "invoice.refresh_from_db()\n"
        "assert invoice.status == 'paid' and invoice.charge_id == 'ch_1', invoice.charge_id\n"
        "assert len(payments.charges) == 1 and invoice.fencing_token > 0\n"
        "print('WORKED-OK')\n",
    )
    assert "WORKED-OK" in out


def test_the_worked_example_command_charges_due_invoices(project: Path) -> None:
    number = f"C-{uuid.uuid4().hex[:6]}"
    _shell(
        project,
        "from billing.models import Invoice\n"
        f"Invoice.objects.create(number={number!r}, amount_cents=700)\n",
    )
    log = (project / "command.log").open("w")
    command = subprocess.Popen(
        [sys.executable, "manage.py", "charge_invoices"],
        cwd=project, env=_env(project), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    conn = psycopg.connect(**DSN[project], autocommit=True)  # type: ignore[arg-type]

    def charged() -> bool:
        assert command.poll() is None, (project / "command.log").read_text()[-3000:]
        row = conn.execute(
            "SELECT status, charge_id FROM billing_invoice WHERE number = %s", [number]
        ).fetchone()
        return row == ("paid", "ch_1")

    try:
        wait_for(charged, limit=120, what="the charge_invoices command charging the invoice")
    finally:
        conn.close()
        os.killpg(command.pid, signal.SIGTERM)
        command.wait(30)
    assert command.returncode == -signal.SIGTERM, (project / "command.log").read_text()[-3000:]
