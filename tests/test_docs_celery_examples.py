"""docs/celery.md followed word for word, as a newcomer would.

The page's Python blocks are saved into a fresh Django project outside this repository
(``mysite`` with an app ``shop``): the block that names its file (``# mysite/celery.py``)
is saved there, every block that defines tasks becomes a module of ``shop`` imported by
``shop/tasks.py``, and the blocks marked ``# python manage.py shell`` are run by
``manage.py shell`` against a real prefork worker of that project, on the Redis server
of the test session. Each documented outcome is checked: a duplicate call gets the
queued task's id and result, a deduplicated chain fails with ``Deduplicated`` under the
queued task's id, a copy called during a retry's countdown is skipped while the
retried attempt runs, a periodic task keeps its lock for ``lock_at_least_for``, a
claimed invoice is charged with the run lock's token, and a fenced
settlement saves with it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from django.conf import settings

from tests.settings import _redis_db
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "celery.md"
SHELL = "# python manage.py shell"

#: What every task module of the newcomer's app imports (the page's blocks assume it).
HEADER = """\
from celery import shared_task

from distlocks.contrib.celery import SingleExecutionTask, current_lease, single_execution
from mysite.celery import app
from shop.models import Account, Invoice, Ledger, compute_balance

"""

FENCING_PAGE = ROOT / "docs" / "fencing.md"


def _docs_invoice() -> str:
    """docs/fencing.md's Invoice model, word for word with its imports: the first one
    the page defines (its "FencedModel" section), which a newcomer copies."""
    blocks = re.findall(r"^```python\n(.*?)^```", FENCING_PAGE.read_text(), re.S | re.M)
    found = [
        b for b in blocks
        if "class Invoice(FencedModel):" in b and "from distlocks.models import FencedModel" in b
    ]  # fmt: skip
    assert found, "docs/fencing.md no longer defines Invoice with its imports"
    return found[0]


#: The newcomer's models: docs/fencing.md's Invoice as the page defines it (nothing
#: added), then Account and Ledger, which no page defines as code: the fields the
#: "Fenced writes from tasks" example uses, with the default lock name its key relies on.
MODELS = (
    _docs_invoice()
    + """

class Account(FencedModel):  # fencing_lock_name is the default: "shop.account:{pk}"
    balance = models.IntegerField(default=0)


class Ledger(FencedModel):
    account = models.ForeignKey(Account, on_delete=models.CASCADE)
    amount = models.IntegerField()
    settled = models.BooleanField(default=False)


def compute_balance(account):
    return sum(Ledger.objects.filter(account=account).values_list("amount", flat=True))
"""
)


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def _shell_blocks() -> list[str]:
    return [b for b in _blocks() if b.startswith(SHELL)]


def _task_blocks() -> list[str]:
    return [b for b in _blocks() if "def " in b and not b.startswith(("#", SHELL))]


def _write_project(base: Path, queue: str) -> dict[str, str]:
    blocks = _blocks()
    named = {b.splitlines()[0][2:]: b for b in blocks if re.match(r"# [\w/]+\.py\n", b)}
    assert set(named) == {"mysite/celery.py"}
    (base / "mysite").mkdir()
    (base / "mysite" / "celery.py").write_text(named["mysite/celery.py"])
    (base / "mysite" / "__init__.py").write_text("from .celery import app as celery_app\n")
    # The settings block of the page, with the URLs of the test session's Redis.
    page_settings = next(b for b in blocks if b.startswith("CELERY_BROKER_URL"))
    documented: dict[str, str] = {}
    exec(page_settings, documented)
    assert {"CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"} <= set(documented)
    redis_url = settings.DISTLOCKS_BACKENDS["default"]["LOCATION"]
    broker, results = _redis_db(redis_url, 3), _redis_db(redis_url, 4)
    (base / "mysite" / "settings.py").write_text(
        f"""
SECRET_KEY = "docs-celery"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "distlocks", "shop"]
DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3",
                           "NAME": {str(base / "db.sqlite3")!r}}}}}
USE_TZ = True
DISTLOCKS_BACKENDS = {{"default": {{"BACKEND": "distlocks.backends.redis.RedisBackend",
                                    "LOCATION": {redis_url!r}}}}}
CELERY_BROKER_URL = {broker!r}
CELERY_RESULT_BACKEND = {results!r}
CELERY_TASK_DEFAULT_QUEUE = {queue!r}  # other tests' workers share this server
"""
    )
    (base / "manage.py").write_text(
        "import os, sys\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'mysite.settings')\n"
        "from django.core.management import execute_from_command_line\n"
        "execute_from_command_line(sys.argv)\n"
    )
    (base / "shop").mkdir()
    (base / "shop" / "__init__.py").touch()
    (base / "shop" / "models.py").write_text(MODELS)
    imports = []
    for number, block in enumerate(_task_blocks()):
        (base / "shop" / f"page_block_{number}.py").write_text(HEADER + block)
        imports.append(f"from shop.page_block_{number} import *  # noqa\n")
    (base / "shop" / "tasks.py").write_text("".join(imports))
    return {"broker": broker}


def _env(base: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = os.pathsep.join([str(base), str(ROOT)])
    return env


def _shell(base: Path, code: str, timeout: float = 90) -> None:
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=base, env=_env(base), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Celery, list]]:
    base = tmp_path_factory.mktemp("newcomer")
    urls = _write_project(base, queue=f"docs-celery-{uuid.uuid4().hex}")
    done = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--run-syncdb", "-v", "0"],
        cwd=base, env=_env(base), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    control = Celery("docs-celery-control", broker=urls["broker"], set_as_current=False)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        yield base, control, workers
    finally:
        for proc in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in workers:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def _start_worker(base: Path, control: Celery, workers: list) -> None:
    """`celery -A mysite worker --loglevel INFO`, as the page says (prefork by default)."""
    log = (base / "worker.log").open("w")
    name = f"docs-{uuid.uuid4().hex[:8]}@%h"
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "mysite", "worker", "--loglevel", "INFO",
         "--concurrency", "2", "-n", name, "--without-gossip", "--without-mingle"],
        cwd=base, env=_env(base), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    workers.append(proc)

    def ready() -> bool:
        assert proc.poll() is None, (base / "worker.log").read_text()[-3000:]
        answers = control.control.ping(timeout=0.5)
        return any(name.split("@")[0] in next(iter(a)) for a in answers)

    wait_for(ready, limit=90, what="the newcomer's Celery worker answering ping")


def test_the_page_has_the_examples_this_test_runs() -> None:
    assert len(_shell_blocks()) == 3
    names = "\n".join(_task_blocks())
    tasks = ("charge_invoice", "settle", "build_report", "send_report", "close_the_books", "export")
    for task in tasks:
        assert f"def {task}(" in names


@pytest.mark.timeout(300)
def test_the_examples_run_against_a_real_worker(project: tuple[Path, Celery, list]) -> None:
    base, control, workers = project
    duplicate, canvas, retry = _shell_blocks()
    # The duplicate call is made before any worker runs, so that it meets the first
    # copy queued whatever the machine's load; the block's get() then waits for the
    # worker started below. The wrapper only says when the block reached get().
    reached = base / "reached-get"
    signal_then_run = (
        "import celery.result\n"
        f"_get = celery.result.AsyncResult.get\n"
        "def get(self, *a, **k):\n"
        f"    open({str(reached)!r}, 'w').close()\n"
        "    return _get(self, *a, **k)\n"
        "celery.result.AsyncResult.get = get\n"
    )
    first = subprocess.Popen(
        [sys.executable, "manage.py", "shell", "-c", signal_then_run + duplicate],
        cwd=base, env=_env(base), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(lambda: reached.exists() or first.poll() is not None, limit=60, what="get()")
    # The retry block: a copy called during the countdown is skipped (the run lock is
    # kept for the retry, 20 s: ample for the copy to run first), and the retried
    # attempt takes the lock over and returns its result. Its key is its own, and the
    # worker holds a retry's countdown without taking a pool slot, so it runs beside
    # the blocks below instead of making them wait out its countdown (checked at the
    # end; the fixture stops it if a block fails first).
    retrying = subprocess.Popen(
        [sys.executable, "manage.py", "shell", "-c", retry],
        cwd=base, env=_env(base), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    workers.append(retrying)
    _start_worker(base, control, workers)
    out, err = first.communicate(timeout=90)
    assert first.returncode == 0, out[-3000:] + err[-3000:]

    # The canvas block: its own countdown keeps the first copy queued.
    _shell(base, canvas)

    # "Periodic tasks on several nodes": the run lock is kept until lock_at_least_for
    # seconds after the run started, although the body returned at once.
    books = next(n for n, b in enumerate(_task_blocks()) if "def close_the_books" in b)
    _shell(
        base,
        "from distlocks import get_backend\n"
        f"from shop.page_block_{books} import close_the_books\n"
        "assert close_the_books.delay().get(timeout=60) is None\n"
        "info = get_backend('default').inspect('close-the-books')\n"
        "assert info is not None, 'the run lock was not kept'\n"
        "assert 49 <= (info.expires_at - info.acquired_at).total_seconds() <= 51, info\n"
        "get_backend('default').force_release('close-the-books')  # a rerun's turn\n",
    )

    # The first block of the page: the invoice is claimed, then charged with the token.
    _shell(
        base,
        "from shop.models import Invoice\n"
        "from shop.page_block_0 import charge_invoice\n"
        "invoice = Invoice.objects.create(number='A-1', amount_cents=100)\n"
        "assert charge_invoice.delay(invoice.pk).get(timeout=60) is None\n"
        "invoice.refresh_from_db()\n"
        "assert invoice.status == 'paid', invoice.status\n"
        "assert invoice.fencing_token, 'not saved with the run lock token'\n",
    )

    # The "Fenced writes from tasks" block: saved with the run lock's token, no token passed.
    fenced = next(
        n for n, b in enumerate(_task_blocks()) if "def settle" in b and "fenced_update" in b
    )
    _shell(
        base,
        "from shop.models import Account, Ledger\n"
        f"from shop.page_block_{fenced} import settle\n"
        "account = Account.objects.create()\n"
        "Ledger.objects.create(account=account, amount=5)\n"
        "Ledger.objects.create(account=account, amount=7)\n"
        "settle.delay(account.pk).get(timeout=60)\n"
        "account.refresh_from_db()\n"
        "assert account.balance == 12, account.balance\n"
        "assert account.fencing_token\n"
        "assert not Ledger.objects.filter(account=account, settled=False).exists()\n"
        "assert len(set(Ledger.objects.values_list('fencing_token', flat=True))) == 1\n",
    )

    out, err = retrying.communicate(timeout=120)
    assert retrying.returncode == 0, out[-3000:] + err[-3000:]


@pytest.mark.parametrize(
    ("misspelt", "meant"),
    [("on_duplicat", "on_duplicate"), ("unique_whle", "unique_while"), ("tll", "ttl"),
     ("lock_at_least", "lock_at_least_for"), ("retry_count_down", "retry_countdown")],
)  # fmt: skip
def test_a_misspelt_option_of_the_decorator_fails_where_the_task_is_defined(
    misspelt: str, meant: str
) -> None:
    """The page: "a misspelt option ... fails at import with a message that says what to
    change". single_execution() hands unknown keywords to Celery, which would take any
    name as a task attribute, so the option meant would be silently left at its default."""
    from distlocks.contrib.celery import single_execution

    with pytest.raises(TypeError, match=rf"{misspelt}.*did you mean '{meant}'"):
        single_execution(key="docs:misspelt", **{misspelt: "skip"})


def test_celery_task_options_still_go_to_celery() -> None:
    from distlocks.contrib.celery import single_execution

    def body(self: object) -> None: ...

    app = Celery("docs-options", set_as_current=False)
    task = single_execution(
        app=app, name="docs.options", bind=True, acks_late=True, max_retries=3, rate_limit="1/s",
        time_limit=30, soft_time_limit=20, ignore_result=True, my_own_attribute=1,
    )(body)  # fmt: skip
    assert (task.acks_late, task.max_retries, task.rate_limit) == (True, 3, "1/s")
    assert task.my_own_attribute == 1
