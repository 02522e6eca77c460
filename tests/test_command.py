"""``manage.py distlocks list|inspect|release`` against real backends."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from distlocks import get_backend, lock
from distlocks.exceptions import LockLost
from distlocks.signals import lock_force_released

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, stdin: str | None = None, monkeypatch: Any = None) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    call_command("distlocks", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_list_shows_locks_of_every_backend(name: str) -> None:
    with lock(f"{name}:a", backend="locmem") as a, lock(f"{name}:b", backend="redis") as b:
        out, err = run("list")
        assert err == ""
        lines = [line for line in out.splitlines() if name in line]
        assert len(lines) == 2
        assert any(f"{name}:a" in line and "locmem" in line for line in lines)
        assert any(str(b.fencing_token) in line and "default" in line for line in lines)
        assert out.splitlines()[0].split()[:4] == ["NAME", "KIND", "BACKEND", "STATUS"]
        assert all(line.split()[1] == "lock" for line in lines)
        assert str(a.fencing_token) in out


def test_list_json_backend_and_status_filters(name: str) -> None:
    with lock(f"{name}:a", backend="locmem"), lock(f"{name}:b", backend="redis") as b:
        data = json.loads(run("list", "--json")[0])
        mine = {d["name"]: d for d in data if d["name"].startswith(name)}
        assert set(mine) == {f"{name}:a", f"{name}:b"}
        assert mine[f"{name}:b"]["fencing_token"] == b.fencing_token
        assert mine[f"{name}:b"]["also"] == ["redis"]
        assert mine[f"{name}:b"]["status"] == "ok"
        only = json.loads(run("list", "--backend", "locmem", "--json")[0])
        assert [d["name"] for d in only if d["name"].startswith(name)] == [f"{name}:a"]
        assert json.loads(run("list", "--status", "stuck", "--json")[0]) == []
        with override_settings(DISTLOCKS_STUCK_AFTER=0):
            stuck = json.loads(run("list", "--status", "stuck", "--json")[0])
        assert {d["name"] for d in stuck if d["name"].startswith(name)} == set(mine)


def test_list_reports_an_unreachable_backend_and_fails(name: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backends = {
        **settings.DISTLOCKS_BACKENDS,
        "down": {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": f"redis://127.0.0.1:{port}/0",
        },
    }
    with override_settings(DISTLOCKS_BACKENDS=backends), lock(name, backend="locmem"):
        out, err = io.StringIO(), io.StringIO()
        with pytest.raises(CommandError, match="1 backend"):
            call_command("distlocks", "list", stdout=out, stderr=err)
        assert name in out.getvalue()  # what could be read is still shown
        assert "Backend 'down' cannot be read" in err.getvalue()


def test_unknown_backend_is_an_error() -> None:
    for args in (("list", "--backend", "nope"), ("release", "x", "--backend", "nope", "--yes")):
        with pytest.raises(CommandError, match="Unknown backend 'nope'; DISTLOCKS_BACKENDS"):
            run(*args)


def test_inspect(name: str) -> None:
    from distlocks.locks import holder_extra

    reset = holder_extra.set({"celery_task_id": "t-42"})
    try:
        lease = lock(name, backend="redis", ttl=30).acquire()
    finally:
        holder_extra.reset(reset)
    try:
        out, _ = run("inspect", name, "--backend", "redis")
        assert f"{name} on redis:" in out
        assert "t-42" in out and lease.owner in out and str(lease.fencing_token) in out
        everywhere = json.loads(run("inspect", name, "--json")[0])
        # Found through both aliases of that Redis server.
        assert sorted(d["backend"] for d in everywhere) == ["default", "redis"]
    finally:
        lease.release()
    with pytest.raises(CommandError, match=f"No live lock '{name}' on any backend"):
        run("inspect", name)


@pytest.mark.django_db
def test_release_with_yes(name: str, shared_alias: str) -> None:
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        seen.append(kwargs)

    lease = lock(name, backend=shared_alias, ttl=30).acquire()
    lock_force_released.connect(receiver)
    try:
        out, _ = run("release", name, "--backend", shared_alias, "--yes")
    finally:
        lock_force_released.disconnect(receiver)
    backend = get_backend(shared_alias)
    assert backend.inspect(name) is None
    assert backend.fencing_counter(name) > lease.fencing_token
    assert f"Released '{name}'" in out
    assert [(s["name"], s["via"], s["released"]) for s in seen] == [(name, "command", True)]
    with pytest.raises(LockLost):
        lease.extend()


@pytest.mark.django_db
def test_release_asks_for_confirmation(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    lease = lock(name, backend="redis", ttl=30).acquire()
    for answer in ("n\n", ""):  # a "no", and the end of input
        with pytest.raises(CommandError, match="not confirmed"):
            run("release", name, "--backend", "redis", stdin=answer, monkeypatch=monkeypatch)
        assert get_backend("redis").inspect(name) is not None
    assert lease.held()
    out, _ = run("release", name, "--backend", "redis", stdin="y\n", monkeypatch=monkeypatch)
    assert f"held by {socket.gethostname()} pid" in out
    assert "Force-release it?" in out
    assert f"Released '{name}'" in out
    assert get_backend("redis").inspect(name) is None
    with pytest.raises(LockLost):
        lease.extend()


def test_release_of_a_free_lock_is_an_error(name: str) -> None:
    with pytest.raises(CommandError, match=f"No live lock '{name}' on backend 'redis'"):
        run("release", name, "--backend", "redis", "--yes")


def test_exit_codes_from_manage_py(name: str) -> None:
    """Run as a real command: errors give exit code 1 and a message on stderr."""
    result = subprocess.run(
        [sys.executable, "manage.py", "distlocks", "release", name, "--backend", "nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"},
    )
    assert result.returncode == 1
    assert "Unknown backend 'nope'" in result.stderr
    ok = subprocess.run(
        [sys.executable, "manage.py", "distlocks", "list", "--backend", "redis", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"},
    )
    assert ok.returncode == 0, ok.stderr
    assert isinstance(json.loads(ok.stdout), list)


@pytest.mark.django_db
@pytest.mark.parametrize("permit_alias", ["redis", "pg"])
def test_inspect_and_release_one_permit(name: str, permit_alias: str, pg_ready: None) -> None:
    from distlocks import rwlock, semaphore

    first = semaphore(name, limit=2, backend=permit_alias, ttl=30).acquire()
    second = semaphore(name, limit=2, backend=permit_alias, ttl=30).acquire()
    reader = rwlock(name, backend=permit_alias).read(ttl=30).acquire()
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        seen.append(kwargs)

    try:
        listed = json.loads(run("list", "--backend", permit_alias, "--json")[0])
        mine = {(d["kind"], d["owner"]) for d in listed if d["name"] == name}
        assert mine == {
            ("semaphore", first.owner),
            ("semaphore", second.owner),
            ("read", reader.owner),
        }
        # No plain lock of that name: the permits are apart from it.
        with pytest.raises(CommandError, match=re.escape(f"No live lock '{name}'")):
            run("inspect", name, "--backend", permit_alias)
        found = json.loads(
            run("inspect", name, "--backend", permit_alias, "--kind", "semaphore", "--json")[0]
        )
        assert sorted(d["owner"] for d in found) == sorted([first.owner, second.owner])
        out, _ = run(
            "inspect", name, "--backend", permit_alias, "--kind", "semaphore",
            "--owner", second.owner,
        )  # fmt: skip
        assert second.owner in out and first.owner not in out
        # Several holders share the name: releasing one takes its owner id.
        with pytest.raises(CommandError, match="give the owner id"):
            run("release", name, "--backend", permit_alias, "--kind", "semaphore", "--yes")
        lock_force_released.connect(receiver)
        out, _ = run(
            "release", name, "--backend", permit_alias, "--kind", "semaphore",
            "--owner", second.owner, "--yes",
        )  # fmt: skip
        assert f"Released '{name}'" in out and second.owner in out
        holders = get_backend(permit_alias).permit_holders("semaphore", name)
        assert [info.owner for info in holders] == [first.owner]
        with pytest.raises(LockLost):
            second.extend()
        first.extend()
        assert reader.held()
        assert [(s["name"], s["via"], s["released"]) for s in seen] == [(name, "command", True)]
        assert seen[0]["info"].extra["kind"] == "semaphore"
        # Gone now: a second release says so and does nothing.
        with pytest.raises(CommandError, match="nothing to release"):
            run(
                "release", name, "--backend", permit_alias, "--kind", "semaphore",
                "--owner", second.owner, "--yes",
            )  # fmt: skip
    finally:
        lock_force_released.disconnect(receiver)
        for lease in (first, second, reader):
            if lease.held():
                lease.release()


def test_owner_without_kind_is_an_error(name: str) -> None:
    with pytest.raises(CommandError, match="add --kind"):
        run("inspect", name, "--owner", "abc")
    with pytest.raises(CommandError, match="identified by its name alone"):
        run("release", name, "--backend", "redis", "--owner", "abc", "--yes")


@pytest.mark.django_db
def test_a_release_is_audited_like_one_from_the_admin(name: str, django_user_model: Any) -> None:
    from django.contrib.admin.models import DELETION, LogEntry

    from distlocks.audit import COMMAND_LINE_USERNAME

    first = lock(f"{name}:a", backend="redis", ttl=30).acquire()
    out, _ = run("release", f"{name}:a", "--backend", "redis", "--yes")
    entry = LogEntry.objects.get(object_id=f"redis:{name}:a")
    assert entry.action_flag == DELETION
    assert entry.user.get_username() == COMMAND_LINE_USERNAME
    assert not entry.user.is_active and not entry.user.has_usable_password()
    assert f"fencing token {first.fencing_token}" in entry.change_message
    assert "From the command line, by" in entry.change_message
    assert f"pid {os.getpid()}" in entry.change_message  # who ran it, on this machine
    assert COMMAND_LINE_USERNAME in out

    ops = django_user_model.objects.create_user("ops-oncall")
    lock(f"{name}:b", backend="redis", ttl=30).acquire()
    run("release", f"{name}:b", "--backend", "redis", "--yes", "--user", "ops-oncall")
    assert LogEntry.objects.get(object_id=f"redis:{name}:b").user == ops

    third = lock(f"{name}:c", backend="redis", ttl=30).acquire()
    with pytest.raises(CommandError, match="no user 'nobody-here'"):
        run("release", f"{name}:c", "--backend", "redis", "--yes", "--user", "nobody-here")
    assert third.held() and get_backend("redis").inspect(f"{name}:c") is not None
    assert not LogEntry.objects.filter(object_id=f"redis:{name}:c").exists()
    third.release()


@pytest.mark.django_db
def test_control_characters_are_escaped_in_text_output(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from distlocks.locks import holder_extra

    evil = "worker\x1b[31m\r\nFAKE LINE\x07"
    result: list[Any] = []

    def take() -> None:
        reset = holder_extra.set({"celery_task_id": "id\x1b[2Jcleared"})
        try:
            result.append(lock(name, backend="redis", ttl=30).acquire())
        finally:
            holder_extra.reset(reset)

    thread = threading.Thread(target=take, name=evil)
    thread.start()
    thread.join()
    lease = result[0]
    try:
        listed, _ = run("list", "--backend", "redis")
        shown, _ = run("inspect", name, "--backend", "redis")
        prompt, _ = run("release", name, "--backend", "redis", stdin="y\n", monkeypatch=monkeypatch)
        for text in (listed, shown, prompt):
            assert "\x1b" not in text and "\r" not in text and "\x07" not in text
            assert "FAKE LINE" not in text.splitlines()  # no line of its own
        assert "worker\\x1b[31m\\x0d\\x0aFAKE LINE\\x07" in shown
    finally:
        lease.release()
