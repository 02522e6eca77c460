"""A lease kept on purpose after its holder finished (``Lease.release_after()``, which
``lock_at_least_for`` uses) is shown as ``kept``, with when it ends, never as an
orphaned or expiring alarm: on the lock's page, in the listing (the Redis listing index
included), in the metrics' counts, and after its holder process has exited."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.test import Client

from distlocks import livelocks, lock
from tests.test_livelocks_admin import _staff

pytestmark = pytest.mark.django_db

KEEP_FOR = 3.0


def _status_now(alias: str, name: str) -> set[str]:
    """The lock's status as the lock's page (inspect) and the listing (with its fast
    path for rows without details) work it out; the metrics' tally counts it as kept."""
    seen = set()
    found = livelocks.inspect(alias, name)
    if found is not None:
        seen.add(found.status)
    livelocks.snapshots.clear()
    for item in livelocks.complete(list(livelocks.collect([alias]).select(query=name).rows)):
        seen.add(item.status)
    # The metrics' tally counts every lock of the server (other tests' too): this one
    # must be among the kept, whatever else is held.
    kept = livelocks.tally([alias]).counts[alias][livelocks.KEPT]
    assert kept >= 1 or livelocks.inspect(alias, name) is None  # (or it just ran out)
    return seen


@pytest.mark.parametrize("alias", ["redis", "locmem"])
def test_a_kept_lease_is_kept_until_it_ends_never_orphaned(alias: str, name: str) -> None:
    lease = lock(name, backend=alias, ttl=30, auto_renew=False).acquire()
    lease.extend(30)  # renewed once: a lease that then stops renewing looks orphaned
    lease.release_after(KEEP_FOR)
    assert not lease.held()
    deadline = time.monotonic() + KEEP_FOR + 10
    statuses: list[set[str]] = []
    while time.monotonic() < deadline:
        found = livelocks.inspect(alias, name)
        if found is None:
            break
        statuses.append(_status_now(alias, name))
        time.sleep(0.2)
    # It was seen in the last third of its keep time (where "orphaned" was shown) and
    # then ran out; never anything but "kept".
    assert len(statuses) >= 5, statuses
    assert all(s == {livelocks.KEPT} for s in statuses), statuses
    assert livelocks.inspect(alias, name) is None


@pytest.mark.parametrize("alias", ["redis", "locmem"])
def test_the_page_says_kept_and_when_it_ends(alias: str, name: str, django_user_model: Any) -> None:
    lease = lock(name, backend=alias, ttl=30).acquire()
    lease.release_after(60)
    client = Client()
    client.force_login(_staff(django_user_model, "viewer", "view_livelock"))
    page = client.get("/admin/distlocks/livelock/lock/", {"backend": alias, "name": name})
    text = page.content.decode()
    assert page.status_code == 200
    assert 'distlocks-status-kept">kept<' in text
    assert 'distlocks-status-orphaned">' not in text
    assert "kept on purpose" in text and "it ends in" in text
    livelocks.snapshots.clear()  # a listing cached by an earlier test predates this lock
    listing = client.get("/admin/distlocks/livelock/", {"q": name, "refresh": "0"}).content
    assert b'distlocks-status-kept"' in listing
    assert livelocks.tally([alias]).counts[alias][livelocks.KEPT] >= 1
    lease_gone = livelocks.inspect(alias, name)
    assert lease_gone is not None and lease_gone.status == livelocks.KEPT
