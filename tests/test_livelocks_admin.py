"""The admin page of live locks: permissions, CSRF, real locks of every backend
(one held by another OS process), statuses, a backend that is down, force release."""

from __future__ import annotations

import datetime as dt
import multiprocessing
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.test import Client, override_settings

from distlocks import get_backend, livelocks, lock
from distlocks.backends.base import LockInfo
from distlocks.exceptions import LockLost
from distlocks.livelocks import (
    EXPIRING,
    OK,
    ORPHANED,
    STUCK,
    classify,
)
from tests.conftest import alias_fixture
from tests.waiting import wait_for

LIST_URL = "/admin/distlocks/livelock/"
LOCK_URL = "/admin/distlocks/livelock/lock/"
RELEASE_URL = "/admin/distlocks/livelock/release/"


# -- a holder in another OS process ---------------------------------------------------


def hold_in_child(alias: str, name: str, work_dir: str, ttl: float, task_id: str) -> None:
    """Run in another process: hold ``name`` (renewed), report token and pid, then wait
    until the lease is lost (logging why) or the test asks it to stop."""
    from tests.workers import setup_django

    setup_django()
    from distlocks import lock
    from distlocks.locks import holder_extra

    work = Path(work_dir)
    lost = threading.Event()
    holder_extra.set({"celery_task_id": task_id})
    lease = lock(name, backend=alias, ttl=ttl, timeout=30, on_lost=lambda _: lost.set()).acquire()
    tmp = work / "acquired.tmp"
    tmp.write_text(f"{lease.fencing_token} {os.getpid()}")
    os.replace(tmp, work / "acquired")
    deadline = time.monotonic() + 240
    while not lost.wait(0.05):
        if (work / "stop").exists() or time.monotonic() > deadline:
            lease.release()
            return
    (work / "lost").write_text(lease.lost_reason or "lost")


class ChildHolder:
    """A lock held by another OS process, started and stopped by the test."""

    def __init__(self, alias: str, name: str, work: Path, ttl: float = 2.0) -> None:
        self.alias, self.name, self.work = alias, name, work
        self.task_id = f"task-{name[-12:]}"
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(
            target=hold_in_child, args=(alias, name, str(work), ttl, self.task_id), daemon=True
        )

    def start(self) -> ChildHolder:
        self.process.start()
        wait_for(lambda: (self.work / "acquired").exists(), 90, "the child holding the lock")
        token, pid = (self.work / "acquired").read_text().split()
        self.token, self.pid = int(token), int(pid)
        return self

    def lost_reason(self) -> str | None:
        """What the child reported when it lost its lease; None until it has written
        it (a file is created empty first)."""
        path = self.work / "lost"
        return (path.read_text() if path.exists() else "") or None

    def stop(self) -> None:
        (self.work / "stop").write_text("")
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


@pytest.fixture
def child_holder(tmp_path: Path, pg_ready: None) -> Iterator[Any]:
    started: list[ChildHolder] = []

    def start(alias: str, name: str, ttl: float = 2.0) -> ChildHolder:
        work = tmp_path / f"child{len(started)}"
        work.mkdir()
        holder = ChildHolder(alias, name, work, ttl)
        started.append(holder)
        return holder.start()

    yield start
    for holder in started:
        holder.stop()


# -- reading the page -------------------------------------------------------------------


class _Rows(HTMLParser):
    """The rows of ``table#result_list``: one dict per row, cell class -> text."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self._in_table = False
        self._row: dict[str, str] | None = None
        self._cell: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = dict(attrs)
        if tag == "table" and attr.get("id") == "result_list":
            self._in_table = True
        elif self._in_table and tag == "tr" and "data-lock-name" in attr:
            self._row = {
                "name": attr["data-lock-name"] or "",
                "backend": attr["data-backend"] or "",
                "status": attr["data-status"] or "",
                "kind": attr.get("data-kind") or "lock",
                "owner": attr.get("data-owner") or "",
            }
        elif self._row is not None and tag in ("td", "th"):
            classes = (attr.get("class") or "").split()
            self._cell = next((c[6:] for c in classes if c.startswith("field-")), None)
            if self._cell in ("name", "backend", "status"):  # apart from the data- attributes
                self._cell += "-cell"
            if self._cell:
                self._row[self._cell] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in_table = False
        elif tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None
        elif tag in ("td", "th"):
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._row is not None and self._cell:
            self._row[self._cell] += data.strip()


def rows_of(response: Any) -> list[dict[str, str]]:
    assert response.status_code == 200, response.status_code
    parser = _Rows()
    parser.feed(response.content.decode())
    return parser.rows


def row(rows: list[dict[str, str]], name: str, backend: str) -> dict[str, str]:
    found = [r for r in rows if r["name"] == name and r["backend"] == backend]
    assert len(found) == 1, f"{name} on {backend}: {found} in {[r['name'] for r in rows]}"
    return found[0]


# -- users ------------------------------------------------------------------------------


def _staff(django_user_model: Any, username: str, *perms: str) -> Any:
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user(username, password="pw", is_staff=True)
    for codename in perms:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="distlocks", codename=codename)
        )
    return user


@pytest.fixture
def viewer(django_user_model: Any) -> Client:
    client = Client()
    client.force_login(_staff(django_user_model, "viewer", "view_livelock"))
    return client


@pytest.fixture
def releaser(django_user_model: Any) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(
        _staff(django_user_model, "releaser", "view_livelock", "force_release_livelock")
    )
    return client


def csrf_post(client: Client, url: str, data: dict[str, Any]) -> Any:
    """POST the way a browser does: with the token from the confirmation page."""
    page = client.get(url, data)
    assert page.status_code == 200
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode())
    assert token, "the confirmation page has no CSRF token"
    return client.post(url, {**data, "csrfmiddlewaretoken": token.group(1)})


pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _read_servers_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request reads the servers (the reuse of listings has a test of its own)."""
    from distlocks.admin import LiveLockAdmin

    livelocks.snapshots.clear()
    monkeypatch.setattr(LiveLockAdmin, "snapshot_ttl", 0)


# -- permissions and CSRF ---------------------------------------------------------------


def test_anonymous_is_sent_to_the_login_page(client: Client) -> None:
    for url in (LIST_URL, LOCK_URL + "?backend=locmem&name=x", RELEASE_URL):
        response = client.get(url)
        assert response.status_code == 302
        assert response["Location"].startswith("/admin/login/?next=")


def test_staff_without_the_view_permission_is_refused(django_user_model: Any) -> None:
    client = Client()
    client.force_login(_staff(django_user_model, "plain"))
    assert client.get(LIST_URL).status_code == 403


def test_staff_with_view_permission_sees_but_cannot_release(viewer: Client, name: str) -> None:
    with lock(name, backend="locmem", ttl=30) as lease:
        rows = rows_of(viewer.get(LIST_URL))
        assert row(rows, name, "locmem")["token"] == str(lease.fencing_token)
        detail = viewer.get(LOCK_URL, {"backend": "locmem", "name": name})
        assert detail.status_code == 200
        assert "distlocks-force-release" not in detail.content.decode()
        assert viewer.get(RELEASE_URL, {"backend": "locmem", "name": name}).status_code == 403
        post = viewer.post(
            RELEASE_URL,
            {"backend": "locmem", "name": name, "fencing_token": lease.fencing_token},
        )
        assert post.status_code == 403
        assert lease.held()
        assert get_backend("locmem").inspect(name) is not None


def test_admin_index_lists_the_page_without_add_link(viewer: Client) -> None:
    page = viewer.get("/admin/").content.decode()
    assert LIST_URL in page
    assert LIST_URL + "add/" not in page


def test_post_without_csrf_token_is_refused(releaser: Client, name: str) -> None:
    with lock(name, backend="locmem", ttl=30) as lease:
        response = releaser.post(
            RELEASE_URL,
            {"backend": "locmem", "name": name, "fencing_token": lease.fencing_token},
        )
        assert response.status_code == 403
        assert "CSRF" in response.content.decode()
        assert get_backend("locmem").inspect(name) is not None
        assert lease.held()


def test_force_release_with_permission(releaser: Client, name: str, shared_alias: str) -> None:
    from django.contrib.admin.models import DELETION, LogEntry

    from distlocks.signals import lock_force_released

    seen: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        seen.append(kwargs)

    lock_force_released.connect(receiver)
    try:
        lease = lock(name, backend=shared_alias, ttl=30).acquire()
        detail = releaser.get(LOCK_URL, {"backend": shared_alias, "name": name})
        assert "distlocks-force-release" in detail.content.decode()
        confirm = releaser.get(RELEASE_URL, {"backend": shared_alias, "name": name})
        assert confirm.status_code == 200
        assert "Yes, force-release it" in confirm.content.decode()
        response = csrf_post(
            releaser,
            RELEASE_URL,
            {"backend": shared_alias, "name": name, "fencing_token": lease.fencing_token},
        )
    finally:
        lock_force_released.disconnect(receiver)
    assert response.status_code == 302
    assert response["Location"] == LIST_URL
    backend = get_backend(shared_alias)
    assert backend.inspect(name) is None
    # The counter moved past the evicted token: its fenced writes are now stale.
    assert backend.fencing_counter(name) > lease.fencing_token
    with pytest.raises(LockLost):
        lease.extend()
    entry = LogEntry.objects.get(object_id=f"{shared_alias}:{name}")
    assert entry.action_flag == DELETION
    assert entry.user.username == "releaser"
    assert str(lease.fencing_token) in entry.change_message
    assert [(s["name"], s["backend"], s["released"], s["via"]) for s in seen] == [
        (name, shared_alias, True, "admin")
    ]
    assert seen[0]["info"].fencing_token == lease.fencing_token
    page = releaser.get(LIST_URL)
    assert "was force-released" in page.content.decode()
    # The admin's action history links back to the lock's page.
    assert entry.get_admin_url() is not None
    link = releaser.get(entry.get_admin_url())
    assert link.status_code == 302
    assert link["Location"].startswith(LOCK_URL)


def test_release_refused_when_the_lock_changed_hands(releaser: Client, name: str) -> None:
    first = lock(name, backend="redis", ttl=30).acquire()
    first.release()
    with lock(name, backend="redis", ttl=30) as second:
        response = csrf_post(
            releaser,
            RELEASE_URL,
            {"backend": "redis", "name": name, "fencing_token": first.fencing_token},
        )
        assert response.status_code == 302
        assert get_backend("redis").inspect(name) is not None
        assert second.held()
        follow = releaser.get(response["Location"])
        assert "changed hands" in follow.content.decode()


def test_unknown_backend_and_free_lock_give_messages_not_errors(
    releaser: Client, name: str
) -> None:
    response = releaser.get(LOCK_URL, {"backend": "nope", "name": name}, follow=True)
    assert response.status_code == 200
    assert "There is no backend" in response.content.decode()
    response = releaser.get(LOCK_URL, {"backend": "redis", "name": name}, follow=True)
    assert "is not held" in response.content.decode()


# -- the list with real locks -----------------------------------------------------------


def test_page_lists_real_locks_of_every_backend(
    viewer: Client, name: str, child_holder: Any
) -> None:
    other = child_holder("redis", f"{name}:child")
    other_pg = child_holder("pg", f"{name}:child-pg")
    with (
        lock(f"{name}:locmem", backend="locmem", ttl=30) as on_locmem,
        lock(f"{name}:redis", backend="redis", ttl=30) as on_redis,
        lock(f"{name}:pg", backend="pg", ttl=30) as on_pg,
    ):
        rows = rows_of(viewer.get(LIST_URL, {"q": name}))
        # "default" and "redis" are one server, as are "pg" and "pgx" (tests.settings):
        # each lock is listed once, under the first alias, naming the other.
        assert {(r["name"], r["backend"], r["backend-cell"]) for r in rows} == {
            (f"{name}:locmem", "locmem", "locmem"),
            (f"{name}:redis", "default", "default(= redis)"),
            (f"{name}:pg", "pg", "pg(= pgx)"),
            (f"{name}:child", "default", "default(= redis)"),
            (f"{name}:child-pg", "pg", "pg(= pgx)"),
        }
        listed_as = {"locmem": "locmem", "redis": "default", "pg": "pg"}
        for lease in (on_locmem, on_redis, on_pg):
            found = row(rows, lease.name, listed_as[lease.backend])
            assert found["token"] == str(lease.fencing_token)
            assert f"pid {os.getpid()}" in found["holder"]
            assert found["status"] == OK
        child = row(rows, other.name, "default")
        assert f"pid {other.pid}" in child["holder"]
        assert child["token"] == str(other.token)
        assert child["task"] == other.task_id
        assert child["waiters"] == "0"  # filled in per page by inspect()
        child_pg = row(rows, other_pg.name, "pg")
        assert f"pid {other_pg.pid}" in child_pg["holder"]
        backend_pid = get_backend("pg").inspect(other_pg.name).extra["backend_pid"]
        assert child_pg["backend-pid"] == str(backend_pid)
        assert child_pg["expires"] == "never"
        assert row(rows, on_redis.name, "default")["expires"].endswith("s")


def test_search_filter_sort_and_pages(
    viewer: Client, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distlocks.admin import LiveLockAdmin

    monkeypatch.setattr(LiveLockAdmin, "list_per_page", 3)
    leases = [lock(f"{name}:{i}", backend="locmem", ttl=30).acquire() for i in range(7)]
    other = lock(f"{name}:other", backend="redis", ttl=30).acquire()
    try:
        rows = rows_of(viewer.get(LIST_URL, {"q": name, "backend": "locmem"}))
        assert [r["name"] for r in rows] == [f"{name}:{i}" for i in range(3)]
        page3 = rows_of(viewer.get(LIST_URL, {"q": name, "backend": "locmem", "p": 3}))
        assert [r["name"] for r in page3] == [f"{name}:6"]
        held_longest = rows_of(viewer.get(LIST_URL, {"q": name, "backend": "locmem", "o": "-held"}))
        assert [r["name"] for r in held_longest] == [f"{name}:{i}" for i in range(3)]
        newest = rows_of(viewer.get(LIST_URL, {"q": name, "backend": "locmem", "o": "held"}))
        assert [r["name"] for r in newest] == [f"{name}:{i}" for i in (6, 5, 4)]
        desc = rows_of(viewer.get(LIST_URL, {"q": name, "o": "-token"}))
        assert [r["name"] for r in desc] == [f"{name}:other", f"{name}:6", f"{name}:5"]
        assert rows_of(viewer.get(LIST_URL, {"q": f"{name}:other"}))[0]["backend"] == "default"
        with override_settings(DISTLOCKS_STUCK_AFTER=0):
            stuck = rows_of(viewer.get(LIST_URL, {"q": name, "status": STUCK}))
            assert len(stuck) == 3 and {r["status"] for r in stuck} == {STUCK}
            assert rows_of(viewer.get(LIST_URL, {"q": name, "status": OK})) == []
        page = viewer.get(LIST_URL, {"q": name, "refresh": 0}).content.decode()
        assert 'http-equiv="refresh"' not in page
        assert 'http-equiv="refresh" content="10"' in viewer.get(LIST_URL).content.decode()
    finally:
        for lease in [*leases, other]:
            lease.release()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_backend_down_shows_a_banner_and_the_other_backends(viewer: Client, name: str) -> None:
    backends = {
        **settings.DISTLOCKS_BACKENDS,
        "down": {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": f"redis://127.0.0.1:{_closed_port()}/0",
        },
        "broken": {"BACKEND": "no.such.Backend"},
    }
    with override_settings(DISTLOCKS_BACKENDS=backends):
        with lock(name, backend="redis", ttl=30):
            response = viewer.get(LIST_URL, {"q": name})
            assert response.status_code == 200
            page = response.content.decode()
            assert "distlocks-backend-errors" in page
            assert "Backend “down” cannot be read" in page
            assert "LockBackendUnavailable" in page
            assert "Backend “broken” cannot be read" in page
            assert [r["name"] for r in rows_of(response)] == [name]
            # Filtering on the broken backend alone still answers.
            only = viewer.get(LIST_URL, {"backend": "down"})
            assert only.status_code == 200
            assert rows_of(only) == []
            detail = viewer.get(LOCK_URL, {"backend": "down", "name": name}, follow=True)
            assert detail.status_code == 200
            assert "cannot be read" in detail.content.decode()


# -- statuses ---------------------------------------------------------------------------


def test_holder_killed_on_this_host_is_orphaned(viewer: Client, name: str, tmp_path: Path) -> None:
    """A Redis lock outlives its SIGKILLed holder until the key expires: orphaned."""
    from tests import workers

    ctx = multiprocessing.get_context("spawn")
    ready = tmp_path / "ready"
    proc = ctx.Process(target=workers.hold_until_killed, args=("redis", name, str(ready)))
    proc.start()
    try:
        wait_for(ready.exists, 90, "the holder process")
        assert row(rows_of(viewer.get(LIST_URL, {"q": name})), name, "default")["status"] == OK
    finally:
        proc.kill()
        proc.join(10)
    found = row(rows_of(viewer.get(LIST_URL, {"q": name})), name, "default")
    assert found["status"] == ORPHANED
    get_backend("redis").force_release(name)


def test_pg_lock_whose_holder_stopped_renewing_is_orphaned(
    viewer: Client, name: str, pg_ready: None
) -> None:
    lease = lock(name, backend="pg", ttl=0.2, auto_renew=False).acquire()
    try:

        def status() -> str:
            return row(rows_of(viewer.get(LIST_URL, {"q": name})), name, "pg")["status"]

        wait_for(lambda: status() == ORPHANED, 30, "the idle PostgreSQL holder to be orphaned")
        detail = viewer.get(LOCK_URL, {"backend": "pg", "name": name}).content.decode()
        assert "stopped renewing" in detail
    finally:
        lease.release()


def _info(**kwargs: Any) -> LockInfo:
    now = dt.datetime.now(dt.UTC)
    base: dict[str, Any] = {
        "name": "n",
        "backend": "b",
        "owner": "o",
        "fencing_token": 1,
        "host": "elsewhere.invalid",
        "pid": 1,
        "acquired_at": now - dt.timedelta(seconds=5),
        "expires_at": now + dt.timedelta(seconds=25),
        "ttl": 30.0,
    }
    return LockInfo(**{**base, **kwargs})


def test_classify_rules() -> None:
    now = dt.datetime.now(dt.UTC)
    assert classify(_info(), now=now, stuck_after=60)[0] == OK
    assert classify(_info(), now=now, stuck_after=1)[0] == STUCK
    soon = now + dt.timedelta(seconds=5)
    assert classify(_info(expires_at=soon), now=now, stuck_after=60)[0] == EXPIRING
    # Renewed before, and now past the point where the next renewal was due.
    assert classify(_info(expires_at=soon, renewals=3), now=now, stuck_after=60)[0] == ORPHANED
    # No expiry (PostgreSQL): never expiring; orphaned when its session is idle too long.
    pg = {"expires_at": None, "ttl": 10.0}
    idle = {"backend_pid": 7, "session_state": "idle", "application_name": "distlocks"}
    quiet = now - dt.timedelta(seconds=11)
    assert classify(_info(**pg, extra={**idle, "last_activity": now}), now=now)[0] == OK
    assert classify(_info(**pg, extra={**idle, "last_activity": quiet}), now=now)[0] == ORPHANED
    busy = {**idle, "session_state": "idle in transaction", "last_activity": quiet}
    assert classify(_info(**pg, extra=busy), now=now)[0] == OK
    gone = {"backend_pid": 7, "session_state": None, "application_name": None}
    assert classify(_info(**pg, extra=gone), now=now)[0] == ORPHANED
    # Orphaned wins over stuck: the more useful thing to know.
    here = {"host": socket.gethostname(), "pid": 2**22 + 12345}
    assert classify(_info(**here), now=now, stuck_after=1)[0] == ORPHANED
    assert classify(_info(host=socket.gethostname(), pid=os.getpid()), now=now)[0] == OK


def test_detail_page_shows_holder_and_fencing_counter(viewer: Client, name: str) -> None:
    from distlocks.locks import holder_extra

    reset = holder_extra.set({"celery_task_id": "abc-123"})
    try:
        with lock(name, backend="redis", ttl=30) as lease:
            page = viewer.get(LOCK_URL, {"backend": "redis", "name": name}).content.decode()
    finally:
        holder_extra.reset(reset)
    assert "abc-123" in page
    assert lease.owner in page
    assert str(lease.fencing_token) in page
    assert f"pid {os.getpid()}" in page or str(os.getpid()) in page


def test_listing_is_reused_for_a_few_seconds(
    viewer: Client, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distlocks.admin import LiveLockAdmin

    monkeypatch.setattr(LiveLockAdmin, "snapshot_ttl", 3600)
    first = lock(f"{name}:1", backend="locmem", ttl=30).acquire()
    assert [r["name"] for r in rows_of(viewer.get(LIST_URL, {"q": name}))] == [first.name]
    second = lock(f"{name}:2", backend="locmem", ttl=30).acquire()
    try:
        # Another search over the same listing: no new read, so no new lock yet...
        assert [r["name"] for r in rows_of(viewer.get(LIST_URL, {"q": f"{name}:"}))] == [first.name]
        # ...until asked for, or after a force release.
        fresh = rows_of(viewer.get(LIST_URL, {"q": name, "fresh": 1}))
        assert [r["name"] for r in fresh] == [first.name, second.name]
        livelocks.force_release("locmem", first.name)
        assert [r["name"] for r in rows_of(viewer.get(LIST_URL, {"q": name}))] == [second.name]
    finally:
        first.release()
        second.release()


# -- semaphore permits and read-write leases ---------------------------------------------


def hold_permits_in_child(
    alias: str, sem_name: str, rw_name: str, work_dir: str, ttl: float
) -> None:
    """Run in another process: hold a permit of ``sem_name`` and a read lease of
    ``rw_name`` (renewed), report their owners, and record each one that is lost."""
    from tests.workers import setup_django

    setup_django()
    from distlocks import rwlock, semaphore

    work = Path(work_dir)
    lost: dict[str, threading.Event] = {"semaphore": threading.Event(), "read": threading.Event()}
    permit = semaphore(
        sem_name, limit=3, backend=alias, ttl=ttl, timeout=30,
        on_lost=lambda _: lost["semaphore"].set(),
    ).acquire()  # fmt: skip
    reader = (
        rwlock(rw_name, backend=alias)
        .read(ttl=ttl, timeout=30, on_lost=lambda _: lost["read"].set())
        .acquire()
    )
    tmp = work / "acquired.tmp"
    tmp.write_text(f"{permit.owner} {reader.owner} {os.getpid()}")
    os.replace(tmp, work / "acquired")
    deadline = time.monotonic() + 240
    while not (work / "stop").exists() and time.monotonic() < deadline:
        for kind, event in lost.items():
            if event.is_set() and not (work / f"lost-{kind}").exists():
                (work / f"lost-{kind}").write_text("lost")
        time.sleep(0.05)
    for lease in (permit, reader):
        if lease.held():
            lease.release()


class ChildPermits:
    """A semaphore permit and a read lease held by another OS process."""

    def __init__(self, alias: str, sem_name: str, rw_name: str, work: Path) -> None:
        self.work = work
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(
            target=hold_permits_in_child,
            args=(alias, sem_name, rw_name, str(work), 2.0),
            daemon=True,
        )

    def start(self) -> ChildPermits:
        self.process.start()
        wait_for(lambda: (self.work / "acquired").exists(), 90, "the child holding permits")
        sem_owner, read_owner, pid = (self.work / "acquired").read_text().split()
        self.sem_owner, self.read_owner, self.pid = sem_owner, read_owner, int(pid)
        return self

    def lost(self, kind: str) -> bool:
        return (self.work / f"lost-{kind}").exists()

    def stop(self) -> None:
        (self.work / "stop").write_text("")
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


@pytest.fixture
def child_permits(tmp_path: Path, pg_ready: None) -> Iterator[Any]:
    started: list[ChildPermits] = []

    def start(alias: str, sem_name: str, rw_name: str) -> ChildPermits:
        work = tmp_path / f"permits{len(started)}"
        work.mkdir()
        child = ChildPermits(alias, sem_name, rw_name, work)
        started.append(child)
        return child.start()

    yield start
    for child in started:
        child.stop()


def _permit_rows(rows: list[dict[str, str]], name: str) -> dict[str, dict[str, str]]:
    """owner -> row, for the rows of ``name`` (holders of one name differ by owner)."""
    return {r["owner"]: r for r in rows if r["name"] == name}


permit_alias = alias_fixture(
    "permit_alias", ["redis", "pg", "zk", "etcd"], "Each backend with semaphores and rwlocks."
)


def test_permits_listed_inspected_and_evicted_one_at_a_time(
    releaser: Client, name: str, permit_alias: str, child_permits: Any
) -> None:
    """Several holders share a semaphore's or a read-write lock's name: each is a row of
    its own, with a page of its own, and a force release evicts that holder only."""
    from django.contrib.admin.models import DELETION, LogEntry

    from distlocks import rwlock, semaphore
    from distlocks.signals import lock_force_released

    sem_name, rw_name = f"{name}:sem", f"{name}:rw"
    child = child_permits(permit_alias, sem_name, rw_name)
    mine = semaphore(sem_name, limit=3, backend=permit_alias, ttl=30).acquire()
    my_read = rwlock(rw_name, backend=permit_alias).read(ttl=30).acquire()
    listed_as = "default" if permit_alias == "redis" else permit_alias
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        seen.append(kwargs)

    try:
        rows = rows_of(releaser.get(LIST_URL, {"q": name}))
        sems, reads = _permit_rows(rows, sem_name), _permit_rows(rows, rw_name)
        assert set(sems) == {mine.owner, child.sem_owner}
        assert set(reads) == {my_read.owner, child.read_owner}
        assert {r["kind"] for r in sems.values()} == {"semaphore"}
        assert {r["kind"] for r in reads.values()} == {"read"}
        assert f"pid {child.pid}" in sems[child.sem_owner]["holder"]
        assert f"pid {os.getpid()}" in sems[mine.owner]["holder"]
        assert {r["backend"] for r in rows} == {listed_as}

        # The page of the other process's permit: identified by kind and owner.
        ref = {"backend": listed_as, "name": sem_name, "kind": "semaphore"}
        detail = releaser.get(LOCK_URL, {**ref, "owner": child.sem_owner})
        assert detail.status_code == 200
        page = detail.content.decode()
        assert child.sem_owner in page and "semaphore permit" in page
        # The other holder of the semaphore is named, with a link to its own page.
        assert f'data-owner="{mine.owner}"' in page

        lock_force_released.connect(receiver)
        response = csrf_post(
            releaser, RELEASE_URL, {**ref, "owner": child.sem_owner, "fencing_token": 0}
        )
        assert response.status_code == 302
        assert response["Location"] == LIST_URL
        follow = releaser.get(LIST_URL, {"q": name})
        assert "the other holders keep theirs" in follow.content.decode()
        # Only that holder is gone: this process keeps its permit of the same semaphore.
        holders = get_backend(permit_alias).permit_holders("semaphore", sem_name)
        assert [info.owner for info in holders] == [mine.owner]
        mine.extend()
        assert mine.held()
        assert set(_permit_rows(rows_of(follow), sem_name)) == {mine.owner}
        # The evicted process learns it at its next renewal; its read lease stays.
        wait_for(lambda: child.lost("semaphore"), 30, "the child to lose its permit")
        assert not child.lost("read")
        entry = LogEntry.objects.get(object_repr__startswith=sem_name)
        assert entry.action_flag == DELETION
        assert child.sem_owner in entry.change_message
        assert "semaphore permit" in entry.change_message
        assert [(s["name"], s["backend"], s["released"], s["via"]) for s in seen] == [
            (sem_name, listed_as, True, "admin")
        ]
        assert seen[0]["info"].owner == child.sem_owner
        assert seen[0]["info"].extra["kind"] == "semaphore"
        # The admin's action history links to the page of that permit.
        link = releaser.get(entry.get_admin_url())
        assert link.status_code == 302
        assert "kind=semaphore" in link["Location"] and child.sem_owner in link["Location"]
        # Evicting it again (a second confirmation, sent late): it is no longer there,
        # so nothing is done.
        token = releaser.cookies["csrftoken"].value
        response = releaser.post(
            RELEASE_URL,
            {**ref, "owner": child.sem_owner, "fencing_token": 0, "csrfmiddlewaretoken": token},
        )
        assert response.status_code == 302
        assert "is no longer held: nothing was done" in releaser.get(LIST_URL).content.decode()
        assert mine.held() and len(seen) == 1

        # The read lease of this process: evicted, the other process's one stays.
        read_ref = {"backend": listed_as, "name": rw_name, "kind": "read"}
        counter = rwlock(rw_name, backend=permit_alias).fencing_counter()
        response = csrf_post(
            releaser, RELEASE_URL, {**read_ref, "owner": my_read.owner, "fencing_token": 0}
        )
        assert response.status_code == 302
        with pytest.raises(LockLost):
            my_read.extend()
        holders = get_backend(permit_alias).permit_holders("read", rw_name)
        assert [info.owner for info in holders] == [child.read_owner]
        # The write counter moved on: writes fenced with an earlier write token are stale.
        assert rwlock(rw_name, backend=permit_alias).fencing_counter() > counter
        assert not child.lost("read")
    finally:
        lock_force_released.disconnect(receiver)
        for lease in (mine, my_read):
            if lease.held():
                lease.release()


def test_bad_permit_references_give_messages(releaser: Client, name: str) -> None:
    cases = [
        ({"kind": "mutex", "owner": "x"}, "Unknown kind"),
        ({"kind": "semaphore"}, "give the owner id"),
        ({"owner": "abc"}, "identified by its name alone"),
    ]
    for params, message in cases:
        for url in (LOCK_URL, RELEASE_URL):
            response = releaser.get(url, {"backend": "redis", "name": name, **params}, follow=True)
            assert response.status_code == 200
            assert message in response.content.decode(), (url, params)
    gone = releaser.get(
        LOCK_URL,
        {"backend": "redis", "name": name, "kind": "read", "owner": "nobody"},
        follow=True,
    )
    assert "is not held (any more)" in gone.content.decode()


def test_a_listing_reads_its_own_key_prefix_only(name: str) -> None:
    """Aliases on one Redis server with other key prefixes (glob characters included):
    each listing asks the server for its own prefix's keys, and shows its own locks and
    permits only."""
    from distlocks import semaphore

    def alias_with(prefix: str) -> dict[str, Any]:
        return {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": settings.REDIS_URL,
            "OPTIONS": {"key_prefix": prefix},
        }

    # Unescaped, "lt*" would match the keys of "lt[*]" and "lt[*]" those of "lt*".
    extra = {"star": alias_with("lt*"), "class": alias_with("lt[*]")}
    with override_settings(DISTLOCKS_BACKENDS={**settings.DISTLOCKS_BACKENDS, **extra}):
        held = [
            lock(f"{name}:star", backend="star", ttl=30).acquire(),
            lock(f"{name}:class", backend="class", ttl=30).acquire(),
            semaphore(f"{name}:class-sem", limit=2, backend="class", ttl=30).acquire(),
        ]
        try:
            listed = {
                alias: sorted(
                    (info.name, str(info.extra.get("kind", "lock")))
                    for info in get_backend(alias).iter_locks()
                    if info.name.startswith(name)
                )
                for alias in ("star", "class", "redis")
            }
            assert listed == {
                "star": [(f"{name}:star", "lock")],
                "class": [(f"{name}:class", "lock"), (f"{name}:class-sem", "semaphore")],
                "redis": [],
            }
            snapshot = livelocks.collect(["star", "class", "redis"])
            rows = {(item.name, item.backend) for item in snapshot.locks}
            assert {row for row in rows if row[0].startswith(name)} == {
                (f"{name}:star", "star"),
                (f"{name}:class", "class"),
                (f"{name}:class-sem", "class"),
            }
        finally:
            for lease in held:
                lease.release()


def test_listing_is_reused_for_one_refresh_interval_by_default(
    viewer: Client, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every viewer's reloads within one refresh interval share one read of the servers."""
    from distlocks.admin import LiveLockAdmin

    monkeypatch.setattr(LiveLockAdmin, "snapshot_ttl", None)
    monkeypatch.setattr(LiveLockAdmin, "refresh_interval", 3600)
    first = lock(f"{name}:1", backend="locmem", ttl=30).acquire()
    try:
        assert [r["name"] for r in rows_of(viewer.get(LIST_URL, {"q": name}))] == [first.name]
        with lock(f"{name}:2", backend="locmem", ttl=30):
            # A reload (and another viewer's page) within the interval: the same read.
            assert [r["name"] for r in rows_of(viewer.get(LIST_URL, {"q": name}))] == [first.name]
            # The "read again now" link reads them.
            again = rows_of(viewer.get(LIST_URL, {"q": name, "fresh": 1}))
            assert [r["name"] for r in again] == [first.name, f"{name}:2"]
    finally:
        first.release()


def test_concurrent_requests_for_a_due_listing_share_one_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When a listing is due, one request reads the servers; the others wait for it."""
    cache = livelocks.SnapshotCache()
    reads: list[list[str]] = []
    reading, go_on = threading.Event(), threading.Event()
    real_collect = livelocks.collect

    def slow_collect(aliases: Any, **kwargs: Any) -> Any:
        reads.append(list(aliases))
        reading.set()
        assert go_on.wait(60)
        return real_collect(aliases, **kwargs)

    class Gate:
        """The cache's per-listing lock, counting who came to it."""

        def __init__(self) -> None:
            self.lock, self.arrived = threading.Lock(), 0

        def __enter__(self) -> None:
            self.arrived += 1
            self.lock.acquire()

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    gate = Gate()
    key = (("locmem",), livelocks.DEFAULT_LIMIT, livelocks.conf.STUCK_AFTER)
    cache._readers[key] = gate  # type: ignore[assignment]
    monkeypatch.setattr(livelocks, "collect", slow_collect)
    got: list[Any] = []
    threads = [
        threading.Thread(target=lambda: got.append(cache.get(["locmem"], 60))) for _ in range(3)
    ]
    threads[0].start()
    assert reading.wait(60)
    for thread in threads[1:]:
        thread.start()
    wait_for(lambda: gate.arrived == 3, 30, "the other requests to wait for the read")
    go_on.set()
    for thread in threads:
        thread.join(30)
    assert reads == [["locmem"]]
    assert len(got) == 3 and got[0] is got[1] is got[2]
    # Asked to read again: a new read, which the next requests reuse.
    fresh = cache.get(["locmem"], 60, refresh=True)
    assert fresh is not got[0] and cache.get(["locmem"], 60) is fresh
    assert len(reads) == 2


@pytest.fixture(scope="module")
def admin_cluster() -> Iterator[Any]:
    """A cluster of this module's own: the session's cluster is failed over by
    tests/test_redis_cluster.py, whose slot bookkeeping must not see other tests' work."""
    from distlocks.testing.servers import RedisClusterSet

    cluster = RedisClusterSet(masters=3, replicas=0, node_timeout_ms=1000).start()
    yield cluster
    cluster.close()


@pytest.fixture
def cluster_alias(admin_cluster: Any) -> Iterator[str]:
    from tests.redis_contract import redis_alias

    with redis_alias("cluster", admin_cluster.url) as alias:
        yield alias


def test_permits_listed_and_evicted_on_a_redis_cluster(
    admin_cluster: Any, cluster_alias: str, name: str
) -> None:
    """On a cluster, locks and permits of names in every primary's slots are listed (a
    cluster client pipelines no scripts: each semaphore is read by its own call)."""
    from distlocks import rwlock, semaphore
    from tests.test_redis_cluster import cluster_backend, name_on, primaries

    backend = cluster_backend(cluster_alias)
    names = [name_on(admin_cluster, backend, node, name) for node in primaries(admin_cluster)]
    permits = [semaphore(n, limit=2, backend=cluster_alias, ttl=30).acquire() for n in names]
    readers = [rwlock(n, backend=cluster_alias).read(ttl=30).acquire() for n in names]
    locks = [lock(n, backend=cluster_alias, ttl=30).acquire() for n in names]
    try:
        listed = {
            (info.name, str(info.extra.get("kind", "lock")), info.owner)
            for info in backend.iter_locks()
            if info.name.startswith(name)
        }
        assert listed == {
            *((p.name, "semaphore", p.owner) for p in permits),
            *((r.name, "read", r.owner) for r in readers),
            *((lk.name, "lock", lk.owner) for lk in locks),
        }
        done = livelocks.force_release(
            cluster_alias, names[0], kind="semaphore", owner=permits[0].owner
        )
        assert done.released
        assert backend.permit_holders("semaphore", names[0]) == []
        with pytest.raises(LockLost):
            permits[0].extend()
        found = livelocks.inspect(cluster_alias, names[1], "read", readers[1].owner)
        assert found is not None and found.info.waiters == 0
    finally:
        for lease in [*permits, *readers, *locks]:
            if lease.held():
                lease.release()
