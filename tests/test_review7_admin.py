"""Review 7: the admin page of live locks, attacked with hand-made input.

* A force-release form whose token is made of digits Python's ``str.isdigit()``
  accepts but ``int()`` does not ("²", superscript two) answered with a server error
  (500); digits of other scripts ("١٢") were read as a token. Both must be "names no
  valid token": a message, nothing released, no audit entry.
* Markup in a lock's name and in the holder's extras (the Celery task id) is shown
  escaped on the list, the lock's page, the confirmation page and in the messages.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from django.conf import settings
from django.contrib.admin.models import LogEntry
from django.test import Client, override_settings
from hypothesis import HealthCheck, given
from hypothesis import settings as examples
from hypothesis import strategies as st

from distlocks import get_backend, lock
from distlocks.locks import holder_extra
from tests.test_livelocks_admin import LIST_URL, LOCK_URL, RELEASE_URL, _staff, csrf_post

pytestmark = pytest.mark.django_db

MARKUP = '<img src=x onerror="alert(1)">'


@pytest.fixture
def releaser(django_user_model: Any) -> Client:
    client = Client()
    client.force_login(
        _staff(django_user_model, "releaser7", "view_livelock", "force_release_livelock")
    )
    return client


@pytest.mark.parametrize(
    "token",
    ["\u00b2", "\u00b9\u00b2", "\u0661\u0662", "\uff11\uff12", "\u0663" * 19, "\U0001d7d7"],
    ids=repr,
)
def test_a_token_of_other_digits_names_no_holder(releaser: Client, name: str, token: str) -> None:
    lease = lock(name, backend="redis", ttl=30).acquire()
    try:
        response = releaser.post(
            RELEASE_URL, {"backend": "redis", "name": name, "fencing_token": token}, follow=True
        )
        assert response.status_code == 200
        assert "was not released" in response.content.decode()
        assert lease.held()
        info = get_backend("redis").inspect(name)
        assert info is not None and info.owner == lease.owner
        assert not LogEntry.objects.exists()
    finally:
        lease.release()


def test_markup_in_names_and_extras_is_escaped_everywhere(releaser: Client, name: str) -> None:
    evil = f"{name}{MARKUP}"
    reset = holder_extra.set({"celery_task_id": MARKUP})
    try:
        lease = lock(evil, backend="locmem", ttl=30).acquire()
    finally:
        holder_extra.reset(reset)
    try:
        pages = {
            "list": releaser.get(LIST_URL, {"q": name, "fresh": "1"}),
            "lock": releaser.get(LOCK_URL, {"backend": "locmem", "name": evil}),
            "confirm": releaser.get(RELEASE_URL, {"backend": "locmem", "name": evil}),
        }
        for page, response in pages.items():
            assert response.status_code == 200, page
            html = response.content.decode()
            assert MARKUP not in html, page
            assert "&lt;img src=x onerror=" in html, page
        done = csrf_post(
            releaser,
            RELEASE_URL,
            {"backend": "locmem", "name": evil, "fencing_token": lease.fencing_token},
        )
        assert done.status_code == 302
        after = releaser.get(done["Location"]).content.decode()
        assert "was force-released" in after
        assert MARKUP not in after
        history = releaser.get("/admin/").content.decode()
        assert MARKUP not in history
    finally:
        lease.release()


# -- FencedModelAdmin: a staff user who may only view the rows -------------------------


@pytest.fixture
def account_viewer(django_user_model: Any) -> Client:
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user("accounts7", password="pw", is_staff=True)
    user.user_permissions.add(
        Permission.objects.get(content_type__app_label="testapp", codename="view_account")
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("pg_ready")
def test_a_view_only_user_takes_no_row_lock(account_viewer: Client) -> None:
    """A POST of the change form or of the editable list by a user who may not
    change the rows is refused (403) before any row lock is taken: it neither waits
    for a worker's lock nor moves the rows' fencing counters."""
    from distlocks.signals import lock_acquired
    from tests.testapp.models import Account

    obj = Account(owner="ann", balance=10)
    obj.save(fencing_token=1)
    taken: list[str] = []

    def record(sender: Any, lease: Any = None, **kwargs: Any) -> None:
        taken.append(getattr(lease, "name", ""))

    backend = get_backend("default")
    counter = backend.fencing_counter(obj.get_fencing_lock_name())
    lock_acquired.connect(record)
    try:
        change = account_viewer.post(
            f"/admin/testapp/account/{obj.pk}/change/", {"owner": "mallory", "balance": 0}
        )
        listed = account_viewer.post(
            "/admin/testapp/account/",
            {
                "form-TOTAL_FORMS": "1",
                "form-INITIAL_FORMS": "1",
                "form-0-id": str(obj.pk),
                "form-0-balance": "0",
                "_save": "Save",
            },
        )
    finally:
        lock_acquired.disconnect(record)
    assert (change.status_code, listed.status_code) == (403, 403)
    assert obj.get_fencing_lock_name() not in taken
    assert backend.fencing_counter(obj.get_fencing_lock_name()) == counter
    assert Account.objects.values_list("owner", "balance", "fencing_token").get() == (
        "ann",
        10,
        1,
    )


# -- a backend that accepts connections and never answers --------------------------------


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port whose server accepts connections and never answers (a hung Redis, a
    network that drops replies): only the client's socket timeout ends a call."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(server.getsockname()[1])
    finally:
        stop.set()
        thread.join()
        for each in held:
            each.close()
        server.close()


def test_a_silent_backend_is_named_and_the_others_listed(
    releaser: Client, name: str, silent_port: int
) -> None:
    backends = {
        **settings.DISTLOCKS_BACKENDS,
        "hung": {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": f"redis://:hunter2@127.0.0.1:{silent_port}/0",
            "OPTIONS": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
        },
    }
    with override_settings(DISTLOCKS_BACKENDS=backends), lock(name, backend="redis", ttl=30):
        response = releaser.get(LIST_URL, {"q": name, "fresh": "1"})
        assert response.status_code == 200
        page = response.content.decode()
        assert "Backend “hung” cannot be read" in page
        assert name in page
        assert "hunter2" not in page
        detail = releaser.get(LOCK_URL, {"backend": "hung", "name": name}, follow=True)
        assert detail.status_code == 200
        assert "cannot be read" in detail.content.decode()
        assert "hunter2" not in detail.content.decode()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("pg_ready")
def test_a_silent_lock_server_makes_an_admin_edit_a_message(
    admin_client: Client, silent_port: int
) -> None:
    from tests.testapp.admin import AccountAdmin
    from tests.testapp.models import Account

    obj = Account(owner="ann", balance=10)
    obj.save(fencing_token=1)
    backends = {
        **settings.DISTLOCKS_BACKENDS,
        "hung": {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": f"redis://:hunter2@127.0.0.1:{silent_port}/0",
            "OPTIONS": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
        },
    }
    with (
        override_settings(DISTLOCKS_BACKENDS=backends),
        mock.patch.object(AccountAdmin, "fencing_backend", "hung"),
    ):
        response = admin_client.post(
            f"/admin/testapp/account/{obj.pk}/change/",
            {"owner": "ann", "balance": 0},
            follow=True,
        )
    page = response.content.decode()
    assert response.status_code == 200
    assert "Not saved: the lock server cannot be reached." in page
    assert "hunter2" not in page
    assert Account.objects.values_list("balance", "fencing_token").get() == (10, 1)


@given(
    st.one_of(
        st.text(max_size=40),
        # Digits of every script, superscripts and fractions, with spaces around.
        st.text(st.characters(categories=("Nd", "No", "Zs")), min_size=1, max_size=25),
        st.integers().map(str),
        st.none(),
        st.integers(),
    )
)
def test_the_forms_token_is_ascii_digits_within_64_bits_or_none(value: Any) -> None:
    """Whatever a hand-made form sends, reading its token never raises, and only the
    decimal ASCII text of a token a lock can have names one."""
    from distlocks.admin.live_locks import _token_of

    token = _token_of(value)
    text = value.strip() if isinstance(value, str) else None
    valid = (
        text is not None
        and text.isascii()
        and text.isdigit()
        and len(text) <= 19
        and int(text) <= 2**63 - 1
    )
    assert token == (int(text) if valid and text is not None else None)


_PARAMS = ["backend", "name", "kind", "owner", "fencing_token", "q", "status", "o", "p", "refresh"]
_VALUES = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["locmem", "redis", "read", "write", "semaphore", "-name", "0", "-1"]),
    st.text(st.characters(categories=("Nd", "No")), min_size=1, max_size=3),
    st.text(min_size=190, max_size=260),
    st.just("x" * 10_000),
)


@examples(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    view=st.sampled_from(["list", "lock", "confirm", "release"]),
    params=st.dictionaries(st.sampled_from([*_PARAMS, "_changelist_filters"]), _VALUES),
)
def test_hand_made_requests_never_fail_the_page(
    releaser: Client, view: str, params: dict[str, str]
) -> None:
    """Any query or form a hand-edited link or script sends to the live-locks views is
    answered with the page, a redirect with a message, or a refusal: never an error."""
    url = {"list": LIST_URL, "lock": LOCK_URL, "confirm": RELEASE_URL, "release": RELEASE_URL}
    # A well-formed reference unless the example replaces it: the other values then
    # reach what reads them (a free lock: nothing can be released).
    data = {"backend": "locmem", "name": "review7-never-held", **params}
    if view == "release":
        response = releaser.post(url[view], data)
    else:
        response = releaser.get(url[view], data)
    assert response.status_code in (200, 302), (view, data, response.status_code)
    assert not LogEntry.objects.exists()
