"""Defects found by review of fencing and of releases inside transactions, each with the
case that showed it."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from distlocks import lock
from distlocks.fencing import unfenced
from tests.testapp.models import Account


class ProxyAccount(Account):
    class Meta:
        proxy = True
        app_label = "testapp"


def _stored(pk: Any) -> tuple[Any, ...]:
    return tuple(Account.objects.filter(pk=pk).values_list("owner", "balance", "fencing_token")[0])


@pytest.mark.django_db
@pytest.mark.parametrize("how", ["token", "update_fields", "inside-the-lock"])
def test_a_fenced_save_of_a_proxy_writes_its_fields(how: str) -> None:
    with unfenced():
        row = Account.objects.create(owner="before", balance=1)
    proxy = ProxyAccount.objects.get(pk=row.pk)
    proxy.owner, proxy.balance = "after", 99
    if how == "token":
        proxy.save(fencing_token=5)
        assert _stored(row.pk) == ("after", 99, 5)
    elif how == "update_fields":
        proxy.save(fencing_token=6, update_fields=["owner"])
        assert _stored(row.pk) == ("after", 1, 6)
    else:
        with lock(f"account:{row.pk}", backend="locmem", ttl=10) as lease:
            proxy.save()
        assert _stored(row.pk) == ("after", 99, lease.fencing_token)


@pytest.mark.django_db
def test_a_fenced_save_of_a_deferred_instance_writes_the_loaded_fields_only() -> None:
    with unfenced():
        row = Account.objects.create(owner="o", balance=1)
    partial = Account.objects.only("balance").get(pk=row.pk)
    # Changed meanwhile, keeping the token (a maintenance write).
    with unfenced():
        Account.objects.filter(pk=row.pk).update(owner="changed meanwhile")
    partial.balance = 7
    with CaptureQueriesContext(connection) as queries:
        partial.save(fencing_token=4)
    # One UPDATE of the loaded field (and the token), as Django's save writes it: no
    # deferred field loaded (a SELECT each) to be written back over a newer value.
    assert len(queries) == 1, [q["sql"] for q in queries]
    assert '"owner"' not in queries[0]["sql"] and '"balance"' in queries[0]["sql"]
    assert _stored(row.pk) == ("changed meanwhile", 7, 4)


@pytest.mark.django_db(transaction=True)
def test_asave_and_adelete_take_a_token() -> None:
    with unfenced():
        row = Account.objects.create(owner="o", balance=1)
    row.balance = 3

    async def write() -> None:
        await row.asave(fencing_token=2)
        assert await Account.objects.filter(pk=row.pk, balance=3, fencing_token=2).aexists()
        await row.adelete(fencing_token=2)

    asyncio.run(write())
    assert not Account.objects.filter(pk=row.pk).exists()


@pytest.mark.django_db(transaction=True)
def test_a_failing_commit_callback_does_not_keep_a_deferred_release(name: str) -> None:
    """An on_commit callback registered before the release raises: Django stops running
    callbacks there, and keeps the rest alive with the exception. The lock is freed at
    the COMMIT anyway, even while the exception is kept."""
    kept: list[BaseException] = []
    lease = lock(name, backend="locmem", ttl=30)
    try:
        with transaction.atomic():
            held = lease.acquire()
            transaction.on_commit(lambda: 1 / 0)
            held.release()  # deferred to the COMMIT
            assert held.release_pending
    except ZeroDivisionError as exc:
        kept.append(exc)
    assert kept, "the failing callback should have raised at the COMMIT"
    assert not held.held()
    with lock(name, backend="locmem", ttl=5, timeout=0):
        pass


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_ending_a_deferred_release_does_not_block(name: str) -> None:
    """A thread of the parent holds the lease's mutex (as the renewer does mid-renewal)
    at the fork: the child ending its copy of the transaction returns at once."""
    with transaction.atomic():
        held = lock(name, backend="locmem", ttl=30).acquire()
        held.release()
        deferral = held._deferral
        assert deferral is not None
        holding, done = threading.Event(), threading.Event()

        def renewer() -> None:
            with held._mutex:
                holding.set()
                done.wait(10)

        thread = threading.Thread(target=renewer)
        thread.start()
        assert holding.wait(5)
        pid = os.fork()
        if pid == 0:  # the child
            try:
                # What ending its copy of the transaction reaches (closing the
                # connection drops the commit hook, whose finalizer ends the deferral).
                held._release_deferred(deferral)
            finally:
                os._exit(0)
        deadline = time.monotonic() + 10
        status = None
        while time.monotonic() < deadline:
            finished, status = os.waitpid(pid, os.WNOHANG)
            if finished:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        done.set()
        thread.join(5)
        assert status == 0, "the child blocked on the parent's mutex"
    # The parent's COMMIT frees it.
    with lock(name, backend="locmem", ttl=5, timeout=0):
        pass
