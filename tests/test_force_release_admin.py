"""Force release from the admin, attacked by hand-made requests (issue "Hardening",
defect 3): only the holder whose fencing token the form names is ever evicted; a
request that names none, or a bad one, or a lock nobody holds, or a name with control
characters, changes nothing and writes no audit entry; every answer is a message."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client

from distlocks import get_backend, lock
from tests.test_livelocks_admin import RELEASE_URL, _staff

pytestmark = pytest.mark.django_db


@pytest.fixture
def releaser(django_user_model: Any) -> Client:
    client = Client()
    client.force_login(
        _staff(django_user_model, "releaser", "view_livelock", "force_release_livelock")
    )
    return client


def post(client: Client, **data: Any) -> tuple[int, str]:
    response = client.post(RELEASE_URL, data, follow=True)
    text = " ".join(
        re.sub(r"<[^>]+>", "", m) for m in re.findall(r"<li class=\"[a-z]+\">(.*?)</li>",
                                                     response.content.decode(), re.S)
    )  # fmt: skip
    return response.status_code, text


@pytest.mark.parametrize(
    "token", [None, "", "abc", "-1", "1.5", "1e3", str(2**63), "9" * 40, " 12 "], ids=repr
)
def test_a_request_that_names_no_valid_token_releases_nothing(
    releaser: Client, name: str, token: str | None
) -> None:
    lease = lock(name, backend="redis", ttl=30).acquire()
    try:
        data = {"backend": "redis", "name": name}
        if token is not None:
            data["fencing_token"] = token
        status, text = post(releaser, **data)
        assert status == 200
        if token is not None and token.strip().isdigit() and int(token) < 2**63:
            assert "changed hands" in text  # a well-formed token, just not this holder's
        else:
            assert "not released" in text
        assert lease.held()
        info = get_backend("redis").inspect(name)
        assert info is not None and info.owner == lease.owner
        assert not LogEntry.objects.exists()
    finally:
        lease.release()


def test_a_stale_token_leaves_the_new_holder(releaser: Client, name: str) -> None:
    first = lock(name, backend="redis", ttl=30).acquire()
    seen = first.fencing_token
    first.release()
    second = lock(name, backend="redis", ttl=30).acquire()
    try:
        status, text = post(releaser, backend="redis", name=name, fencing_token=str(seen))
        assert status == 200 and "changed hands" in text
        assert second.held()
        assert not LogEntry.objects.exists()
    finally:
        second.release()


@pytest.mark.parametrize("alias", ["redis", "pg", "locmem"])
def test_a_name_never_held_writes_nothing(
    releaser: Client, name: str, alias: str, request: pytest.FixtureRequest
) -> None:
    if alias == "pg":
        request.getfixturevalue("pg_ready")
    backend = get_backend(alias)
    status, text = post(releaser, backend=alias, name=name, fencing_token="12345")
    assert status == 200 and "released meanwhile" in text
    assert backend.fencing_counter(name) == 0  # no fence key, no counter
    assert not LogEntry.objects.exists()


@pytest.mark.parametrize("bad", ["a\x00b", "a\x1b[31mb", "a\r\nb", "x" * 500, ""])
def test_a_bad_name_is_a_message(releaser: Client, bad: str) -> None:
    status, text = post(releaser, backend="redis", name=bad, fencing_token="1")
    assert status == 200
    assert text  # told what is wrong
    assert "\x1b" not in text and "\x00" not in text
    assert not LogEntry.objects.exists()


def test_the_holder_named_is_evicted_audited_and_logged_escaped(
    releaser: Client, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    import threading

    result: list[Any] = []
    thread = threading.Thread(
        target=lambda: result.append(lock(name, backend="redis", ttl=30).acquire()),
        name="bad\x1b[2Jthread\r\nFORGED",
    )
    thread.start()
    thread.join()
    lease = result[0]
    caplog.set_level(logging.WARNING, logger="distlocks.livelocks")
    status, text = post(
        releaser, backend="redis", name=name, fencing_token=str(lease.fencing_token)
    )
    assert status == 200 and "was force-released" in text
    assert get_backend("redis").inspect(name) is None
    entry = LogEntry.objects.get()
    assert f"fencing token {lease.fencing_token}" in entry.change_message
    assert "\x1b" not in entry.change_message and "\r" not in entry.change_message
    lines = [r.getMessage() for r in caplog.records if "force-released" in r.getMessage()]
    assert lines and all("\x1b" not in line and "\n" not in line for line in lines)
