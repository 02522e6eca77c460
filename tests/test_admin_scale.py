"""The live-locks listing of many locks: lock summaries instead of full records.

A listing reads a backend's ``iter_lock_summaries()`` where it has one (Redis): plain
tuples, no datetime, no parsed JSON, no reason text per lock; the shown rows only are
made into full :class:`~distlocks.livelocks.LiveLock` records. These tests check that
this changes nothing a listing shows: the same locks, statuses, counts, search and
filter results, and the same records for the rows shown, as the full records of
``iter_locks()`` classified one by one.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import uuid
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlocks import get_backend, livelocks, semaphore
from distlocks.backends.base import LockInfo
from distlocks.livelocks import EXPIRING, OK, ORPHANED, STATUSES, STUCK, LiveLock, classify

HOST = socket.gethostname()
#: A pid no process can have (above any pid_max): "no longer exists" on this host.
GONE_PID = 2**31 - 7
STUCK_AFTER = 3600.0
NOW = dt.datetime(2026, 11, 25, 12, 0, 0, 123456, tzinfo=dt.UTC)
NOW_MS = (NOW - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(milliseconds=1)
#: Moments of a listing: NOW, and a whole millisecond at which a lease can have exactly
#: a third of its ttl left, or a lock have been held exactly DISTLOCKS_STUCK_AFTER.
MOMENTS = st.sampled_from([NOW, NOW.replace(microsecond=123000)])


# -- the statuses of summaries, worked out on numbers ------------------------------------

#: Holder details as a server may hold them: none, plain, a Celery task id, a
#: PostgreSQL-looking session, an escape, text that is not JSON, not an object.
EXTRAS = st.sampled_from(
    [
        "",
        "{}",
        json.dumps({"python": "3.11"}),
        json.dumps({"celery_task_id": "task-0123"}),
        json.dumps({"backend_pid": 77}),
        json.dumps({"backend_pid": 77, "session_state": "active", "application_name": "x"}),
        '{"celery\\u005ftask_id": "escaped-0123"}',
        "not json",
        "[1, 2]",
    ]
)


@st.composite
def summaries(draw: st.DrawFn) -> tuple[Any, ...]:
    """One lock summary as RedisBackend.iter_lock_summaries() yields it, with times
    drawn around the boundaries of the statuses (exactly on them included)."""
    ttl = draw(st.sampled_from([None, 0.5, 1.0, 30.0, 3600.0, 0.001]))
    if ttl and draw(st.booleans()):
        # Left: around a third of the ttl, to the millisecond.
        third_ms = int(ttl * 1000 * livelocks.EXPIRING_FRACTION)
        expires = NOW_MS + third_ms + draw(st.integers(-2, 2))
    else:
        expires = draw(st.one_of(st.none(), st.integers(NOW_MS - 10_000, NOW_MS + 10**7)))
    if draw(st.booleans()):
        acquired = NOW_MS - int(STUCK_AFTER * 1000) + draw(st.integers(-2, 2))
    else:
        acquired = draw(st.one_of(st.none(), st.integers(NOW_MS - 10**8, NOW_MS)))
    return (
        f"lock:{draw(st.text('ab{}:é ', max_size=6))}",
        uuid.UUID(int=draw(st.integers(0, 2**128 - 1))).hex,
        draw(st.integers(0, 2**53)),
        draw(st.sampled_from([HOST, "elsewhere", ""])),
        draw(st.sampled_from([None, os.getpid(), GONE_PID, 0])),
        draw(st.sampled_from(["", "MainThread"])),
        acquired,
        expires,
        ttl,
        draw(st.integers(0, 3)),
        draw(st.integers(0, 2)),
        draw(EXTRAS),
    )


def pid_gone(pid: int) -> bool:
    return pid == GONE_PID


@settings(max_examples=300, deadline=None)
@given(
    found=st.lists(summaries(), max_size=12),
    query=st.sampled_from(["", "0123", "A", "elsewhere", HOST[:3]]),
    order=st.sampled_from([*sorted(livelocks.SORTS), "-name", "-expires", "-held"]),
    now=MOMENTS,
)
def test_summary_rows_list_what_full_records_list(
    found: list[tuple[Any, ...]], query: str, order: str, now: dt.datetime
) -> None:
    """Each summary's status is classify()'s on its full record, at the same moment
    (also exactly on the boundaries); a row shown is that record with that status and
    reason; searches, sorts, status filters and counts are those of the full records."""
    context = livelocks._Context(now, STUCK_AFTER, pid_gone)
    now_us = (now - livelocks._EPOCH) // livelocks._MICROSECOND
    rows = [livelocks._summary_row(summary, "alias", "", now_us, context) for summary in found]
    full = []
    for summary, row in zip(found, rows, strict=True):
        info = livelocks._summary_info(summary, "alias")
        item = LiveLock(info, *classify(info, now=now, stuck_after=STUCK_AFTER, pid_gone=pid_gone))
        full.append(item)
        assert livelocks._live(row, context) == item
    snapshot = livelocks.Snapshot(rows=rows, aliases=["alias"], context=context)
    expected = livelocks.select(full, query=query, order=order)
    assert snapshot.counts() == {"alias": dict(livelocks.status_counts(full))}
    for status in ("", *STATUSES):
        selection = snapshot.select(query=query, status=status, order=order)
        assert list(selection.rows) == [
            item for item in expected if not status or item.status == status
        ]
        assert selection.counts == livelocks.status_counts(expected)


def test_summary_statuses_on_their_boundaries() -> None:
    """Examples of each rule, a millisecond on either side of its boundary."""
    context = livelocks._Context(NOW, STUCK_AFTER, pid_gone)
    now_us = (NOW - livelocks._EPOCH) // livelocks._MICROSECOND

    def status(**changes: Any) -> str:
        fields = {
            "name": "n", "owner": "o", "token": 1, "host": "elsewhere", "pid": 1,
            "thread": "", "acquired": NOW_MS, "expires": NOW_MS + 30_000, "ttl": 30.0,
            "renewals": 0, "waiters": 0, "extra": "",
        }  # fmt: skip
        fields.update(changes)
        row = livelocks._summary_row(tuple(fields.values()), "a", "", now_us, context)
        return str(row[livelocks._STATUS])

    # The ms of NOW are 123.456: 10_000 ms left of a 30 s lease is exactly a third.
    third = NOW_MS + 10_000
    assert status() == OK
    assert status(expires=third + 1) == OK  # 10.000544 s left
    assert status(expires=third) == EXPIRING  # 9.999544 s
    assert status(expires=third, renewals=1) == ORPHANED
    stuck = NOW_MS - 3_600_000
    assert status(acquired=stuck) == STUCK  # held 3600.000456 s
    assert status(acquired=stuck + 1) == OK
    assert status(acquired=stuck, expires=third) == STUCK  # stuck before expiring
    assert status(host=HOST, pid=GONE_PID, acquired=stuck) == ORPHANED
    assert status(host="elsewhere", pid=GONE_PID) == OK
    assert status(ttl=None, expires=NOW_MS) == OK  # no lease: never expiring
    # At a whole millisecond: exactly a third left is not less than a third; held
    # exactly DISTLOCKS_STUCK_AFTER is not longer.
    context = livelocks._Context(NOW.replace(microsecond=123000), STUCK_AFTER, pid_gone)
    now_us -= 456
    assert status(expires=third) == OK
    assert status(expires=third - 1) == EXPIRING
    assert status(acquired=stuck) == OK
    assert status(acquired=stuck - 1) == STUCK


# -- a real Redis server: the listing against iter_locks() -------------------------------


KINDS_OF_LOCKS = st.sampled_from(
    ["ok", "expiring", "stuck", "orphaned-pid", "orphaned-renewals", "odd", "persistent"]
)


def write_lock(backend: Any, name: str, kind: str, index: int) -> None:
    """A lock hash as the acquire script writes it, in one of the states above (away
    from the boundaries: the two listings compared are read moments apart)."""
    now_ms = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    ttl_ms = 600_000
    fields: dict[str, Any] = {
        "owner": uuid.uuid4().hex, "name": name, "token": index + 1, "host": "elsewhere",
        "pid": 4242, "thread": "MainThread", "acquired_at": now_ms - 1000, "ttl": ttl_ms,
        "renewals": 0, "extra": "{}",
    }  # fmt: skip
    left = ttl_ms // 2
    if kind == "expiring":
        left = ttl_ms // 20
    elif kind == "stuck":
        fields["acquired_at"] = now_ms - int(STUCK_AFTER * 2000)
    elif kind == "orphaned-pid":
        fields.update(host=HOST, pid=GONE_PID)
    elif kind == "orphaned-renewals":
        fields["renewals"] = 3
        left = ttl_ms // 20
    elif kind == "odd":
        # Written by another program: no dates, a pid that is no number, a Celery
        # task, details that need parsing.
        del fields["acquired_at"]
        fields.update(pid="n/a", extra=json.dumps({"celery_task_id": f"task-{index:04d}"}))
    key = backend.all_keys(name).lock
    client = backend.client
    client.hset(key, mapping=fields)
    if kind != "persistent":
        client.pexpire(key, left)


@pytest.fixture(scope="module")
def scale_alias() -> Any:
    """A Redis alias with a key prefix of its own: only this module's locks."""
    alias = "scale"
    config = {
        "BACKEND": "distlocks.backends.redis.RedisBackend",
        "LOCATION": django_settings.REDIS_URL,
        # Locks are written here as hashes, not by the scripts: listed by SCAN, the
        # path these tests are about (tests/test_redis_index.py checks the index).
        "OPTIONS": {
            "key_prefix": f"distlocks-scale-{uuid.uuid4().hex[:8]}",
            "listing_index": False,
        },
    }
    with override_settings(
        DISTLOCKS_BACKENDS={**django_settings.DISTLOCKS_BACKENDS, alias: config},
        DISTLOCKS_STUCK_AFTER=STUCK_AFTER,
    ):
        backend = get_backend(alias)
        yield alias
        for key in backend.client.scan_iter(match=f"{backend.key_prefix}:*", count=1000):
            backend.client.delete(key)


def _comparable(info: LockInfo) -> tuple[Any, ...]:
    """The fields of a record but its expiry, which moves between two reads."""
    return (
        info.name, info.backend, info.owner, info.fencing_token, info.host, info.pid,
        info.thread, info.acquired_at, info.ttl, info.renewals, info.waiters, info.extra,
    )  # fmt: skip


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    kinds=st.lists(KINDS_OF_LOCKS, min_size=1, max_size=25),
    taken=st.integers(0, 3),
    permits=st.integers(0, 2),
)
def test_redis_listing_equals_its_full_records(
    scale_alias: str, kinds: list[str], taken: int, permits: int
) -> None:
    """Locks of every status (written as the scripts write them, some taken for real,
    some semaphore permits) listed from summaries: the same rows, statuses, counts,
    search and filter results as the full records of iter_locks() classified with
    the listing's moment; and the rows shown are those records."""
    backend = get_backend(scale_alias)
    run = uuid.uuid4().hex[:8]
    for index, kind in enumerate(kinds):
        write_lock(backend, f"{run}:w{index:03d}", kind, index)
    held = [
        backend.acquire(f"{run}:t{index}", uuid.uuid4().hex, 600.0, _holder())
        for index in range(taken)
    ]
    assert all(result.acquired for result in held)
    leases = [
        semaphore(f"{run}:sem", limit=3, backend=scale_alias, ttl=600).acquire()
        for _ in range(permits)
    ]
    try:
        snapshot = livelocks.collect([scale_alias])
        assert not snapshot.errors
        context = snapshot.context
        assert context is not None
        full = [
            LiveLock(
                info,
                *classify(
                    info,
                    now=context.now,
                    stuck_after=context.stuck_after,
                    pid_gone=context.pid_gone,
                ),
            )
            for info in backend.iter_locks()
            if info.name.startswith(run)
        ]
        listed = [item for item in snapshot.locks if item.name.startswith(run)]
        assert len(listed) == len(kinds) + taken + permits
        key = lambda item: (item.name, item.info.owner)  # noqa: E731
        assert sorted(map(key, listed)) == sorted(map(key, full))
        by_key = {key(item): item for item in full}
        for item in listed:
            other = by_key[key(item)]
            assert (item.status, item.reason, item.kind) == (other.status, other.reason, other.kind)
            assert _comparable(item.info) == _comparable(other.info)
            assert item.info.expires_at is not None or other.info.expires_at is None
            if item.info.expires_at is not None:
                assert other.info.expires_at is not None
                assert abs(item.info.expires_at - other.info.expires_at) < dt.timedelta(seconds=5)
        expected_status = {f"{run}:w{i:03d}": k for i, k in enumerate(kinds)}
        wanted = {
            "ok": OK, "persistent": OK, "odd": OK, "expiring": EXPIRING, "stuck": STUCK,
            "orphaned-pid": ORPHANED, "orphaned-renewals": ORPHANED,
        }  # fmt: skip
        for item in listed:
            if item.name in expected_status:
                assert item.status == wanted[expected_status[item.name]], item
        for query in (run, f"{run}:w00", "task-000", HOST):
            for status in ("", *STATUSES):
                selection = snapshot.select(query=query, status=status)
                shown = [key(item) for item in selection.rows if item.name.startswith(run)]
                mine = [item for item in full if livelocks.matches(item, query)]
                assert shown == [
                    key(item)
                    for item in livelocks.select(mine, order="name")
                    if not status or item.status == status
                ]
        counts = livelocks.status_counts(listed)
        assert counts == livelocks.status_counts(full)
    finally:
        for lease in leases:
            lease.release()
        for key_ in backend.client.scan_iter(match=f"{backend.key_prefix}:*{run}*", count=1000):
            backend.client.delete(key_)


def _holder() -> Any:
    from distlocks.locks import current_holder

    return current_holder()
