"""Review 7: a fenced write whose transaction commits after its lease was
force-released, on a real PostgreSQL database and a real Redis lock.

Holder A writes the row inside ``transaction.atomic()`` and leaves its ``with lock``
block (the release waits for the COMMIT). An operator force-releases A's lock before
A commits. Holder B takes the lock and claims the row: its claim waits for A's row
lock, so it runs after A's COMMIT and sees A's write. Then, A's late writes (its
paused thread resuming after the COMMIT) are refused, A learns of the loss
(``lock_lost``), and no committed write is lost.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, connections, transaction

from distlocks import get_backend, lock
from distlocks.exceptions import StaleFencingToken
from distlocks.signals import lock_lost
from tests.testapp.models import Account
from tests.waiting import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]


def _waiting_on_a_row_lock(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        found = cursor.fetchone()
    return found is not None and found[0] == "Lock"


def test_a_commit_after_a_force_release_is_ordered_by_the_next_claim(name: str) -> None:
    row = Account(owner="ann", balance=0)
    row.save(fencing_token=0)
    lost: list[str] = []
    events = {key: threading.Event() for key in ("written", "commit", "committed")}
    seen: dict[str, Any] = {}

    def on_lost(sender: Any, lease: Any = None, **kwargs: Any) -> None:
        if getattr(lease, "name", None) == name:
            lost.append(str(kwargs.get("reason", "")))

    def holder_a() -> None:
        try:
            mine = Account.objects.get(pk=row.pk)
            with transaction.atomic():
                with lock(name, backend="redis", ttl=60) as lease:
                    seen["a"] = lease
                    mine.balance = 1
                    mine.save(fencing_token=lease)
                seen["pending"] = lease.release_pending
                events["written"].set()
                assert events["commit"].wait(120)
            events["committed"].set()
            # The paused holder resumes after its COMMIT and writes again.
            mine.balance = 2
            try:
                mine.save(fencing_token=lease.fencing_token)
                seen["late"] = "written"
            except StaleFencingToken:
                seen["late"] = "refused"
        finally:
            connections.close_all()

    lock_lost.connect(on_lost)
    a = threading.Thread(target=holder_a)
    a.start()
    try:
        assert events["written"].wait(120)
        assert seen["pending"] is True
        lease_a = seen["a"]
        # The operator frees A's lock while A's transaction is still open.
        assert get_backend("redis").force_release(name, lease_a.fencing_token)
        lease_b = lock(name, backend="redis", ttl=60, timeout=10).acquire()
        assert lease_b.fencing_token > lease_a.fencing_token
        claimed: dict[str, Any] = {}

        def holder_b() -> None:
            try:
                claimed["pid"] = connection.cursor().connection.info.backend_pid
                claimed["rows"] = lease_b.claim(Account.objects.filter(pk=row.pk))
                claimed["balance"] = Account.objects.get(pk=row.pk).balance
            finally:
                connections.close_all()

        b = threading.Thread(target=holder_b)
        b.start()
        wait_for(lambda: "pid" in claimed, 60, "B's connection")
        wait_for(lambda: _waiting_on_a_row_lock(claimed["pid"]), 60, "B's claim to wait")
        events["commit"].set()
        b.join(120)
        a.join(120)
        assert not a.is_alive() and not b.is_alive()
        assert claimed["rows"] == 1
        # A's late write races B's claim for the row once A's COMMIT lets both go (B
        # waited on A's transaction, not in a queue A's next UPDATE must join). Either
        # order is fenced correctly: before B's claim it lands (A's token is still the
        # row's newest) and B's claim, then B's read, come after it; after B's claim
        # it is refused. Never both: a write that lands after B's claim.
        if seen["late"] == "written":
            assert claimed["balance"] == 2, "A's late write landed after B's claim"
        else:
            assert seen["late"] == "refused" and claimed["balance"] == 1
        wait_for(lambda: lost, 60, "A to learn it lost the lock")
        stored = Account.objects.values_list("balance", "fencing_token").get(pk=row.pk)
        assert stored == (claimed["balance"], lease_b.fencing_token)
        lease_b.release()
    finally:
        events["commit"].set()
        lock_lost.disconnect(on_lost)
        a.join(120)
